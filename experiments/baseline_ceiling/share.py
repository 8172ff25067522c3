"""The share of the oracle's gain a row recovers: a ratio of two paired means with
Fieller's interval.

rho = mean(a) / mean(b) over the same n seeds, a_s = SAO_s - baseline_s and b_s =
oracle_s - baseline_s (results/online_shift_offsets/recheck.py reads the online shift's
ceiling share the same way). Fieller's interval is the set of r for which the paired t
test of a_s - r b_s does not reject at alpha,

  (a - r b)^2 <= t^2 (v_aa - 2 r v_ab + r^2 v_bb),  t = t_{1 - alpha/2, n - 1},
  v_xy = cov(x, y, ddof=1) / n,

exact when the per-seed pairs are normal, with no linearisation (the delta method) and no
resampling. It is a bounded interval iff b^2 > t^2 v_bb, i.e. iff mean(b) differs from 0
at the same level; otherwise the ratio is not estimable from these seeds (the set is
unbounded) and `fieller_interval` returns None.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from sao_jax.report import stats
from sao_jax.report.compare import ALPHA, Difference, fmt_p, paired_difference
from sao_jax.report.tables import finite


def fieller_interval(
    a_mean: float,
    b_mean: float,
    v_aa: float,
    v_bb: float,
    v_ab: float,
    df: float,
    alpha: float = ALPHA,
) -> tuple[float, float] | None:
    """The 1 - alpha Fieller interval of a_mean / b_mean (module docstring), from the
    variances v_aa, v_bb and covariance v_ab of the two means and the df of their
    estimate; None when it is unbounded (b_mean not distinguishable from 0)."""
    t2 = stats.t_quantile(1.0 - alpha / 2.0, df) ** 2
    if not math.isfinite(t2):
        return None
    qa = b_mean**2 - t2 * v_bb
    qb = a_mean * b_mean - t2 * v_ab
    qc = a_mean**2 - t2 * v_aa
    if not qa > 0:
        return None
    half = math.sqrt(max(qb * qb - qa * qc, 0.0))  # >= 0 when qa > 0: a_mean/b_mean is inside
    return (qb - half) / qa, (qb + half) / qa


@dataclasses.dataclass(frozen=True)
class Ratio:
    """mean(a) / mean(b) of paired per-seed values, its 1 - ALPHA Fieller interval (NaN
    when undefined) and the denominator's own test (is mean(b) > 0?)."""

    ratio: float
    lo: float
    hi: float
    denominator: Difference  # mean(b) with its SE, t and p

    @property
    def defined(self) -> bool:
        return math.isfinite(self.lo) and self.denominator.diff > 0


def paired_ratio(num: Mapping[int, Any], den: Mapping[int, Any]) -> Ratio:
    """mean_s num_s / mean_s den_s over the seeds with a finite value in both, with
    Fieller's interval. Undefined (ratio and interval NaN) unless mean(den) > 0 and its
    two-sided t test rejects 0 at ALPHA: an oracle that does not beat the baseline leaves
    nothing to recover."""
    ok = lambda s: s in den and finite(num[s]) is not None and finite(den[s]) is not None
    seeds = sorted(filter(ok, num))
    a = np.array([num[s] for s in seeds], np.float64)
    b = np.array([den[s] for s in seeds], np.float64)
    d = paired_difference(dict(zip(seeds, b, strict=True)), dict.fromkeys(seeds, 0.0))
    if a.size < 2 or not d.diff > 0:
        return Ratio(math.nan, math.nan, math.nan, d)
    cov = np.cov(a, b, ddof=1) / a.size
    ci = fieller_interval(
        float(a.mean()), float(b.mean()), cov[0, 0], cov[1, 1], cov[0, 1], a.size - 1
    )
    if ci is None:
        return Ratio(math.nan, math.nan, math.nan, d)
    return Ratio(float(a.mean() / b.mean()), ci[0], ci[1], d)


def fmt_ratio(r: Ratio) -> str:
    """'62% [21%, 140%]', or why the ratio is undefined."""
    if r.defined:
        return f"{100 * r.ratio:.0f}% [{100 * r.lo:.0f}%, {100 * r.hi:.0f}%]"
    d = r.denominator
    if d.n < 2:
        return "undefined (fewer than 2 paired seeds)"
    return (
        f"undefined: the denominator ({100 * d.diff:+.1f} points, p {fmt_p(d.p)}) is not "
        f"> 0 at p < {ALPHA:g}"
    )
