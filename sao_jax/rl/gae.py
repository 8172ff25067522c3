"""Observation-skipping token-level GAE (docs/method.md section 4) and its variants.

All arrays are [B, T], one trajectory per row, aligned to tokens (sao_jax/batch_schema.py).
`m_t` = action_mask: 1 on tokens the policy generated. Reverse time, masked-carry form:

    delta_t = r_t + p_t + gamma * nextV - V_t     # p_t: rewards parked on observations
    g_new   = delta_t + gamma * lam * g
    nextV   = m_t ? V_t : nextV ;  g = m_t ? g_new : g ;  A_t = m_t ? g_new : 0
    R_t     = m_t ? A_t + V_t : 0

which equals plain GAE on the compacted subsequence of action tokens, scattered back:
A(a_{i,N}) = delta + gamma*lam*A(a_{i+1,0}), delta = r + gamma*V(a_{i+1,0}) - V(a_{i,N}).
Observation tokens get no TD error and no advantage. After the row's last action token
the recursion bootstraps with `last_value_b` (zeros: terminated; V(last): truncated).

Rewards belong on action tokens (`place_outcome_reward`, `place_turn_rewards`). A nonzero
reward on a non-action token is an error in checked mode (sao_jax.rl.checks); otherwise
it is credited, undiscounted, to the last action token *before* it in time (so an outcome
written on a trailing observation still reaches the advantages in full); one before the
row's first action token has nothing to credit and is dropped.

Three implementations with equal results (up to float rounding): `impl="scan"`, a reverse
`lax.scan` over T; `impl="associative"`, the same first-order linear recurrence
A_t = d_t + c_t * A_{t+1} (c_t = gamma*lam on actions, 1 on observations) evaluated with
`lax.associative_scan`; and `impl="chunked"`, a closed form of the whole recursion as ONE
recurrence solved in blocks of tokens with two small matmuls and a scan over blocks
(sao_jax/rl/gae_chunked.py; rows with gamma*lam < 0.01, e.g. lam = 0, take the scan).
`default_gae_impl(backend)` picks one per backend (docs/benchmarks.md, "GAE"): what
`impl=None` or `impl="auto"` runs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sao_jax.parallel import platform
from sao_jax.rl import checks as ck
from sao_jax.rl.gae_chunked import MIN_DISCOUNT, gae_chunked

GAE_IMPLS = ("scan", "associative", "chunked")
# CPU: measured by experiments/bench/gae.py (docs/benchmarks.md, "GAE"): the chunked form
# beats the reverse scan (latency-bound: one loop step per token over B lanes) at every
# measured T, and the scan beats the associative form. GPU/TPU: not measured yet; there a
# scan step per token costs a loop iteration on the device, and the associative form's
# O(log T) depth is the usual choice.
_DEFAULT_IMPL = {
    "cpu": "chunked",
    "gpu": "associative",
    "cuda": "associative",
    "rocm": "associative",
    "tpu": "associative",
}


def default_gae_impl(backend: str | None = None) -> str:
    """The GAE implementation to use on `backend` (default: `platform.backend()`)."""
    return _DEFAULT_IMPL.get(backend or platform.backend(), "associative")


# ------------------------------------------------------------------------ the recursion


def _reverse_linear_recurrence(c_tx: jax.Array, d_tx: jax.Array) -> jax.Array:
    """x_t = d_t + c_t * x_{t+1} along the leading (time) axis, x_T = 0, in O(log T) depth.

    Time-major, so that the scan's strided slices are whole rows (faster on CPU).
    """

    def compose(hi, lo):  # `hi` covers later times; apply `lo` after it
        c_hi, d_hi = hi
        c_lo, d_lo = lo
        return c_lo * c_hi, d_lo + c_lo * d_hi

    return jax.lax.associative_scan(compose, (c_tx, d_tx), reverse=True, axis=0)[1]


def _gae_associative(r_bt, v_bt, m_bt, gamma, lam_b, last_b):
    r_tb, v_tb, m_tb = r_bt.T, v_bt.T, m_bt.T  # time-major [T, B]
    # Pass 1: V at the next action token at or after t (last_b past the end), and the
    # rewards parked on the observations before the next action, as 0/1-coefficient
    # recurrences x_t = d_t + (1 - m_t) x_{t+1} (exact: no rounding).
    keep_tb = jnp.where(m_tb, 0.0, 1.0).astype(r_bt.dtype)
    d_v_tb = jnp.where(m_tb, v_tb, 0.0).at[-1].add(keep_tb[-1] * last_b)
    d_p_tb = jnp.where(m_tb, 0.0, r_tb)
    fill_tb2 = _reverse_linear_recurrence(keep_tb[..., None], jnp.stack([d_v_tb, d_p_tb], -1))
    end_b2 = jnp.stack([last_b, jnp.zeros_like(last_b)], -1)
    after_tb2 = jnp.concatenate([fill_tb2[1:], end_b2[None]], axis=0)  # value at t + 1
    # Pass 2: g_t = delta_t + gamma*lam*g_{t+1} on actions, g_t = g_{t+1} on observations.
    delta_tb = r_tb + after_tb2[..., 1] + gamma * after_tb2[..., 0] - v_tb
    c_tb = jnp.where(m_tb, gamma * lam_b, 1.0).astype(r_bt.dtype)
    g_tb = _reverse_linear_recurrence(c_tb, jnp.where(m_tb, delta_tb, 0.0))
    return jnp.where(m_tb, g_tb, 0.0).T


def _gae_scan(r_bt, v_bt, m_bt, gamma, lam_b, last_b, unroll: int = 8):
    gl_b = gamma * lam_b  # [B]

    def step(carry, x):
        g_b, next_v_b, parked_b = carry
        r_b, v_b, m_b = x
        g_new_b = r_b + parked_b + gamma * next_v_b - v_b + gl_b * g_b
        carry = (
            jnp.where(m_b, g_new_b, g_b),
            jnp.where(m_b, v_b, next_v_b),
            jnp.where(m_b, 0.0, parked_b + r_b),
        )
        return carry, jnp.where(m_b, g_new_b, 0.0)

    zeros_b = jnp.zeros_like(last_b)
    _, a_tb = jax.lax.scan(
        step, (zeros_b, last_b, zeros_b), (r_bt.T, v_bt.T, m_bt.T), reverse=True, unroll=unroll
    )
    return a_tb.T


def _with_returns(fn):
    def both(r_bt, v_bt, m_bt, gamma, lam_b, last_b):
        a_bt = fn(r_bt, v_bt, m_bt, gamma, lam_b, last_b)
        return a_bt, jnp.where(m_bt, a_bt + v_bt, 0.0)

    return both


def _gae_chunked_or_scan(r_bt, v_bt, m_bt, gamma, lam_b, last_b):
    """The chunked form, or the scan when a row with actions has gamma*lam < MIN_DISCOUNT."""
    tiny = jnp.any(jnp.where(gamma * lam_b < MIN_DISCOUNT, jnp.any(m_bt, axis=1), False))
    return jax.lax.cond(
        tiny, _with_returns(_gae_scan), gae_chunked, r_bt, v_bt, m_bt, gamma, lam_b, last_b
    )


_IMPL_FNS = {
    "scan": _with_returns(_gae_scan),
    "associative": _with_returns(_gae_associative),
    "chunked": _gae_chunked_or_scan,
}


@functools.partial(jax.jit, static_argnames=("impl",))
def _gae_jit(r_bt, v_bt, m_bt, gamma, lam_b, last_b, *, impl: str):
    """(advantages, returns) from already checked, float32-or-wider inputs."""
    return _IMPL_FNS[impl](r_bt, v_bt, m_bt, gamma, lam_b.astype(r_bt.dtype), last_b)


class _Inputs(NamedTuple):
    r_bt: jax.Array
    v_bt: jax.Array
    m_bt: jax.Array
    gamma: jax.Array
    lam_b: jax.Array
    last_b: jax.Array


def _prepare(rewards_bt, values_bt, action_mask_bt, gamma, lam, last_value_b, checked):
    """Shape checks (always) and value checks (checked mode); float inputs, bool mask."""
    bt = ck.check_bt(values_bt, "values_bt")
    ck.check_bt(rewards_bt, "rewards_bt", bt)
    ck.check_float(values_bt, "values_bt")
    ck.check_float(rewards_bt, "rewards_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, checked)
    dtype = jnp.result_type(rewards_bt.dtype, values_bt.dtype, jnp.float32)
    if last_value_b is None:
        last_b = jnp.zeros((bt[0],), dtype)
    else:
        ck.check_b(last_value_b, "last_value_b", bt[0])
        last_b = jnp.asarray(last_value_b, dtype)
    return _Inputs(
        jnp.asarray(rewards_bt, dtype),
        jnp.asarray(values_bt, dtype),
        m_bt,
        ck.as_unit_scalar(gamma, "gamma", checked).astype(dtype),
        ck.as_unit_interval(lam, "lam", bt[0], checked),
        last_b,
    )


def _check_impl(impl: str | None) -> str:
    impl = default_gae_impl() if impl in (None, "auto") else impl
    if impl not in GAE_IMPLS:
        raise ValueError(f"impl: unknown GAE implementation {impl!r}; known: {list(GAE_IMPLS)}")
    return impl


def _require_rewards_on(r_bt: jax.Array, on_bt: jax.Array, what: str) -> None:
    ck.require_value(
        jnp.all(jnp.where(on_bt, True, r_bt == 0)),
        f"rewards_bt: nonzero reward on a non-{what} token (place rewards on action tokens: "
        "place_outcome_reward / place_turn_rewards)",
    )


def skip_observation_gae(
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    action_mask_bt: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    last_value_b: jax.Array | None = None,
    impl: str | None = None,
    checked: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Observation-skipping GAE: (advantages_bt, returns_bt), both 0 off action tokens.

    Args:
      rewards_bt: [B, T] float rewards on action tokens (see the module doc for others).
      values_bt: [B, T] float V(state before token t), read on action tokens only.
      action_mask_bt: [B, T] bool (or 0/1) mask of policy-generated tokens.
      gamma: scalar discount in [0, 1].
      lam: GAE lambda in [0, 1], a scalar or per-row [B] (`length_adaptive_lambda`).
      last_value_b: [B] bootstrap after the row's last token: V(last) for rows truncated
        by a length limit, 0 for terminated rows. Default zeros.
      impl: "scan", "associative" or "chunked"; None or "auto": `default_gae_impl()`.
      checked: run value checks (None: the enclosing `checked_mode`).

    Returns:
      advantages_bt and returns_bt = advantages_bt + values_bt on action tokens, 0 elsewhere.
    """
    checked = ck.is_checked(checked)
    x = _prepare(rewards_bt, values_bt, action_mask_bt, gamma, lam, last_value_b, checked)
    if checked:
        _require_rewards_on(x.r_bt, x.m_bt, "action")
    return _gae_jit(*x, impl=_check_impl(impl))


