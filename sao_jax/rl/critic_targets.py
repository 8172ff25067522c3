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
  y_t = G_t + sum_{j<k} gamma^j (P_{t,j} w_{t+j} - 1) delta_{t+j}, the form computed.
  Special cases (tested): rho = 1 (fresh tokens, no train/inference mismatch) or k = 0
  give the lambda = 1 returns bit for bit; k >= L gives the V-trace target with the same
  truncation levels. The config allows it only with rl.advantage = 'gae' and
  rl.lam_critic = 1 (sao_jax/rl/settings.py), the targets it replaces.

  Computed without a loop over tokens: delta and G - V are the lambda = 1 advantages of
  `gae.skip_observation_gae` (so observations, parked rewards and the bootstrap are
  handled by the GAE itself); rows are then compacted to their action tokens (a scatter
  by rank), so "t + j" is j action tokens later, whatever observations lie between; the
  k-capped sum is `capped_trace_sum` (windows doubled: O(log k) elementwise steps), and
  the tail is gamma^k (G - V) shifted by k.

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
from sao_jax.rl import gae
from sao_jax.rl import metrics as rm
from sao_jax.rl.losses import LOG_RATIO_CLAMP

TAILS = ("one", "trace")
BRACE_PARAMS = {"k": 8, "c_bar": 1.0, "rho_bar": 1.0, "tail": "one"}


class TargetInputs(NamedTuple):
    """Arguments of `critic_targets`, as given (each target checks what it reads)."""

    rewards_bt: jax.Array  # [B, T] float
    values_bt: jax.Array  # [B, T] float, the anchor V0
    action_mask_bt: jax.Array  # [B, T] bool or 0/1
    log_ratio_bt: jax.Array | None  # [B, T] log pi_theta - rollout_logp (needs_log_ratio)
    last_value_b: jax.Array | None  # [B] bootstrap after the last token (None: zeros)
    gamma: Any  # scalar discount
    lambda_returns: Callable[[], jax.Array] | None  # the estimator's returns, lazily
    checked: bool | None  # value checks (None: the enclosing checked_mode)


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
    """[B, T] -> [B, T]: row b's action-token entries moved to the front, in order; 0 after."""
    b, t = m_bt.shape
    rank_bt = jnp.where(m_bt, jnp.cumsum(m_bt, axis=1) - 1, t)  # t: out of bounds, dropped
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return jnp.zeros((b, t), x_bt.dtype).at[rows_bt, rank_bt].set(x_bt, mode="drop")


def _scatter_back(x_bn: jax.Array, m_bt: jax.Array) -> jax.Array:
    """Inverse of `_compact` on action tokens; 0 elsewhere."""
    rank_bt = jnp.clip(jnp.cumsum(m_bt, axis=1) - 1, 0, m_bt.shape[1] - 1)
    return jnp.where(m_bt, jnp.take_along_axis(x_bn, rank_bt, axis=1), 0.0)


def _shift_left(x_bn: jax.Array, j: int, fill: float) -> jax.Array:
    """out[:, n] = x[:, n + j], `fill` past the end (j >= 0, static)."""
    n = x_bn.shape[1]
    if j == 0:
        return x_bn
    if j >= n:
        return jnp.full_like(x_bn, fill)
    return jnp.pad(x_bn[:, j:], ((0, 0), (0, j)), constant_values=fill)


