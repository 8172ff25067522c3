"""Small-sample inference (sao_jax/report/stats.py) against closed forms, printed tables,
numbers worked by hand and scipy (installed with jax; the library itself does not use it)."""

import math

import pytest
from scipy import stats as scipy_stats

from sao_jax.report import stats as S


def test_t_quantiles_match_the_printed_table():
    # Student's t table, two-sided 95% (q = 0.975) and one-sided 80% (q = 0.8)
    assert S.t_quantile(0.975, 4) == pytest.approx(2.776445, abs=1e-6)
    assert S.t_quantile(0.975, 9) == pytest.approx(2.262157, abs=1e-6)
    assert S.t_quantile(0.975, 19) == pytest.approx(2.093024, abs=1e-6)
    assert S.t_quantile(0.8, 4) == pytest.approx(0.940965, abs=1e-6)
    assert math.isnan(S.t_quantile(0.975, 0))


def test_two_sided_p_matches_closed_forms():
    # df = 1 (Cauchy): p = 1 - (2 / pi) atan |t|;  df = 2: p = 1 - |t| / sqrt(2 + t^2)
    for t in (0.3, 1.0, 2.0, 4.5):
        assert S.two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-9)
        assert S.two_sided_p(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    # the figure: 2 SE with 5 seeds (df 4) is p = 0.116, not 0.05
    assert S.two_sided_p(2.0, 4) == pytest.approx(0.1161165, abs=1e-6)
    assert S.two_sided_p(math.inf, 4) == 0.0
    assert math.isnan(S.two_sided_p(math.nan, 4)) and math.isnan(S.two_sided_p(1.0, 0))


def test_interval_and_detectable():
    lo, hi = S.t_interval(1.0, 0.5, 4)
    assert (lo, hi) == pytest.approx((1.0 - 0.5 * 2.776445, 1.0 + 0.5 * 2.776445), abs=1e-6)
    assert S.detectable(1.0, 4) == pytest.approx(2.776445 + 0.940965, abs=1e-5)
    # `detectable` is the usual approximation: the noncentral t's power there is ~0.8
    for df in (4, 9, 19):
        crit, nc = S.t_quantile(0.975, df), S.detectable(1.0, df)
        power = scipy_stats.nct.sf(crit, df, nc) + scipy_stats.nct.cdf(-crit, df, nc)
        assert power == pytest.approx(0.8, abs=0.02)


def test_t_distribution_matches_scipy():
    # the incomplete-beta form against scipy (installed with jax), over df and |t|
    for df in (1, 2, 3, 4, 5.7, 9, 19, 40, 1000, 1e5):
        for t in (0.0, 0.1, 0.7, 1.5, 2.0, 3.3, 6.0, 25.0):
            assert S.two_sided_p(t, df) == pytest.approx(
                2 * scipy_stats.t.sf(t, df), rel=1e-9, abs=1e-300
            )
            assert S.t_cdf(-t, df) == pytest.approx(scipy_stats.t.cdf(-t, df), rel=1e-9, abs=1e-300)
        for q in (0.5, 0.6, 0.8, 0.975, 0.995, 0.9999, 0.025):
            assert S.t_quantile(q, df) == pytest.approx(
                scipy_stats.t.ppf(q, df), rel=1e-9, abs=1e-12
            )
    assert math.isnan(S.t_quantile(1.0, 4)) and math.isnan(S.t_quantile(0.0, 4))


def test_betainc_by_hand():
    # I_x(1, 1) = x; I_x(a, 1) = x^a; I_x(1, b) = 1 - (1 - x)^b; I_x(a, b) + I_{1-x}(b, a) = 1
    for x in (0.0, 0.2, 0.5, 0.93, 1.0):
        assert S.betainc(1, 1, x) == pytest.approx(x, abs=1e-15)
        assert S.betainc(3.5, 1, x) == pytest.approx(x**3.5, abs=1e-14)
        assert S.betainc(1, 2.5, x) == pytest.approx(1 - (1 - x) ** 2.5, abs=1e-14)
        assert S.betainc(2, 7, x) + S.betainc(7, 2, 1 - x) == pytest.approx(1.0, abs=1e-14)


def test_holm_by_hand():
    # sorted: d 0.005 x4 = 0.02; a 0.01 x3 = 0.03; c 0.03 x2 = 0.06; b 0.04 x1 -> max 0.06
    got = S.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005, "e": math.nan})
    assert got == pytest.approx(
        {"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02, "e": math.nan}, nan_ok=True
    )
    assert S.holm({"x": 0.6, "y": 0.7}) == {"x": 1.0, "y": 1.0}  # capped at 1
    assert S.holm({}) == {}
