"""The sweep runner (with a fake trainer process) and the aggregation helpers."""

import json
import os
import signal
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations import report as table

from sao_jax import sweep
from sao_jax.checkpointing.meta import encode_meta
from sao_jax.report import tables

FAKE_TRAIN = textwrap.dedent(
    """
    import json, os, pathlib, signal, sys, time
    flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    wd = pathlib.Path(flags["workdir"])
    def _term(*_):  # as experiments/train.py: save, exit 0
        (pathlib.Path(os.environ["FAKE_LOG"]).parent / ("term_" + wd.name)).write_text("saved")
        sys.exit(0)
    signal.signal(signal.SIGTERM, _term)
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"name": wd.name, "flags": flags, "t0": time.time()}) + "\\n")
    slow = json.loads(os.environ.get("FAKE_SLOW", "{}"))  # name -> seconds
    time.sleep(slow.get(wd.name, float(os.environ.get("FAKE_SLEEP", "0"))))
    if "fail" in flags["config"]:
        print("Traceback\\nRuntimeError: deliberate failure", file=sys.stderr)
        sys.exit(3)
    wd.mkdir(parents=True, exist_ok=True)
    steps = int(flags.get("config.train.total_steps", 4))
    if steps == 0:  # a warm start: the SFT policy and the pretrained critic, no RL
        (wd / "warm_start" / "0").mkdir(parents=True, exist_ok=True)
        (wd / "warm_start_critic" / "0").mkdir(parents=True, exist_ok=True)
        sys.exit("ValueError: Progress: total must be an int > 0, got 0")
    seed = int(flags["config.seed"])
    rows = [{"step": s, "train/success": 0.1 * s + seed, "eval/greedy_success": 0.05 * s}
            for s in range(steps + 1)]
    (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    summary = {"steps": steps, "wall_time_s": 1.5, "interrupted": False,
               "before": {"eval/greedy_success": 0.0},
               "after": {"eval/greedy_success": 0.05 * steps}}
    (wd / "summary.json").write_text(json.dumps(summary))
    """
)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), FAKE_LOG=str(tmp_path / "log.jsonl"))

    def calls():
        path = tmp_path / "log.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    return env, calls


def _spec(**kw):
    base = dict(
        name="t",
        config="configs/ablations.py",
        variants=("sao", "grpo"),
        seeds=(0, 1),
        grid=(sweep.axis("optim.policy.lr", [1e-4, 1e-3]),),
        fixed={"train.total_steps": 3, "model.hidden_size": 32},
        entry="fake_train",
    )
    return sweep.SweepSpec(**{**base, **kw})


# --------------------------------------------------------------------------- spec


def test_expand_is_the_product_with_unique_names():
    points = sweep.expand(_spec())
    assert len(points) == 2 * 2 * 2
    assert [p.name for p in points[:2]] == [
        "ablations__sao__lr=0.0001__seed=0",
        "ablations__sao__lr=0.0001__seed=1",
    ]
    assert len({p.name for p in points}) == 8
    assert {p.row for p in points} == {
        f"{v}__lr={lr}" for v in ("sao", "grpo") for lr in (1e-4, 1e-3)
    }
    linked = _spec(grid=(({"a.b": 1, "a.c": 2}, {"a.b": 3, "a.c": 4}),), seeds=(0,))
    names = [p.name for p in sweep.expand(linked)]
    assert names[0] == "ablations__sao__b=1__c=2__seed=0"


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="set twice"):
        sweep.expand(_spec(grid=(sweep.axis("train.total_steps", [1]),)))
    with pytest.raises(ValueError, match="dotted config field"):
        sweep.expand(_spec(grid=(sweep.axis("bad field", [1]),)))
    with pytest.raises(ValueError, match="axis of its own"):
        _spec(fixed={"seed": 1})
    with pytest.raises(ValueError, match="repeated seeds"):
        _spec(seeds=(0, 0))
    with pytest.raises(ValueError, match="no levels"):
        _spec(grid=((),))
    with pytest.raises(ValueError, match="mappings"):
        _spec(grid=({"a.b": 1},))
    with pytest.raises(ValueError, match="share names"):
        sweep.expand(_spec(variants=("sao", "sao")))