def monte_carlo_returns(rewards_bt, action_mask_bt, gamma) -> jax.Array:
    """Observed return of every action token, lambda = 1 and no bootstrap:
    R_t = sum over action tokens t' >= t of gamma^(number of action tokens in [t, t')) r_t'
    (observation tokens skipped, docs/method.md section 4); 0 off action tokens."""
    zeros_bt = jnp.zeros(rewards_bt.shape, jnp.float32)
    _, returns_bt = skip_observation_gae(
        rewards_bt, zeros_bt, action_mask_bt, gamma=gamma, lam=1.0, checked=False
    )
    return returns_bt


# --------------------------------------------------------------------------- lambdas


def length_adaptive_lambda(action_mask_bt: jax.Array, alpha: float | jax.Array = 1.5) -> jax.Array:
    """lam_b = clip(1 - 1/(alpha * l_b), 0, 1), l_b = action tokens of row b; 0 if l_b = 0.

    Longer trajectories get lambda closer to 1 (less bias where the TD chain is long).
    """
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", None, False)
    if isinstance(alpha, (int, float)) and not alpha > 0:
        raise ValueError(f"alpha: must be > 0, got {alpha}")
    l_b = jnp.sum(m_bt, axis=1).astype(jnp.float32)  # [B]
    lam_b = 1.0 - 1.0 / (jnp.asarray(alpha, jnp.float32) * jnp.maximum(l_b, 1.0))
    return jnp.where(l_b > 0, jnp.clip(lam_b, 0.0, 1.0), 0.0)


