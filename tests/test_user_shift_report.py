"""The per-user online shift's numbers (experiments/online_shift/report.py, EnvLog) against
literal loops, its pre-registered verdicts, the tracking main effects, and the audit file
that regenerates a table without training (sao_jax/report/audit.py)."""

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest
from sao_jax.experiments.online_shift import report as U

from sao_jax import sweep
from sao_jax.report import audit, stats
from sao_jax.report.compare import Difference
from sao_jax.report.experiment import Experiment
from sao_jax.run.accounting import EnvLog
from sao_jax.sampling.trajectory import Trajectory
from sao_jax.schema import ConfigError


def _traj(log: dict | None) -> Trajectory:
    info = {"turn_infos": [{"log": log}] if log is not None else [{}]}
    return Trajectory(
        tokens=np.arange(3, dtype=np.int32), action_mask=np.array([False, True, True]),
        rollout_logp=np.zeros(3, np.float32), sampled_logp=np.zeros(3, np.float32),
        versions=np.zeros(3, np.int32), turn_ids=np.array([-1, 0, 0], np.int32),
        turn_rewards=np.ones(1, np.float32), outcome=1.0, terminated=True, truncated=False,
        prompt_uid="p", info=info,
    )  # fmt: skip


def test_env_log_pools_sums_and_counts_per_name():
    log = EnvLog()
    log.add([_traj({"a": 1.0}), _traj({"a": 0.0, "b": 1.0}), _traj(None)])
    log.add([_traj({"a": 1.0})])
    assert log.scalars() == {"env/a": 2 / 3, "env/a/count": 3.0, "env/b": 1.0, "env/b/count": 1.0}
    assert log.scalars() == {}  # a new window


def _records(rng, steps=40, users=3):
    """Per-step env records as the trainer writes them: a mean and a count per name."""
    out = []
    for s in range(steps):
        rec = {"step": s}
        for name in ("success_recovering", "success_settled", "success_since_switch_05"):
            n = int(rng.integers(0, 4))
            if n:
                rec[f"env/{name}"], rec[f"env/{name}/count"] = float(rng.integers(0, n + 1)) / n, n
        for u in range(users):
            if rng.uniform() < 0.5:
                rec[f"env/success_recovering_u{u}"] = float(rng.uniform())
                rec[f"env/success_recovering_u{u}/count"] = int(rng.integers(1, 5))
        out.append(rec)
    return out


def test_pooled_equal_weight_and_curve_match_loops():
    hist = _records(np.random.default_rng(0))
    name = "success_recovering"
    s = sum(r[f"env/{name}"] * r[f"env/{name}/count"] for r in hist if f"env/{name}" in r)
    c = sum(r[f"env/{name}/count"] for r in hist if f"env/{name}" in r)
    assert U.pooled(hist, name) == pytest.approx(s / c, rel=1e-12)
    assert U.pooled(hist, "never_logged") is None
    per_user = []
    for u in range(3):
        k = f"env/success_recovering_u{u}"
        rs = [r for r in hist if k in r]
        per_user.append(sum(r[k] * r[k + "/count"] for r in rs) / sum(r[k + "/count"] for r in rs))
    assert U.per_user_equal(hist, 3) == pytest.approx(np.mean(per_user), rel=1e-12)
    bin05 = U.pooled(hist, "success_since_switch_05")
    assert U.recovery_curve(hist, 40, 5) == {5: pytest.approx(bin05)}


def _d(diff, se=0.01, n=10):
    return Difference(diff, se, n, True, n - 1.0)


