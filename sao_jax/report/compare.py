"""Comparing table rows with a reference row: standard errors, paired differences, tests.

Every experiment table reports each row as mean ± standard error over seeds and its
difference from the reference row (SAO) with the standard error of that difference.
Rows of one seed share the SFT warm start, the prompt stream and the held-out prompts
(sao_jax/sweep), so differences are PAIRED by seed: d_s = row_s - ref_s, and the seed's
shared luck cancels (rows that share no seeds, two tasks' warm starts, get Welch's
unpaired form: experiments/observation_signal/report.py `welch_difference`).

  SE(x)             = std(x, ddof=1) / sqrt(n)
  paired:   diff    = mean_s (row_s - ref_s),   SE = std(d, ddof=1) / sqrt(n),  df = n - 1
  t = diff / SE; two-sided p, the 95% interval and the difference detectable with 80%
  power: Student's t on df (sao_jax/report/stats.py)
  the differences of one table are one family: Holm-adjusted p-values (`holm_family`);
  a difference counts when its Holm-adjusted p < alpha (0.05)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from sao_jax.report import stats
from sao_jax.report.tables import finite

ALPHA = stats.ALPHA  # a difference counts when its (Holm-adjusted) p < ALPHA


def _finite(values: Sequence[Any]) -> np.ndarray:
    return np.array([v for v in map(finite, values) if v is not None], np.float64)


def mean_se(values: Sequence[Any]) -> tuple[float, float, int]:
    """(mean, std(ddof=1) / sqrt(n), n) over the finite values; SE NaN for n < 2."""
    x = _finite(values)
    if x.size == 0:
        return math.nan, math.nan, 0
    se = float(np.std(x, ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan
    return float(np.mean(x)), se, int(x.size)


def fmt_mean_se(values: Sequence[Any], *, scale: float = 100.0, digits: int = 1) -> str:
    """'mean ± SE' of scale * values: the bare mean for one finite value; 'n/a' if none;
    '(n=k)' appended when some are missing (not finite)."""
    mean, se, n = mean_se(values)
    if n == 0:
        return "n/a"
    text = f"{scale * mean:.{digits}f}"
    if n > 1:
        text += f" ± {scale * se:.{digits}f}"
    return text if n == len(values) else f"{text} (n={n})"


@dataclasses.dataclass(frozen=True)
class Difference:
    """row - reference: mean, its standard error, the seeds (or runs) used, and the
    degrees of freedom of the SE (NaN: n - 1)."""

    diff: float
    se: float
    n: int
    paired: bool
    df: float = math.nan

    @property
    def dof(self) -> float:
        return self.df if math.isfinite(self.df) else float(self.n - 1)

    @property
    def t(self) -> float:
        return self.diff / self.se if self.se > 0 else math.nan

    @property
    def p(self) -> float:
        """Two-sided p-value of 'no difference' (Student's t on `dof`)."""
        return stats.two_sided_p(self.t, self.dof)

    def interval(self, alpha: float = ALPHA) -> tuple[float, float]:
        """The two-sided 1 - alpha t interval of the difference."""
        return stats.t_interval(self.diff, self.se, self.dof, alpha)

    @property
    def mdd(self) -> float:
        """The true |difference| this design detects with 80% power at alpha (unadjusted)."""
        return stats.detectable(self.se, self.dof)


def paired_difference(row: Mapping[int, Any], ref: Mapping[int, Any]) -> Difference:
    """Over the seeds with a finite value in both: d_s = row_s - ref_s."""
    seeds = sorted(s for s in row if s in ref)
    both = [s for s in seeds if finite(row[s]) is not None and finite(ref[s]) is not None]
    d = _finite([row[s] - ref[s] for s in both])
    if d.size == 0:
        return Difference(math.nan, math.nan, 0, True)
    se = float(np.std(d, ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
    return Difference(float(np.mean(d)), se, int(d.size), True, float(d.size - 1))


def holm_family(diffs: Mapping[Hashable, Difference]) -> dict[Hashable, float]:
    """Holm-adjusted p of each difference of one family (NaN where no p)."""
    return stats.holm({k: d.p for k, d in diffs.items()})


def fmt_p(p: float) -> str:
    """'0.012', '< 0.001', 'n/a'."""
    if not math.isfinite(p):
        return "n/a"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def fmt_difference(d: Difference, *, scale: float = 100.0, digits: int = 1) -> str:
    """'+1.2 ± 0.8 [-1.0, +3.4]': the difference, its SE and its 95% t interval; 'n/a'
    when nothing was compared."""
    if d.n == 0 or not math.isfinite(d.diff):
        return "n/a"
    if not math.isfinite(d.se):
        return f"{scale * d.diff:+.{digits}f} (n={d.n}, no SE)"
    lo, hi = d.interval()
    return (
        f"{scale * d.diff:+.{digits}f} ± {scale * d.se:.{digits}f} "
        f"[{scale * lo:+.{digits}f}, {scale * hi:+.{digits}f}]"
    )


def fmt_test(d: Difference, holm_p: float = math.nan) -> str:
    """'t +2.9, p 0.044, Holm p 0.13': the test of one difference (and its adjustment)."""
    if d.n < 2 or not math.isfinite(d.t):
        return "n/a"
    text = f"t {d.t:+.1f}, p {fmt_p(d.p)}"
    return text + (f", Holm p {fmt_p(holm_p)}" if math.isfinite(holm_p) else "")


MDD_HEADER = "MDD (80% power, alpha 0.05; at alpha / m)"  # the column `fmt_mdd` fills
MDD_NOTE = (
    "- MDD: the minimum detectable difference, the true difference this design detects "
    "with 80% power, (t_{1 - alpha/2, n-1} + t_{0.8, n-1}) x the SE of the paired "
    f"differences (two-sided alpha {ALPHA:g}, unadjusted; in brackets at alpha / m, the "
    "level of Holm's first step over a family of m tests), from the seeds' own spread; "
    "'no difference shown' is not evidence of no effect unless the MDD is small next to "
    "the effect in question.\n"
)


def fmt_mdd(d: Difference, m: int = 1, *, scale: float = 100.0, digits: int = 2) -> str:
    """'2.95 (3.57)': the difference detectable with 80% power at ALPHA, unadjusted, then
    at ALPHA / m (Holm's first step) for a family of m > 1 tests; 'n/a' without an SE."""
    if d.n < 2 or not (d.se > 0):
        return "n/a"
    text = f"{scale * d.mdd:.{digits}f}"
    if m > 1:
        text += f" ({scale * stats.detectable(d.se, d.dof, ALPHA / m):.{digits}f})"
    return text


def verdict(
    d: Difference, holm_p: float = math.nan, *, scale: float = 100.0, higher: str = "higher"
) -> str:
    """One plain sentence: a difference at Holm-adjusted p < ALPHA (the unadjusted p when
    no family is given), or none, with the difference the design detects (80% power)."""
    if d.n < 2 or not math.isfinite(d.se):
        return "not decidable (fewer than 2 paired seeds)"
    p = holm_p if math.isfinite(holm_p) else d.p
    which = "Holm p" if math.isfinite(holm_p) else "p"
    if p < ALPHA:
        return f"{higher if d.diff > 0 else 'lower'} than the reference ({which} {fmt_p(p)})"
    return (
        f"no difference shown ({which} {fmt_p(p)}; detectable with 80% power: {scale * d.mdd:.1f})"
    )
