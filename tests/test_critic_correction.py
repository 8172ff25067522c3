"""The stale-critic correction experiment: its report on synthetic runs against literal
loops (experiments/critic_correction/report.py: per-run EV, stale-record EV, success, step time;
paired differences, t intervals, Holm within the EV family and the success family; the
table regenerated from its runs file), and the script's dry run. Its rows and sweeps
(sharing with the staleness grid and the online main table) are checked in
tests/test_ablations_config.py; the smoke run end to end is marked slow."""

import itertools
import math
import statistics

import numpy as np
import pytest
from sao_jax.experiments.critic_correction import report as cc
from scipy import stats as scipy_stats

from configs import ablations, online_shift
from sao_jax import sweep
from sao_jax.report import audit
from sao_jax.report.experiment import Experiment
from tests.experiment_support import SharedRuns, check_report, run_experiment


def _specs(mode="full"):
    return (
        ablations.get_sweep(f"table=brace_staleness,mode={mode}"),
        online_shift.get_sweep(f"table=brace,mode={mode},offsets=none"),  # as the script
    )


def _history(p, rng, online: bool, total: int):
    """A run's log records: EV, lag, keep rate, time (and the env's recovering success on
    the online task); BRACE runs also log their target shift, and step 1.1x slower."""
    brace = p.variant == cc.ROW
    s = 0 if online else dict(p.overrides)[cc.STALENESS_FIELD]
    tau = (1.0 + 0.1 * p.seed) * (1.1 if brace else 1.0) * rng.uniform(0.95, 1.05)
    t, hist = 100.0, []
    every = 1 if online else 2
    for step in range(every, total + 1, every):
        t += every * tau * rng.uniform(0.9, 1.1) + (300.0 if step == 2 * every else 0.0)  # a pause
        lag = 1.0 if online else min(s, 0.7 * step) * rng.uniform(0.9, 1.0)
        rec = {
            "step": step,
            "time": t,
            cc.EV: 0.3 + 0.05 * brace * (s > 0) + 0.1 * rng.normal(),
            cc.LAG: lag,
            cc.KEEP: 1.0 - 0.01 * lag * rng.uniform(),
        }
        if brace:
            rec[cc.SHIFT] = 0.01 * rng.normal()
        if online:
            n = int(rng.integers(0, 5))
            if n:
                rec["env/success_recovering"] = float(rng.integers(0, n + 1)) / n
                rec["env/success_recovering/count"] = n
        hist.append(rec)
    hist.append({"step": total, cc.METRIC: 0.4})  # the final evaluation's own record
    return hist


def _results(specs, tmp_path, failed=()):
    rng = np.random.default_rng(0)
    out = []
    for spec in specs:
        online = spec.config.endswith("online_shift.py")
        total = spec.fixed["train.total_steps"]
        for p in sweep.expand(spec):
            hist = _history(p, rng, online, total)
            summary = {"after": {cc.METRIC: 0.4 + 0.03 * p.seed + 0.02 * rng.normal()}}
            status = "failed" if p.name in failed else "done"
            out.append(sweep.PointResult(p, tmp_path / p.name, status, summary, hist))
    return out


# Literal per-run numbers: loops over the records.
def _ev(hist, high=None):
    vals = [r[cc.EV] for r in hist if cc.EV in r and (high is None or r[cc.LAG] >= high)]
    return sum(vals) / len(vals) if vals else None