class DecoupledGAE(NamedTuple):
    advantages_bt: jax.Array  # [B, T] policy advantages at lam_policy_b
    returns_bt: jax.Array  # [B, T] critic targets at lam_critic
    lam_policy_b: jax.Array  # [B] the length-adaptive lambdas used


def critic_and_policy_advantages(
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    action_mask_bt: jax.Array,
    *,
    gamma: float | jax.Array = 1.0,
    lam_critic: float | jax.Array = 1.0,
    alpha: float | jax.Array = 1.5,
    last_value_b: jax.Array | None = None,
    impl: str | None = None,
    checked: bool | None = None,
) -> DecoupledGAE:
    """Decoupled lambdas from one set of values (docs/method.md section 4).

    Critic targets: returns of `skip_observation_gae` at `lam_critic` (1.0: Monte-Carlo-like).
    Policy advantages: `skip_observation_gae` at `length_adaptive_lambda(mask, alpha)`.
    """
    lam_policy_b = length_adaptive_lambda(action_mask_bt, alpha)
    kw = dict(gamma=gamma, last_value_b=last_value_b, impl=impl, checked=checked)
    _, returns_bt = skip_observation_gae(
        rewards_bt, values_bt, action_mask_bt, lam=lam_critic, **kw
    )
    adv_bt, _ = skip_observation_gae(rewards_bt, values_bt, action_mask_bt, lam=lam_policy_b, **kw)
    return DecoupledGAE(adv_bt, returns_bt, lam_policy_b)


