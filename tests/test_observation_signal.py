"""The observation-signal experiment: its rows and sweeps (configs/observation_signal.py),
its report against literal numbers (experiments/observation_signal/report.py), and the script
end to end in smoke mode."""

import math

import numpy as np
import pytest
from sao_jax.experiments.observation_signal import report
from scipy import stats as scipy_stats

from configs import ablations, observation_signal, sao
from sao_jax import config as config_lib
from sao_jax import sweep
from sao_jax.checkpointing.workdir import flatten_config
from sao_jax.config import ConfigError
from sao_jax.report.experiment import Experiment
from tests.experiment_support import SharedRuns, run_experiment


def _flat(c) -> dict:
    return flatten_config(c.to_dict())


def _differing(a, b) -> set[str]:
    assert set(a) == set(b)
    return {k for k in a if a[k] != b[k]}


@pytest.mark.parametrize("extra", ["", ",smoke"])
def test_rows_differ_only_in_the_estimator_and_the_task_only_in_its_fields(extra):
    skip = _flat(observation_signal.get_config("sao" + extra))
    cross = _flat(observation_signal.get_config("cross_observation" + extra))
    assert _differing(skip, cross) == {"rl.advantage"}
    assert cross["rl.advantage"] == "cross_observation" and skip["rl.advantage"] == "gae"
    base = _flat(sao.get_config(extra.lstrip(",")))
    task_fields = {k for k in set(base) | set(skip) if base.get(k) != skip.get(k)}
    if extra:  # smoke pads every update batch to max_len (one compile), so it follows max_len
        assert skip["train.length_bucket"] == skip["sampling.max_len"]
        task_fields -= {"train.length_bucket"}
    assert {f.split(".")[0] for f in task_fields} <= {"env", "sft", "sampling"}, task_fields
    assert skip["env.name"] == "code_feedback"
    assert {r: ablations.VARIANTS[r] for r in report.ROWS} == observation_signal.VARIANTS
    config_lib.validate(observation_signal.get_config("cross_observation" + extra))
    with pytest.raises(ConfigError, match="pick one row"):
        observation_signal.get_config("sao,cross_observation")


def test_sweeps_pair_rows_per_task_and_share_table_5s_levels_points():
    for mode in observation_signal.MODES:
        code, levels = observation_signal.sweeps(mode)
        assert (code.name, levels.name) == observation_signal.TASKS
        names = [p.name for s in (code, levels) for p in sweep.expand(s)]
        warm = [sweep.warm_start_name(s, seed) for s in (code, levels) for seed in s.seeds]
        rows = 3 if mode == "smoke" else 4  # smoke: the code task's SAO row only
        assert len(set(names)) == len(names) == rows * len(code.seeds)
        assert len(set(warm)) == len(warm)
    table5 = ablations.get_sweep("table=gae,mode=full")
    ours = {p.name: p for p in sweep.expand(observation_signal.sweeps("full")[1])}
    for p in sweep.expand(table5):
        if p.variant in report.ROWS:
            assert ours.pop(p.name) == p  # the same command: reused in a shared sweep dir
    assert not ours
    assert len(observation_signal.sweeps("full")[0].seeds) >= 5
    with pytest.raises(ConfigError, match="task="):
        observation_signal.get_sweep("task=style")


def _history(seed, final, shares, last):
    """A run's records: warm start at 0, final success, and obs/ metrics on 3 steps."""
    sq, var = shares
    hist = [{"step": 0, report.METRIC: 0.3 + 0.01 * seed}, {"step": last, report.METRIC: final}]
    for i, step in enumerate((2, 4, 6)):
        hist.append(
            {"step": step, report.JUMP_SQ: sq[i], report.RETURN_VAR: var[i], "obs/value_jump": 0.1}
        )
    return hist


