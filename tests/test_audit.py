"""Every committed table with a runs file (results/**/<name>_runs.jsonl) is recomputed
from that file alone (`--from_runs`, nothing trained) and must be the committed text:
a reader can check every cell without rerunning (sao_jax/report/audit.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import subprocess

import pytest

from sao_jax import sweep
from sao_jax.checkpointing import integrity
from sao_jax.configs import online_shift
from sao_jax.report import audit
from sao_jax.report.experiment import Experiment, git_commit, machine_of
from tests.experiment_support import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Runs files of finished designs whose code is gone: each regenerates at the commit named
# here, which its folder's README.md names too, not at this one.
RETIRED = {
    "results/online_shift/pilot_wide/online_shift_main_runs.jsonl": "48359ad",  # payouts=wide
}
RUNS_FILES = sorted(
    p
    for p in (ROOT / "results").rglob(f"*{audit.RUNS_SUFFIX}")
    if str(p.relative_to(ROOT)) not in RETIRED
)
DROP = ("--out_dir", "--sweep_dir", "--parallel", "--launcher", "--dry_run")


def test_results_hold_runs_files():
    assert RUNS_FILES, "no committed results/**/*_runs.jsonl: nothing below would be checked"


def test_retired_tables_name_the_commit_that_regenerates_them():
    for rel, commit in RETIRED.items():
        assert (ROOT / rel).exists(), rel
        readme = (ROOT / rel).parent / "README.md"
        assert f"`{commit}`" in readme.read_text(), f"{readme} names no commit {commit}"


def _regenerate(runs: pathlib.Path, out: pathlib.Path) -> tuple[str, list[str]]:
    """The recorded command's script and flags (--table, --offsets) with --from_runs in
    place of training and the output in `out`."""
    header = json.loads(runs.read_text().splitlines()[0])
    words = shlex.split(header["settings"]["command"])
    assert words[:2] == ["python", "-m"], f"{runs}: recorded command {words}"
    assert words[2].startswith("experiments."), f"{runs}: recorded command {words}"
    flags = [w for w in words[3:] if w.split("=", 1)[0] not in DROP]
    return words[2].removeprefix("experiments."), [
        *flags,
        f"--from_runs={runs}",
        f"--out_dir={out}",
    ]


@pytest.mark.parametrize("runs", RUNS_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_table_recomputes_from_its_runs(runs, tmp_path):
    """The recorded command with --from_runs, run as its script's absl main in this
    process (tests/experiment_support.py run_script; the command line's own
    mechanics: tests/test_experiments_smoke.py)."""
    name = runs.name[: -len(audit.RUNS_SUFFIX)]
    table = runs.parent / f"{name}.md"
    assert table.exists(), f"{runs} has no table {table.name} beside it"
    code, _, err = run_script(*_regenerate(runs, tmp_path), dict(os.environ))
    assert code == 0, err[-3000:]
    assert (tmp_path / table.name).read_text() == table.read_text()


def test_recorded_spec_takes_the_runs_rows_seeds_and_schedule(tmp_path):
    runs = ROOT / "results/online_shift/pilot/online_shift_main_runs.jsonl"
    results, _ = audit.read_runs(runs)
    today = online_shift.get_sweep("mode=quick,table=main")
    spec = audit.recorded_spec(today, results)
    assert spec.seeds == (0, 1)  # the pilot ran two seeds; today's quick mode runs one
    assert set(spec.variants) == {r.point.variant for r in results}
    assert spec.fixed["env.params.switch_steps"][0] == (20, 60)  # the pilot's schedule
    other = online_shift.get_sweep("mode=smoke,table=main")  # another common arg
    assert audit.recorded_spec(other, results) == other  # not its runs: unchanged
    refixed = dataclasses.replace(results[1].point, fixed=(("train.total_steps", 1),))
    mixed = [results[0], dataclasses.replace(results[1], point=refixed)]
    with pytest.raises(audit.ConfigError, match="different shared overrides"):
        audit.recorded_spec(today, mixed)


def _runs(spec, digest=lambda seed: f"d{seed}"):
    return [
        sweep.PointResult(
            p, pathlib.Path(p.name), "done", {"after": {"x": 1.0}}, [], warm_start={
                "policy": digest(p.seed), "critic": None
            }
        )
        for p in sweep.expand(spec)
    ]  # fmt: skip


def test_add_to_checks_then_merges_in_the_modes_order():
    full = online_shift.get_sweep("mode=full,table=main")
    first = dataclasses.replace(full, variants=("sao", "moving_average", "ceiling"))
    later = dataclasses.replace(full, variants=("sao_lambda1", "moving_average_w32"))
    earlier = _runs(first)
    audit.check_addable(later, earlier, "f.jsonl")  # other rows, same schedule: fine
    with pytest.raises(audit.ConfigError, match=r"10 point\(s\) are already in f.jsonl"):
        audit.check_addable(dataclasses.replace(later, variants=("sao",)), earlier, "f.jsonl")
    other = dataclasses.replace(later, fixed={**later.fixed, "train.total_steps": 5})
    with pytest.raises(audit.ConfigError, match="other shared overrides"):
        audit.check_addable(other, earlier, "f.jsonl")
    smoke = online_shift.get_sweep("mode=smoke,table=main")  # another common arg
    with pytest.raises(audit.ConfigError, match="holds no run of sweep"):
        audit.check_addable(smoke, earlier, "f.jsonl")
    spec, merged = audit.add_runs(later, full, _runs(later), earlier)
    assert spec.variants == (
        "sao",
        "moving_average",
        "moving_average_w32",
        "sao_lambda1",
        "ceiling",
    )
    assert spec.seeds == full.seeds and len(merged) == 50
    assert [r.point.name for r in merged] == [p.name for p in sweep.expand(spec)]
    assert sum(r.reused for r in merged) == 30  # the earlier runs count as reused


def test_warm_starts_are_checked_per_seed(tmp_path):
    full = online_shift.get_sweep("mode=full,table=main")
    a = _runs(dataclasses.replace(full, variants=("sao",), seeds=(0, 1, 2)))
    b = _runs(
        dataclasses.replace(full, variants=("ceiling",), seeds=(0, 1, 2)),
        lambda s: "another" if s == 1 else f"d{s}",  # seed 1 re-created differently
    )
    b[2].warm_start = None  # seed 2: a run that recorded no digest
    assert audit.warm_start_check(a + b) == ({"policy": [1], "critic": []}, [2])
    exp = Experiment(
        mode="full", command="python -m y --add_to=f", out_dir=str(tmp_path),
        earlier=({"command": "python -m y", "wall_s": 600.0, "runs_file": "f"},),
    )  # fmt: skip
    text = exp.header("T", full, a + b, 60.0)
    assert "adds to the runs of `python -m y` (10.0 min" in text
    assert "**warm-start policies differ** within seed(s) 1" in text
    assert "not checked for seed(s) 2 (a run" in text
    assert exp.settings()["earlier"][0]["wall_s"] == 600.0
    same = exp.header(
        "T",
        full,
        a + _runs(dataclasses.replace(full, variants=("ceiling",), seeds=(0, 1, 2))),
        60.0,
    )
    assert "start from the same tensors" in same
    a[0].warm_start = {"policy": "d0", "critic": "c0"}  # the same SFT policy, another
    b[0].warm_start = {"policy": "d0", "critic": "c1"}  # value pretraining
    assert audit.warm_start_check([a[0], b[0]]) == ({"policy": [], "critic": [0]}, [])
    assert "pretrained critics differ within seed(s) 0" in exp.header("T", full, [a[0], b[0]], 1)


def test_header_names_every_machine_the_runs_ran_on():
    full = online_shift.get_sweep("mode=full,table=main")
    runs = _runs(dataclasses.replace(full, variants=("sao", "ceiling"), seeds=(0, 1)))
    amd, intel = "x86_64 (AMD EPYC), 2 CPU cores", "x86_64 (Intel Xeon), 2 CPU cores"
    for r in runs:
        r.summary["machine"] = amd
    assert machine_of(runs) == amd  # one machine: named as it recorded itself
    for r in runs[2:]:  # the ceiling's runs, added in a later session on another box
        r.summary["machine"] = intel
    runs[1].summary = None  # a run that did not finish is not counted
    assert machine_of(runs) == f"{amd} (1 run); {intel} (2 runs)"
    header = Experiment(mode="full", command="python -m y").header("T", full, runs, 1.0)
    assert f"- machine: {amd} (1 run); {intel} (2 runs)" in header


def test_stored_digest_reads_the_newest_steps_fingerprints(tmp_path):
    for step, tensors in ((0, {"w": [1, 2]}), (5, {"w": [3, 4]})):
        d = tmp_path / str(step) / integrity.CHECKSUMS
        d.mkdir(parents=True)
        (d / integrity.JSON_ITEM_FILE).write_text(json.dumps({"format": 1, "tensors": tensors}))
    got = integrity.stored_digest(tmp_path)
    (tmp_path / "5" / integrity.CHECKSUMS / integrity.JSON_ITEM_FILE).write_text(
        json.dumps({"format": 1, "tensors": {"w": [3, 4]}}, indent=2)  # another layout
    )
    assert integrity.stored_digest(tmp_path) == got and len(got) == 16
    (tmp_path / "6").mkdir()  # a newer step without fingerprints
    assert integrity.stored_digest(tmp_path) is None
    assert integrity.stored_digest(tmp_path / "absent") is None


def test_a_stopped_table_keeps_what_finished_and_says_so(tmp_path, monkeypatch):
    spec = dataclasses.replace(
        online_shift.get_sweep("mode=smoke,table=main"), variants=("sao", "moving_average")
    )
    points = sweep.expand(spec)
    finished = {"interrupted": False, "after": {"x": 1.0}, "wall_time_s": 3.0}

    def write(point, summary):
        (tmp_path / point.name).mkdir(parents=True, exist_ok=True)
        (tmp_path / point.name / "summary.json").write_text(json.dumps(summary))

    write(points[0], finished)  # finished by an earlier invocation

    def stopped_sweep(specs, sweep_dir, **_):
        write(points[1], finished)  # this invocation finished one more, then a signal came
        raise sweep.SweepStopped(0)

    monkeypatch.setattr(sweep, "run_sweep", stopped_sweep)
    exp = Experiment(mode="smoke", sweep_dir=str(tmp_path), command="python -m z")
    results, wall_s, stop = exp.run_table(spec)
    assert isinstance(stop, sweep.SweepStopped) and wall_s >= 0
    assert [r.status for r in results] == ["done", "done"]
    assert [r.reused for r in results] == [True, False]
    write(points[1], {**finished, "interrupted": True})  # had it not finished in time

    def stop_at_once(specs, sweep_dir, **_):
        raise sweep.SweepStopped(0)

    monkeypatch.setattr(sweep, "run_sweep", stop_at_once)
    results, _, _ = exp.run_table(spec)
    assert [r.status for r in results] == ["done", "stopped"]
    assert "- **incomplete**: 1 of 2 runs finished" in exp.header("T", spec, results, 1.0)
    # a later invocation may add the unfinished point: it replaces the recorded one
    audit.check_addable(dataclasses.replace(spec, variants=("moving_average",)), results, "f")
    with pytest.raises(audit.ConfigError, match="already in f"):
        audit.check_addable(dataclasses.replace(spec, variants=("sao",)), results, "f")
    again = _runs(dataclasses.replace(spec, variants=("moving_average",)))
    _, merged = audit.add_runs(
        dataclasses.replace(spec, variants=("moving_average",)), spec, again, results
    )
    assert [r.status for r in merged] == ["done", "done"] and merged[1] is again[0]


def test_runs_record_the_commit_and_the_header_prints_it(tmp_path):
    assert git_commit(tmp_path) == {"sha": None, "dirty": None}  # not a git checkout
    git = lambda *a: subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
        cwd=tmp_path, check=True, capture_output=True, text=True,
    )  # fmt: skip
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    sha = git("rev-parse", "HEAD").stdout.strip()
    assert git_commit(tmp_path) == {"sha": sha, "dirty": False}
    (tmp_path / "untracked.txt").write_text("u")  # untracked files do not count
    assert git_commit(tmp_path)["dirty"] is False
    (tmp_path / "f.txt").write_text("b")
    assert git_commit(tmp_path) == {"sha": sha, "dirty": True}
    full = online_shift.get_sweep("mode=full,table=main")
    runs = _runs(dataclasses.replace(full, variants=("sao",), seeds=(0,)))
    exp = Experiment(mode="full", command="python -m y", commit={"sha": sha, "dirty": True})
    assert f"- commit: `{sha[:12]}`, with uncommitted changes" in exp.header("T", full, runs, 1.0)
    path = audit.write_runs(tmp_path / "t_runs.jsonl", runs, audit.Recorder(), 1.0, exp.settings())
    _, header = audit.read_runs(path)
    assert header.settings["commit"] == {"sha": sha, "dirty": True}
    again = Experiment(**header.settings)  # as --from_runs takes it back
    assert again.header("T", full, runs, 1.0) == exp.header("T", full, runs, 1.0)
    nogit = Experiment(mode="full", commit={"sha": None, "dirty": None})
    assert "- commit: none (the runs were not made from a git checkout)" in nogit.header(
        "T", full, runs, 1.0
    )
    old = Experiment(mode="full")  # a runs file from before commits were recorded
    assert "commit" not in old.settings() and "- commit" not in old.header("T", full, runs, 1.0)


def test_header_names_the_tables_that_share_its_warm_starts(tmp_path):
    full = online_shift.get_sweep("mode=full,table=main")
    spec = dataclasses.replace(full, variants=("sao",), seeds=(0, 1, 2))
    mine = _runs(spec)  # digests d0, d1, d2
    write = lambda rel, runs, table=True: (
        audit.write_runs(tmp_path / f"{rel}_runs.jsonl", runs, audit.Recorder(), 1.0, {}),
        table and (tmp_path / f"{rel}.md").write_text("t"),
    )
    write("a/own", mine)  # this table's own file: not another table
    write("b/other", _runs(spec, lambda s: f"d{s}" if s < 2 else "x"))  # shares d0, d1
    write("c/apart", _runs(spec, lambda s: f"y{s}"))  # shares none
    write("d/no_table", mine, table=False)  # a runs file without its table: not named
    got = audit.shared_warm_starts(mine, tmp_path, [tmp_path / "a/own_runs.jsonl"])
    assert got == {str(tmp_path / "b/other.md"): 2}
    exp = Experiment(
        mode="full", results_root=str(tmp_path), own_runs=(str(tmp_path / "a/own_runs.jsonl"),)
    )
    line = "- shares SFT warm starts (the same policy digests) with other committed tables: "
    line += f"{tmp_path / 'b/other.md'} (2 of this table's 3); runs that start from the same"
    assert line in exp.header("T", spec, mine, 1.0)
    assert "shares SFT" not in Experiment(mode="full").header("T", spec, mine, 1.0)
    alone = _runs(spec, lambda s: f"z{s}")
    assert "shares SFT" not in exp.header("T", spec, alone, 1.0)


def test_preregistration_decides_whether_a_table_is_read(tmp_path):
    full = online_shift.get_sweep("mode=full,table=main")
    spec = dataclasses.replace(full, variants=("sao", "ceiling"), seeds=(0, 1))
    runs = _runs(spec)
    assert audit.read_preregistration(tmp_path, "t") is None  # no file: a pilot
    entry = dict(file="results/x/PREREGISTRATION.md", commit="abc1234", family="two tests")
    (tmp_path / audit.PREREGISTRATION).write_text(
        json.dumps({"t": {**entry, "seeds": [0, 1], "rows": ["sao", "ceiling"]}})
    )
    assert audit.read_preregistration(tmp_path, "other") is None  # another table's: a pilot
    g = audit.read_preregistration(tmp_path, "t")
    assert g["seeds"] == [0, 1] and audit.unfinished(g, runs) == []
    exp = Experiment(mode="full", prereg=g, prereg_folder=str(tmp_path))
    assert exp.reading(runs) == "read"
    want = "- pre-registered: results/x/PREREGISTRATION.md (commit `abc1234`): seeds 0, 1; "
    assert want + "rows sao, ceiling; family: two tests\n" in exp.header("T", spec, runs, 1.0)
    runs[3].status = "stopped"  # ceiling, seed 1 unfinished
    assert audit.unfinished(g, runs) == ["ceiling, seed 1"]
    assert audit.unfinished(g, runs[:2]) == ["ceiling, seed 0", "ceiling, seed 1"]
    assert exp.reading(runs) == "incomplete: not read"
    text = exp.header("T", spec, runs, 1.0)
    assert "- **incomplete: not read**: 1 pre-registered run(s) missing or unfinished" in text
    assert "(e.g. ceiling, seed 1)" in text
    pilot = Experiment(mode="full", prereg_folder=str(tmp_path))
    assert pilot.reading(runs) == "pilot: not a test"
    assert "- **pilot: not a test**: no pre-registration" in pilot.header("T", spec, runs, 1.0)
    assert Experiment(mode="full").reading(runs) == ""  # not looked for: no line
    (tmp_path / audit.PREREGISTRATION).write_text(json.dumps({"t": {**entry, "seeds": [0]}}))
    with pytest.raises(audit.ConfigError, match=r"preregistration.json: table 't' is not"):
        audit.read_preregistration(tmp_path, "t")  # no 'rows'