def test_verdicts_follow_the_preregistered_reading():
    fam = lambda sao, ceil: {("sao", "moving_average"): sao, ("ceiling", "moving_average"): ceil}
    holm = lambda diffs: {k: d.p for k, d in diffs.items()}
    yes = fam(_d(0.05), _d(0.09))
    assert U.verdict_text(yes, holm(yes)).startswith("**Yes**")
    null = fam(_d(0.001), _d(0.09))
    said = U.verdict_text(null, holm(null))
    mdd = (stats.t_quantile(0.975, 9) + stats.t_quantile(0.80, 9)) * 0.01  # SE 0.01, n 10
    assert said.startswith(f"**No difference shown (MDD {100 * mdd:.1f})**"), said
    mdd_m = (stats.t_quantile(1 - 0.025 / 2, 9) + stats.t_quantile(0.80, 9)) * 0.01
    assert f"{100 * mdd_m:.1f} at alpha 0.05/2" in said and "cannot tell" not in said
    wide = fam(_d(0.02, se=0.012), _d(0.03))  # SAO's interval holds 0 and the ceiling's gain
    assert "the data cannot tell them apart" in U.verdict_text(wide, holm(wide))
    blind = fam(_d(0.001), _d(0.002))
    assert U.verdict_text(blind, holm(blind)).startswith("**The design cannot show the effect**")
    opposite = fam(_d(-0.05), _d(0.09))
    assert U.verdict_text(opposite, holm(opposite)).startswith("**No, the opposite**")
    assert U.verdict_text({}, {}).startswith("**Not decidable**")
    no_ceiling = {("sao", "moving_average"): _d(0.001)}  # a null needs the ceiling's test
    assert U.verdict_text(no_ceiling, holm(no_ceiling)).startswith("**No reading**")
    no_ceiling = {("sao", "moving_average"): _d(0.05)}  # a difference holds without it
    assert U.verdict_text(no_ceiling, holm(no_ceiling)).startswith("**Yes**")


def test_main_effects_of_the_half_fraction_match_a_loop():
    rng = np.random.default_rng(1)
    factors = ("lr", "k", "attn", "noclip")
    cells = ["sao"] + [
        "track_" + "_".join(c) for k in (2, 4) for c in itertools.combinations(factors, k)
    ]
    primary = {v: {s: float(rng.uniform()) for s in range(5)} for v in cells}
    assert U.factors_of(cells) == factors
    got = U.main_effects(primary, factors)
    for f in factors:
        high = [v for v in cells if f in v.split("_")[1:]]
        low = [v for v in cells if v not in high]
        mean = lambda vs, s: np.mean([primary[v][s] for v in vs])
        d = [mean(high, s) - mean(low, s) for s in range(5)]
        assert got[f].diff == pytest.approx(np.mean(d), rel=1e-12)
        assert got[f].se == pytest.approx(np.std(d, ddof=1) / math.sqrt(5), rel=1e-9)
        assert len(high) == 4


def _results(tmp_path, variants=("sao", "moving_average"), **fixed):
    spec = sweep.SweepSpec(
        name="t", config="configs/online_shift.py", variants=variants, seeds=(0, 1, 2),
        fixed={"train.total_steps": 40, "env.params.switch_steps": ((5, 25),), **fixed},
    )  # fmt: skip
    rng = np.random.default_rng(3)
    out = []
    for p in sweep.expand(spec):
        summary = {"wall_time_s": 60.0, "machine": "m", "after": {"eval/sampled_success": 0.5}}
        hist = _records(rng, users=1)
        for r in hist:
            r["policy/keep_rate"] = 1.0
            r["junk/not_read"] = 7.0
        out.append(sweep.PointResult(p, tmp_path / p.name, "done", summary, hist))
    return spec, out


def test_runs_file_keeps_what_the_report_reads_and_regenerates_it(tmp_path):
    spec, results = _results(tmp_path)
    exp = Experiment(mode="full", out_dir=str(tmp_path / "out"), command="python -m x")
    recorder = audit.Recorder()
    text = U.main_report(exp, spec, recorder.wrap(results), 12.0)
    path = audit.write_runs(tmp_path / "r.jsonl", results, recorder, 12.0, exp.settings())
    back, header = audit.read_runs(path)
    assert header == audit.Header(12.0, exp.settings())
    assert all("junk/not_read" not in rec for r in back for rec in r.history)  # trimmed
    assert [r.point for r in back] == [r.point for r in results]
    exp2 = dataclasses.replace(Experiment(out_dir=str(tmp_path / "again")), **header.settings)
    assert U.main_report(exp2, spec, back, header.wall_s) == text
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ConfigError, match=r"r.jsonl:8 is not a runs record"):
        audit.read_runs(path)
    offsets = dataclasses.replace(spec, fixed={**spec.fixed, "env.params.offsets": (0.0, 2.0)})
    assert "(per user) and earn (0.0, 2.0) on every line" in U.main_report(
        exp2, offsets, back, 12.0
    )


