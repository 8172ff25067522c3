"""The ablation table (experiments/ablations/report.py) with several seeds: every row's
difference from SAO carries its 95% t interval, two-sided p and the Holm-adjusted p over
the table's rows, against a literal computation (Student's t quantile and p from scipy,
Holm by hand)."""

import dataclasses
import math

import numpy as np
from sao_jax.experiments.ablations import report as table
from scipy import stats as scipy_stats

from configs import ablations as ablations_cfg
from sao_jax import sweep
from sao_jax.report.experiment import Experiment


def _results(spec, finals, sft, tmp_path):
    last = table.eval_steps(spec)[-1]
    out = []
    for p in sweep.expand(spec):
        hist = [
            {"step": 0, table.METRIC: sft[p.seed]},
            {"step": last, table.METRIC: finals[p.variant][p.seed]},
        ]
        summary = {
            "before": {table.METRIC: sft[p.seed]},
            "after": {table.METRIC: finals[p.variant][p.seed]},
        }
        out.append(sweep.PointResult(p, tmp_path / p.name, "done", summary, hist))
    return out


def test_ablation_table_reports_t_intervals_and_holm(tmp_path):
    spec = dataclasses.replace(
        ablations_cfg.get_sweep("table=table4,mode=full"), seeds=(0, 1, 2, 3, 4)
    )
    rng = np.random.default_rng(0)
    sft = {s: 0.2 + 0.01 * s for s in spec.seeds}
    base = {s: 0.4 + 0.05 * rng.normal() for s in spec.seeds}
    finals = {
        v: {
            s: base[s] + (0 if v == "sao" else 0.02 * i * (-1) ** i + 0.02 * rng.normal())
            for s in spec.seeds
        }
        for i, v in enumerate(spec.variants)
    }
    results = _results(spec, finals, sft, tmp_path)
    exp = Experiment(mode="smoke", out_dir=str(tmp_path / "out"))
    text = table.ablation_report(
        exp, "t", "ablations", spec, results, 1.0, paper=table.PAPER, paper_columns=("a", "b")
    )
    rows = [v for v in spec.variants if v != "sao"]
    n = len(spec.seeds)
    lit = {}
    for v in rows:  # literal: paired d, SE, t on n - 1 df, two-sided p
        d = [finals[v][s] - finals["sao"][s] for s in spec.seeds]
        mean = sum(d) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
        half = scipy_stats.t.ppf(0.975, n - 1) * se
        p = 2 * scipy_stats.t.sf(abs(mean / se), n - 1)
        lit[v] = (mean, se, half, p)
    order = sorted(rows, key=lambda v: lit[v][3])
    holm, running = {}, 0.0
    for j, v in enumerate(order):  # Holm by hand: (m - j) p_(j), running max, capped at 1
        running = max(running, min(1.0, (len(rows) - j) * lit[v][3]))
        holm[v] = running
    assert f"test (Holm over {len(rows)} rows)" in text
    for v in rows:
        mean, se, half, p = lit[v]
        line = next(x for x in text.splitlines() if x.startswith(f"| {table.LABELS[v]} |"))
        lo, hi = 100 * (mean - half), 100 * (mean + half)
        cell = f"{100 * mean:+.1f} ± {100 * se:.1f} [{lo:+.1f}, {hi:+.1f}]"
        assert cell in line, (cell, line)
        fmt = lambda q: "< 0.001" if q < 0.001 else f"{q:.3f}"
        assert f"p {fmt(p)}, Holm p {fmt(holm[v])}" in line, line
        called = "higher" in line or "lower than the reference" in line
        assert called == (holm[v] < 0.05), line
    assert "2 SE" not in text
    # the draw exercises both readings: rows called at Holm p < 0.05 and rows not called
    assert min(holm.values()) < 0.05 < max(holm.values())
