"""Running the experiment scripts as the smoke tests do: `python -m experiments.<name>
--mode=smoke` in the repository root, without the fake devices the in-process tests use,
and checking the markdown report it writes."""

import os
import pathlib
import subprocess
import sys

from tests import train_support as ts

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE_DEVICES = "--xla_force_host_platform_device_count=8"


def env(cache: pathlib.Path | None = None) -> dict[str, str]:
    """The runs need no fake devices (conftest sets 8 for in-process tests): one CPU device
    compiles faster. With `cache`, every run compiles through it (the sweep runner keeps a
    cache the caller set instead of its own under the sweep dir)."""
    out = dict(os.environ)
    out["XLA_FLAGS"] = out.get("XLA_FLAGS", "").replace(FAKE_DEVICES, "").strip()
    return out if cache is None else {**out, **ts.cache_env_vars(cache)}


def run_experiment(
    module: str,
    sweep_dir,
    out_dir,
    *extra: str,
    cache: pathlib.Path | None = None,
    timeout: float = 900,
) -> str:
    argv = [sys.executable, "-m", f"experiments.{module}", "--mode=smoke", *extra]
    argv += [f"--sweep_dir={sweep_dir}", f"--out_dir={out_dir}"]
    proc = subprocess.run(
        argv, cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def check_report(out_dir: pathlib.Path, name: str, rows: list[str]) -> str:
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