def test_secondary_family_is_the_preregistered_one(tmp_path):
    # Pre-registered (results/online_shift/PREREGISTRATION.md): every main row minus SAO
    # but the two the primary family tests (the paper's moving average, the ceiling).
    from sao_jax.configs.online_shift import MAIN_ROWS

    assert U.secondary_rows(MAIN_ROWS) == [
        "moving_average_w1", "moving_average_w8", "moving_average_w32",
        "moving_average_per_user", "sao_lambda1", "sao_policy_first",
    ]  # fmt: skip
    spec, results = _results(tmp_path)  # sao and the paper's moving average only
    exp = Experiment(mode="full", out_dir=str(tmp_path / "out"), command="python -m x")
    text = U.main_report(exp, spec, results, 1.0)
    assert "## Every other row" not in text  # the moving average is in the primary family
    ma = next(line for line in text.splitlines() if line.startswith("| moving average, 128"))
    assert "Holm p" in ma  # its row shows minus SAO with the primary family's Holm p
    spec = dataclasses.replace(spec, variants=("sao", "moving_average", "sao_lambda1"))
    lam = [
        dataclasses.replace(r, point=dataclasses.replace(r.point, variant="sao_lambda1"))
        for r in results
        if r.point.variant == "moving_average"
    ]
    text = U.main_report(exp, spec, results + lam, 1.0)
    assert "this one difference" in text
    assert "Incomplete: 1 of the 6 rows of the pre-registered secondary family" in text


def test_verdict_waits_for_every_seed_of_the_primary_rows(tmp_path):
    spec, results = _results(tmp_path)
    exp = Experiment(mode="full", out_dir=str(tmp_path / "out"), command="python -m x")
    assert "Not the pre-registered reading yet" not in U.main_report(exp, spec, results, 1.0)
    results[-1] = dataclasses.replace(results[-1], status="stopped", summary=None, history=[])
    text = U.main_report(exp, spec, results, 1.0)
    assert "- **Not the pre-registered reading yet** (unfinished runs in: moving average" in text
    assert "- **incomplete**: 5 of 6 runs finished" in text


def test_pilots_incomplete_and_secondary_tables_say_what_they_test(tmp_path):
    spec, results = _results(tmp_path, variants=("sao", "moving_average", "sao_lambda1"))
    ma = lambda text: next(ln for ln in text.splitlines() if ln.startswith("| moving average, 1"))
    pilot = Experiment(mode="full", out_dir=str(tmp_path / "out"), prereg_folder=str(tmp_path))
    text = U.main_report(pilot, spec, results, 1.0)
    tested = lambda text: re.search(r"t [+-]\d+\.\d, p ", text) is not None  # a test cell
    assert "- **pilot: not a test**" in text and not tested(text)
    assert "| pilot: not a test |" in ma(text) and "**No reading**" not in text
    g = dict(file="results/s/PREREGISTRATION_secondary.md", commit="abc", family="six tests")
    g.update(seeds=[0, 1, 2], rows=["sao", "moving_average", "sao_lambda1"], tests="secondary")
    second = dataclasses.replace(pilot, prereg=g)
    text = U.main_report(second, spec, results, 1.0)
    assert "## The pre-registered family\n" not in text and "pilot" not in text
    assert "## SAO - the moving average (the main table's family: descriptive here" in text
    assert "## The pre-registered family (results/s/PREREGISTRATION_secondary.md)" in text
    assert tested(text) and "**No reading**" not in text  # tests read, no main verdict
    results[-1] = dataclasses.replace(results[-1], status="stopped", summary=None, history=[])
    text = U.main_report(second, spec, results, 1.0)
    assert "- **incomplete: not read**" in text and not tested(text)


def test_tracking_report_states_the_task_and_the_main_effects(tmp_path):
    """The tracking table says which task ran (switches, offsets) as the main table does,
    and reads its main effects from the cells' recovering success."""
    offsets = {"env.params.offsets": (0.0, 1.0, 2.0)}
    spec, results = _results(tmp_path, ("sao", "track_lr_k"), **offsets)
    exp = Experiment(mode="full", out_dir=str(tmp_path / "out"), command="python -m x")
    text = U.tracking_report(exp, spec, results, 12.0)
    assert "switch their target style at their own steps ((5, 25),)" in text
    assert "earn (0.0, 1.0, 2.0) on every line" in text
    primary = {v: U.scores(rs, U._metric(U.PRIMARY)) for v, rs in U.by_row(results).items()}
    effect = U.main_effects({"sao": primary["sao"], "track_lr_k": primary["track_lr_k"]}, ["lr"])
    assert f"| lr | {U.compare.fmt_difference(effect['lr'])} |" in text
