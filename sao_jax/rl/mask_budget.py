"""Keep rules at a matched mask budget: each rule's parameter calibrated from data.

ESTR's evidence is a paired-budget comparison: every keep rule is recalibrated so that all
of them mask the same fraction f of the action tokens of the same batches, and then they
are compared on stability. Each rule here is one registered policy loss
(sao_jax/rl/losses.py) with a one-parameter family of bands, written as a per-token score
and a threshold c: the rule masks a token iff its score exceeds c (log r = the token's
log-ratio of the current policy to the rollout engine, H its entropy):

  dis     fixed band, symmetric in log r: keep iff e^-c < r < e^c
          (eps_l = 1 - e^-c, eps_h = e^c - 1);              score = |log r|
  estr    entropy-scaled band: keep iff |log r| <= sqrt(tau (H + eps)), tau = c
          (eps as the loss's default);                       score = log^2 r / (H + eps)
  icepop  IcePop's own asymmetric band [0.5, 5.0] with both log-bounds scaled by c:
          keep iff 0.5^c <= k <= 5^c (k = r: icepop's pi_old is the current policy
          at the update's single step);      score = max(log r / ln 5, log r / ln 0.5)

DIS is taken symmetric in log r so that DIS and ESTR differ in one thing only, whether
the band's width follows the token's entropy; IcePop keeps its published asymmetry (more
room above 1 than below), so the table also shows what the band's shape does at a fixed
width. At c = ln(1/0.7) / ln 6 the scaled DIS band of SAO's default would be (0.7, 6.0)
again; the symmetric one has no such point.

A calibration file (`write_calibration`, `read_levels`) holds, per budget and rule, the
parameters and the achieved fraction; configs/ablations.py turns each budget into one grid
level setting every rule's parameters (a row reads only its own loss's).

`calibrate(rule, tokens, f)` returns the c that masks round(f N) of the N tokens: the
midpoint between the round(f N)-th and the next largest score (a quantile, no search), so
the boundary sits between two tokens; ties can make the achieved fraction differ, which
`Calibration.achieved` reports. The parameters are rounded to `DIGITS` significant digits
(they name sweep points) and the achieved fraction is measured with the rounded ones by
the loss itself (`masked_fraction` reads the loss's keep-rate metric), not by a copy of
its rule. Where fewer than round(f N) tokens have any drift (every log r = 0: synchronous
rollouts at step 0, no train/inference mismatch) a budget means nothing and calibration
raises instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from sao_jax.rl import losses
from sao_jax.schema import ConfigError

DIGITS = 4  # significant digits of a calibrated parameter
ESTR_EPS = losses.LOSSES.get("estr").params["eps"]
ICEPOP_BAND = (0.5, 5.0)  # icepop's default band, the shape its family scales


@dataclasses.dataclass(frozen=True)
class Rule:
    """A keep rule at a mask budget: the loss it is, its per-token score (the token is
    masked iff score > threshold), and the loss parameters of a threshold."""

    loss: str
    score: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (log_ratio, entropy) -> [N]
    params: Callable[[float], dict[str, float]]  # threshold -> rl.losses.<loss>.*
    label: str


def _dis_score(log_ratio: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    return np.abs(log_ratio)


def _estr_score(log_ratio: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    return np.square(log_ratio) / (np.maximum(entropy, 0.0) + ESTR_EPS)


def _icepop_score(log_ratio: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    lo, hi = (math.log(b) for b in ICEPOP_BAND)
    return np.maximum(log_ratio / hi, log_ratio / lo)


RULES: dict[str, Rule] = {
    "dis": Rule(
        "dis",
        _dis_score,
        lambda c: {"eps_l": -math.expm1(-c), "eps_h": math.expm1(c)},
        "DIS, fixed band symmetric in log r",
    ),
    "estr": Rule("estr", _estr_score, lambda c: {"tau": c}, "ESTR, entropy-scaled band"),
    "icepop": Rule(
        "icepop",
        _icepop_score,
        lambda c: {"band_low": ICEPOP_BAND[0] ** c, "band_high": ICEPOP_BAND[1] ** c},
        "IcePop, fixed band [0.5, 5]^c",
    ),
}


def rule(name: str) -> Rule:
    if name not in RULES:
        raise ValueError(f"mask rule {name!r}: one of {sorted(RULES)}")
    return RULES[name]


def round_sig(x: float, digits: int = DIGITS) -> float:
    """`x` to `digits` significant digits (0 stays 0)."""
    return float(f"{x:.{digits - 1}e}") if x else 0.0


def threshold_for(score_n: np.ndarray, fraction: float) -> float:
    """The threshold that leaves the m = round(fraction N) largest scores above it: the
    midpoint between the m-th largest and the next. ValueError if fraction is not in
    (0, 1), m is 0, or fewer than m scores are > 0 (nothing drifted: no budget)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"mask budget fraction: must be in (0, 1), got {fraction}")
    s = np.sort(np.asarray(score_n, np.float64))[::-1]  # descending [N]
    m = round(fraction * s.size)
    if m == 0:
        raise ValueError(
            f"mask budget {fraction:g}: {s.size} tokens are too few to mask that share of"
        )
    drifted = int(np.sum(s > 0.0))
    if drifted < m:
        raise ValueError(
            f"mask budget {fraction:g}: only {drifted} of {s.size} tokens have a nonzero "
            f"score (log-ratio), fewer than the {m} it would mask; the ratio is 1 on the "
            "rest (no staleness, no train/inference mismatch), so a budget means nothing "
            "here: calibrate on batches that carry staleness"
        )
    below = float(s[m]) if m < s.size else 0.0
    return 0.5 * (float(s[m - 1]) + below)


