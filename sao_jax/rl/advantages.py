"""Advantage estimators by name, all called the same way (docs/method.md sections 4-6).

    compute_advantages(name, *, rewards_bt, outcome_b, action_mask_bt, values_bt=None,
                       last_value_b=None, turn_ids_bt=None, group_ids_b=None,
                       baseline_state=None, baseline_keys_b=None, gamma=1.0, lam=1.0,
                       eps=1e-6, **params)
        -> Advantages(advantages_bt, returns_bt | None, baseline_state, metrics)

Critic-based (`needs_values`): `gae` (observation-skipping token-level GAE), `step_mean`,
`step_last` (one value per model turn), `cross_observation` (GAE through observations).
They read `rewards_bt` (rewards on action tokens) and return critic targets `returns_bt`
at the `lam` given. SAO's decoupled lambdas are two calls on the same values:
critic targets = returns of `gae` at lam=1.0; policy advantages = advantages of `gae` at
lam=length_adaptive_lambda(action_mask_bt, 1.5) (or `gae.critic_and_policy_advantages`).

Critic-free: `grpo` ((R - mean_g) / (std_g + eps), population std over the row's group),
`rloo` (R - mean of the other rows of the group), `drgrpo` (R - mean_g), and
`moving_average` (R - mean of the last W outcomes seen before this batch; 0 when none;
with a keyed state, `init_moving_average_state(W, keys=K)`, the last W outcomes of the
row's own key `baseline_keys_b[b]`, e.g. its prompt's difficulty level).
They read `outcome_b` and broadcast the row's scalar advantage to its action tokens;
`returns_bt` is None. Group statistics and the moving-average history use only rows with
at least one action token; rows without one get zero advantage everywhere, and their
number is the metric `rows_without_actions`.

`**params` are the estimator's own parameters, declared with their defaults in its
registry entry (`Estimator.params`; the critic-based ones: `impl`, the GAE implementation,
"auto" per backend); a run sets them as `rl.estimators.<name>.<param>` (sao_jax/defaults.py
reads the defaults from the registry), as it sets a loss's as `rl.losses.<name>.<param>`.

Metrics are name -> (sum, count) pairs of float32 scalars, reduced on the host.
Whitening is a separate step: `whiten_advantages`.
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


class Advantages(NamedTuple):
    advantages_bt: jax.Array  # [B, T], 0 off action tokens
    returns_bt: jax.Array | None  # [B, T] critic targets (critic-based estimators only)
    baseline_state: Any  # the updated estimator state (moving_average), else as given
    metrics: rm.Metrics


class MovingAverageState(NamedTuple):
    """Ring buffers of the last W outcomes (explicit state, carried in the TrainState).

    Global (one history for every row, the default): rewards_w [W], count []. Keyed (one
    history per key k in [0, K), e.g. per difficulty level): rewards_w [K, W], count [K].
    The global shapes are those of every checkpoint written before keys existed, so those
    restore unchanged.
    """

    rewards_w: jax.Array  # [W] | [K, W] float32; slots [0, min(count, W)) hold valid outcomes
    count: jax.Array  # int32 [] | [K]: outcomes pushed so far (per key)


def init_moving_average_state(window: int = 128, keys: int = 0) -> MovingAverageState:
    """An empty history of `window` outcomes (docs/method.md: 128); `keys` >= 2: one such
    history per key (0 or 1: one global history)."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window: must be an int >= 1, got {window!r}")
    if not isinstance(keys, int) or isinstance(keys, bool) or keys < 0:
        raise ValueError(f"keys: must be an int >= 0, got {keys!r}")
    lead = (keys,) if keys >= 2 else ()
    return MovingAverageState(jnp.zeros((*lead, window), jnp.float32), jnp.zeros(lead, jnp.int32))