# ------------------------------------------------------------------ reward placement


def last_action_mask(action_mask_bt: jax.Array) -> jax.Array:
    """[B, T] bool: True on each row's last action token (no True in rows without one)."""
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", None, False)
    t = m_bt.shape[1]
    last_b = t - 1 - jnp.argmax(m_bt[:, ::-1], axis=1)  # [B]
    return (jnp.arange(t)[None, :] == last_b[:, None]) & jnp.any(m_bt, axis=1, keepdims=True)


def place_outcome_reward(
    outcome_b: jax.Array, action_mask_bt: jax.Array, *, checked: bool | None = None
) -> jax.Array:
    """[B, T] rewards: outcome_b on each row's LAST ACTION token, 0 elsewhere.

    Never on an observation or pad token, even when the row ends with one; rows with no
    action token get no reward.
    """
    bt = ck.check_bt(action_mask_bt, "action_mask_bt")
    ck.check_b(outcome_b, "outcome_b", bt[0])
    ck.as_mask(action_mask_bt, "action_mask_bt", bt, ck.is_checked(checked))
    out_b = jnp.asarray(outcome_b, jnp.result_type(outcome_b.dtype, jnp.float32))
    return jnp.where(last_action_mask(action_mask_bt), out_b[:, None], 0.0)