def capped_trace_sum(
    d_bn: jax.Array, c_bn: jax.Array, gamma: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    """(S_bn, P_bn) over windows of k positions along axis 1 (static k >= 0):

        S_n = sum_{j<k} gamma^j P_{n,j} d_{n+j}      P_{n,j} = c_n * ... * c_{n+j-1}
        P_n = P_{n,k}                                 (d = 0 and c = 1 past the end)

    The k-term truncation of the V-trace sum X_n = d_n + gamma c_n X_{n+1}, computed
    directly: windows are doubled and joined (a segment [n, n+a) followed by [n+a, n+a+b)
    has S = S_a(n) + gamma^a P_a(n) S_b(n+a), P = P_a(n) P_b(n+a)), so the loop runs over
    the bits of k, O(log k) elementwise steps, never over tokens; no subtraction of long
    sums or of running log-sums, so no cancellation on long rows.
    """
    s_bn, p_bn = jnp.zeros_like(d_bn), jnp.ones_like(c_bn)  # the empty window
    span_s, span_p, width, done = d_bn, c_bn, 1, 0  # windows of `width`; `done` covered
    while k:
        if k & 1:
            s_bn = s_bn + gamma**done * p_bn * _shift_left(span_s, done, 0.0)
            p_bn = p_bn * _shift_left(span_p, done, 1.0)
            done += width
        k >>= 1
        if k:
            span_s = span_s + gamma**width * span_p * _shift_left(span_s, width, 0.0)
            span_p = span_p * _shift_left(span_p, width, 1.0)
            width *= 2
    return s_bn, p_bn


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
    checked: bool | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The BRACE target y_bt (module doc) and, for metrics, y - G (`shift_bt`, G the
    lambda = 1 returns) and P_{t,k} (`trace_bt`); all [B, T], 0 off action tokens.

    Observations are skipped by `gae.skip_observation_gae` itself: delta and G - V come
    from its lambda = 1 advantages (rewards parked on observations, the bootstrap and
    checked mode exactly as there), then rows are compacted to their action tokens, so
    "t + j" is j action tokens later whatever observations lie between.

    Args:
      rewards_bt: [B, T] float rewards on action tokens (others: as skip_observation_gae).
      values_bt: [B, T] float anchor values V0, read on action tokens.
      action_mask_bt: [B, T] bool mask of policy-generated tokens.
      log_ratio_bt: [B, T] log pi_theta(a_t) - rollout_logp(a_t), read on action tokens
        (clamped to +-LOG_RATIO_CLAMP).
      gamma: discount per action token.
      last_value_b: [B] bootstrap after the last action token (default zeros).
      k: correction horizon in action tokens (int >= 0; static).
      c_bar, rho_bar: caps of the trace and of the residual weight (> 0).
      tail: 'one' (tail weight 1) or 'trace' (P_{t,k}).
      checked: value checks (None: the enclosing checked_mode).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k: must be an int >= 0, got {k!r}")
    if tail not in TAILS:
        raise ValueError(f"tail: one of {TAILS}, got {tail!r}")
    for name, cap in (("c_bar", c_bar), ("rho_bar", rho_bar)):
        if isinstance(cap, int | float) and not cap > 0:
            raise ValueError(f"{name}: must be > 0, got {cap}")
    bt = ck.check_bt(log_ratio_bt, "log_ratio_bt", ck.check_bt(values_bt, "values_bt"))
    ck.check_float(log_ratio_bt, "log_ratio_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, ck.is_checked(checked))
    a1_bt, g_bt = gae.skip_observation_gae(
        rewards_bt, values_bt, m_bt, gamma=gamma, lam=1.0, last_value_b=last_value_b,
        checked=checked,
    )  # fmt: skip
    gamma = ck.as_unit_scalar(gamma, "gamma", False).astype(a1_bt.dtype)
    k = min(k, bt[1])  # a window past the row's end adds nothing
    on_bn = jnp.arange(bt[1])[None, :] < jnp.sum(m_bt, axis=1)[:, None]
    a1_bn = _compact(a1_bt, m_bt)  # G_t - V_t on the compacted action tokens
    delta_bn = a1_bn - gamma * _shift_left(a1_bn, 1, 0.0)  # r_t + gamma V_{t+1} - V_t
    rho_bn = jnp.exp(_compact(jnp.clip(log_ratio_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), m_bt))
    c_bn = jnp.where(on_bn, jnp.minimum(c_bar, rho_bn), 1.0)  # trace factors
    w_bn = jnp.where(on_bn, jnp.minimum(rho_bar, rho_bn), 0.0)  # residual weights
    # y - G = (corrected - uncorrected first k residuals) [+ (P_{t,k} - 1) x the tail]:
    # the tail sum_{j>=k} gamma^j delta_{t+j} telescopes to gamma^k (G - V)_{t+k}. Written
    # as a shift from G, so rho = 1 (both sums the same float operations) or k = 0 give the
    # lambda = 1 returns bit for bit.
    corrected_bn, trace_bn = capped_trace_sum(w_bn * delta_bn, c_bn, gamma, k)
    plain_bn, _ = capped_trace_sum(delta_bn, jnp.ones_like(c_bn), gamma, k)
    shift_bn = corrected_bn - plain_bn
    if tail == "trace":
        shift_bn = shift_bn + (trace_bn - 1.0) * gamma**k * _shift_left(a1_bn, k, 0.0)
    shift_bt = _scatter_back(shift_bn, m_bt)
    parts = {"shift_bt": shift_bt, "trace_bt": _scatter_back(trace_bn, m_bt)}
    return g_bt + shift_bt, parts


# ------------------------------------------------------------------------ the registry


@register("lambda")
def _lambda(x: TargetInputs) -> tuple[jax.Array, rm.Metrics]:
    if x.lambda_returns is None:
        raise ValueError("critic target 'lambda' needs lambda_returns, got None")
    return x.lambda_returns(), {}


@register("brace", BRACE_PARAMS, needs_log_ratio=True)
def _brace(x: TargetInputs, k, c_bar, rho_bar, tail) -> tuple[jax.Array, rm.Metrics]:
    y_bt, parts = brace_targets(
        x.rewards_bt, x.values_bt, x.action_mask_bt, x.log_ratio_bt, gamma=x.gamma,
        last_value_b=x.last_value_b, k=k, c_bar=c_bar, rho_bar=rho_bar, tail=tail,
        checked=x.checked,
    )  # fmt: skip
    m_bt = jnp.asarray(x.action_mask_bt) != 0
    metrics = {
        "target_shift": rm.masked_sum_count(parts["shift_bt"], m_bt),
        "target_trace": rm.masked_sum_count(parts["trace_bt"], m_bt),
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
    parameters raise naming them, and so does a missing input the target needs. Each
    target checks the arrays it reads ('lambda' reads none: its returns are the caller's)."""
    entry = CRITIC_TARGETS.get(name)
    check_params("critic target", name, params, tuple(entry.params))
    if entry.needs_log_ratio and log_ratio_bt is None:
        raise ValueError(f"critic target {name!r} needs log_ratio_bt, got None")
    x = TargetInputs(
        rewards_bt, values_bt, action_mask_bt, log_ratio_bt, last_value_b, gamma,
        lambda_returns, checked,
    )  # fmt: skip
    return entry.fn(x, **{**entry.params, **params})