def test_point_argv_and_flag_values(tmp_path):
    p = sweep.expand(_spec(common_arg="smoke"))[0]
    argv = sweep.point_argv(p, tmp_path / "w", warm_start_dir=tmp_path / "ws", python="py")
    assert argv[:5] == ["py", "-m", "experiments.train", "--config=configs/ablations.py:sao,smoke",
                        f"--workdir={tmp_path / 'w'}"]  # fmt: skip
    assert "--config.seed=0" in argv and "--config.optim.policy.lr=0.0001" in argv
    assert "--config.init.kind=params" in argv
    assert f"--config.init.params_path={tmp_path / 'ws' / 'warm_start'}" in argv
    assert [sweep.flag_value(v) for v in ("a", True, 3, 0.5, (1, 2), [3])] == [
        "a", "true", "3", "0.5", "(1, 2)", "(3,)"
    ]  # fmt: skip
    with pytest.raises(TypeError, match="override value"):
        sweep.flag_value({"a": 1})


def test_warm_start_keeps_only_fields_that_shape_it():
    spec = _spec(fixed={"train.total_steps": 3, "model.hidden_size": 32, "env.eval_size": 4})
    ws = sweep.warm_start_point(spec, 1)
    o = ws.all_overrides()
    assert o["model.hidden_size"] == 32 and o["train.total_steps"] == 0
    assert o["env.eval_size"] == sweep.WARM_START_OVERRIDES["env.eval_size"]
    assert ws.seed == 1 and ws.variant == "" and ws.config_path == "configs/ablations.py"


def test_rows_with_a_critic_share_the_warm_start_critic(tmp_path):
    """K=1 and no-frozen-attention read no pretraining field: they load the warm start's
    critic like SAO; rows without a critic don't; a row that changes a field pretraining
    reads pretrains its own."""
    spec = _spec(
        variants=("sao", "no_faster_value", "no_frozen_attention", "vanilla_vapo", "grpo",
                  "moving_average"),
        grid=(), seeds=(0,), fixed={"train.total_steps": 3, "value_pretrain.steps": 7},
    )  # fmt: skip
    warm, pairs = sweep.sweep_jobs(spec, tmp_path)
    assert warm[0].critic and "--config.value_pretrain.steps=7" in warm[0].argv
    critic = tmp_path / warm[0].name / "warm_start_critic"
    shared = {p.variant for p, job in pairs if f"--config.init.critic_path={critic}" in job.argv}
    assert shared == {"sao", "no_faster_value", "no_frozen_attention", "vanilla_vapo"}
    gamma = _spec(variants=("sao",), grid=(sweep.axis("rl.gamma", [0.9]),), seeds=(0,))
    _, pairs = sweep.sweep_jobs(gamma, tmp_path / "g")
    assert not any("init.critic_path" in a for a in pairs[0][1].argv)
    assert sweep.affects_warm_start("value_pretrain.steps") and sweep.affects_warm_start("rl.gamma")
    assert not sweep.affects_warm_start("rl.k_critic")
    assert not sweep.affects_warm_start("optim.critic.freeze_attention")
    assert not sweep.affects_warm_start("sampling.max_staleness")


def test_launcher_argv():
    argv = ["py", "-m", "experiments.train", "--config=c.py", "--workdir=w"]
    assert sweep.launcher_argv("local", argv, "n") == argv
    out = sweep.launcher_argv("tpu", argv, "n")
    assert out[:6] == ["py", "-m", "experiments.launch", "--platform=tpu", "--name=n", "--"]
    assert out[6:] == argv[2:]
    with pytest.raises(ValueError, match="launcher"):
        sweep.launcher_argv("slurm", argv, "n")


# --------------------------------------------------------------------------- running