def loss_params(name: str, threshold: float) -> dict[str, float]:
    """rl.losses.<loss>.* of rule `name` at `threshold`, rounded to DIGITS digits."""
    return {k: round_sig(v) for k, v in rule(name).params(threshold).items()}


class MaskStats(NamedTuple):
    """What a rule masks on a set of tokens: the share, and the mean entropy of the masked
    and of the kept tokens (NaN where there are none)."""

    fraction: float
    masked_entropy: float
    kept_entropy: float


def mask_stats(
    name: str, params: Mapping[str, float], log_ratio_n: np.ndarray, entropy_n: np.ndarray
) -> MaskStats:
    """What rule `name`'s loss masks with `params`, read from the loss's own metrics
    (`keep_rate`, `masked_entropy`, `kept_entropy`): log r enters as logp - rollout_logp =
    log r - 0; icepop's pi_old is the current policy, so its log k is log r too."""
    loss = rule(name).loss
    lr_bt = jnp.asarray(log_ratio_n, jnp.float32)[None]  # [1, N]
    zeros_bt = jnp.zeros_like(lr_bt)
    entry = losses.LOSSES.get(loss)
    _, metrics = losses.policy_loss(
        loss,
        logp_bt=lr_bt,
        rollout_logp_bt=zeros_bt,
        advantages_bt=zeros_bt,
        action_mask_bt=jnp.ones(lr_bt.shape, bool),
        old_logp_bt=lr_bt if entry.needs_old_logp else None,
        entropy_bt=jnp.asarray(entropy_n, jnp.float32)[None],
        **params,
    )

    def ratio(key: str) -> float:
        total, count = (float(x) for x in metrics[key])
        return total / count if count else math.nan

    return MaskStats(1.0 - ratio("keep_rate"), ratio("masked_entropy"), ratio("kept_entropy"))


def masked_fraction(
    name: str, params: Mapping[str, float], log_ratio_n: np.ndarray, entropy_n: np.ndarray
) -> float:
    """The share of the tokens rule `name` masks with `params` (`mask_stats`)."""
    return mask_stats(name, params, log_ratio_n, entropy_n).fraction


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Rule `rule` at target mask fraction `target` on `tokens` tokens: its loss
    parameters (rounded), the fraction the loss masks with them (`achieved`) and the mean
    entropy of the tokens it masks and keeps."""

    rule: str
    target: float
    threshold: float
    params: dict[str, float]
    achieved: float
    tokens: int
    masked_entropy: float = math.nan
    kept_entropy: float = math.nan

    def overrides(self) -> dict[str, float]:
        """The config fields that set these parameters: rl.losses.<loss>.<param>."""
        loss = rule(self.rule).loss
        return {f"rl.losses.{loss}.{k}": v for k, v in self.params.items()}


def calibrate(
    name: str, log_ratio_n: np.ndarray, entropy_n: np.ndarray, fraction: float
) -> Calibration:
    """Rule `name`'s parameters that mask `fraction` of these tokens (module docstring)."""
    log_ratio_n = np.asarray(log_ratio_n, np.float64)
    entropy_n = np.asarray(entropy_n, np.float64)
    if log_ratio_n.shape != entropy_n.shape or log_ratio_n.ndim != 1:
        raise ValueError(
            f"mask budget: log_ratio and entropy must be 1-D of one length, got "
            f"{log_ratio_n.shape} and {entropy_n.shape}"
        )
    c = threshold_for(rule(name).score(log_ratio_n, entropy_n), fraction)
    params = loss_params(name, c)
    got = mask_stats(name, params, log_ratio_n, entropy_n)
    return Calibration(name, fraction, c, params, got.fraction, int(log_ratio_n.size), *got[1:])


def budget_key(fraction: float) -> str:
    """A budget's key in a calibration file: '0.05'."""
    return f"{fraction:g}"


def write_calibration(
    path: str | pathlib.Path, calibrations: Sequence[Calibration], meta: Mapping[str, Any]
) -> pathlib.Path:
    """Writes {"budgets": {budget: {rule: {params, threshold, achieved, tokens}}}, **meta}."""
    budgets: dict[str, dict[str, Any]] = {}
    for c in calibrations:
        entry = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in dataclasses.asdict(c).items()
            if k not in ("rule", "target")
        }
        budgets.setdefault(budget_key(c.target), {})[c.rule] = entry
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "budgets": budgets}, indent=2, sort_keys=True) + "\n")
    return path


def read_calibration(path: str | pathlib.Path) -> dict[str, Any]:
    """A calibration file's contents; ConfigError naming the file if absent or malformed."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"mask budget calibration {path}: not readable ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("budgets"), dict):
        raise ConfigError(f"mask budget calibration {path}: no 'budgets' mapping")
    return data


def read_levels(path: str | pathlib.Path, budgets: Sequence[float]) -> tuple[dict[str, float], ...]:
    """One sweep grid level per budget: every rule's calibrated rl.losses.* fields."""
    data = read_calibration(path)["budgets"]
    levels = []
    for f in budgets:
        by_rule = data.get(budget_key(f))
        if not isinstance(by_rule, dict) or set(by_rule) != set(RULES):
            raise ConfigError(
                f"mask budget calibration {path}: budget {budget_key(f)} needs the rules "
                f"{sorted(RULES)}, got {sorted(by_rule or {})}"
            )
        level: dict[str, float] = {}
        for name in RULES:
            params = by_rule[name].get("params", {})
            for key, value in params.items():
                level[f"rl.losses.{rule(name).loss}.{key}"] = float(value)
        levels.append(level)
    return tuple(levels)
