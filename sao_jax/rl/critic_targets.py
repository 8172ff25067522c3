"""Critic targets by name: what the K critic steps regress (docs/method.md sections 4 and 8).

    critic_targets(name, *, rewards_bt, values_bt, action_mask_bt, log_ratio_bt=None,
                   last_value_b=None, gamma=1.0, lambda_returns=None, **params)
        -> (targets_bt, metrics)

- `lambda` (default): the advantage estimator's own returns at `rl.lam_critic` (1.0:
  Monte-Carlo returns on action tokens, observations skipped). The caller passes them as
  `lambda_returns` (a callable of no arguments, so they are only computed when used).
- `brace`: an anchored Bellman-residual target for a critic trained on stale rollouts,
  after BRACE (docs/method.md section 8): a k-capped, importance-weighted correction of
  the anchor's TD residuals plus an equal-weight Monte-Carlo tail, where V-trace would
  keep multiplying truncated traces over the whole remainder. On the action tokens of a
  row in order (observations skipped exactly as SAO's GAE), t = 0 .. L-1:

      delta_t = r_t + gamma * V_{t+1} - V_t            V_L = last_value_b (0: terminated)
      rho_t   = exp(log_ratio_t)                       current policy / rollout engine
      c_t     = min(c_bar, rho_t)      w_t = min(rho_bar, rho_t)
      P_{t,j} = c_t * c_{t+1} * ... * c_{t+j-1}        (P_{t,0} = 1)
      y_t     = V_t + sum_{j<k} gamma^j P_{t,j} w_{t+j} delta_{t+j}        (correction)
                    + tau_t * sum_{j>=k} gamma^j delta_{t+j}                (MC tail)
      tau_t   = 1 (tail='one', default) | P_{t,k} (tail='trace')

  V is the anchor: the critic's values before this update's K critic steps (V0, the
  values the lambda targets come from). The tail sum telescopes to
  gamma^k (G_{t+k} - V_{t+k}), G the observed return: with tail 'one' the target is the
  Monte-Carlo return with its first k residuals importance-corrected,
  y_t = G_t + sum_{j<k} gamma^j (P_{t,j} w_{t+j} - 1) delta_{t+j}. Special cases (tested):
  rho = 1 (fresh tokens, no train/inference mismatch) or k = 0 give the lambda = 1 returns
  exactly; k >= L gives the V-trace target with the same truncation levels.

  Closed form, no loop over time: with X_t = w_t delta_t + gamma c_t X_{t+1} (the V-trace
  recursion, a reverse linear recurrence) the capped sum is X_t - gamma^k P_{t,k} X_{t+k},
  and P_{t,k} = exp(Lambda_{t+k} - Lambda_t) with Lambda the running sum of log c. Rows
  are compacted to their action tokens first (a scatter by rank), so "t + k" is k action
  tokens later, whatever observations lie between.

Parameters (`rl.critic_targets.brace.*`, defaults in `BRACE_PARAMS`): k (correction
horizon in action tokens), c_bar (trace cap), rho_bar (residual weight cap), tail.
Metrics (name -> (sum, count) over action tokens): `target_shift` (y - G, how far the
correction moves the target from the Monte-Carlo return) and `target_trace` (P_{t,k}).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sao_jax.registry import Registry, check_params
from sao_jax.rl import checks as ck
from sao_jax.rl import metrics as rm

LOG_RATIO_CLAMP = 20.0  # as the policy losses' log-ratios (sao_jax/rl/losses.py)
TAILS = ("one", "trace")
BRACE_PARAMS = {"k": 8, "c_bar": 1.0, "rho_bar": 1.0, "tail": "one"}


class TargetInputs(NamedTuple):
    """Arguments of `critic_targets`, checked; the mask as bool."""

    rewards_bt: jax.Array
    values_bt: jax.Array
    m_bt: jax.Array
    log_ratio_bt: jax.Array | None
    last_value_b: jax.Array
    gamma: Any
    lambda_returns: Callable[[], jax.Array] | None


@dataclasses.dataclass(frozen=True)
class Target:
    """fn(inputs, **params) -> (targets_bt, metrics); `params` holds the defaults."""

    fn: Callable[..., tuple[jax.Array, rm.Metrics]]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    needs_log_ratio: bool = False  # the current policy's log-probs of the batch


CRITIC_TARGETS: Registry[Target] = Registry("critic target")


def register(name: str, params: dict[str, Any] | None = None, **attrs: Any) -> Callable:
    """Decorator: registers `fn(x: TargetInputs, **params) -> (targets_bt, metrics)` as the
    critic target `name`, its parameters with their defaults (a run sets them as
    rl.critic_targets.<name>.<param>); `needs_log_ratio` runs a policy forward first."""

    def wrap(fn):
        CRITIC_TARGETS.register(name, Target(fn, dict(params or {}), **attrs))
        return fn

    return wrap


# ---------------------------------------------------------------------------- the math


def _compact(x_bt: jax.Array, m_bt: jax.Array) -> jax.Array:
    """[B, T] -> [B, T]: row b's action-token entries moved to the front, in order."""
    b, t = m_bt.shape
    rank_bt = jnp.where(m_bt, jnp.cumsum(m_bt, axis=1) - 1, t)  # t: out of bounds, dropped
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return jnp.zeros((b, t), x_bt.dtype).at[rows_bt, rank_bt].set(x_bt, mode="drop")