def moving_average_update(
    state: MovingAverageState,
    outcome_b: jax.Array,
    valid_b: jax.Array,
    keys_b: jax.Array | None = None,
) -> tuple[jax.Array, MovingAverageState]:
    """(baseline_b [B], new_state): each row's baseline is the mean of its key's history
    before this batch (0 when that history is empty); then the valid outcomes are pushed,
    each onto its own key's history.

    Pure and jittable. Outcomes are pushed in row order; with more than W new ones of a key
    only its last W survive. `keys_b` [B] int in [0, K) picks each row's history in a keyed
    state (None: the global state, every row key 0). Rows that are not valid read and push
    nothing, whatever their key; a valid row's key outside [0, K) is clipped into it
    (callers check keys on the host: sao_jax/sampling/trajectory.py `baseline_keys`).
    """
    w = state.rewards_w.shape[-1]
    rewards_kw = state.rewards_w.reshape(-1, w)  # global: K = 1
    count_k = state.count.reshape(-1)
    k = count_k.shape[0]
    key_b = jnp.zeros(outcome_b.shape, jnp.int32) if keys_b is None else keys_b
    key_b = jnp.clip(key_b.astype(jnp.int32), 0, k - 1)
    n_old_k = jnp.minimum(count_k, w)
    slot_on_kw = jnp.arange(w)[None, :] < n_old_k[:, None]
    total_k = jnp.sum(jnp.where(slot_on_kw, rewards_kw, 0.0), axis=1)
    baseline_k = jnp.where(n_old_k > 0, total_k / jnp.maximum(n_old_k, 1), 0.0)
    mine_bk = valid_b[:, None] & (key_b[:, None] == jnp.arange(k)[None, :])
    rank_bk = jnp.cumsum(mine_bk.astype(jnp.int32), axis=0) - 1  # rank among the key's rows
    rank_b = jnp.take_along_axis(rank_bk, key_b[:, None], axis=1)[:, 0]
    n_new_k = jnp.sum(mine_bk.astype(jnp.int32), axis=0)
    keep_b = valid_b & (rank_b >= n_new_k[key_b] - w)
    slot_b = (count_k[key_b] + rank_b) % w
    pos_b = jnp.where(keep_b, key_b * w + slot_b, k * w)  # k * w: out of bounds, dropped
    flat = rewards_kw.reshape(-1).at[pos_b].set(outcome_b.astype(jnp.float32), mode="drop")
    new = MovingAverageState(
        flat.reshape(state.rewards_w.shape), (count_k + n_new_k).reshape(state.count.shape)
    )
    return baseline_k[key_b], new


