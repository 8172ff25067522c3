"""Table statistics (sao_jax/report/compare.py) against numbers computed by hand."""

import math

import pytest
from sao_jax.experiments.ablations import report as table

from sao_jax.report import compare


def test_mean_se_by_hand():
    # x = 1, 2, 3, 6: mean 3, deviations -2 -1 0 3, sum of squares 14, var 14/3,
    # SE = sqrt(14/3) / 2 = 1.0801234
    mean, se, n = compare.mean_se([1.0, 2.0, 3.0, 6.0])
    assert (mean, n) == (3.0, 4)
    assert se == pytest.approx(math.sqrt(14 / 3) / 2) and se == pytest.approx(1.0801234)
    mean, se, n = compare.mean_se([0.5, None, float("nan"), True])
    assert (mean, n) == (0.5, 1) and math.isnan(se)
    assert compare.mean_se([])[2] == 0


def test_fmt_mean_se():
    # 0.1, 0.3: mean 0.2, std 0.1414, SE 0.1 -> "20.0 ± 10.0"
    assert compare.fmt_mean_se([0.1, 0.3]) == "20.0 ± 10.0"
    assert compare.fmt_mean_se([0.25]) == "25.0"
    assert compare.fmt_mean_se([0.1, 0.3, None]) == "20.0 ± 10.0 (n=2)"
    assert compare.fmt_mean_se([None]) == "n/a"


def test_paired_difference_by_hand():
    # seeds 0..4; d = row - ref = 0.05, 0.02, 0.08, 0.01, 0.04 (seed 5 only in ref)
    ref = {0: 0.50, 1: 0.60, 2: 0.40, 3: 0.70, 4: 0.55, 5: 0.9}
    row = {0: 0.55, 1: 0.62, 2: 0.48, 3: 0.71, 4: 0.59}
    d = compare.paired_difference(row, ref)
    # mean 0.04; deviations .01 -.02 .04 -.03 0 -> sum sq 0.0030, var 0.00075,
    # SE = sqrt(0.00075 / 5) = 0.0122474
    assert d.paired and d.n == 5
    assert d.diff == pytest.approx(0.04)
    assert d.se == pytest.approx(math.sqrt(0.00075 / 5))
    assert d.t == pytest.approx(0.04 / 0.0122474, rel=1e-5) and d.dof == 4
    # t = 3.266 on 4 df: two-sided p = 0.0308 (scipy-free check: between the table's
    # 0.05 at 2.776 and 0.02 at 3.747)
    assert 0.02 < d.p < 0.05 and d.p == pytest.approx(0.03089, abs=2e-4)
    lo, hi = d.interval()
    half = 2.776445 * math.sqrt(0.00075 / 5)
    assert (lo, hi) == pytest.approx((0.04 - half, 0.04 + half), abs=1e-7)
    assert d.mdd == pytest.approx((2.776445 + 0.940965) * 0.0122474, rel=1e-5)


def test_paired_difference_missing_values():
    d = compare.paired_difference({0: 0.5, 1: None}, {0: 0.4, 1: 0.3})
    assert d.n == 1 and d.diff == pytest.approx(0.1) and math.isnan(d.se)
    assert compare.paired_difference({}, {0: 1.0}).n == 0
    assert compare.verdict(d).startswith("not decidable")


def test_gain_shares():
    # paper: sao 97.3, moving average 79.8, sft 80.4: the moving average lost 0.6 points,
    # -0.6 / 16.9 = -3.6% of SAO's gain
    paper = {"sao": 97.3, "moving_average": 79.8, "sft": 80.4}
    assert table.paper_share(paper, "moving_average", "sao", "sft") == pytest.approx(-0.6 / 16.9)
    assert math.isnan(table.paper_share(paper, "grpo", "sao", "sft"))
    assert table.gain_share(0.12, 0.15) == pytest.approx(0.8)
    assert math.isnan(table.gain_share(0.1, 0.0))


def test_holm_family():
    a = compare.Difference(0.03, 0.01, 5, True)  # t 3: p 0.0399
    b = compare.Difference(0.01, 0.01, 5, True)  # t 1: p 0.373
    holm = compare.holm_family({"a": a, "b": b})
    assert holm["a"] == pytest.approx(2 * a.p) and holm["b"] == pytest.approx(max(2 * a.p, b.p))


def test_verdict_text():
    hit = compare.Difference(diff=-0.10, se=0.02, n=5, paired=True)
    assert compare.verdict(hit).startswith("lower than the reference (p 0.00")
    assert compare.verdict(hit, 0.04) == "lower than the reference (Holm p 0.040)"
    assert compare.fmt_difference(hit) == "-10.0 ± 2.0 [-15.6, -4.4]"
    assert compare.fmt_test(hit, 0.04) == f"t -5.0, p {compare.fmt_p(hit.p)}, Holm p 0.040"
    miss = compare.Difference(diff=-0.01, se=0.02, n=5, paired=True)
    text = compare.verdict(miss)
    assert text.startswith("no difference shown (p 0.64")
    assert f"detectable with 80% power: {100 * miss.mdd:.1f})" in text
    # at 2 SE with 5 seeds: p 0.116, no verdict (the old rule called it)
    assert compare.verdict(compare.Difference(0.04, 0.02, 5, True)).startswith("no difference")
    assert compare.fmt_p(0.0004) == "< 0.001" and compare.fmt_p(math.nan) == "n/a"