def turn_bounds(
    action_mask_bt: jax.Array, turn_ids_bt: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """(start_bt, end_bt): first and last token of each model turn.

    A turn is a maximal run of consecutive action tokens with the same turn id (with
    `turn_ids_bt` None: a maximal run of action tokens).
    """
    m_bt = jnp.asarray(action_mask_bt, bool)
    tid_bt = jnp.zeros(m_bt.shape, jnp.int32) if turn_ids_bt is None else turn_ids_bt
    same_bt = m_bt[:, 1:] & m_bt[:, :-1] & (tid_bt[:, 1:] == tid_bt[:, :-1])  # [B, T-1]
    no_b1 = jnp.zeros((m_bt.shape[0], 1), bool)
    start_bt = m_bt & ~jnp.concatenate([no_b1, same_bt], axis=1)
    end_bt = m_bt & ~jnp.concatenate([same_bt, no_b1], axis=1)
    return start_bt, end_bt


def _check_turn_ids(turn_ids_bt: Any, bt: tuple[int, int], m_bt: jax.Array, checked: bool):
    ck.check_bt(turn_ids_bt, "turn_ids_bt", bt)
    if not jnp.issubdtype(turn_ids_bt.dtype, jnp.integer):
        raise TypeError(f"turn_ids_bt: expected an int array, got dtype {turn_ids_bt.dtype}")
    if checked:
        ck.require_value(
            jnp.all(jnp.where(m_bt, turn_ids_bt >= 0, turn_ids_bt == -1)),
            "turn_ids_bt: must be >= 0 on action tokens and -1 elsewhere",
        )


def place_turn_rewards(
    turn_rewards_bn: jax.Array,
    turn_ids_bt: jax.Array,
    action_mask_bt: jax.Array,
    *,
    checked: bool | None = None,
) -> jax.Array:
    """[B, T] rewards: turn_rewards_bn[b, n] on the last action token of model turn n.

    turn_ids_bt holds the model-turn index of action tokens (-1 elsewhere). Turn ids
    outside [0, N) get no reward (an error in checked mode).
    """
    checked = ck.is_checked(checked)
    bt = ck.check_bt(action_mask_bt, "action_mask_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, checked)
    _check_turn_ids(turn_ids_bt, bt, m_bt, checked)
    shape = ck.shape_of(turn_rewards_bn, "turn_rewards_bn")
    if len(shape) != 2 or shape[0] != bt[0]:
        raise ValueError(f"turn_rewards_bn: expected shape [B={bt[0]}, N], got {shape}")
    n = shape[1]
    if checked:
        ck.require_value(
            jnp.all(jnp.where(m_bt, turn_ids_bt < n, True)),
            f"turn_ids_bt: turn index >= N = {n} (turn_rewards_bn has N columns)",
        )
    _, end_bt = turn_bounds(m_bt, turn_ids_bt)
    idx_bt = jnp.clip(turn_ids_bt, 0, max(n - 1, 0))
    dtype = jnp.result_type(turn_rewards_bn.dtype, jnp.float32)
    if n == 0:
        return jnp.zeros(bt, dtype)
    r_bt = jnp.take_along_axis(jnp.asarray(turn_rewards_bn, dtype), idx_bt, axis=1)
    ok_bt = end_bt & (turn_ids_bt >= 0) & (turn_ids_bt < n)
    return jnp.where(ok_bt, r_bt, 0.0)


# ------------------------------------------------------------ granularity ablation


def _turn_broadcast(x_bt: jax.Array, on_bt: jax.Array, start_bt: jax.Array) -> jax.Array:
    """Sum of x over the `on` tokens of each turn, broadcast to every token of the turn."""
    b, t = x_bt.shape
    seg_n = jnp.cumsum(start_bt.reshape(-1)) - 1  # [B*T] global turn index
    seg_n = jnp.maximum(seg_n, 0)
    tot_n = jax.ops.segment_sum(jnp.where(on_bt, x_bt, 0).reshape(-1), seg_n, num_segments=b * t)
    return tot_n[seg_n].reshape(b, t)


def step_level_gae(
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    action_mask_bt: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    reduce: str = "mean",
    turn_ids_bt: jax.Array | None = None,
    last_value_b: jax.Array | None = None,
    impl: str | None = None,
    checked: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Step-level GAE (docs/method.md section 4, Table 5 ablation): one value per model turn.

    V_n = mean of the turn's token values (reduce="mean", "step-mean") or its last token's
    value (reduce="last", "step-last"); r_n = every reward of the turn plus those parked on
    the observations after it. A_n = r_n + gamma*V_{n+1} - V_n + gamma*lam*A_{n+1} (last
    turn: V_{N} = last_value_b). A_n is broadcast to the turn's tokens; returns are
    A_n + V_n on them. Turns as in `turn_bounds`.
    """
    if reduce not in ("mean", "last"):
        raise ValueError(f"reduce: must be 'mean' or 'last', got {reduce!r}")
    checked = ck.is_checked(checked)
    x = _prepare(rewards_bt, values_bt, action_mask_bt, gamma, lam, last_value_b, checked)
    if turn_ids_bt is not None:
        _check_turn_ids(turn_ids_bt, x.m_bt.shape, x.m_bt, checked)
    if checked:
        _require_rewards_on(x.r_bt, x.m_bt, "action")
    start_bt, end_bt = turn_bounds(x.m_bt, turn_ids_bt)
    if reduce == "mean":
        n_bt = _turn_broadcast(jnp.ones_like(x.v_bt), x.m_bt, start_bt)
        v_turn_bt = _turn_broadcast(x.v_bt, x.m_bt, start_bt) / jnp.maximum(n_bt, 1.0)
    else:
        v_turn_bt = _turn_broadcast(x.v_bt, end_bt, start_bt)
    # Each turn is one step, represented by its first token; every other reward is parked
    # and credited to the closest turn start before it: its own turn's.
    a_start_bt, _ = _gae_jit(
        x.r_bt, v_turn_bt, start_bt, x.gamma, x.lam_b, x.last_b, impl=_check_impl(impl)
    )
    a_bt = jnp.where(x.m_bt, _turn_broadcast(a_start_bt, start_bt, start_bt), 0.0)
    return a_bt, jnp.where(x.m_bt, a_bt + v_turn_bt, 0.0)


def cross_observation_gae(
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    action_mask_bt: jax.Array,
    *,
    gamma: float | jax.Array,
    lam: float | jax.Array,
    token_mask_bt: jax.Array | None = None,
    last_value_b: jax.Array | None = None,
    impl: str | None = None,
    checked: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Plain token-level GAE through observations (the opposite premise to skipping).

    Every token of `token_mask_bt` (default: each row's tokens up to and including its last
    action token; pass the non-pad mask to include trailing observations) takes part in
    the recursion with its own TD error and gamma*lam per token. Advantages and returns
    are then masked to action tokens for the loss.
    """
    checked = ck.is_checked(checked)
    x = _prepare(rewards_bt, values_bt, action_mask_bt, gamma, lam, last_value_b, checked)
    if token_mask_bt is None:
        last_bt = last_action_mask(x.m_bt)
        tok_bt = jnp.cumsum(last_bt[:, ::-1], axis=1)[:, ::-1] > 0  # t <= last action
    else:
        tok_bt = ck.as_mask(token_mask_bt, "token_mask_bt", x.m_bt.shape, checked)
    if checked:
        _require_rewards_on(x.r_bt, tok_bt, "token_mask")
    a_bt, ret_bt = _gae_jit(
        x.r_bt, x.v_bt, tok_bt, x.gamma, x.lam_b, x.last_b, impl=_check_impl(impl)
    )
    return jnp.where(x.m_bt, a_bt, 0.0), jnp.where(x.m_bt, ret_bt, 0.0)