def test_report_pairs_by_seed_holms_over_tasks_and_pools_the_share(tmp_path):
    specs = observation_signal.sweeps("full")
    last = 60
    rng = np.random.default_rng(0)
    finals, shares, results = {}, {}, []
    for spec in specs:
        for p in sweep.expand(spec):
            key = (spec.name, p.variant, p.seed)
            finals[key] = 0.5 + 0.03 * p.seed + (0.02 if p.variant == report.ROW else 0.0)
            finals[key] += 0.01 * rng.normal()
            shares[key] = (rng.uniform(0.01, 0.1, 3), rng.uniform(0.15, 0.25, 3))
            hist = _history(p.seed, finals[key], shares[key], last)
            summary = {"before": {report.METRIC: 0.3 + 0.01 * p.seed}}
            results.append(sweep.PointResult(p, tmp_path / p.name, "done", summary, hist))
    exp = Experiment(mode="full", out_dir=str(tmp_path / "out"))
    text = report.report(exp, specs, results, 1.0)
    seeds = specs[0].seeds
    n = len(seeds)
    lit = {}
    for task in observation_signal.TASKS:  # paired d, SE, t on n - 1 df, two-sided p
        d = [finals[(task, report.ROW, s)] - finals[(task, report.REFERENCE, s)] for s in seeds]
        mean = sum(d) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
        lit[task] = (mean, se, scipy_stats.t.ppf(0.975, n - 1) * se)
        lit[task] += (2 * scipy_stats.t.sf(abs(mean / se), n - 1),)
    ps = sorted(lit[t][3] for t in lit)
    holm = {t: max(min(1.0, 2 * ps[0]), min(1.0, ps[1])) for t in lit}
    holm[min(lit, key=lambda t: lit[t][3])] = min(1.0, 2 * ps[0])
    assert "test (Holm over 2 tasks)" in text
    fmt = lambda q: "< 0.001" if q < 0.001 else f"{q:.3f}"
    for task, (mean, se, half, p) in lit.items():
        line = next(
            x
            for x in text.splitlines()
            if x.startswith(f"| {task} | {report.ROW_LABELS[report.ROW]}")
        )
        lo, hi = 100 * (mean - half), 100 * (mean + half)
        cell = f"{100 * mean:+.1f} ± {100 * se:.1f} [{lo:+.1f}, {hi:+.1f}]"
        assert cell in line, (cell, line)
        assert f"p {fmt(p)}, Holm p {fmt(holm[task])}" in line, line
    for task in observation_signal.TASKS:  # the share: pooled mean over records, then seeds
        per_seed = [
            np.mean(shares[(task, "sao", s)][0]) / np.mean(shares[(task, "sao", s)][1])
            for s in seeds
        ]
        m, se = np.mean(per_seed), np.std(per_seed, ddof=1) / math.sqrt(n)
        line = [x for x in text.splitlines() if x.startswith(f"| {task} | SAO")][-1]
        assert line.rstrip(" |").endswith(f"{m:.3f} ± {se:.3f}"), (line, m, se)
    assert (tmp_path / "out" / "plots" / "observation_signal_variance_share.png").is_file()


def test_run_share_is_none_without_records_or_variance():
    assert report.run_share([{"step": 1, report.METRIC: 0.5}]) is None
    flat = [{"step": 1, report.JUMP_SQ: 0.1, report.RETURN_VAR: 0.0}]
    assert report.run_share(flat) is None


@pytest.mark.slow
def test_the_script_end_to_end_in_smoke_mode(tmp_path, jax_cache_dir, shared_runs_dir):
    out = tmp_path / "out"
    # the graded task's warm start and runs are the ablations and GAE smokes' (the pool's);
    # the code task trains its warm start and SAO (smoke's code rows, configs/observation_signal.py)
    shared = ("warm_start__ablations__smoke__seed=0", "ablations__sao__seed=0")
    shared += ("ablations__cross_observation__seed=0",)
    SharedRuns(shared_runs_dir, jax_cache_dir).copy_into(tmp_path / "sweep", *shared)
    log = run_experiment("observation_signal", tmp_path / "sweep", out, cache=jax_cache_dir)
    assert "start ablations__" not in log and "start warm_start__ablations" not in log
    text = (out / "observation_signal.md").read_text()
    assert "Runs that did not finish" not in text
    for task in observation_signal.TASKS:
        for label in report.ROW_LABELS.values():
            assert f"| {task} | {label} |" in text  # the code task's cross row: no runs
    assert "| levels | cross-observation GAE | 1/1 |" in text
    line = [x for x in text.splitlines() if x.startswith("| code | SAO")][-1]  # value jumps
    cells = [c.strip() for c in line.strip(" |").split("|")]
    jumps = cells[2 : 2 + len(report.JUMPS)]  # the obs/ metrics were logged; the share of
    assert "n/a" not in jumps and float(jumps[4].split()[0]) > 0, line  # Var(G) may be n/a
    # in smoke (every return 0), and spans per trajectory > 0: the tool answered


def test_welch_difference_by_hand():
    # Unpaired on paired numbers is far less precise: the seeds' shared luck stays in.
    ref = [0.50, 0.60, 0.40, 0.70, 0.55]
    row = [0.55, 0.62, 0.48, 0.71, 0.59]  # row - ref: 0.05, 0.02, 0.08, 0.01, 0.04
    u = report.welch_difference(row, ref)
    assert u.diff == pytest.approx(0.04) and not u.paired
    se_row, se_ref = (np.std(x, ddof=1) / math.sqrt(5) for x in (row, ref))
    assert u.se == pytest.approx(math.hypot(se_row, se_ref))
    assert u.se > 4 * math.sqrt(0.00075 / 5)  # the paired SE of the same numbers
    u = report.welch_difference([1.0, 2.0, 3.0], [1.0, 3.0, 5.0, 7.0])
    # SEs sqrt(1/3) and sqrt(20/3)/2; df = (1/3 + 5/3)^2 / ((1/3)^2 / 2 + (5/3)^2 / 3)
    assert u.dof == pytest.approx(4 / (1 / 18 + 25 / 27))
    # (1 + 4)^2 / (1/4 + 16/4) = 25 / 4.25
    assert report.welch_df(1.0, 5, 2.0, 5) == pytest.approx(25 / 4.25)
    assert math.isnan(report.welch_df(1.0, 1, 2.0, 5))
