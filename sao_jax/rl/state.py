"""TrainState: everything one RL update reads and writes, as one pytree.

Policy and critic keep separate parameters AND separate optax states (their own
learning rates, schedules, clipping; the critic's frozen attention has no moments).
`step` counts policy updates and is the policy *version* published to the sampler.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import Params
from sao_jax.rl.advantages import MovingAverageState, init_moving_average_state


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 policy updates done == version of `policy`
    updates: jax.Array  # int32 update calls done (critic-only and value steps included)
    policy: Params
    critic: Params  # {} when the estimator needs no critic
    policy_opt: Any
    critic_opt: Any
    baseline: MovingAverageState  # moving-average window(s), global or per key (carried)
    skipped_steps: jax.Array  # int32 non-finite steps skipped so far
    consecutive_skips: jax.Array  # int32 non-finite steps in a row
    rng: jax.Array  # uint32 raw key data (checkpointable)


def init_state(
    policy: Params,
    critic: Params,
    policy_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    *,
    window: int,
    seed: int,
    keys: int = 0,
) -> TrainState:
    """A fresh state around given params (call under jit to get sharded moments); the
    moving-average baseline keeps `window` outcomes, per key when `keys` >= 2."""
    zero = jnp.zeros((), jnp.int32)
    return TrainState(
        step=zero,
        updates=zero,
        policy=policy,
        critic=critic,
        policy_opt=policy_tx.init(policy),
        critic_opt=critic_tx.init(critic),
        baseline=init_moving_average_state(window, keys),
        skipped_steps=zero,
        consecutive_skips=zero,
        rng=jax.random.key_data(jax.random.key(seed)),
    )


def optimizer_shardings(
    tx: optax.GradientTransformation, opt_state: Any, param_shardings: Params, sharder: Sharder
) -> Any:
    """NamedShardings of an optimizer state: moments like their params (derived with
    optax.tree_map_params), counts replicated; None when unsharded."""
    if sharder.mesh is None:
        return None
    replicated = NamedSharding(sharder.mesh, PartitionSpec())
    # Masked (frozen) leaves hold an optax.MaskedNode instead of moments: keep it.
    return optax.tree_map_params(
        tx,
        lambda x, s: x if isinstance(x, optax.MaskedNode) else s,
        opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, (NamedSharding, optax.MaskedNode)),
    )


def state_shardings(
    abstract: TrainState,
    policy_shardings: Params | None,
    critic_shardings: Params | None,
    policy_tx: optax.GradientTransformation,
    critic_tx: optax.GradientTransformation,
    sharder: Sharder,
) -> TrainState | None:
    """NamedShardings for every leaf: params as given, optimizer moments like their
    params (derived with optax.tree_map_params), everything else replicated."""
    if sharder.mesh is None:
        return None
    replicated = NamedSharding(sharder.mesh, PartitionSpec())
    rep = lambda tree: jax.tree.map(lambda _: replicated, tree)
    opt_shardings = lambda tx, opt, params: optimizer_shardings(tx, opt, params, sharder)

    return TrainState(
        step=replicated,
        updates=replicated,
        policy=policy_shardings,
        critic=critic_shardings if critic_shardings is not None else {},
        policy_opt=opt_shardings(policy_tx, abstract.policy_opt, policy_shardings),
        critic_opt=opt_shardings(critic_tx, abstract.critic_opt, critic_shardings or {}),
        baseline=rep(abstract.baseline),
        skipped_steps=replicated,
        consecutive_skips=replicated,
        rng=replicated,
    )
