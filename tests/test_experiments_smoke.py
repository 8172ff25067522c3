"""Every experiment script end to end in smoke mode: real training processes (tiny model,
2-4 steps, one seed), one shared sweep dir so runs are reused across scripts, and the
session's compilation cache (tests/conftest.py) so programs are compiled once across
sweeps."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import train_support as ts

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE_DEVICES = "--xla_force_host_platform_device_count=8"


def _env(cache: pathlib.Path | None = None) -> dict[str, str]:
    """The runs need no fake devices (conftest sets 8 for in-process tests): one CPU device
    compiles faster. With `cache`, every run compiles through it (the sweep runner keeps a
    cache the caller set instead of its own under the sweep dir)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(FAKE_DEVICES, "").strip()
    return env if cache is None else {**env, **ts.cache_env_vars(cache)}


def _experiment(module: str, sweep_dir, out_dir, cache: pathlib.Path, *extra: str) -> str:
    argv = [sys.executable, "-m", f"experiments.{module}", "--mode=smoke", *extra]
    argv += [f"--sweep_dir={sweep_dir}", f"--out_dir={out_dir}"]
    env = _env(cache)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _check_report(out_dir: pathlib.Path, name: str, rows: list[str]) -> str:
    text = (out_dir / f"{name}.md").read_text()
    assert "Runs that did not finish" not in text, text
    assert "- command: `python -m experiments." in text
    for row in rows:
        assert f"| {row} |" in text, (row, text)
    for line in text.splitlines():
        if line.startswith("!["):
            png = out_dir / line.split("(", 1)[1].rstrip(")")
            assert png.read_bytes()[:4] == b"\x89PNG", png
    return text


def test_ablations_gae_and_staleness_share_one_sweep(tmp_path, jax_cache_dir):
    sweep_dir, out = tmp_path / "sweep", tmp_path / "results"
    _experiment("ablations", sweep_dir, out, jax_cache_dir)
    text = _check_report(out, "ablations", ["SAO", "GRPO", "SFT warm start (step 0)"])
    assert "Does laptop scale reproduce the paper's ordering?" in text
    assert "| 97.3 | 74.8 |" in text  # the paper's SAO row beside ours

    log = _experiment("gae_granularity", sweep_dir, out, jax_cache_dir)
    assert "start ablations__sao__seed=0" not in log  # the SAO run of the ablations is reused
    assert "start ablations__step_last__seed=0" in log
    _check_report(out, "gae_granularity", ["SAO", "step-level (last)"])

    _experiment("staleness_lr", sweep_dir, out, jax_cache_dir)
    text = _check_report(out, "staleness_lr", [])
    assert "DIS: collapsed runs" in text and "no DIS: collapsed runs" in text
    assert "DIS: keep rate % (min)" in text
    assert text.count("| 1 | 0.0001 |") == 1  # one grid row: S=1, lr=1e-4

    # Rescoring on as many prompts as the runs' own evaluation reproduces it exactly (the
    # same prompts and sampling keys); the scores are cached beside each run.
    _experiment("rescore", sweep_dir, out, jax_cache_dir, "--table=table4", "--heldout=8")
    text = _check_report(out, "ablations_rescored", ["SAO", "GRPO", "SFT warm start (step 0)"])
    for row in ("sao", "grpo"):
        run = sweep_dir / f"ablations__{row}__seed=0"
        own = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        own = [r["eval/sampled_success"] for r in own if "eval/sampled_success" in r]
        cached = json.loads((run / "rescore" / "heldout=8,step=2.json").read_text())
        assert cached["eval/sampled_success"] == own[-1], row
    sft = json.loads(
        (sweep_dir / "ablations__sao__seed=0/rescore/heldout=8,step=0.json").read_text()
    )
    before = json.loads((sweep_dir / "ablations__sao__seed=0/summary.json").read_text())["before"]
    assert sft["eval/greedy_success"] == before["eval/greedy_success"]
    assert "Δ vs SAO" in text and "## By difficulty level" in text


def test_online_shift_with_chosen_seeds(tmp_path, jax_cache_dir):
    sweep_dir, out = tmp_path / "sweep", tmp_path / "results"
    _experiment("online_shift", sweep_dir, out, jax_cache_dir, "--seeds=1")
    text = _check_report(tmp_path / "results", "online_shift", ["SAO", "moving-average baseline"])
    assert "steps to recover after 1" in text and "steps to recover after 2" in text
    assert "## The critic around the switches" in text and "## Do the mechanisms fire?" in text
    assert "## The policy signal around the switches" in text
    assert "- mode: smoke; seeds: 1\n" in text  # --seeds replaces the mode's seed 0
    assert "online_shift__sao__seed=1" in text and "seed=0" not in text


def _dry_run(*extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "experiments.ablations", "--mode=smoke", "--dry_run", *extra]
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def test_rows_runs_only_the_chosen_rows(tmp_path):
    # smoke's Table 4 has the rows sao and grpo; --rows keeps one
    proc = _dry_run("--rows=grpo", "--seeds=3,7", f"--sweep_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ablations__grpo__seed=3" in proc.stdout, proc.stdout
    assert "ablations__grpo__seed=7" in proc.stdout and "ablations__sao__" not in proc.stdout
    assert "seed=0" not in proc.stdout

    bad = _dry_run("--rows=sao,nope", f"--sweep_dir={tmp_path}")
    assert bad.returncode != 0
    assert "--rows: nope" in bad.stderr and "rows sao, grpo" in bad.stderr  # names the rows
