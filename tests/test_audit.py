"""Every committed table with a runs file (results/**/<name>_runs.jsonl) is recomputed
from that file alone (`--from_runs`, nothing trained) and must be the committed text:
a reader can check every cell without rerunning (sao_jax/report/audit.py)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex
import subprocess
import sys

import pytest

from sao_jax.configs import online_shift
from sao_jax.report import audit

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS_FILES = sorted((ROOT / "results").rglob(f"*{audit.RUNS_SUFFIX}"))
DROP = ("--out_dir", "--sweep_dir", "--parallel", "--launcher", "--dry_run")


def test_results_hold_runs_files():
    assert RUNS_FILES, "no committed results/**/*_runs.jsonl: nothing below would be checked"


def _regenerate_argv(runs: pathlib.Path, out: pathlib.Path) -> list[str]:
    """The recorded command (its script and flags: --design, --table) with --from_runs in
    place of training and the output in `out`."""
    header = json.loads(runs.read_text().splitlines()[0])
    words = shlex.split(header["settings"]["command"])
    assert words[:2] == ["python", "-m"], f"{runs}: recorded command {words}"
    flags = [w for w in words[3:] if w.split("=", 1)[0] not in DROP]
    return [sys.executable, "-m", words[2], *flags, f"--from_runs={runs}", f"--out_dir={out}"]


@pytest.mark.parametrize("runs", RUNS_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_table_recomputes_from_its_runs(runs, tmp_path):
    name = runs.name[: -len(audit.RUNS_SUFFIX)]
    table = runs.parent / f"{name}.md"
    assert table.exists(), f"{runs} has no table {table.name} beside it"
    proc = subprocess.run(
        _regenerate_argv(runs, tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / table.name).read_text() == table.read_text()


def test_recorded_spec_takes_the_runs_rows_seeds_and_schedule(tmp_path):
    runs = ROOT / "results/online_shift/pilot/online_shift_main_runs.jsonl"
    results, _ = audit.read_runs(runs)
    today = online_shift.get_sweep("mode=quick,table=main")
    spec = audit.recorded_spec(today, results)
    assert spec.seeds == (0, 1)  # the pilot ran two seeds; today's quick mode runs one
    assert set(spec.variants) == {r.point.variant for r in results}
    assert spec.fixed["env.params.switch_steps"][0] == (20, 60)  # the pilot's schedule
    other = online_shift.get_sweep("mode=quick,table=main,design=global")
    assert audit.recorded_spec(other, results) == other  # not its runs: unchanged
    refixed = dataclasses.replace(results[1].point, fixed=(("train.total_steps", 1),))
    mixed = [results[0], dataclasses.replace(results[1], point=refixed)]
    with pytest.raises(audit.ConfigError, match="different shared overrides"):
        audit.recorded_spec(today, mixed)