def test_run_sweep_seed_by_seed_warm_start_then_points_resumably(tmp_path, fake):
    env, calls = fake
    spec = _spec(variants=("sao", "fail"))
    logs = []
    results = sweep.run_sweep(
        spec, tmp_path / "sw", env=env, log=logs.append, python=sys.executable
    )
    first = calls()
    names = [c["name"] for c in first]
    warm = [sweep.warm_start_name(spec, s) for s in (0, 1)]
    seed = lambda s: [p.name for p in sweep.expand(spec) if p.seed == s]
    assert names == [warm[0], *seed(0), warm[1], *seed(1)]  # one process at a time
    for c in first:
        if c["name"] in warm:  # the warm starts pretrain the critic (no value_pretrain.steps=0)
            assert "config.value_pretrain.steps" not in c["flags"]
            continue
        ws = tmp_path / "sw" / sweep.warm_start_name(spec, int(c["flags"]["config.seed"]))
        assert c["flags"]["config.init.params_path"] == str(ws / "warm_start")
        assert c["flags"]["config.model.hidden_size"] == "32"
    status = {r.point.name: r.status for r in results}
    assert all(s == "done" for n, s in status.items() if n.startswith("sao"))
    failed = [r for r in results if r.point.variant == "fail"]
    assert failed and all(r.status == "failed" for r in failed)
    assert "deliberate failure" in failed[0].error
    record = json.loads(sweep.side_file(failed[0].workdir, sweep.FAILED_FILE).read_text())
    assert record["returncode"] == 3
    ok = next(r for r in results if r.status == "done")
    assert ok.summary["steps"] == 3 and ok.history[-1]["step"] == 3

    # Rerun: finished points and warm starts are skipped, failed ones retried.
    rerun = sweep.run_sweep(spec, tmp_path / "sw", env=env, log=logs.append)
    again = [c["name"] for c in calls()[len(first) :]]
    assert sorted(again) == sorted(r.point.name for r in failed)
    assert all(r.reused == (r.point.variant == "sao") for r in rerun)
    assert not any(r.reused for r in results)

    table = collapse.points_table(results)
    assert table.count("\n") == len(results) + 2 and "deliberate failure" in table


def test_a_workdir_of_another_command_is_refused(tmp_path, fake):
    env, _ = fake
    spec = _spec(variants=("sao",), seeds=(0,), grid=())
    sweep.run_sweep(spec, tmp_path / "sw", env=env, log=lambda _: None)
    changed = _spec(variants=("sao",), seeds=(0,), grid=(), fixed={"train.total_steps": 5})
    with pytest.raises(ValueError, match="records another"):
        sweep.run_sweep(changed, tmp_path / "sw", env=env, log=lambda _: None)
    # Another interpreter path (a re-created virtualenv, a second checkout): the same command
    (tmp_path / "py").symlink_to(sys.executable)
    again = sweep.run_sweep(spec, tmp_path / "sw", env=env, python=str(tmp_path / "py"))
    assert [r.reused for r in again] == [True]


def test_dry_run_runs_nothing(tmp_path, fake, capsys):
    env, calls = fake
    spec = _spec(warm_start=False)
    results = sweep.run_sweep(spec, tmp_path / "sw", env=env, dry_run=True)
    assert calls() == [] and {r.status for r in results} == {"missing"}
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 8 and all("-m fake_train --config=configs/ablations.py:" in x for x in out)


def test_parallel_jobs_overlap(tmp_path, fake):
    env, calls = fake
    env = dict(env, FAKE_SLEEP="1.0")
    spec = _spec(variants=("sao",), seeds=(0, 1), grid=(), warm_start=False)
    sweep.run_sweep(spec, tmp_path / "sw", env=env, parallel=2, log=lambda _: None)
    starts = sorted(c["t0"] for c in calls())
    ends = [sweep.collect(spec, tmp_path / "sw")[0].workdir.joinpath("summary.json").stat()]
    # Both started before the first one wrote its summary (it sleeps 1 s first).
    assert len(starts) == 2 and starts[1] < ends[0].st_mtime


