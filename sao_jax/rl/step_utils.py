"""Small pieces of the update step (sao_jax/rl/update.py): metric pairs, finiteness
checks, explained variance, Monte-Carlo returns, minibatch indices."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.rl import gae

Metrics = dict[str, tuple[jax.Array, jax.Array]]


def one(x) -> tuple[jax.Array, jax.Array]:
    return jnp.asarray(x, jnp.float32), jnp.ones((), jnp.float32)


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


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


def monte_carlo_returns(rewards_bt, action_mask_bt, gamma) -> jax.Array:
    """Observed return of every action token, lambda = 1 and no bootstrap:
    R_t = sum over action tokens t' >= t of gamma^(number of action tokens in [t, t')) r_t'
    (observation tokens skipped, docs/method.md section 4); 0 off action tokens."""
    zeros_bt = jnp.zeros(rewards_bt.shape, jnp.float32)
    _, returns_bt = gae.skip_observation_gae(
        rewards_bt, zeros_bt, action_mask_bt, gamma=gamma, lam=1.0, checked=False
    )
    return returns_bt


def minibatch_indices(key, batch_size: int, epochs: int, minibatches: int) -> jax.Array:
    """[epochs * minibatches, batch_size // minibatches] int32 row indices: epoch e is the
    permutation of the rows drawn with fold_in(key, e), cut into `minibatches` parts."""
    perm = lambda e: jax.random.permutation(jax.random.fold_in(key, e), batch_size)
    perms_eb = jax.vmap(perm)(jnp.arange(epochs))  # [E, B]
    return perms_eb.reshape(epochs * minibatches, batch_size // minibatches).astype(jnp.int32)


def reduce_metrics(metrics: Metrics) -> dict[str, float]:
    """Host side: (sum, count) pairs -> means (NaN where count is 0)."""
    out = {}
    for k, (s, c) in jax.device_get(metrics).items():
        out[k] = float(s) / float(c) if float(c) > 0 else float("nan")
    return out


def masked(x_bt, m_bt) -> tuple[jax.Array, jax.Array]:
    m = m_bt.astype(jnp.float32)
    return jnp.sum(jnp.where(m_bt, x_bt, 0.0).astype(jnp.float32)), jnp.sum(m)
