"""Policy and value losses by name, all called the same way (docs/method.md sections 2, 3, 5).

    policy_loss(name, *, logp_bt, rollout_logp_bt, advantages_bt, action_mask_bt,
                old_logp_bt=None, entropy_bt=None, staleness_bt=None,
                denominator=None, **params) -> (loss, metrics)
    value_loss(values_bt, returns_bt, action_mask_bt, *, old_values_bt=None,
               clip_eps=None, denominator=None) -> (loss, metrics)

Every loss is sum_t m_t * loss_t / denominator; `denominator` defaults to the number of
action tokens and lets a microbatched step divide by the GLOBAL token count so that the
sum of microbatch losses equals the full-batch loss. Tokens a loss masks out stay in it.

Policy losses (r_t = exp(logp - rollout_logp); the "keep" mask says which action tokens
carry gradient):
- `dis` (SAO): L = -sum m * sg(f(r)) * sg(A) * logp / denom, f(r) = r inside
  (1 - eps_l, 1 + eps_h) else 0 (mask, not clamp). keep: r in the band.
  Defaults eps_l=0.3, eps_h=5.0 (keep (0.7, 6.0)).
- `ppo_clip`: rho = exp(logp - rollout_logp), pi_old = the BEHAVIOUR policy: the rollout
  engine's recorded log-probs, as veRL and OpenRLHF use the batch's behaviour policy
  (docs/method.md section 5); L = -sum m * min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)
  / denom. keep: the unclipped term is active. With several minibatch optimizer steps per
  batch (rl.ppo_epochs x rl.minibatches) and on stale data the clip binds.
  Defaults eps_low=0.2, eps_high=0.28.
- `icepop` (the published form): L = -sum m * M(k) * min(rho A, clip(rho, 1-eps_low,
  1+eps_high) A) / denom with rho = exp(logp - old_logp), k = exp(old_logp -
  rollout_logp) and M(k) = k inside [band_low, band_high], else 0 (a weight, no gradient
  through it). old_logp_bt is the TRAINING engine's log-prob of the policy at the start
  of the update step (the "pi_old" the engine recomputes, fixed through the step's
  minibatches), rollout_logp_bt the INFERENCE engine's: k is the train/inference
  mismatch ratio of IcePop. For tokens sampled by the version the learner holds
  (staleness 0; every token with synchronous rollouts) that is exactly
  pi_train(theta_old) / pi_infer(theta_old). The learner does not keep the weights of
  older versions, so on stale tokens k also carries the lag (their band rejections show
  in keep_rate_stale_*). keep: k in the band (inclusive). Defaults [0.5, 5.0], PPO eps as
  ppo_clip. Needs old_logp_bt.
- `icepop_mask`: the mask-only variant: as `icepop` with M(k) = 1 inside the band (kept
  tokens unweighted), else 0. Needs old_logp_bt.
- `estr`: as `dis` with keep iff |log r| <= sqrt(tau * (H + eps)), H = entropy_bt of the
  current policy (no gradient through it). Defaults tau=1.0, eps=1e-6. Needs entropy_bt.
- `positive_nll`: supervised NLL, L = -sum m * [A > 0] * logp / denom (SFT-style
  ablation on positive-advantage rows). keep: A > 0.

PPO-style ratios use log-ratios clamped to +-20 before exp so that gradients stay finite.

Metrics (name -> (sum, count) over action tokens): `keep_rate`, `approx_kl` (k3 estimator
r - 1 - log r of KL(rollout || current), log r clamped to +-20), `ppo_clip_low` /
`ppo_clip_high` / `clip_frac` (ppo_clip, icepop*: rho < 1-eps_low with A < 0 / rho >
1+eps_high with A > 0 / either), `icepop_weight` (icepop*: the mean weight M(k) over
action tokens), `masked_entropy` and `kept_entropy` (mean entropy of masked-out / kept tokens,
when entropy_bt is given), and `keep_rate_stale_{0,1,2,3_4,5_8,gt8}` (when staleness_bt,
the per-token policy-version lag, is given: buckets 0, 1, 2, 3-4, 5-8, >8).
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

sg = jax.lax.stop_gradient

LOG_RATIO_CLAMP = 20.0
# (metric suffix, lowest lag, highest lag or None): static edges, so they jit.
STALENESS_BUCKETS = (
    ("0", 0, 0),
    ("1", 1, 1),
    ("2", 2, 2),
    ("3_4", 3, 4),
    ("5_8", 5, 8),
    ("gt8", 9, None),
)


class LossInputs(NamedTuple):
    """Arguments of `policy_loss`, checked, float32; the mask as bool."""

    logp_bt: jax.Array
    rollout_logp_bt: jax.Array
    adv_bt: jax.Array
    m_bt: jax.Array
    old_logp_bt: jax.Array | None
    entropy_bt: jax.Array | None


class TokenLoss(NamedTuple):
    loss_bt: jax.Array  # per-token loss (only read on action tokens)
    keep_bt: jax.Array  # bool: the token carries gradient
    metrics: rm.Metrics


@dataclasses.dataclass(frozen=True)
class Loss:
    """fn(inputs, **params) -> TokenLoss; `params` holds every accepted parameter's default."""

    fn: Callable[..., TokenLoss]
    params: dict[str, float]
    needs_old_logp: bool = False
    needs_entropy: bool = False
    kind: str = "policy"  # "policy" or "value"