def test_a_point_starts_once_its_own_warm_start_is_done(tmp_path, fake):
    """No barrier after the warm starts: seed 0's point runs beside seed 1's slow warm
    start; seed 1's point waits for it."""
    env, calls = fake
    spec = _spec(variants=("sao",), seeds=(0, 1), grid=())
    ws1 = sweep.warm_start_name(spec, 1)
    env = dict(env, FAKE_SLOW=json.dumps({ws1: 2.0}))
    results = sweep.run_sweep(spec, tmp_path / "sw", env=env, parallel=2, log=lambda _: None)
    assert [r.status for r in results] == ["done", "done"]
    t0 = {c["name"]: c["t0"] for c in calls()}
    ws1_done = (tmp_path / "sw" / ws1 / "warm_start" / "0").stat().st_mtime
    assert t0["ablations__sao__seed=0"] < ws1_done <= t0["ablations__sao__seed=1"]


def test_the_seeds_finish_in_order(tmp_path, fake):
    """Two slots, three seeds: the first two seeds' points start before the third seed's
    warm start (a sweep stopped early leaves whole seeds, not every warm start)."""
    env, calls = fake
    spec = _spec(variants=("sao",), seeds=(0, 1, 2), grid=())
    env = dict(env, FAKE_SLEEP="0.3")
    lines = []  # the runner's own start order (a child's clock reads after its start-up)
    sweep.run_sweep(spec, tmp_path / "sw", env=env, parallel=2, log=lines.append)
    started = [x.split()[-1] for x in lines if x.startswith("[sweep] start ")]
    assert len(started) == 6 and {c["name"] for c in calls()} == set(started)
    points = [f"ablations__sao__seed={s}" for s in (0, 1)]
    assert max(map(started.index, points)) < started.index(sweep.warm_start_name(spec, 2))


def test_a_failed_warm_start_blocks_only_its_seeds_points(tmp_path, fake):
    env, calls = fake
    spec = _spec(variants=("sao",), seeds=(0, 1), grid=())
    lines = []
    jobs, pairs = sweep.sweep_jobs(spec, tmp_path / "sw")
    jobs[0].argv = [sys.executable, "-c", "raise SystemExit(3)"]  # seed 0's warm start
    status = sweep.run_jobs(jobs + [j for _, j in pairs], env=env, log=lines.append)
    assert status == {
        jobs[0].name: "failed",
        jobs[1].name: "done",
        "ablations__sao__seed=0": "blocked",
        "ablations__sao__seed=1": "done",
    }
    assert [c["name"] for c in calls()] == [jobs[1].name, "ablations__sao__seed=1"]
    assert any(x.startswith("[sweep] blocked ablations__sao__seed=0") for x in lines)
    with pytest.raises(ValueError, match="waits for 'nope'"):
        sweep.run_jobs([sweep.Job("a", ["true"], tmp_path / "a", after="nope")])
    with pytest.raises(ValueError, match="two jobs named 'a'"):
        sweep.run_jobs([sweep.Job("a", ["true"], tmp_path / "a")] * 2)


def test_run_sweep_overlaps_the_sweeps_warm_starts(tmp_path, fake):
    """A table's two tasks: both warm starts run at once, then every point; the results
    in the sweeps' order. Sweeps that share a point are refused."""
    env, calls = fake
    a = _spec(variants=("sao",), seeds=(0,), grid=(), common_arg="task=a")
    b = _spec(variants=("grpo",), seeds=(0,), grid=(), common_arg="task=b")
    env = dict(env, FAKE_SLEEP="1.0")
    results = sweep.run_sweep((a, b), tmp_path / "sw", env=env, parallel=2, log=print)
    assert [r.point.name for r in results] == [p.name for s in (a, b) for p in sweep.expand(s)]
    assert [r.status for r in results] == ["done", "done"]
    t0 = {c["name"]: c["t0"] for c in calls()}
    ws = [sweep.warm_start_name(s, 0) for s in (a, b)]
    first_done = min((tmp_path / "sw" / w / "warm_start" / "0").stat().st_mtime for w in ws)
    assert max(t0[w] for w in ws) < first_done  # the second began before the first ended
    with pytest.raises(ValueError, match="two jobs named"):
        sweep.run_sweep((a, a), tmp_path / "sw2", env=env, log=lambda _: None)


