"""Table statistics (sao_jax/report/compare.py) against numbers computed by hand."""

import math

import pytest

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
    assert d.z == pytest.approx(0.04 / 0.0122474, rel=1e-5)
    assert d.mdd == pytest.approx(2 * 0.0122474, rel=1e-5)
    # Unpaired on the same numbers is far less precise: the seeds' shared luck stays in.
    u = compare.unpaired_difference(list(row.values()), [ref[s] for s in row])
    assert u.diff == pytest.approx(0.04) and not u.paired
    se_row = compare.mean_se(list(row.values()))[1]
    se_ref = compare.mean_se([ref[s] for s in row])[1]
    assert u.se == pytest.approx(math.hypot(se_row, se_ref))
    assert u.se > 4 * d.se


def test_paired_difference_missing_values():
    d = compare.paired_difference({0: 0.5, 1: None}, {0: 0.4, 1: 0.3})
    assert d.n == 1 and d.diff == pytest.approx(0.1) and math.isnan(d.se)
    assert compare.paired_difference({}, {0: 1.0}).n == 0
    assert compare.verdict(d).startswith("not decidable")


def test_power_and_paper_gap():
    d = compare.Difference(diff=0.01, se=0.02, n=5, paired=True)
    assert d.mdd == pytest.approx(0.04)
    # a true gap of 2 SE is detected half the time; 3 SE: Phi(1) = 0.8413
    assert d.power(0.04) == pytest.approx(0.5)
    assert d.power(-0.06) == pytest.approx(0.841345, rel=1e-5)
    # paper: sao 97.3, moving average 79.8, sft 80.4 -> gap share 17.5 / 16.9; ours: SAO
    # gains 0.20 over its warm start -> paper-sized gap 0.20 * 17.5 / 16.9 = 0.2071
    paper = {"sao": 97.3, "moving_average": 79.8, "sft": 80.4}
    gap = compare.paper_gap(paper, "moving_average", "sao", "sft", 0.20)
    assert gap == pytest.approx(0.20 * 17.5 / 16.9)
    assert math.isnan(compare.paper_gap(paper, "grpo", "sao", "sft", 0.2))


def test_verdict_text():
    hit = compare.Difference(diff=-0.10, se=0.02, n=5, paired=True)
    assert compare.verdict(hit) == "lower than the reference at 5.0 SE"
    assert compare.fmt_difference(hit) == "-10.0 ± 2.0 (z -5.0)"
    miss = compare.Difference(diff=-0.01, se=0.02, n=5, paired=True)
    text = compare.verdict(miss, gap=-0.10)
    assert text.startswith("no difference at 2 SE (detectable: >= 4.0)")
    assert "paper-sized gap 10.0: powered (power 100%)" in text
    assert "underpowered (power 16%)" in compare.verdict(miss, gap=0.02)