def _seconds(hist):
    recs = [r for r in hist if cc.LAG in r]
    return statistics.median(
        (b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in itertools.pairwise(recs)
    )


def _success(r):
    if cc.cell_of(r.point) != cc.ONLINE:
        return r.summary["after"][cc.METRIC]
    key = "env/success_recovering"
    num = sum(x[key] * x[key + "/count"] for x in r.history if key in x)
    return num / sum(x[key + "/count"] for x in r.history if key in x)


def _paired(rows, refs):
    """(mean, se, half width of the 95% t interval, two-sided p) of the paired d."""
    d = [rows[s] - refs[s] for s in sorted(rows) if s in refs]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    half = scipy_stats.t.ppf(0.975, n - 1) * se
    return mean, se, half, 2 * scipy_stats.t.sf(abs(mean / se), n - 1)


def _holm(ps: dict) -> dict:
    keys = sorted(ps, key=ps.get)
    out, running = {}, 0.0
    for i, k in enumerate(keys):
        running = max(running, min(1.0, (len(keys) - i) * ps[k]))
        out[k] = running
    return out


def _section(text, title):
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _line(section, cell):
    return next(x for x in section.splitlines() if x.startswith(f"| {cc.cell_label(cell)} |"))


def _fmt_p(p):
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def test_report_against_literal_loops(tmp_path):
    specs = _specs()
    failed = {"ablations__sao_brace__max_staleness=8__queue_size=576__lr=0.001__seed=4"}
    results = _results(specs, tmp_path, failed)
    assert failed <= {r.point.name for r in results}
    text = cc.report(Experiment(mode="full", out_dir=str(tmp_path / "out")), specs, results, 1.0)
    per = {}  # (cell, row) -> {seed: (ev, stale ev, success, seconds)}
    for r in results:
        if r.status == "done":
            key = (cc.cell_of(r.point), r.point.variant)
            per.setdefault(key, {})[r.point.seed] = (
                _ev(r.history), _ev(r.history, cc.HIGH_LAG), _success(r), _seconds(r.history)
            )  # fmt: skip
    cells = [(0, 1e-4), (0, 1e-3), (8, 1e-4), (8, 1e-3), cc.ONLINE]
    assert list(cc.by_cell_row(results)) == cells
    lit = {}
    for i, name in enumerate(("ev", "stale", "success")):
        for c in cells:
            rows = {s: v[i] for s, v in per[(c, cc.ROW)].items() if v[i] is not None}
            refs = {s: v[i] for s, v in per[(c, cc.REFERENCE)].items() if v[i] is not None}
            lit[(name, c)] = _paired(rows, refs) if rows and refs else None
    for name, title in (("ev", "Critic EV"), ("success", "Success")):
        holm = _holm({c: lit[(name, c)][3] for c in cells})
        section = _section(text, title)
        assert f"Holm over {len(cells)} cells" in section
        for c in cells:
            mean, se, half, p = lit[(name, c)]
            cell = f"{100 * mean:+.1f} ± {100 * se:.1f} [{100 * (mean - half):+.1f}, "
            cell += f"{100 * (mean + half):+.1f}]"
            line = _line(section, c)
            assert cell in line, (cell, line)
            assert f"p {_fmt_p(p)}, Holm p {_fmt_p(holm[c])}" in line, line
    ev_section = _section(text, "Critic EV")
    for c in cells:  # stale records: only where the lag reaches HIGH_LAG (S = 8)
        line = _line(ev_section, c)
        if c == cc.ONLINE or c[0] == 0:
            assert lit[("stale", c)] is None and line.count("n/a") == 2, line
        else:
            mean, se, _, p = lit[("stale", c)]
            assert f"{100 * mean:+.1f} ± {100 * se:.1f}" in line and f"p {_fmt_p(p)} |" in line
    n_s8 = len(per[((8, 1e-3), cc.ROW)])
    brace_line = f"| {cc.cell_label((8, 1e-3))} | {cc.LABELS[cc.ROW]} | 4/5 |"
    assert n_s8 == 4 and brace_line in _section(text, "Per cell and row")
    cost = _section(text, "Mechanism and cost")
    all_logs = []
    for c in cells:  # step time: geometric-mean ratio with its t interval over seeds
        rows, refs = per[(c, cc.ROW)], per[(c, cc.REFERENCE)]
        logs = [math.log(rows[s][3] / refs[s][3]) for s in sorted(rows) if s in refs]
        all_logs += logs
        m, se = np.mean(logs), np.std(logs, ddof=1) / math.sqrt(len(logs))
        half = scipy_stats.t.ppf(0.975, len(logs) - 1) * se
        ratio = f"{math.exp(m):.3f} [{math.exp(m - half):.3f}, {math.exp(m + half):.3f}]"
        assert f"{ratio} (n={len(logs)})" in _line(cost, c), (ratio, _line(cost, c))
        assert 1.0 < math.exp(m) < 1.25  # the synthetic runs' 1.1x, the pause ignored
    m = np.mean(all_logs)
    assert f"table: {math.exp(m):.3f} [" in cost and f"(n={len(all_logs)})" in cost
    assert "shared CPU and noisy" in cost
    reading = _section(text, "Reading (pre-registered)")
    assert reading.count("- S=8, lr") == 2 and "controls" in reading
    assert (tmp_path / "out" / "plots" / "critic_correction_ev_S8_lr1e-03.png").is_file()
    assert "## Every run, graded task" in text and "## Every run, online task" in text


def test_the_table_is_regenerated_from_its_runs_file(tmp_path):
    specs = _specs("quick")
    results = _results(specs, tmp_path)
    exp = Experiment(mode="quick", out_dir=str(tmp_path / "out"))
    recorder = audit.Recorder()
    text = cc.report(exp, specs, recorder.wrap(results), 1.0)
    path = audit.write_runs(tmp_path / "runs.jsonl", results, recorder, 1.0, exp.settings())
    again, header = audit.read_runs(path)
    assert cc.report(exp, specs, again, header.wall_s) == text


def test_success_reading_and_ratio_format():
    d = lambda diff, se: cc.compare.Difference(diff, se, 5, True, 4.0)
    assert cc.success_reading(d(-0.05, 0.01), 0.01).startswith("costs success")
    assert cc.success_reading(d(0.0, 0.01), 1.0).startswith("does not cost success")
    assert cc.success_reading(d(0.0, 0.03), 1.0).startswith("undecided")
    assert cc.success_reading(cc.compare.Difference(0.1, math.nan, 1, True), 1.0).startswith(
        "not decidable"
    )
    assert cc.fmt_ratio(cc.compare.Difference(math.nan, math.nan, 0, True)) == "n/a"
    assert cc.fmt_ratio(d(math.log(1.1), 0.0)).startswith("1.100 [1.100, 1.100]")
    assert cc.step_seconds([{"step": 2, cc.LAG: 1.0, "time": 5.0}]) is None
    assert cc.stale_mean([{"step": 2, cc.LAG: 1.0, cc.EV: 0.5}], cc.EV) is None


def _dry_run(tmp_path, mode: str) -> str:
    return run_experiment("critic_correction", tmp_path / mode, None, "--dry_run", mode=mode)


def test_the_script_dry_run_lists_both_tasks_rows_and_quick_the_graded_only(tmp_path):
    out = _dry_run(tmp_path, "smoke")
    for config in ("configs/ablations.py", "configs/online_shift.py"):
        for row in cc.ROWS:
            assert f"--config={config}:{row},smoke" in out, (config, row)
    assert "ablations__sao_brace__max_staleness=1__queue_size=16__lr=0.0001__seed=0" in out
    assert "online_shift__sao_brace__seed=0" in out
    quick = _dry_run(tmp_path, "quick")  # the 15-minute check: no online warm start
    assert "configs/online_shift.py" not in quick
    assert all(f"--config=configs/ablations.py:{row}" in quick for row in cc.ROWS)


@pytest.mark.slow
def test_the_script_end_to_end_in_smoke_mode(tmp_path, jax_cache_dir, shared_runs_dir):
    # the staleness cell's warm start and SAO run are the staleness grid smoke's, the
    # online cell's the per-user main table's (`offsets=none`)
    shared = (
        "warm_start__ablations__smoke__seed=0",
        "ablations__sao__max_staleness=1__queue_size=16__lr=0.0001__seed=0",
        "warm_start__online_shift__smoke__seed=0",
        "online_shift__sao__seed=0",
    )
    SharedRuns(shared_runs_dir, jax_cache_dir).copy_into(tmp_path / "sweep", *shared)
    log = run_experiment(
        "critic_correction", tmp_path / "sweep", tmp_path / "out", cache=jax_cache_dir
    )
    assert "start warm_start" not in log and "start online_shift__sao__" not in log  # pooled
    cells = ((1, 1e-4), cc.ONLINE)
    labels = [f"{cc.cell_label(c)} | {cc.LABELS[v]}" for c in cells for v in cc.ROWS]
    text = check_report(tmp_path / "out", "critic_correction", labels)
    for line in _section(text, "Per cell and row").splitlines():
        if line.startswith("| S=1") or line.startswith("| online"):
            columns = [x.strip() for x in line.split("|")]
            assert "n/a" not in (columns[4], columns[6], columns[10]), line  # EV, success, s/step
    assert (tmp_path / "out" / "critic_correction_runs.jsonl").is_file()