def _scatter_back(x_bn: jax.Array, m_bt: jax.Array) -> jax.Array:
    """Inverse of `_compact` on action tokens; 0 elsewhere."""
    rank_bt = jnp.clip(jnp.cumsum(m_bt, axis=1) - 1, 0, m_bt.shape[1] - 1)
    return jnp.where(m_bt, jnp.take_along_axis(x_bn, rank_bt, axis=1), 0.0)


def _fold_rewards(r_bt: jax.Array, m_bt: jax.Array) -> jax.Array:
    """Compacted rewards, each non-action token's reward added to the last action token
    before it (as sao_jax/rl/gae.py credits them); one before the first action is dropped."""
    b, t = m_bt.shape
    rank_bt = jnp.cumsum(m_bt, axis=1) - 1
    rank_bt = jnp.where(rank_bt < 0, t, rank_bt)
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return jnp.zeros((b, t), r_bt.dtype).at[rows_bt, rank_bt].add(r_bt, mode="drop")


def _reverse_recurrence(c_bn: jax.Array, d_bn: jax.Array) -> jax.Array:
    """x_t = d_t + c_t * x_{t+1} along axis 1, x_T = 0 (a reverse lax.scan over time)."""

    def step(x_b, cd):
        c_b, d_b = cd
        x_b = d_b + c_b * x_b
        return x_b, x_b

    _, x_nb = jax.lax.scan(step, jnp.zeros_like(d_bn[:, 0]), (c_bn.T, d_bn.T), reverse=True)
    return x_nb.T


def _shift_left(x_bn: jax.Array, k: int) -> jax.Array:
    """out[:, t] = x[:, t + k], 0 past the end."""
    if k == 0:
        return x_bn
    n = x_bn.shape[1]
    if k >= n:
        return jnp.zeros_like(x_bn)
    return jnp.pad(x_bn[:, k:], ((0, 0), (0, k)))