def test_a_signal_stops_the_sweep_cleanly_and_the_same_command_resumes(tmp_path, fake):
    """SIGTERM to the sweep: its running points get SIGTERM (they save and exit 0), no
    other starts, nothing is marked failed, exit status 0; the rerun finishes them all."""
    env, calls = fake
    spec = _spec(variants=("sao",), seeds=(0, 1, 2), grid=(), warm_start=False)
    lines = []

    def kill_when_both_run():
        deadline = time.monotonic() + 60
        while len(calls()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_when_both_run)
    killer.start()
    with pytest.raises(sweep.SweepStopped) as stopped:
        sweep.run_sweep(
            spec, tmp_path / "sw", env=dict(env, FAKE_SLEEP="60"), parallel=2, log=lines.append
        )
    killer.join()
    assert stopped.value.code == 0
    assert sorted(p.name for p in tmp_path.glob("term_*")) == [
        "term_ablations__sao__seed=0",
        "term_ablations__sao__seed=1",
    ]  # both saved; seed 2 never started
    assert len(calls()) == 2 and not list((tmp_path / "sw").rglob("failed.json"))
    assert sum("[sweep] stopped ablations__sao__seed=" in x for x in lines) == 2, lines
    results = sweep.run_sweep(spec, tmp_path / "sw", env=env, parallel=2, log=lambda _: None)
    assert [r.status for r in results] == ["done"] * 3 and not any(r.reused for r in results)
    assert signal.getsignal(signal.SIGTERM) is not None  # the handlers are given back
    # A run that a signal stopped writes a summary too: it is not finished, so it reruns.
    wd = results[0].workdir
    summary = json.loads((wd / "summary.json").read_text())
    (wd / "summary.json").write_text(json.dumps({**summary, "interrupted": True}))
    stopped = sweep.collect(spec, tmp_path / "sw")[0]
    assert stopped.status == "stopped" and "signal" in stopped.error  # no table reads it
    again = sweep.run_sweep(spec, tmp_path / "sw", env=env, parallel=2, log=lambda _: None)
    assert [r.reused for r in again] == [False, True, True]


# --------------------------------------------------------------------------- tables


def test_ranking_joins_ties():
    assert table.ranking({"a": 1.0, "b": 2.0, "c": 1.0}, {"b": "B"}) == "B > a = c"


def test_series_value_at_and_mean_curve_match_literal():
    h1 = [{"step": 0, "x": 1.0}, {"step": 2, "x": 3.0}, {"step": 2, "y": 1}, {"step": 4, "x": None}]
    h2 = [{"step": 2, "x": 5.0}, {"step": 4, "x": 7.0}]
    steps, v = tables.series(h1, "x")
    assert steps.tolist() == [0, 2] and v.tolist() == [1.0, 3.0]
    assert tables.value_at(h1, "x", 2) == 3.0 and tables.value_at(h1, "x", 4) is None
    s, mean, std = plots.mean_curve([h1, h2], "x")
    assert s.tolist() == [0, 2, 4]
    assert mean.tolist() == [1.0, 4.0, 7.0]
    assert std.tolist() == [0.0, np.std([3.0, 5.0], ddof=1), 0.0]


def _hist(values, name="train/success", every=5):
    return [{"step": every * (i + 1), name: v} for i, v in enumerate(values)]


