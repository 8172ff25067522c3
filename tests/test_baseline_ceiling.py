"""The baseline-ceiling table (experiments/baseline_ceiling/report.py, experiments/
baseline_ceiling.py): the training-mix score is the mean of the per-level successes; every
row's difference carries its t interval and the Holm p over the stated family of four; the
recovered share is Fieller's ratio (checked against the paired t test at its ends), and
undefined when the oracle does not beat the moving average. The script's real smoke run
is in tests/test_experiments_smoke.py (slow)."""

import math

import numpy as np
import pytest
from sao_jax.experiments.ablations import report as table
from sao_jax.experiments.baseline_ceiling import levels, share
from sao_jax.experiments.baseline_ceiling import report as bc
from scipy import stats as scipy_stats

from configs import ablations as ablations_cfg
from sao_jax import sweep
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment
from tests.experiment_support import run_experiment

LEVELS = (1, 2, 3, 4)


def _scores(rng, shift: float) -> dict[str, float]:
    """A held-out evaluation record: per-level successes and a raw mix over-weighting
    the hard levels (as the held-out split does)."""
    per = {k: float(np.clip(0.9 - 0.25 * k + shift + 0.01 * rng.normal(), 0, 1)) for k in LEVELS}
    raw = 0.05 * per[1] + 0.3 * per[2] + 0.35 * per[3] + 0.3 * per[4]
    return {table.METRIC: raw, **{f"{levels.LEVEL}{k}": v for k, v in per.items()}}


def _results(spec, gains, tmp_path, seed=0):
    rng = np.random.default_rng(seed)
    last = table.eval_steps(spec)[-1]
    luck = {s: 0.03 * rng.normal() for s in spec.seeds}  # shared by a seed's rows
    out = []
    for p in sweep.expand(spec):
        hist = [
            {"step": 0, **_scores(np.random.default_rng(p.seed), -0.1)},
            {"step": last, **_scores(rng, gains[p.variant] + luck[p.seed])},
        ]
        summary = {"before": hist[0], "after": hist[1]}
        out.append(sweep.PointResult(p, tmp_path / p.name, "done", summary, hist))
    return out


def _mix(r, step):
    return np.mean([tables.value_at(r.history, f"{levels.LEVEL}{k}", step) for k in LEVELS])


def test_report_against_a_literal_computation(tmp_path):
    spec = ablations_cfg.get_sweep("table=baseline_ceiling,mode=full")
    assert len(spec.seeds) >= 10 and set(spec.variants) == {bc.SAO, bc.MA, bc.MA160, bc.ORACLE}
    gains = {bc.SAO: 0.02, bc.MA: 0.0, bc.MA160: 0.003, bc.ORACLE: 0.04}
    results = _results(spec, gains, tmp_path)
    text = bc.ceiling_report(Experiment(mode="full", out_dir=str(tmp_path)), spec, results, 1.0)
    last = table.eval_steps(spec)[-1]
    mix = {v: {r.point.seed: _mix(r, last) for r in results if r.point.variant == v} for v in gains}
    for r in results:
        assert levels.training_mix_at(r.history, last) == pytest.approx(_mix(r, last))
    n = len(spec.seeds)
    lit = {}
    for row, ref in bc.COMPARISONS:  # literal paired t test on the training mix
        d = np.array([mix[row][s] - mix[ref][s] for s in spec.seeds])
        se = d.std(ddof=1) / math.sqrt(n)
        lit[(row, ref)] = (d.mean(), se, 2 * scipy_stats.t.sf(abs(d.mean() / se), n - 1))
    order = sorted(lit, key=lambda k: lit[k][2])
    holm, running = {}, 0.0
    for j, k in enumerate(order):  # Holm by hand over the family of four
        running = max(running, min(1.0, (len(order) - j) * lit[k][2]))
        holm[k] = running
    assert "test, training mix (Holm over 4)" in text
    for row, ref in bc.COMPARISONS:
        if ref != bc.SAO:
            continue
        mean, se, _ = lit[(row, ref)]
        half = scipy_stats.t.ppf(0.975, n - 1) * se
        line = next(x for x in text.splitlines() if x.startswith(f"| {bc.LABELS[row]} |"))
        want = f"{100 * mean:+.1f} ± {100 * se:.1f} [{100 * (mean - half):+.1f}, "
        assert want in line, (want, line)
        assert f"Holm p {compare.fmt_p(holm[(row, ref)])}" in line, line
    # recovered share vs MA 128 on the training mix: ratio of the paired means; at each end
    # of the interval the paired t statistic of a - r b is exactly the t quantile
    a = np.array([mix[bc.SAO][s] - mix[bc.MA][s] for s in spec.seeds])
    b = np.array([mix[bc.ORACLE][s] - mix[bc.MA][s] for s in spec.seeds])
    r = bc.recovered({v: {s: mix[v][s] for s in spec.seeds} for v in gains}, bc.MA)
    assert r.defined and r.ratio == pytest.approx(a.mean() / b.mean())
    for end in (r.lo, r.hi):
        d = a - end * b
        t = d.mean() / (d.std(ddof=1) / math.sqrt(n))
        assert abs(t) == pytest.approx(scipy_stats.t.ppf(0.975, n - 1), rel=1e-6)
    assert share.fmt_ratio(r) in text
    assert "## How much of the oracle's gain SAO recovers" in text
    assert "Fieller" in text
    assert "its 4 comparisons (MA 128 - SAO, MA 160 - SAO, oracle - SAO, oracle - MA 128)" in text


