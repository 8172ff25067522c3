"""Comparing table rows with a reference row: standard errors, paired differences, power.

Every experiment table reports each row as mean ± standard error over seeds and its
difference from the reference row (SAO) with the standard error of that difference.
Rows of one seed share the SFT warm start, the prompt stream and the held-out prompts
(sao_jax/sweep), so differences are PAIRED by seed: d_s = row_s - ref_s, and the seed's
shared luck cancels. Where rows do not share seeds, the unpaired (Welch) form is used.

  SE(x)             = std(x, ddof=1) / sqrt(n)
  paired:   diff    = mean_s (row_s - ref_s),   SE = std(d, ddof=1) / sqrt(n)
  unpaired: diff    = mean(row) - mean(ref),    SE = sqrt(SE(row)^2 + SE(ref)^2)
  minimum detectable difference (MDD) at z SE = z * SE(diff)        (z = 2)
  power for a true gap g (one-sided, normal) = Phi(|g| / SE - z)
  paper-sized gap = (paper[ref] - paper[row]) / (paper[ref] - paper[base])
                    * (ours[ref] - ours[base])

The paper-sized gap translates the paper's row gap to this task: the same fraction of the
reference row's gain over the starting point (`base`, the SFT warm start), since the
paper's accuracies are on another benchmark at another scale.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sao_jax.report.tables import finite, fmt_spread

Z = 2.0  # a difference counts when |diff| >= Z * SE(diff)


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
    """'mean ± SE' of scale * values; see `sao_jax.report.tables.fmt_spread`."""
    return fmt_spread(mean_se(values), len(values), scale=scale, digits=digits)


@dataclasses.dataclass(frozen=True)
class Difference:
    """row - reference: mean, its standard error, the seeds (or runs) used."""

    diff: float
    se: float
    n: int
    paired: bool

    @property
    def z(self) -> float:
        return self.diff / self.se if self.se > 0 else math.nan

    @property
    def mdd(self) -> float:
        """The smallest |difference| this design calls real: Z * SE."""
        return Z * self.se

    def power(self, gap: float) -> float:
        """Probability that a true difference of |gap| reaches Z SE (one-sided, normal)."""
        if not (self.se > 0 and math.isfinite(gap)):
            return math.nan
        return 0.5 * (1.0 + math.erf((abs(gap) / self.se - Z) / math.sqrt(2.0)))


def paired_difference(row: Mapping[int, Any], ref: Mapping[int, Any]) -> Difference:
    """Over the seeds with a finite value in both: d_s = row_s - ref_s."""
    seeds = sorted(s for s in row if s in ref)
    d = _finite([row[s] - ref[s] if _ok(row[s]) and _ok(ref[s]) else None for s in seeds])
    if d.size == 0:
        return Difference(math.nan, math.nan, 0, True)
    se = float(np.std(d, ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
    return Difference(float(np.mean(d)), se, int(d.size), True)


def unpaired_difference(row: Sequence[Any], ref: Sequence[Any]) -> Difference:
    """Welch: mean(row) - mean(ref), SE = sqrt(SE_row^2 + SE_ref^2)."""
    m1, s1, n1 = mean_se(row)
    m0, s0, n0 = mean_se(ref)
    return Difference(m1 - m0, math.sqrt(s1**2 + s0**2), min(n1, n0), False)


def _ok(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)


def paper_gap(paper: Mapping[str, float], row: str, ref: str, base: str, ours_gain: float) -> float:
    """The paper's ref - row gap as a share of ref's gain over `base`, times ours_gain
    (our ref's gain over our base). NaN when a number is missing or the paper's gain is 0."""
    if not all(k in paper for k in (row, ref, base)) or not math.isfinite(ours_gain):
        return math.nan
    gain = paper[ref] - paper[base]
    return (paper[ref] - paper[row]) / gain * ours_gain if gain else math.nan


def fmt_difference(d: Difference, *, scale: float = 100.0, digits: int = 1) -> str:
    """'+1.2 ± 0.8 (z 1.5)'; 'n/a' when nothing was compared."""
    if d.n == 0 or not math.isfinite(d.diff):
        return "n/a"
    if not math.isfinite(d.se):
        return f"{scale * d.diff:+.{digits}f} (n={d.n}, no SE)"
    return f"{scale * d.diff:+.{digits}f} ± {scale * d.se:.{digits}f} (z {d.z:+.1f})"


def verdict(
    d: Difference, gap: float = math.nan, *, scale: float = 100.0, higher: str = "higher"
) -> str:
    """One plain sentence: a difference at >= Z SE, or none, and whether the design had
    the power to see a gap of `gap` (the paper-sized one)."""
    if d.n < 2 or not math.isfinite(d.se):
        return "not decidable (fewer than 2 paired seeds)"
    if abs(d.diff) >= Z * d.se:
        return f"{higher if d.diff > 0 else 'lower'} than the reference at {abs(d.z):.1f} SE"
    text = f"no difference at {Z:g} SE (detectable: >= {scale * d.mdd:.1f})"
    if math.isfinite(gap):
        pw = d.power(gap)
        powered = "powered" if abs(gap) >= d.mdd else "underpowered"
        text += f"; paper-sized gap {scale * abs(gap):.1f}: {powered} (power {100 * pw:.0f}%)"
    return text