def test_collapse_detection():
    rule = collapse.CollapseRule(drop_fraction=0.5, min_peak=0.2, patience=3)
    assert collapse.detect_collapse(_hist([0.1, 0.3, 0.5, 0.6, 0.55]), rule) is None
    # Never learned: low values are not a collapse.
    assert collapse.detect_collapse(_hist([0.15, 0.0, 0.0, 0.0, 0.0]), rule) is None
    # Peak 0.6 at step 20, then below 0.3 for steps 25, 30, 35.
    c = collapse.detect_collapse(_hist([0.2, 0.4, 0.5, 0.6, 0.2, 0.1, 0.0, 0.0]), rule)
    assert c == collapse.Collapse(25, "success")
    # A dip shorter than `patience` is not a collapse.
    assert collapse.detect_collapse(_hist([0.6, 0.1, 0.1, 0.5, 0.1, 0.5]), rule) is None
    ent = _hist([1.0, 0.5, 0.01, 0.02, 0.01, 0.3], "policy/entropy")
    assert collapse.detect_collapse(ent, rule) == collapse.Collapse(15, "entropy")
    skipped = _hist([0, 2, 5, 9], "train/skipped_steps")
    assert collapse.detect_collapse(skipped, rule) == collapse.Collapse(15, "nonfinite")
    err = "sao_jax.rl.update.NonFiniteError: 10 consecutive updates"
    assert collapse.detect_collapse(_hist([0.1, 0.1]), rule, error=err) == collapse.Collapse(
        10, "nonfinite"
    )
    ev = [{"step": s, "eval/greedy_success": v} for s, v in [(0, 0.6), (10, 0.2), (20, 0.7)]]
    assert collapse.detect_collapse(ev, rule) is None  # recovered by the last eval
    ev += [{"step": 30, "eval/greedy_success": 0.2}, {"step": 40, "eval/greedy_success": 0.0}]
    assert collapse.detect_collapse(ev, rule) == collapse.Collapse(30, "heldout")
    assert collapse.fmt_collapses([None, collapse.Collapse(25, "success")]) == "1/2 at 25 (success)"
    assert collapse.fmt_collapses([None]) == "none (0/1)"


def test_ordering_agreement():
    paper = {"a": 3.0, "b": 2.0, "c": 1.0}
    assert table.ordering_agreement({"a": 0.9, "b": 0.5, "c": 0.1}, paper) == (3, 3, [])
    agree, total, bad = table.ordering_agreement({"a": 0.1, "b": 0.5, "c": 0.2}, paper)
    assert (agree, total) == (1, 3) and bad == [("a", "b"), ("a", "c")]
    assert table.ordering_agreement({"a": 1.0}, paper) == (0, 0, [])


def test_markdown_table_and_plots(tmp_path):
    text = tables.markdown_table(["a", "b"], [[1, "x|y"], [2.5, None]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | x\\|y |", "| 2.5 | None |"]
    with pytest.raises(ValueError, match="row 0"):
        tables.markdown_table(["a"], [[1, 2]])
    curve = (np.array([0, 1, 2]), np.array([0.1, 0.2, 0.3]), np.array([0.0, 0.1, 0.0]))
    plots.plot_curves(tmp_path / "c.png", "t", "y", {"x": curve}, vlines=[1], vline_label="s")
    plots.plot_bars(tmp_path / "b.png", "t", "y", {"x": (0.5, 0.1)}, reference={"x": 0.6})
    empty = (np.array([]), np.array([]), np.array([]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no empty-legend warning: the figure says "no points"
        plots.plot_curves(tmp_path / "e.png", "t", "y", {"x": empty})
    for name in ("c.png", "b.png", "e.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_whose_config_changed_since_is_refused(tmp_path, fake):
    env, calls = fake
    spec = _spec(variants=("sao",), seeds=(0,), grid=(), warm_start=False)
    sweep.run_sweep(spec, tmp_path / "sw", env=env, log=lambda _: None)
    _, [(_, job)] = sweep.sweep_jobs(spec, tmp_path / "sw")
    # What sao_jax.train writes: the config the command builds (tuples as lists).
    built = sweep.point_config(*job.config).to_dict()
    saved = json.loads(json.dumps(encode_meta(built, "config")))
    (job.workdir / "config.json").write_text(json.dumps(saved))
    n = len(calls())
    assert sweep.run_sweep(spec, tmp_path / "sw", env=env, log=lambda _: None)[0].reused
    assert len(calls()) == n
    saved["rl"]["k_critic"] = 7  # as if configs/ablations.py had been edited since
    (job.workdir / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"rl\.k_critic.*config changed since"):
        sweep.run_sweep(spec, tmp_path / "sw", env=env, log=lambda _: None)
