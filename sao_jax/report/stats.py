"""Small-sample inference for the experiment tables: t intervals, p-values, Holm.

A table's differences are means over a handful of seeds (5-20), so they are read with
Student's t distribution on their degrees of freedom, not with a normal "2 SE" rule
(with 5 seeds, |d| = 2 SE is a two-sided p of 0.12, not 0.05):

  t           = d / SE(d)
  p           = 2 * P(T_df > |t|)                               two-sided
  interval    = d -+ t_{1 - alpha/2, df} * SE(d)                (95% at alpha = 0.05)
  detectable  = (t_{1 - alpha/2, df} + t_{power, df}) * SE(d)   the true difference found
                with probability `power` (the usual approximation of the noncentral t)

The t distribution is computed here, from the regularized incomplete beta function
(P(|T_df| > |t|) = I_{df/(df+t^2)}(df/2, 1/2)), so that the report needs no statistics
package; tests/test_stats.py checks it against printed tables, closed forms and scipy.

Several differences in one table are one family: each p-value is adjusted by Holm's
step-down method, which controls the family-wise error rate at alpha with no assumption
on how the tests depend on each other:

  p_(1) <= ... <= p_(m):  adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) * p_(j))
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

ALPHA = 0.05  # two-sided level of every test and interval in the tables
POWER = 0.8  # the power `detectable` is quoted at

K = TypeVar("K", bound=Hashable)


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), a, b > 0, 0 <= x <= 1:
    x^a (1 - x)^b / (a B(a, b)) times its continued fraction (modified Lentz), taken on
    the side of x < (a + 1) / (a + b + 2), where it converges, by I_x(a, b) =
    1 - I_{1-x}(b, a)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def _beta_fraction(a: float, b: float, x: float, tol: float = 1e-15) -> float:
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < tol:
            return h
    raise ArithmeticError(f"betainc({a}, {b}, {x}): continued fraction did not converge")


def two_sided_p(t: float, df: float) -> float:
    """2 * P(T_df > |t|) = I_{df / (df + t^2)}(df / 2, 1 / 2); NaN for a NaN t or df <= 0."""
    if math.isnan(t) or not df > 0:
        return math.nan
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """P(T_df <= t): 1 - p / 2 for t >= 0, p / 2 below (p the two-sided p of |t|)."""
    half = 0.5 * two_sided_p(t, df)
    return 1.0 - half if t >= 0 else half


def t_quantile(q: float, df: float) -> float:
    """The q-quantile of Student's t with `df` degrees of freedom, 0 < q < 1: the root of
    t_cdf(t) = q by bisection (NaN for df <= 0 or q outside (0, 1))."""
    if not (df > 0 and 0.0 < q < 1.0):
        return math.nan
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):  # the bracket halves each time: far below float resolution
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return 0.5 * (lo + hi)


def t_interval(mean: float, se: float, df: float, alpha: float = ALPHA) -> tuple[float, float]:
    """The two-sided 1 - alpha interval mean -+ t_{1 - alpha/2, df} * se."""
    half = t_quantile(1.0 - alpha / 2.0, df) * se
    return mean - half, mean + half


def detectable(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The true |difference| a two-sided level-alpha t test detects with `power`:
    (t_{1 - alpha/2, df} + t_{power, df}) * se, the usual approximation of the noncentral
    t (tests/test_stats.py checks it against scipy's)."""
    return (t_quantile(1.0 - alpha / 2.0, df) + t_quantile(power, df)) * se


def holm(pvalues: Mapping[K, float]) -> dict[K, float]:
    """Holm-adjusted p-values of one family (module docstring); NaN p-values are not
    part of the family and stay NaN."""
    family = sorted(((p, k) for k, p in pvalues.items() if not math.isnan(p)), key=lambda x: x[0])
    m = len(family)
    out = {k: math.nan for k in pvalues}
    running = 0.0
    for i, (p, k) in enumerate(family):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out