LOSSES: Registry[Loss] = Registry("loss")


def register(name: str, params: dict[str, float], **attrs: Any) -> Callable:
    """Decorator: registers `fn(x: LossInputs, **params) -> TokenLoss` as the policy loss
    `name` (`kind="value"` for a value loss). `params` maps each parameter to its default
    (a run sets them as rl.losses.<name>.<param>); `needs_old_logp` / `needs_entropy` say
    which optional inputs it reads. The whole loss is -sum m * loss_bt / denominator, and
    keep_bt feeds the keep-rate metrics. A new loss is one file with this call
    (sao_jax/registry.py has the how-to)."""

    def wrap(fn):
        LOSSES.register(name, Loss(fn, params, **attrs))
        return fn

    return wrap


def _log_ratio(a_bt: jax.Array, b_bt: jax.Array, m_bt: jax.Array) -> jax.Array:
    """a - b on action tokens (0 elsewhere), clamped to +-LOG_RATIO_CLAMP."""
    return jnp.clip(jnp.where(m_bt, a_bt - b_bt, 0.0), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _weighted_logp_loss(x: LossInputs, keep_bt: jax.Array) -> TokenLoss:
    """-sg(f(r)) * sg(A) * logp with f(r) = r on kept tokens, 0 elsewhere."""
    r_bt = jnp.exp(jnp.where(x.m_bt, x.logp_bt - x.rollout_logp_bt, 0.0))
    w_bt = sg(jnp.where(keep_bt, r_bt * x.adv_bt, 0.0))
    return TokenLoss(-jnp.where(keep_bt, w_bt * x.logp_bt, 0.0), keep_bt, {})


@register("dis", {"eps_l": 0.3, "eps_h": 5.0})
def _dis(x: LossInputs, eps_l: float, eps_h: float) -> TokenLoss:
    r_bt = jnp.exp(jnp.where(x.m_bt, sg(x.logp_bt) - x.rollout_logp_bt, 0.0))
    keep_bt = x.m_bt & (r_bt > 1.0 - eps_l) & (r_bt < 1.0 + eps_h)
    return _weighted_logp_loss(x, keep_bt)


@register("estr", {"tau": 1.0, "eps": 1e-6}, needs_entropy=True)
def _estr(x: LossInputs, tau: float, eps: float) -> TokenLoss:
    log_r_bt = jnp.where(x.m_bt, sg(x.logp_bt) - x.rollout_logp_bt, 0.0)
    bound_bt = jnp.sqrt(tau * (jnp.maximum(sg(x.entropy_bt), 0.0) + eps))
    keep_bt = x.m_bt & (jnp.abs(log_r_bt) <= bound_bt)
    return _weighted_logp_loss(x, keep_bt)


def _ppo(x: LossInputs, old_logp_bt: jax.Array, eps_low: float, eps_high: float) -> TokenLoss:
    """Clipped surrogate -min(rho A, clip(rho) A), rho = exp(logp - old_logp_bt)."""
    rho_bt = jnp.exp(_log_ratio(x.logp_bt, old_logp_bt, x.m_bt))
    surr_bt = jnp.minimum(rho_bt * x.adv_bt, jnp.clip(rho_bt, 1 - eps_low, 1 + eps_high) * x.adv_bt)
    low_bt = x.m_bt & (sg(rho_bt) < 1 - eps_low) & (x.adv_bt < 0)
    high_bt = x.m_bt & (sg(rho_bt) > 1 + eps_high) & (x.adv_bt > 0)
    metrics = {
        "ppo_clip_low": rm.masked_sum_count(low_bt, x.m_bt),
        "ppo_clip_high": rm.masked_sum_count(high_bt, x.m_bt),
        "clip_frac": rm.masked_sum_count(low_bt | high_bt, x.m_bt),
    }
    return TokenLoss(-surr_bt, x.m_bt & ~low_bt & ~high_bt, metrics)


@register("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28})
def _ppo_clip(x: LossInputs, eps_low: float, eps_high: float) -> TokenLoss:
    return _ppo(x, x.rollout_logp_bt, eps_low, eps_high)  # pi_old = the behaviour policy


def icepop_weight(
    old_logp_bt: jax.Array, rollout_logp_bt: jax.Array, m_bt: jax.Array, lo: float, hi: float
) -> tuple[jax.Array, jax.Array]:
    """(M(k), in-band mask) with k = pi_train(old) / pi_infer = exp(old_logp - rollout_logp),
    M(k) = k for lo <= k <= hi, else 0; 0 off action tokens. No gradient."""
    k_bt = jnp.exp(_log_ratio(sg(old_logp_bt), sg(rollout_logp_bt), m_bt))
    band_bt = m_bt & (k_bt >= lo) & (k_bt <= hi)
    return jnp.where(band_bt, k_bt, 0.0), band_bt


def _icepop_loss(x: LossInputs, eps_low, eps_high, band_low, band_high, weighted) -> TokenLoss:
    ppo = _ppo(x, x.old_logp_bt, eps_low, eps_high)
    w_bt, band_bt = icepop_weight(x.old_logp_bt, x.rollout_logp_bt, x.m_bt, band_low, band_high)
    if not weighted:
        w_bt = band_bt.astype(jnp.float32)
    metrics = dict(ppo.metrics, icepop_weight=rm.masked_sum_count(w_bt, x.m_bt))
    return TokenLoss(w_bt * ppo.loss_bt, band_bt, metrics)


ICEPOP_PARAMS = {"eps_low": 0.2, "eps_high": 0.28, "band_low": 0.5, "band_high": 5.0}


@register("icepop", ICEPOP_PARAMS, needs_old_logp=True)
def _icepop(x: LossInputs, eps_low, eps_high, band_low, band_high) -> TokenLoss:
    return _icepop_loss(x, eps_low, eps_high, band_low, band_high, weighted=True)


@register("icepop_mask", ICEPOP_PARAMS, needs_old_logp=True)
def _icepop_mask(x: LossInputs, eps_low, eps_high, band_low, band_high) -> TokenLoss:
    return _icepop_loss(x, eps_low, eps_high, band_low, band_high, weighted=False)


@register("positive_nll", {})
def _positive_nll(x: LossInputs) -> TokenLoss:
    keep_bt = x.m_bt & (x.adv_bt > 0)
    return TokenLoss(-jnp.where(keep_bt, x.logp_bt, 0.0), keep_bt, {})


# --------------------------------------------------------------------------- metrics


def _common_metrics(x: LossInputs, keep_bt, staleness_bt) -> rm.Metrics:
    log_r_bt = sg(_log_ratio(x.logp_bt, x.rollout_logp_bt, x.m_bt))
    metrics = {
        "keep_rate": rm.masked_sum_count(keep_bt, x.m_bt),
        "approx_kl": rm.masked_sum_count(jnp.expm1(log_r_bt) - log_r_bt, x.m_bt),
    }
    if x.entropy_bt is not None:
        h_bt = sg(x.entropy_bt)
        metrics["masked_entropy"] = rm.masked_sum_count(h_bt, x.m_bt & ~keep_bt)
        metrics["kept_entropy"] = rm.masked_sum_count(h_bt, keep_bt)
    if staleness_bt is not None:
        for suffix, lo, hi in STALENESS_BUCKETS:
            in_bt = x.m_bt & (staleness_bt >= lo)
            if hi is not None:
                in_bt &= staleness_bt <= hi
            metrics[f"keep_rate_stale_{suffix}"] = rm.masked_sum_count(keep_bt, in_bt)
    return metrics


# ---------------------------------------------------------------------- the one call


def _float_bt(x: Any, name: str, bt: tuple[int, int]) -> jax.Array:
    ck.check_bt(x, name, bt)
    ck.check_float(x, name)
    return jnp.asarray(x).astype(jnp.float32)


def _denominator(denominator: Any, m_bt: jax.Array, checked: bool) -> jax.Array:
    if denominator is None:
        return jnp.maximum(jnp.sum(m_bt), 1).astype(jnp.float32)
    d = jnp.asarray(denominator, jnp.float32)
    if d.ndim != 0:
        raise ValueError(f"denominator: expected a scalar, got shape {d.shape}")
    if isinstance(denominator, (int, float)) and not denominator > 0:
        raise ValueError(f"denominator: must be > 0, got {denominator}")
    if checked:
        ck.require_value(d > 0, "denominator: must be > 0")
    return d


def _check_loss_params(name: str, entry: Loss, params: dict[str, Any]) -> dict[str, Any]:
    check_params("loss", name, params, tuple(entry.params))
    out = {**entry.params, **params}
    for key, value in out.items():
        if isinstance(value, (int, float)) and not value >= 0:
            raise ValueError(f"loss {name!r} parameter {key}: must be >= 0, got {value}")
    return out


def policy_loss(
    name: str,
    *,
    logp_bt: jax.Array,
    rollout_logp_bt: jax.Array,
    advantages_bt: jax.Array,
    action_mask_bt: jax.Array,
    old_logp_bt: jax.Array | None = None,
    entropy_bt: jax.Array | None = None,
    staleness_bt: jax.Array | None = None,
    denominator: Any = None,
    checked: bool | None = None,
    **params: Any,
) -> tuple[jax.Array, rm.Metrics]:
    """(scalar loss, metrics) of policy loss `name` (module doc); differentiable in logp_bt.

    Unknown names, parameters the loss does not accept, and inputs a loss needs but got as
    None raise errors naming them. Parameters default as in the module doc.
    """
    entry = LOSSES.get(name)
    if entry.kind != "policy":
        raise ValueError(f"loss {name!r} is a {entry.kind} loss; call value_loss instead")
    params = _check_loss_params(name, entry, params)
    checked = ck.is_checked(checked)
    bt = ck.check_bt(action_mask_bt, "action_mask_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, checked)
    for arg, needed, value in (
        ("old_logp_bt", entry.needs_old_logp, old_logp_bt),
        ("entropy_bt", entry.needs_entropy, entropy_bt),
    ):
        if needed and value is None:
            raise ValueError(f"loss {name!r} needs {arg}, got None")
    optional = lambda v, n: None if v is None else _float_bt(v, n, bt)
    x = LossInputs(
        _float_bt(logp_bt, "logp_bt", bt),
        _float_bt(rollout_logp_bt, "rollout_logp_bt", bt),
        _float_bt(advantages_bt, "advantages_bt", bt),
        m_bt,
        optional(old_logp_bt, "old_logp_bt"),
        optional(entropy_bt, "entropy_bt"),
    )
    if staleness_bt is not None:
        ck.check_bt(staleness_bt, "staleness_bt", bt)
        if not jnp.issubdtype(staleness_bt.dtype, jnp.integer):
            raise TypeError(f"staleness_bt: expected an int array, got dtype {staleness_bt.dtype}")
        if checked:
            ck.require_value(
                jnp.all(jnp.where(m_bt, staleness_bt >= 0, True)), "staleness_bt: must be >= 0"
            )
    denom = _denominator(denominator, m_bt, checked)
    out = entry.fn(x, **params)
    loss = jnp.sum(jnp.where(m_bt, out.loss_bt, 0.0)) / denom
    metrics = {**_common_metrics(x, sg(out.keep_bt), staleness_bt), **out.metrics}
    return loss, metrics


def value_loss(
    values_bt: jax.Array,
    returns_bt: jax.Array,
    action_mask_bt: jax.Array,
    *,
    old_values_bt: jax.Array | None = None,
    clip_eps: float | None = None,
    denominator: Any = None,
    checked: bool | None = None,
) -> tuple[jax.Array, rm.Metrics]:
    """Masked MSE on action tokens: sum m * 0.5 (V - R)^2 / denom (the `value_mse` loss).

    With clip_eps (off by default), PPO-style value clipping around old_values_bt:
    V_c = V_old + clip(V - V_old, -clip_eps, clip_eps), loss 0.5 max((V-R)^2, (V_c-R)^2).
    Metrics: value_loss, value_residual(_sq) (R - V), returns(_sq) (explained variance
    1 - Var(R - V) / Var(R) on the host) and, when clipping, value_clip_frac.
    """
    checked = ck.is_checked(checked)
    bt = ck.check_bt(action_mask_bt, "action_mask_bt")
    m_bt = ck.as_mask(action_mask_bt, "action_mask_bt", bt, checked)
    v_bt = _float_bt(values_bt, "values_bt", bt)
    r_bt = sg(_float_bt(returns_bt, "returns_bt", bt))
    sq_bt = jnp.square(v_bt - r_bt)
    metrics: rm.Metrics = {}
    if clip_eps is not None:
        if not (isinstance(clip_eps, (int, float)) and clip_eps > 0):
            raise ValueError(f"clip_eps: must be a number > 0 (or None), got {clip_eps!r}")
        if old_values_bt is None:
            raise ValueError("value_loss with clip_eps needs old_values_bt, got None")
        old_bt = sg(_float_bt(old_values_bt, "old_values_bt", bt))
        v_clip_bt = old_bt + jnp.clip(v_bt - old_bt, -clip_eps, clip_eps)
        sq_clip_bt = jnp.square(v_clip_bt - r_bt)
        metrics["value_clip_frac"] = rm.masked_sum_count(sq_clip_bt > sq_bt, m_bt)
        sq_bt = jnp.maximum(sq_bt, sq_clip_bt)
    loss_bt = 0.5 * sq_bt
    loss = jnp.sum(jnp.where(m_bt, loss_bt, 0.0)) / _denominator(denominator, m_bt, checked)
    res_bt = sg(r_bt - v_bt)
    metrics |= {
        "value_loss": rm.masked_sum_count(sg(loss_bt), m_bt),
        "value_residual": rm.masked_sum_count(res_bt, m_bt),
        "value_residual_sq": rm.masked_sum_count(jnp.square(res_bt), m_bt),
        "returns": rm.masked_sum_count(r_bt, m_bt),
        "returns_sq": rm.masked_sum_count(jnp.square(r_bt), m_bt),
    }
    return loss, metrics


LOSSES.register("value_mse", Loss(value_loss, {}, kind="value"))