def test_recovered_share_is_undefined_without_an_oracle_gap(tmp_path):
    spec = ablations_cfg.get_sweep("table=baseline_ceiling,mode=full")
    gains = {bc.SAO: 0.02, bc.MA: 0.0, bc.MA160: 0.0, bc.ORACLE: 0.0}
    results = _results(spec, gains, tmp_path, seed=1)
    text = bc.ceiling_report(Experiment(mode="full", out_dir=str(tmp_path)), spec, results, 1.0)
    section = text.split("## How much of the oracle's gain SAO recovers")[1].split("\n## ")[0]
    assert section.count("undefined: the denominator (") == 4  # 2 references x 2 scores


def test_the_script_runs_the_table_sweep(tmp_path):
    out = run_experiment("baseline_ceiling", tmp_path, None, "--dry_run")
    assert "configs/ablations.py:moving_average_per_level" in out
    assert "ablations__sao__seed=0" in out


def _not_rejected(a, b, grid, alpha=0.05):
    """Literal, per r of `grid`: the paired t test of a_s - r b_s does not reject 0."""
    d = np.asarray(a)[None, :] - grid[:, None] * np.asarray(b)[None, :]  # [R, n]
    n = d.shape[1]
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return np.abs(t) <= scipy_stats.t.ppf(1 - alpha / 2, n - 1)


def test_paired_ratio_is_fieller_by_a_grid_search():
    rng = np.random.default_rng(0)
    b = list(0.05 + 0.02 * rng.normal(size=10))  # the oracle's gain: clearly > 0
    a = [0.4 * y + 0.01 * rng.normal() for y in b]  # SAO's: about 40% of it
    r = share.paired_ratio(dict(enumerate(a)), dict(enumerate(b)))
    assert r.defined and r.lo < r.ratio < r.hi
    assert r.ratio == pytest.approx(sum(a) / sum(b))
    grid = np.linspace(-2, 3, 50001)
    inside = grid[_not_rejected(a, b, grid)]
    assert inside.min() == pytest.approx(r.lo, abs=2e-4)
    assert inside.max() == pytest.approx(r.hi, abs=2e-4)
    assert share.fmt_ratio(r) == f"{100 * r.ratio:.0f}% [{100 * r.lo:.0f}%, {100 * r.hi:.0f}%]"


def test_paired_ratio_is_undefined_when_the_denominator_is_not_above_zero():
    a = {0: 0.01, 1: 0.02, 2: 0.0, 3: 0.01}
    noisy = {0: 0.05, 1: -0.04, 2: 0.03, 3: -0.01}  # mean > 0, p ~0.7
    for den in (noisy, {s: -abs(v) - 0.01 for s, v in noisy.items()}):  # and mean < 0
        r = share.paired_ratio(a, den)
        assert not r.defined and math.isnan(r.ratio) and math.isnan(r.lo)
        assert share.fmt_ratio(r).startswith("undefined: the denominator (")
    r = share.paired_ratio({0: 0.1}, {0: 0.2})
    assert share.fmt_ratio(r) == "undefined (fewer than 2 paired seeds)"
