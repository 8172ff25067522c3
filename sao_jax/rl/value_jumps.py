r"""The critic's value change across observations, and the share of the return's variance
it explains (docs/method.md section 4, docs/experiments.md "Observation signal").

All arrays are [B, T] aligned to tokens (sao_jax/batch_schema.py): `values_bt[b, t]` is
V(state before token t). An observation span is a maximal run of non-action tokens with
an action token on both sides (the prompt before the first action and anything after
the last one are not spans). For each span k of row b, with t0 its last action token
before and t1 its first action token after:

    dV_bk = V[b, t1] - V[b, t0]

the critic's value change across the span (and across the turn's last token): the TD
error observation-skipping GAE puts on t0, less its reward, at gamma = 1.

The share of the return's variance the observations explain:

    share = mean_b(sum_k dV_bk^2) / Var_b(G_b)

G_b the row's return (its Monte-Carlo return at its first action token), the mean and
variance over the rows with an action token. Why this ratio: for an exact critic
(V = E[G | state]) the values along a trajectory are a martingale with uncorrelated
increments, so Var(G) = Var(V at the first action) + E[sum of the squared increments
over every later step, the last one to G]. The increments across observations are the
part resolved by what the environment wrote; the first value holds what the prompt
tells, the other increments what the model's own tokens tell. So for an exact critic
0 <= share <= 1 - Var(V_first) / Var(G); a real critic's noise adds to its jumps (a share
above that bound is noise). 0 when Var(G) = 0.

Metrics (name -> (sum, count), sao_jax/rl/metrics.py):
  value_jump          sum of dV over spans, count spans: the mean jump
  value_jump_abs      |dV|, over spans
  value_jump_success  dV over the spans of rows whose outcome is > 0
  value_jump_failure  dV over the spans of the other rows
  spans               spans per row (count: rows with an action token)
  value_jump_sq       sum_k dV_bk^2 per row (count: rows with an action token)
  return_var          (G_b - mean G)^2 per row (same count): Var(G), population form
  variance_share      the share of this batch (count 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.rl import metrics as rm


def span_ends(action_mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(end_bt, next_bt): end_bt[b, t] is True on the last action token before each
    observation span; next_bt[b, t] the index of the first action token after t (T when
    there is none)."""
    m_bt = jnp.asarray(action_mask_bt, bool)
    b, t = m_bt.shape
    pos_t = jnp.arange(t)
    at_or_after_bt = jax.lax.cummin(jnp.where(m_bt, pos_t[None, :], t), axis=1, reverse=True)
    next_bt = jnp.concatenate([at_or_after_bt[:, 1:], jnp.full((b, 1), t)], axis=1)
    end_bt = m_bt & (next_bt > pos_t[None, :] + 1) & (next_bt < t)
    return end_bt, next_bt


def value_jumps(values_bt: jax.Array, action_mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(jump_bt, end_bt): dV on the last action token before each span (0 elsewhere) and
    the mask of those tokens."""
    end_bt, next_bt = span_ends(action_mask_bt)
    t = values_bt.shape[1]
    after_bt = jnp.take_along_axis(values_bt, jnp.minimum(next_bt, t - 1), axis=1)
    return jnp.where(end_bt, after_bt - values_bt, 0.0), end_bt


def first_action_value(x_bt: jax.Array, action_mask_bt: jax.Array) -> jax.Array:
    """[B] x at each row's first action token (0 for a row without one)."""
    m_bt = jnp.asarray(action_mask_bt, bool)
    first_b = jnp.argmax(m_bt, axis=1)
    x_b = jnp.take_along_axis(x_bt, first_b[:, None], axis=1)[:, 0]
    return jnp.where(jnp.any(m_bt, axis=1), x_b, 0.0)


def value_jump_metrics(
    values_bt: jax.Array, action_mask_bt: jax.Array, returns_bt: jax.Array, outcome_b: jax.Array
) -> rm.Metrics:
    """The module's metrics from the critic's values, the action mask, the Monte-Carlo
    returns on action tokens (`gae.monte_carlo_returns`) and the rows' outcomes."""
    jump_bt, end_bt = value_jumps(values_bt.astype(jnp.float32), action_mask_bt)
    valid_b = jnp.any(jnp.asarray(action_mask_bt, bool), axis=1)
    n_rows = jnp.maximum(jnp.sum(valid_b), 1).astype(jnp.float32)
    g_b = first_action_value(returns_bt.astype(jnp.float32), action_mask_bt)
    g_mean = jnp.sum(jnp.where(valid_b, g_b, 0.0)) / n_rows
    var_b = jnp.where(valid_b, jnp.square(g_b - g_mean), 0.0)
    sq_b = jnp.sum(jnp.square(jump_bt), axis=1)
    var_g = jnp.sum(var_b) / n_rows
    share = jnp.where(var_g > 0, jnp.sum(sq_b) / n_rows / jnp.maximum(var_g, 1e-12), 0.0)
    success_bt = (outcome_b > 0)[:, None]
    return {
        "value_jump": rm.masked_sum_count(jump_bt, end_bt),
        "value_jump_abs": rm.masked_sum_count(jnp.abs(jump_bt), end_bt),
        "value_jump_success": rm.masked_sum_count(jump_bt, end_bt & success_bt),
        "value_jump_failure": rm.masked_sum_count(jump_bt, end_bt & ~success_bt),
        "spans": rm.masked_sum_count(jnp.sum(end_bt, axis=1), valid_b),
        "value_jump_sq": rm.masked_sum_count(sq_b, valid_b),
        "return_var": rm.masked_sum_count(var_b, valid_b),
        "variance_share": rm.one(share),
    }
