"""Build the policy and its critic (initialised from the policy) from a model config."""

from __future__ import annotations

from typing import NamedTuple

from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Critic, Policy, critic_params_from_policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params, init_params


class Models(NamedTuple):
    """The defs and params; params None where a run loads both (init.kind='params' with
    init.critic_path: sao_jax/run/inputs.py build_models builds no random init)."""

    cfg: ModelConfig
    policy_def: ModelDef
    policy: Params | None
    critic_def: ModelDef
    critic: Params | None


def policy_def(cfg: ModelConfig, sharder: Sharder) -> ModelDef:
    return ModelDef.of(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(0)))


def critic_def(cfg: ModelConfig, sharder: Sharder) -> ModelDef:
    return ModelDef.of(lambda: Critic(cfg, sharder=sharder, rngs=nnx.Rngs(0)))


def init_models(cfg: ModelConfig, sharder: Sharder, seed: int) -> Models:
    """Randomly initialised policy (from `seed`) and a critic whose trunk copies it and
    whose value head is zero: the critic starts as the policy plus a scalar head."""
    pdef, policy = init_params(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(seed)), sharder)
    cdef, critic = init_params(lambda: Critic(cfg, sharder=sharder, rngs=nnx.Rngs(seed)), sharder)
    return Models(cfg, pdef, policy, cdef, critic_params_from_policy(policy, critic))
