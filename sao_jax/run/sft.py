"""Warm start by supervised fine-tuning on generated demonstrations.

The embedded tasks write their own demonstrations (correct tool use, with a configured
fraction deliberately imperfect so that RL has headroom). A demonstration is a list of
(text, is_model_turn) segments; it is tokenised exactly as the rollout engine tokenises
a live episode ([BOS] + prompt + turns + observations), so SFT trains the policy on the
same token layout it will sample. The loss is the mean NLL over model-turn tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax.envs.base import Prompt
from sao_jax.envs.registry import get_task
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.rl import passes
from sao_jax.rl.optim import make_optimizer
from sao_jax.schema import ConfigDict, ConfigError

Segments = list[tuple[str, bool]]


def demonstration(env_name: str, prompt: Prompt, rng: np.random.Generator, error_rate: float):
    """(text, is_model_turn) segments of one demonstration of task `env_name` (its
    registered builder, sao_jax/envs/registry.py)."""
    task = get_task(env_name)
    if task.demonstrations is None:
        raise ConfigError(f"config field env.name: no demonstrations for task {env_name!r}")
    return task.demonstrations(prompt, rng, error_rate=error_rate)


def encode_segments(
    segments: Segments, tokenizer, *, add_bos: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [n] and action mask [n] of a demonstration, laid out like a rollout."""
    ids: list[int] = []
    mask: list[bool] = []
    if add_bos and tokenizer.bos_id is not None:
        ids.append(tokenizer.bos_id)
        mask.append(False)
    for text, is_model in segments:
        toks = tokenizer.encode(text)
        ids += toks
        mask += [is_model] * len(toks)
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def demo_batches(
    env_name: str,
    prompts: Iterator[Prompt],
    tokenizer,
    *,
    batch_size: int,
    length: int,
    error_rate: float,
    seed: int,
    add_bos: bool = True,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless [B, T] batches (tokens, positions, segment_ids, action_mask) of demos.

    Demonstrations longer than `length` tokens are skipped (counted in no batch).
    """
    rng = np.random.default_rng(seed)
    while True:
        tokens = np.zeros((batch_size, length), np.int32)
        mask = np.zeros((batch_size, length), bool)
        segment = np.zeros((batch_size, length), np.int32)
        row = 0
        while row < batch_size:
            ids, m = encode_segments(
                demonstration(env_name, next(prompts), rng, error_rate), tokenizer, add_bos=add_bos
            )
            if len(ids) > length or not m.any():
                continue
            tokens[row, : len(ids)], mask[row, : len(ids)], segment[row, : len(ids)] = ids, m, 1
            row += 1
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch_size, length))
        yield dict(
            tokens=tokens, positions=np.array(positions), segment_ids=segment, action_mask=mask
        )


def sft_loss(params: Params, policy_def: ModelDef, batch: dict[str, jax.Array]):
    """Mean NLL of model-turn tokens (+ the MoE load-balancing loss)."""
    out = passes.policy_pass(policy_def.bind(params), batch, replay=False)
    m = batch["action_mask"]
    n = jnp.maximum(jnp.sum(m), 1)
    nll = -jnp.sum(jnp.where(m, out["logp"], 0.0)) / n
    acc = jnp.sum(jnp.where(m, out["logp"] > jnp.log(0.5), False)) / n
    return nll + out["aux_loss"], {"sft/nll": nll, "sft/confident": acc}


class SFTTrainer:
    """A jitted, sharded SFT step with its own AdamW state."""

    def __init__(self, policy_def: ModelDef, optim: ConfigDict, sharder: Sharder):
        self.policy_def = policy_def
        self.tx = make_optimizer(optim)
        step = functools.partial(self._step, policy_def=policy_def, tx=self.tx)
        self.init = jax.jit(self.tx.init)  # moments follow the params' shardings
        if sharder.mesh is None:
            self.step = jax.jit(step, donate_argnums=(0, 1))
        else:
            param_sh = policy_def.shardings(sharder)
            rep = NamedSharding(sharder.mesh, PartitionSpec())
            batch_sh = NamedSharding(sharder.mesh, sharder.spec(("batch",)))
            self.step = jax.jit(
                step,
                donate_argnums=(0, 1),
                in_shardings=(param_sh, None, batch_sh),
                out_shardings=(param_sh, None, rep),
            )

    @staticmethod
    def _step(params, opt_state, batch, *, policy_def, tx):
        (_, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(params, policy_def, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        return params, opt_state, metrics

    def run(self, params: Params, batches: Iterator[dict[str, Any]], steps: int, on_log=None):
        """`steps` SFT steps; `on_log(step, metrics)` every 10 steps and at the end."""
        opt_state = self.init(params)
        metrics = {}
        for i in range(steps):
            params, opt_state, metrics = self.step(params, opt_state, next(batches))
            if on_log is not None and (i % 10 == 9 or i == steps - 1):
                on_log(i + 1, {k: float(v) for k, v in jax.device_get(metrics).items()})
        return params
