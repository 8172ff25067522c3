"""Running the experiment scripts as the smoke tests do: `python -m experiments.<name>
--mode=smoke` in the repository root, without the fake devices the in-process tests use,
and checking the markdown report it writes.

`SharedRuns`: the smoke runs that several test modules' sweeps start with the same
command (the ablations config's SFT warm start, its SAO row, the staleness grid's SAO
cell) are built once per test session, under a lock that the xdist workers share, and
copied into each test's sweep dir; the sweep runner then finds them finished and reuses
them as it would in one sweep dir.
"""

import contextlib
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

from sao_jax.sweep.results import POINT_FILE, SIDE_DIR, side_file
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


# The points the pool holds: the scripts whose smoke sweeps start them with one command each.
SHARED = {
    "warm_start__ablations__smoke__seed=0": ("ablations", "--rows=sao"),
    "ablations__sao__seed=0": ("ablations", "--rows=sao"),
    "ablations__sao__max_staleness=1__queue_size=16__lr=0.0001__seed=0": (
        "staleness_lr",
        "--rows=sao",
    ),
}
TEXT_SUFFIXES = (".json", ".jsonl", ".md")  # files that name the run's own paths


class SharedRuns:
    """The session's pool of shared smoke runs under `root` (a folder the xdist workers
    share): built by the first test that asks, under a file lock (the others wait for it
    instead of building their own), then copied on request."""

    def __init__(self, root: pathlib.Path, cache: pathlib.Path):
        self.root, self.cache = root, cache
        self.sweep = root / "sweep"

    @contextlib.contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "w") as f:  # closing the file releases the lock
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _build(self) -> None:
        done = self.root / "built"
        if done.exists():
            return
        for script, rows in sorted(set(SHARED.values())):
            run_experiment(script, self.sweep, self.root / "out", rows, cache=self.cache)
        missing = [n for n in SHARED if not (self.sweep / n).is_dir()]
        assert not missing, f"the shared smoke runs lack {missing}"
        done.touch()

    def copy_into(self, sweep_dir: pathlib.Path, *names: str) -> None:
        """Copies the named runs (keys of SHARED) into `sweep_dir`, their recorded paths
        rewritten to it: the runner finds each one finished with the command it would
        start (sao_jax/sweep/runner.py: is_finished)."""
        unknown = [n for n in names if n not in SHARED]
        assert not unknown, f"not shared runs: {unknown}"
        with self._locked():
            self._build()
        (sweep_dir / SIDE_DIR).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copytree(self.sweep / name, sweep_dir / name)
            point = side_file(sweep_dir / name, POINT_FILE)
            shutil.copy(side_file(self.sweep / name, POINT_FILE), point)
            texts = [point]
            texts += [p for p in (sweep_dir / name).iterdir() if p.suffix in TEXT_SUFFIXES]
            for path in texts:
                path.write_text(path.read_text().replace(str(self.sweep), str(sweep_dir)))