def brace_targets(
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    action_mask_bt: jax.Array,
    log_ratio_bt: jax.Array,
    *,
    gamma: float | jax.Array = 1.0,
    last_value_b: jax.Array | None = None,
    k: int = BRACE_PARAMS["k"],
    c_bar: float = BRACE_PARAMS["c_bar"],
    rho_bar: float = BRACE_PARAMS["rho_bar"],
    tail: str = BRACE_PARAMS["tail"],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The BRACE target y_bt (module doc) and, for metrics, the MC return G_bt and
    P_{t,k} (`trace_bt`); all [B, T], 0 off action tokens.

    Args:
      rewards_bt: [B, T] float rewards (on action tokens; others folded as in GAE).
      values_bt: [B, T] float anchor values V0, read on action tokens.
      action_mask_bt: [B, T] bool mask of policy-generated tokens.
      log_ratio_bt: [B, T] log pi_theta(a_t) - rollout_logp(a_t), read on action tokens
        (clamped to +-20).
      gamma: discount per action token.
      last_value_b: [B] bootstrap after the last action token (default zeros).
      k: correction horizon in action tokens (>= 0; static).
      c_bar, rho_bar: caps of the trace and of the residual weight (> 0).
      tail: 'one' (tail weight 1) or 'trace' (P_{t,k}).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k: must be an int >= 0, got {k!r}")
    if tail not in TAILS:
        raise ValueError(f"tail: one of {TAILS}, got {tail!r}")
    for name, cap in (("c_bar", c_bar), ("rho_bar", rho_bar)):
        if isinstance(cap, (int, float)) and not cap > 0:
            raise ValueError(f"{name}: must be > 0, got {cap}")
    m_bt = action_mask_bt
    n_b = jnp.sum(m_bt, axis=1)  # [B] action tokens per row
    pos_bn = jnp.arange(m_bt.shape[1])[None, :]
    on_bn = pos_bn < n_b[:, None]
    last_b = jnp.zeros(n_b.shape, values_bt.dtype) if last_value_b is None else last_value_b
    v_bn = _compact(values_bt, m_bt)
    r_bn = _fold_rewards(rewards_bt, m_bt)
    v_next_bn = jnp.where(pos_bn + 1 < n_b[:, None], _shift_left(v_bn, 1), last_b[:, None])
    delta_bn = jnp.where(on_bn, r_bn + gamma * v_next_bn - v_bn, 0.0)
    log_rho_bn = _compact(jnp.clip(log_ratio_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), m_bt)
    log_c_bn = jnp.where(on_bn, jnp.minimum(jnp.log(c_bar), log_rho_bn), 0.0)
    w_bn = jnp.where(on_bn, jnp.exp(jnp.minimum(jnp.log(rho_bar), log_rho_bn)), 0.0)
    gamma_n = jnp.asarray(gamma, v_bn.dtype)
    # V-trace recursion X and the lambda = 1 advantage (G - V), both reverse recurrences.
    x_bn = _reverse_recurrence(gamma_n * jnp.exp(log_c_bn), w_bn * delta_bn)
    mc_bn = _reverse_recurrence(jnp.broadcast_to(gamma_n, delta_bn.shape), delta_bn)
    cum_bn = jnp.cumsum(log_c_bn, axis=1) - log_c_bn  # Lambda_t: sum of log c before t
    # Lambda_{t+k}; past the row's end log c = 0, so Lambda stays at its last value.
    total_b = jnp.sum(log_c_bn, axis=1)
    end_bn = jnp.where(pos_bn + k < m_bt.shape[1], _shift_left(cum_bn, k), total_b[:, None])
    trace_bn = jnp.where(on_bn, jnp.exp(end_bn - cum_bn), 0.0)  # P_{t,k}
    gk = gamma_n**k
    correction_bn = x_bn - gk * trace_bn * _shift_left(x_bn, k)
    tail_w_bn = trace_bn if tail == "trace" else jnp.ones_like(trace_bn)
    y_bn = v_bn + correction_bn + tail_w_bn * gk * _shift_left(mc_bn, k)
    return _scatter_back(y_bn, m_bt), {
        "returns_bt": _scatter_back(v_bn + mc_bn, m_bt),
        "trace_bt": _scatter_back(trace_bn, m_bt),
    }


# ------------------------------------------------------------------------ the registry


@register("lambda")
def _lambda(x: TargetInputs) -> tuple[jax.Array, rm.Metrics]:
    if x.lambda_returns is None:
        raise ValueError("critic target 'lambda' needs lambda_returns, got None")
    return x.lambda_returns(), {}


@register("brace", BRACE_PARAMS, needs_log_ratio=True)
def _brace(x: TargetInputs, k, c_bar, rho_bar, tail) -> tuple[jax.Array, rm.Metrics]:
    y_bt, parts = brace_targets(
        x.rewards_bt, x.values_bt, x.m_bt, x.log_ratio_bt, gamma=x.gamma,
        last_value_b=x.last_value_b, k=k, c_bar=c_bar, rho_bar=rho_bar, tail=tail,
    )  # fmt: skip
    metrics = {
        "target_shift": rm.masked_sum_count(y_bt - parts["returns_bt"], x.m_bt),
        "target_trace": rm.masked_sum_count(parts["trace_bt"], x.m_bt),
    }
    return y_bt, metrics


def critic_targets(
    name: str,
    *,
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    action_mask_bt: jax.Array,
    log_ratio_bt: jax.Array | None = None,
    last_value_b: jax.Array | None = None,
    gamma: float | jax.Array = 1.0,
    lambda_returns: Callable[[], jax.Array] | None = None,
    checked: bool | None = None,
    **params: Any,
) -> tuple[jax.Array, rm.Metrics]:
    """(targets_bt, metrics) of critic target `name` (module doc); unknown names and
    parameters raise naming them, and so does a missing input the target needs."""
    entry = CRITIC_TARGETS.get(name)
    check_params("critic target", name, params, tuple(entry.params))
    params = {**entry.params, **params}
    checked = ck.is_checked(checked)
    bt = ck.check_bt(values_bt, "values_bt")
    ck.check_bt(rewards_bt, "rewards_bt", bt)
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, checked)
    if entry.needs_log_ratio:
        if log_ratio_bt is None:
            raise ValueError(f"critic target {name!r} needs log_ratio_bt, got None")
        ck.check_bt(log_ratio_bt, "log_ratio_bt", bt)
        ck.check_float(log_ratio_bt, "log_ratio_bt")
    if last_value_b is None:
        last_value_b = jnp.zeros((bt[0],), jnp.float32)
    ck.check_b(last_value_b, "last_value_b", bt[0])
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
    x = TargetInputs(
        f32(rewards_bt), f32(values_bt), m_bt, f32(log_ratio_bt), f32(last_value_b),
        ck.as_unit_scalar(gamma, "gamma", checked), lambda_returns,
    )  # fmt: skip
    return entry.fn(x, **params)