def whiten_advantages(
    advantages_bt: jax.Array, action_mask_bt: jax.Array, *, eps: float = 1e-6, shift_mean=True
) -> jax.Array:
    """(A - mean) / sqrt(var + eps) over action tokens (no shift: A / sqrt(var + eps))."""
    bt = ck.check_bt(advantages_bt, "advantages_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, False)
    n = jnp.maximum(jnp.sum(m_bt), 1)
    mean = jnp.sum(jnp.where(m_bt, advantages_bt, 0.0)) / n
    var = jnp.sum(jnp.where(m_bt, jnp.square(advantages_bt - mean), 0.0)) / n
    centred_bt = advantages_bt - mean if shift_mean else advantages_bt
    return jnp.where(m_bt, centred_bt * jax.lax.rsqrt(var + eps), 0.0)


# ---------------------------------------------------------------------- the registry


class Inputs(NamedTuple):
    """Arguments of `compute_advantages`, checked; the mask as bool."""

    rewards_bt: jax.Array | None
    outcome_b: jax.Array | None
    m_bt: jax.Array
    values_bt: jax.Array | None
    last_value_b: jax.Array | None
    turn_ids_bt: jax.Array | None
    group_ids_b: jax.Array | None
    baseline_state: Any
    baseline_keys_b: jax.Array | None
    gamma: Any
    lam: Any
    eps: float
    checked: bool


@dataclasses.dataclass(frozen=True)
class Estimator:
    """fn(inputs, **params) -> Advantages (metrics without the common ones)."""

    fn: Callable[..., Advantages]
    needs_values: bool = False  # run the critic first
    needs_rewards: bool = False  # token-level rewards_bt
    needs_outcome: bool = False  # per-row outcome_b
    needs_groups: bool = False  # group_ids_b
    needs_state: bool = False  # baseline_state
    # Keyword parameters with their defaults, settable from the config
    # (rl.estimators.<name>.<param>, sao_jax/defaults.py reads them from here).
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: tuple[str, ...] = ()  # keyword array inputs a caller may pass (not config)


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def register(name: str, **attrs: Any) -> Callable:
    """Decorator: registers `fn(x: Inputs, **params) -> Advantages` as the estimator `name`,
    with the inputs it needs (`Estimator` fields: needs_values runs the critic first,
    needs_outcome / needs_groups / needs_state, ...) and `params`, each parameter with its
    default (a run sets them as rl.estimators.<name>.<param>). A new estimator is one file
    with this call (sao_jax/registry.py has the how-to)."""

    def wrap(fn):
        ESTIMATORS.register(name, Estimator(fn, **attrs))
        return fn

    return wrap


def estimator(name: str) -> Estimator:
    """The registry entry of `name` (e.g. `estimator(name).needs_values`)."""
    return ESTIMATORS.get(name)


_CRITIC = dict(needs_values=True, needs_rewards=True)


_IMPL = {"impl": "auto"}  # GAE implementation (sao_jax/rl/gae.py; "auto": per backend)


@register("gae", params=_IMPL, **_CRITIC)
def _gae(x: Inputs, impl: str | None = None) -> Advantages:
    a_bt, ret_bt = gae.skip_observation_gae(
        x.rewards_bt, x.values_bt, x.m_bt, gamma=x.gamma, lam=x.lam,
        last_value_b=x.last_value_b, impl=impl, checked=x.checked,
    )  # fmt: skip
    return Advantages(a_bt, ret_bt, x.baseline_state, {})


def _step(reduce: str):
    def fn(x: Inputs, impl: str | None = None) -> Advantages:
        a_bt, ret_bt = gae.step_level_gae(
            x.rewards_bt, x.values_bt, x.m_bt, gamma=x.gamma, lam=x.lam, reduce=reduce,
            turn_ids_bt=x.turn_ids_bt, last_value_b=x.last_value_b, impl=impl,
            checked=x.checked,
        )  # fmt: skip
        return Advantages(a_bt, ret_bt, x.baseline_state, {})

    return fn


register("step_mean", params=_IMPL, **_CRITIC)(_step("mean"))
register("step_last", params=_IMPL, **_CRITIC)(_step("last"))


@register("cross_observation", params=_IMPL, arrays=("token_mask_bt",), **_CRITIC)
def _cross(x: Inputs, impl: str | None = None, token_mask_bt=None) -> Advantages:
    a_bt, ret_bt = gae.cross_observation_gae(
        x.rewards_bt, x.values_bt, x.m_bt, gamma=x.gamma, lam=x.lam,
        token_mask_bt=token_mask_bt, last_value_b=x.last_value_b, impl=impl,
        checked=x.checked,
    )  # fmt: skip
    return Advantages(a_bt, ret_bt, x.baseline_state, {})


def _rows(x: Inputs) -> tuple[jax.Array, jax.Array]:
    """(outcome_b as float32, valid_b: rows with at least one action token)."""
    return x.outcome_b.astype(jnp.float32), jnp.any(x.m_bt, axis=1)


def _row_advantages(x: Inputs, adv_b: jax.Array, valid_b: jax.Array, state=None):
    adv_b = jnp.where(valid_b, adv_b, 0.0)
    metrics = {"rows_zero_advantage": rm.masked_sum_count(adv_b == 0, valid_b)}
    a_bt = jnp.where(x.m_bt, adv_b[:, None], 0.0)
    return Advantages(a_bt, None, x.baseline_state if state is None else state, metrics)


def _group_stats(x: Inputs):
    """Per row: (outcome, valid, group size n, group mean, group population variance)."""
    r_b, valid_b = _rows(x)
    same_bb = (x.group_ids_b[:, None] == x.group_ids_b[None, :]) & valid_b[None, :]
    w_bb = same_bb.astype(jnp.float32)
    n_b = jnp.sum(w_bb, axis=1)
    mean_b = (w_bb @ r_b) / jnp.maximum(n_b, 1.0)
    var_b = jnp.sum(w_bb * jnp.square(r_b[None, :] - mean_b[:, None]), axis=1)
    return r_b, valid_b, n_b, mean_b, var_b / jnp.maximum(n_b, 1.0)


_GROUP = dict(needs_outcome=True, needs_groups=True)


@register("grpo", **_GROUP)
def _grpo(x: Inputs) -> Advantages:
    r_b, valid_b, _, mean_b, var_b = _group_stats(x)
    return _row_advantages(x, (r_b - mean_b) / (jnp.sqrt(var_b) + x.eps), valid_b)


@register("drgrpo", **_GROUP)
def _drgrpo(x: Inputs) -> Advantages:
    r_b, valid_b, _, mean_b, _ = _group_stats(x)
    return _row_advantages(x, r_b - mean_b, valid_b)


@register("rloo", **_GROUP)
def _rloo(x: Inputs) -> Advantages:
    """R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean); 0 for a group of one."""
    r_b, valid_b, n_b, mean_b, _ = _group_stats(x)
    adv_b = jnp.where(n_b > 1, n_b / jnp.maximum(n_b - 1.0, 1.0) * (r_b - mean_b), 0.0)
    return _row_advantages(x, adv_b, valid_b)


@register("moving_average", needs_outcome=True, needs_state=True)
def _moving_average(x: Inputs) -> Advantages:
    r_b, valid_b = _rows(x)
    if x.checked and x.baseline_keys_b is not None:
        k = x.baseline_state.count.shape[0]
        in_range_b = (x.baseline_keys_b >= 0) & (x.baseline_keys_b < k)
        ck.require_value(
            jnp.all(in_range_b | ~valid_b),
            f"baseline_keys_b: the keys of rows with action tokens must be in [0, {k})",
        )
    baseline_b, state = moving_average_update(x.baseline_state, r_b, valid_b, x.baseline_keys_b)
    out = _row_advantages(x, r_b - baseline_b, valid_b, state)
    out.metrics["baseline"] = rm.masked_sum_count(baseline_b, valid_b)
    return out


# ----------------------------------------------------------------------- the one call


def _check_state(state: Any, keys_b: jax.Array | None, b: int) -> None:
    if not isinstance(state, MovingAverageState):
        raise TypeError(
            "baseline_state: expected a MovingAverageState (init_moving_average_state), "
            f"got {type(state).__name__}"
        )
    shapes = (state.rewards_w.shape, state.count.shape)
    keyed = state.rewards_w.ndim == 2
    if not (state.rewards_w.ndim in (1, 2) and state.count.shape == state.rewards_w.shape[:-1]):
        raise ValueError(
            "baseline_state: expected rewards_w [W] and a scalar count (global), or "
            f"rewards_w [K, W] and count [K] (keyed), got {shapes[0]} and {shapes[1]}"
        )
    if keyed and keys_b is None:
        raise ValueError(
            f"baseline_keys_b: a keyed moving-average state ({shapes[0][0]} keys) needs one "
            "key per row, got None"
        )
    if keys_b is not None:
        if not keyed:
            raise ValueError(
                "baseline_keys_b: given, but baseline_state is global (rewards_w [W]); "
                "init_moving_average_state(window, keys=K) makes a keyed one"
            )
        ck.check_b(keys_b, "baseline_keys_b", b)
        if not jnp.issubdtype(keys_b.dtype, jnp.integer):
            raise TypeError(f"baseline_keys_b: expected an int array, got dtype {keys_b.dtype}")


def compute_advantages(
    name: str,
    *,
    rewards_bt: jax.Array | None,
    outcome_b: jax.Array | None,
    action_mask_bt: jax.Array,
    values_bt: jax.Array | None = None,
    last_value_b: jax.Array | None = None,
    turn_ids_bt: jax.Array | None = None,
    group_ids_b: jax.Array | None = None,
    baseline_state: Any = None,
    baseline_keys_b: jax.Array | None = None,
    gamma: float | jax.Array = 1.0,
    lam: float | jax.Array = 1.0,
    eps: float = 1e-6,
    checked: bool | None = None,
    **params: Any,
) -> Advantages:
    """Advantages of estimator `name` (module doc); unknown names raise with the known ones.

    Every estimator returns the common metrics `rows_without_actions` (sum: rows without an
    action token, count: B), `advantage` and `advantage_sq` (over action tokens).
    Arguments an estimator needs but got as None raise ValueError naming them.
    `baseline_keys_b` [B] int: each row's key into a keyed moving-average state.
    """
    entry = ESTIMATORS.get(name)
    check_params("advantage estimator", name, params, (*entry.params, *entry.arrays))
    params = {**entry.params, **params}
    checked = ck.is_checked(checked)
    bt = ck.check_bt(action_mask_bt, "action_mask_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, checked)
    need = {
        "values_bt": (entry.needs_values, values_bt),
        "rewards_bt": (entry.needs_rewards, rewards_bt),
        "outcome_b": (entry.needs_outcome, outcome_b),
        "group_ids_b": (entry.needs_groups, group_ids_b),
        "baseline_state": (entry.needs_state, baseline_state),
    }
    for arg, (needed, value) in need.items():
        if needed and value is None:
            raise ValueError(f"advantage estimator {name!r} needs {arg}, got None")
    if entry.needs_outcome:
        ck.check_b(outcome_b, "outcome_b", bt[0])
        ck.check_float(outcome_b, "outcome_b")
    if entry.needs_groups:
        ck.check_b(group_ids_b, "group_ids_b", bt[0])
        if not jnp.issubdtype(group_ids_b.dtype, jnp.integer):
            raise TypeError(f"group_ids_b: expected an int array, got dtype {group_ids_b.dtype}")
    if entry.needs_state:
        _check_state(baseline_state, baseline_keys_b, bt[0])
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps: must be a number >= 0, got {eps!r}")
    x = Inputs(
        rewards_bt, outcome_b, m_bt, values_bt, last_value_b, turn_ids_bt, group_ids_b,
        baseline_state, baseline_keys_b, gamma, lam, float(eps), checked,
    )  # fmt: skip
    out = entry.fn(x, **params)
    a_bt = out.advantages_bt
    metrics = dict(out.metrics)
    valid_b = jnp.any(m_bt, axis=1)
    metrics["rows_without_actions"] = rm.masked_sum_count(~valid_b, jnp.ones_like(valid_b))
    metrics["advantage"] = rm.masked_sum_count(a_bt, m_bt)
    metrics["advantage_sq"] = rm.masked_sum_count(jnp.square(a_bt), m_bt)
    if out.returns_bt is not None:
        metrics["returns"] = rm.masked_sum_count(out.returns_bt, m_bt)
    return out._replace(metrics=metrics)
