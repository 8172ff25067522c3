"""The online-shift report's per-phase numbers against literal loops over the records."""

import itertools
import math

import numpy as np
import pytest

from sao_jax.configs import online_shift as shift_cfg
from sao_jax.report import compare
from sao_jax.report import style_shift as shift

SWITCHES, TOTAL = (20, 40), 60


def _history(metric: str, steps, values) -> list[dict]:
    return [{"step": int(s), metric: float(v)} for s, v in zip(steps, values, strict=True)]


def _slow_mean(records, metric, lo, hi):
    vals = [r[metric] for r in records if lo <= r["step"] < hi and metric in r]
    return sum(vals) / len(vals) if vals else None


def test_phase_ev_splits_each_phase_into_early_and_rest():
    rng = np.random.default_rng(0)
    steps = np.arange(0, TOTAL + 1, 2)
    hist = _history(shift.EV_METRIC, steps, rng.normal(size=steps.size))
    got = shift.phase_ev(hist, SWITCHES, TOTAL)
    edges = [0, 20, 40, TOTAL + 1]
    want = []
    for a, b in itertools.pairwise(edges):
        e = min(a + shift.EARLY_STEPS, b)
        want += [_slow_mean(hist, shift.EV_METRIC, a, e), _slow_mean(hist, shift.EV_METRIC, e, b)]
    assert len(got) == 6
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_phase_ev_is_none_where_nothing_was_logged():
    hist = _history(shift.EV_METRIC, [0, 2], [0.5, 0.1])  # phase 0's early steps only
    got = shift.phase_ev(hist, SWITCHES, TOTAL)
    assert math.isclose(got[0], 0.3) and got[1:] == [None] * 5


def test_phase_means_and_score_match_a_loop():
    steps = np.arange(0, TOTAL + 1)
    reward = np.where(steps < 20, 0.8, np.where(steps < 40, 0.2, 0.5))
    hist = _history(shift.METRIC, steps, reward)
    np.testing.assert_allclose(shift.phase_means(hist, SWITCHES, TOTAL), [0.8, 0.2, 0.5])
    assert math.isclose(shift.recovery_score(hist, SWITCHES, TOTAL), 0.35)


def test_verdict_states_direction_interval_and_power():
    from sao_jax.report.compare import Difference

    # d = moving average - SAO, in reward fractions; 5 seeds: t on 4 df, t_0.975 = 2.776445.
    opposite = shift.shift_verdict(
        Difference(0.060, 0.012, 5, True)
    )  # t 5.0, p 0.0074 (closed form, df 4)
    assert opposite.startswith("**No, the opposite**") and "p 0.007;" in opposite
    half = 2.776445 * 1.2  # 95% interval of SAO - MA: -6.0 -+ 3.33 points
    assert f"[{-6.0 - half:+.1f}, {-6.0 + half:+.1f}] points" == "[-9.3, -2.7] points"
    assert "[-9.3, -2.7] points" in opposite
    assert f"detects differences of {(2.776445 + 0.940965) * 1.2:.1f}" in opposite
    yes = shift.shift_verdict(Difference(-0.05, 0.01, 5, True))
    assert yes.startswith("**Yes**") and "5.0 ± 1.0" in yes
    # 2.6 SE on 5 seeds was 'the opposite' under the old 2-SE rule; t: p 0.0595 (closed form, df 4)
    old = shift.shift_verdict(Difference(0.060, 0.023, 5, True))
    assert old.startswith("**Not shown**") and "p 0.060;" in old
    # the Holm-adjusted p decides when given
    assert shift.shift_verdict(Difference(-0.05, 0.01, 5, True), 0.2).startswith("**Not shown")
    assert "Holm p 0.200" in shift.shift_verdict(Difference(-0.05, 0.01, 5, True), 0.2)
    assert shift.shift_verdict(Difference(0.01, 0.02, 5, True)).startswith("**Not shown**")
    assert shift.shift_verdict(Difference(0.01, math.nan, 1, True)).startswith("**Not decidable")
    assert shift.shift_verdict(None).startswith("**Not decidable")


