"""Running the experiment scripts as the smoke tests do: `python -m experiments.<name>
--mode=smoke` in the repository root, and checking the markdown report it writes.

A script runs in the test's process (its absl main with the command line's flags, argv and
working directory as `python -m` gives them, stdout captured, the flags restored after):
its training runs are the sweep runner's subprocesses either way, so a script process
would only add an interpreter and its imports (~5 s of CPU each). The training runs get no
fake devices (conftest sets 8 for in-process tests): one CPU device compiles faster.
`in_process=False` keeps a script process, for a script that computes with JAX itself
(rescore evaluates checkpoints: on one device, as the runs did).

`SharedRuns`: the smoke runs that several test modules' sweeps start with the same
command (the ablations config's SFT warm start, its SAO row, the staleness grid's SAO
cell) are built once per test session, under a lock that the xdist workers share, and
copied into each test's sweep dir; the sweep runner then finds them finished and reuses
them as it would in one sweep dir.
"""

import contextlib
import fcntl
import importlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

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
    in_process: bool = True,
    mode: str = "smoke",
) -> str:
    """stdout of `python -m experiments.<module> --mode=<mode> <extra> --sweep_dir --out_dir`;
    an exit other than 0 fails with its stderr. `sweep_dir` / `out_dir` None: not passed."""
    flags = [f"--mode={mode}", *extra]
    flags += [f"--{k}={v}" for k, v in (("sweep_dir", sweep_dir), ("out_dir", out_dir)) if v]
    if in_process:
        code, out, err = run_script(module, flags, env(cache))
    else:
        argv = [sys.executable, "-m", f"experiments.{module}", *flags]
        proc = subprocess.run(
            argv, cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=timeout
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    assert code == 0, f"exit {code}: {err[-3000:]}"
    return out


def run_script(module: str, flags: list[str], environ: dict[str, str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m experiments.<module> <flags>` run in this
    process: absl parses `flags` as its app.run would (every flag back to its default
    first, restored after), sys.argv, the working directory and os.environ are the
    script's for the call (its sweep's training processes inherit them)."""
    from absl import flags as absl_flags
    from absl.testing import flagsaver

    script = importlib.import_module(f"experiments.{module}.__main__")
    argv = [str(ROOT / "experiments" / module / "__main__.py"), *flags]
    out, err = io.StringIO(), io.StringIO()
    saved = (sys.argv, os.getcwd(), dict(os.environ))
    code = 0
    try:
        with flagsaver.flagsaver(), redirect_stdout(out), redirect_stderr(err):
            absl_flags.FLAGS.unparse_flags()
            sys.argv = argv
            os.chdir(ROOT)
            os.environ.clear()
            os.environ.update(environ)
            try:
                rest = absl_flags.FLAGS(argv)
                script.main(rest)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    err.write(e.code)
            except absl_flags.Error as e:
                code = 1
                err.write(f"FATAL Flags parsing error: {e}")
    finally:
        sys.argv, cwd, environ_before = saved
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ_before)
        absl_flags.FLAGS.unparse_flags()
    return code, out.getvalue(), err.getvalue()


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


# The points the pool holds: the scripts whose smoke sweeps start them with one command
# each (the staleness grid's two cells are also the staleness law's smoke cells, GAE's
# cross_observation row observation_signal's graded-task row; the online task's:
# critic_correction's per-user cell is the main table's `offsets=none` SAO row and its
# warm start).
STALENESS_CELL = "max_staleness=1__queue_size=16__lr=0.0001__seed=0"
SHARED = {
    "warm_start__ablations__smoke__seed=0": ("ablations", "--rows=sao"),
    "ablations__sao__seed=0": ("ablations", "--rows=sao"),
    f"ablations__sao__{STALENESS_CELL}": ("staleness_lr",),
    f"ablations__vanilla_vapo__{STALENESS_CELL}": ("staleness_lr",),
    "ablations__cross_observation__seed=0": ("gae_granularity", "--rows=cross_observation"),
    "warm_start__online_shift__smoke__seed=0": ("online_shift", "--rows=sao", "--offsets=none"),
    "online_shift__sao__seed=0": ("online_shift", "--rows=sao", "--offsets=none"),
}
TEXT_SUFFIXES = (".json", ".jsonl", ".md")  # files that name the run's own paths


class SharedRuns:
    """The session's pool of shared smoke runs under `root` (a folder the xdist workers
    share): each script invocation of SHARED built by the first test that asks for one of
    its runs, under a file lock (the others wait for it instead of building their own),
    then copied on request."""

    def __init__(self, root: pathlib.Path, cache: pathlib.Path):
        self.root, self.cache = root, cache
        self.sweep = root / "sweep"

    @contextlib.contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "w") as f:  # closing the file releases the lock
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _build(self, names) -> None:
        for script, *args in sorted({SHARED[n] for n in names}):
            done = self.root / ("built__" + "_".join([script, *args]).replace("-", ""))
            if done.exists():
                continue
            run_experiment(script, self.sweep, self.root / "out", *args, cache=self.cache)
            ran = [n for n, how in SHARED.items() if how == (script, *args)]
            missing = [n for n in ran if not (self.sweep / n).is_dir()]
            assert not missing, f"the shared smoke runs lack {missing}"
            done.touch()

    def copy_into(self, sweep_dir: pathlib.Path, *names: str) -> None:
        """Copies the named runs (keys of SHARED) into `sweep_dir`, their recorded paths
        rewritten to it: the runner finds each one finished with the command it would
        start (sao_jax/sweep/runner.py: is_finished)."""
        unknown = [n for n in names if n not in SHARED]
        assert not unknown, f"not shared runs: {unknown}"
        with self._locked():
            self._build(names)
        (sweep_dir / SIDE_DIR).mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copytree(self.sweep / name, sweep_dir / name)
            point = side_file(sweep_dir / name, POINT_FILE)
            shutil.copy(side_file(self.sweep / name, POINT_FILE), point)
            texts = [point]
            texts += [p for p in (sweep_dir / name).iterdir() if p.suffix in TEXT_SUFFIXES]
            for path in texts:
                path.write_text(path.read_text().replace(str(self.sweep), str(sweep_dir)))
