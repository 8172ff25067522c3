"""experiments/device_check.py: its smoke mode end to end on CPU (every phase, the JSON and
the table), the exit codes naming the first problem, and the watchdog's partial JSON."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import qwen3_30b_a3b_sao as recipe
from sao_jax.device_check import record as record_lib
from sao_jax.device_check import runner
from sao_jax.schema import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    return env


@pytest.mark.slow
def test_smoke_runs_every_phase(tmp_path):
    """Two CPU devices, so that weight sync has somewhere to go."""
    argv = [sys.executable, "-m", "experiments.device_check", "--smoke", f"--out={tmp_path}"]
    proc = subprocess.run(argv, cwd=ROOT, env=_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / record_lib.JSON_NAME).read_text())
    assert (data["mode"], data["platform"], data["exit_code"]) == ("smoke", "cpu", 0)
    assert list(data["phases"]) == list(runner.PHASES)
    assert {p["status"] for p in data["phases"].values()} == {"ok"}, data["phases"]
    for name in runner.PHASES:
        assert f"[device_check] {name}: ok in" in proc.stdout
    mfu = data["phases"]["update_mfu"]
    assert mfu["results"]["step_s"] > 0 and "mfu" not in mfu["results"]  # no CPU peak
    assert set(data["phases"]["decode"]["results"]) == {"slots_4", "slots_8"}
    assert data["phases"]["weight_sync"]["checks"][0]["ok"]
    table = (tmp_path / record_lib.MD_NAME).read_text()
    assert table.count("| ok |") == len(runner.PHASES)


def test_exit_code_names_the_first_problem(tmp_path):
    rec = record_lib.Record(tmp_path, 60, {"mode": "test"})
    rec.run("fine", 10, lambda p: p.check("a", 1e-6, 1e-4))
    rec.run("short", 10, lambda p: p.skip("timing"))
    assert rec.first_problem() == (record_lib.EXIT_INCOMPLETE, "short (incomplete)")
    rec.run("wrong", 10, lambda p: p.check("ragged vs grouped", 0.5, 1e-4))
    rec.run("broken", 10, lambda p: 1 / 0)
    assert rec.finish() == record_lib.EXIT_FAILED
    data = json.loads((tmp_path / record_lib.JSON_NAME).read_text())
    assert data["first_problem"] == "wrong (ragged vs grouped)"
    assert data["phases"]["broken"]["status"] == "failed"
    assert "ZeroDivisionError" in data["phases"]["broken"]["notes"][0]


def test_bad_phase_and_mode_name_the_flag(tmp_path):
    config = recipe.get_config()
    with pytest.raises(ConfigError, match="flag --phases: 'decod'"):
        runner.run(config, mode="smoke", out_dir=str(tmp_path), phases=("decod",))
    with pytest.raises(ConfigError, match="flag --mode"):
        runner.run(config, mode="quick", out_dir=str(tmp_path))


WATCHDOG = """
import sys, time
from sao_jax.device_check.record import Record
rec = Record(sys.argv[1], 1.0, {"mode": "test"})
rec.start_watchdog(grace_s=0.5)
rec.run("quick", 10, lambda p: p.check("a", 0.0, 1.0))
rec.run("hangs", 10, lambda p: time.sleep(30))
"""


def test_watchdog_leaves_partial_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG, str(tmp_path)],
        cwd=ROOT, env=_env(1), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == record_lib.EXIT_INCOMPLETE, proc.stderr
    assert "budget of 1 s spent in hangs" in proc.stdout
    data = json.loads((tmp_path / record_lib.JSON_NAME).read_text())
    assert data["phases"]["quick"]["status"] == "ok"
    assert data["phases"]["hangs"]["status"] == "timeout"
    assert data["first_problem"] == "hangs (timeout)"
    assert "| hangs | timeout |" in (tmp_path / record_lib.MD_NAME).read_text()