def test_window_mean_and_signal_windows_match_a_loop():
    rng = np.random.default_rng(1)
    steps = np.arange(0, TOTAL + 1, 2)
    hist = _history("adv/advantage", steps, rng.normal(size=steps.size))
    windows = shift.signal_windows(SWITCHES, TOTAL)
    e = shift.EARLY_STEPS
    want = [(20, 20 + e), (20 + e, 40), (40, 40 + e), (40 + e, TOTAL + 1)]
    assert [(lo, hi) for _, lo, hi in windows] == want
    assert windows[0][0] == f"steps 20-{20 + e - 1}" and windows[-1][0] == f"steps {40 + e}-60"
    for _, lo, hi in windows:
        got = shift.window_mean(hist, "adv/advantage", lo, hi)
        assert math.isclose(got, _slow_mean(hist, "adv/advantage", lo, hi), rel_tol=1e-12)
    assert shift.window_mean(hist, "adv/advantage", 61, 70) is None
    assert shift.window_mean(hist, "policy/grad_norm", 0, 60) is None


def test_pairs_text_has_one_paired_verdict_per_pair_that_ran():
    rng = np.random.default_rng(2)
    seeds = range(5)
    scores = {v: {s: float(rng.uniform()) for s in seeds} for v in shift_cfg.GLOBAL_VARIANTS}
    text = shift.pairs_text(scores)
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("- does laptop scale reproduce the paper's claim?")
    assert lines[1].startswith("- with the staleness confound removed")
    assert "synchronous SAO" in lines[1] and "synchronous SAO" not in lines[0]
    fam = shift.family(scores)
    # the family: every row minus SAO, then the synchronous pair (not among them)
    assert list(fam) == [(v, "sao") for v in shift_cfg.GLOBAL_VARIANTS if v != "sao"] + [
        ("moving_average_sync", "sao_sync")
    ]
    for line, (row, ref) in zip(lines, shift.PAIRS, strict=True):
        d = [scores[row][s] - scores[ref][s] for s in seeds]  # literal paired difference
        mean = sum(d) / len(d)
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
        assert fam[(row, ref)].diff == pytest.approx(mean) and fam[(row, ref)].se == pytest.approx(
            se
        )
        p = [fam[k].p for k in fam]  # literal Holm: sorted p_(j) x (m - j + 1), running max
        order = sorted(range(len(p)), key=p.__getitem__)
        adj, run = {}, 0.0
        for j, i in enumerate(order):
            run = max(run, min(1.0, (len(p) - j) * p[i]))
            adj[list(fam)[i]] = run
        assert f"Holm p {compare.fmt_p(adj[(row, ref)])}" in line
        if adj[(row, ref)] >= 0.05:
            assert f"({100 * -mean:+.1f} ± {100 * se:.1f} points" in line
        else:
            assert f"{100 * abs(mean):.1f} ± {100 * se:.1f} points above" in line
    no_sao = shift.family({"moving_average": scores["moving_average"]})  # --rows without SAO
    assert no_sao[("moving_average", "sao")].n == 0
    assert math.isnan(compare.holm_family(no_sao)[("moving_average", "sao")])
    only_async = {k: scores[k] for k in ("sao", "moving_average")}
    assert shift.pairs_text(only_async).count("\n") == 1
    assert shift.pairs_text({"sao": scores["sao"]}) == ""
    assert set(shift.IN_PROSE) == set(shift.LABELS) == set(shift_cfg.GLOBAL_VARIANTS)


def test_verdict_names_the_rows_it_compares():
    from sao_jax.report.compare import Difference

    text = shift.shift_verdict(Difference(0.06, 0.01, 5, True), sao="S", ma="M")
    assert "M scores 6.0 ± 1.0 points above S" in text and "interval for S minus M" in text
    assert "S's score is 5.0" in shift.shift_verdict(Difference(-0.05, 0.01, 5, True), sao="S")


def test_every_row_has_a_label_and_every_pair_names_rows():
    assert set(shift.LABELS) == set(shift_cfg.GLOBAL_VARIANTS)
    for row, ref in shift.PAIRS:
        assert {row, ref} <= set(shift_cfg.GLOBAL_VARIANTS) and row in shift.PAIR_QUESTIONS
