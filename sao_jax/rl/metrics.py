"""The RL math's metrics: name -> (sum, count) pairs of float32 scalars, summed over
microbatches and devices on the way, and turned into means on the host only on log steps
(the one host reduction: `sao_jax.metrics.pair_means`, and `reduce_sum_count` with the
statistics derived from those means)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

Metrics = dict[str, tuple[jax.Array, jax.Array]]


def masked_sum_count(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of x where mask, number of such entries) as float32 scalars: a metric pair."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, x, 0).astype(jnp.float32)), jnp.sum(m)


def one(x) -> tuple[jax.Array, jax.Array]:
    """The pair of one value (count 1)."""
    return jnp.asarray(x, jnp.float32), jnp.ones((), jnp.float32)


def step_metrics(loss, grads, max_norm: float) -> Metrics:
    """One optimizer step's `loss`, gradient global norm `grad_norm`, and `grad_clipped`:
    1 when the norm exceeds `max_norm` (the optimizer's global-norm clip binds and scales
    the step by max_norm / norm), else 0, and always 0 without a clip (`max_norm` 0). Its
    mean over steps is the clip fraction."""
    norm = optax.tree.norm(grads)
    clipped = (norm > max_norm) if max_norm > 0 else jnp.zeros((), bool)
    return dict(loss=one(loss), grad_norm=one(norm), grad_clipped=one(clipped))


def prefixed(prefix: str, metrics: Metrics) -> Metrics:
    return {f"{prefix}/{k}": v for k, v in metrics.items()}


def explained_variance(values_bt, returns_bt, mask_bt) -> jax.Array:
    """1 - Var(R - V) / Var(R) over action tokens (0 when Var(R) = 0)."""
    m = mask_bt.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mean = lambda x: jnp.sum(x * m) / n
    var = lambda x: mean(jnp.square(x - mean(x)))
    var_r = var(returns_bt)
    return jnp.where(var_r > 0, 1.0 - var(returns_bt - values_bt) / jnp.maximum(var_r, 1e-12), 0.0)
