"""Sweeps: a spec -> named points -> one training process per point -> collected results.

A `SweepSpec` (a config file's `get_sweep(arg)`) is a product: config variants x grid
levels x seeds, plus overrides every point shares. Each point is one `python -m
experiments.train --config=<file>:<variant> --workdir=<sweep_dir>/<name> --config.seed=<n>
--config.<field>=<value> ...` process; `run_sweep` runs `parallel` of them at a time and
never stops for a failed one. Names: `<config stem>__<variant>__<field>=<value>...__seed=<n>`.

Resumable: a point is finished when its workdir holds `summary.json` and the runner's
`<sweep_dir>/_sweep/<name>.point.json` records the same command; it is then skipped. An
unfinished workdir resumes (the trainer restores its last checkpoint). A workdir whose
recorded command, or whose config.json, differs from what the point builds now is
refused, never reused nor overwritten. A failure writes `_sweep/<name>.failed.json`
(exit code, stderr tail) and is retried by the next call.

Shared warm start: with `spec.warm_start`, each seed first gets one SFT-only run
(`warm_start__<config>__<arg>__seed=<n>`, `train.total_steps=0`) whose
`<workdir>/warm_start` policy every point of that seed loads (`init.kind=params`).

Pods: `launcher='tpu'|'gpu'` hands each point's command to experiments/launch.py
(`launcher_argv`); everything else is unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sao_jax import config as config_lib
from sao_jax.checkpointing.meta import encode_meta
from sao_jax.checkpointing.workdir import CONFIG_FILE, config_differences
from sao_jax.metrics import METRICS_FILE, read_jsonl
from sao_jax.schema import ConfigDict, ConfigError

SUMMARY_FILE = "summary.json"  # written by sao_jax.train.run at the end of a run
# The runner's files about a point live beside its workdir (the trainer wants that empty):
# <sweep_dir>/_sweep/<point name>.<kind>
SIDE_DIR = "_sweep"
POINT_FILE = "point.json"  # the command of a point, written before it starts
FAILED_FILE = "failed.json"  # exit code + stderr tail of the last failed attempt
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"
LAUNCHERS = ("local", "tpu", "gpu")
TRAIN_MODULE = "experiments.train"
LAUNCH_MODULE = "experiments.launch"
WARM_START_PREFIX = "warm_start__"
# Overrides of the shared warm-start run: SFT only (no RL, no value pretraining, a
# small evaluation, no report).
WARM_START_OVERRIDES = {
    "train.total_steps": 0,
    "value_pretrain.steps": 0,
    "env.eval_size": 8,
    "train.eval_every": 0,
    "train.report": False,
    "train.progress": False,
}
WARM_START_SECTIONS = ("model", "sft", "init", "mesh", "env")
STDERR_TAIL_LINES = 40
WARM_START_SUBDIR = "warm_start"  # where sao_jax.train saves the SFT policy

Level = Mapping[str, Any]  # one grid level: dotted config field -> value


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """A product of variants x grid levels x seeds over one config file."""

    name: str  # label of the sweep (logs, tables)
    config: str  # config file, e.g. 'configs/ablations.py'
    variants: tuple[str, ...]  # the ':variant' of each row, e.g. ('sao', 'grpo')
    seeds: tuple[int, ...]
    grid: tuple[tuple[Level, ...], ...] = ()  # product axes; each a tuple of levels
    fixed: Level = dataclasses.field(default_factory=dict)  # overrides of every point
    common_arg: str = ""  # appended to every ':variant' (e.g. 'smoke')
    warm_start: bool = True  # one shared SFT warm start per seed
    base_variant: str = ""  # ':variant' of the warm-start run ('' = the file's default)
    entry: str = TRAIN_MODULE  # module run per point (`python -m <entry>`)

    def __post_init__(self):
        if not self.variants:
            raise ValueError(f"SweepSpec {self.name!r}: variants must not be empty")
        if not self.seeds:
            raise ValueError(f"SweepSpec {self.name!r}: seeds must not be empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"SweepSpec {self.name!r}: repeated seeds {self.seeds}")
        for i, levels in enumerate(self.grid):
            if not levels:
                raise ValueError(f"SweepSpec {self.name!r}: grid axis {i} has no levels")
            if isinstance(levels, Mapping) or not all(isinstance(x, Mapping) for x in levels):
                raise ValueError(
                    f"SweepSpec {self.name!r}: grid axis {i} must be a sequence of mappings "
                    f"(field -> value), got {levels!r}"
                )
        for field in self.fixed:
            _check_field(field, f"SweepSpec {self.name!r}: fixed")


def load_sweep(path: str) -> SweepSpec:
    """`get_sweep(arg)` of a config file given as ``file[:arg]``."""
    file, _, arg = path.partition(":")
    p = pathlib.Path(file)
    if not p.is_file():
        raise ConfigError(f"sweep config file {file!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_sao_sweep_{p.stem}", p)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"config file {file!r} defines no get_sweep(arg)")
    spec = module.get_sweep(arg or None)
    if not isinstance(spec, SweepSpec):
        raise ConfigError(f"{file}: get_sweep returned {type(spec).__name__}, not a SweepSpec")
    return spec


def axis(field: str, values: Sequence[Any]) -> tuple[Level, ...]:
    """One grid axis over a single field: axis('optim.policy.lr', [1e-4, 1e-3])."""
    return tuple({field: v} for v in values)


@dataclasses.dataclass(frozen=True)
class Point:
    """One training run of a sweep."""

    config: str  # config file
    variant: str  # ':variant' of the row
    common_arg: str
    seed: int
    overrides: tuple[tuple[str, Any], ...]  # grid overrides (part of the name)
    fixed: tuple[tuple[str, Any], ...]  # shared overrides (not in the name)

    @property
    def row(self) -> str:
        """The row label: variant and grid overrides, seed left out (seeds aggregate)."""
        parts = [self.variant or "default"]
        parts += [f"{_short(k)}={_slug(v)}" for k, v in self.overrides]
        return "__".join(parts)

    @property
    def name(self) -> str:
        """Directory name under the sweep dir: `<config stem>__<row>__seed=<n>` (sweeps of
        several config files may share a sweep dir)."""
        return f"{pathlib.Path(self.config).stem}__{self.row}__seed={self.seed}"

    @property
    def config_path(self) -> str:
        arg = ",".join(a for a in (self.variant, self.common_arg) if a)
        return f"{self.config}:{arg}" if arg else self.config

    def all_overrides(self) -> dict[str, Any]:
        return {**dict(self.fixed), **dict(self.overrides)}


def expand(spec: SweepSpec) -> list[Point]:
    """Every point of `spec`: variants x grid levels x seeds, in that nesting order.

    Raises ValueError when two points would get one name, or a grid field is also fixed.
    """
    fixed = tuple(spec.fixed.items())
    points = []
    for variant in spec.variants:
        for levels in itertools.product(*spec.grid):
            merged: dict[str, Any] = {}
            for level in levels:
                for field, value in level.items():
                    _check_field(field, f"SweepSpec {spec.name!r}: grid")
                    if field in merged or field in spec.fixed:
                        raise ValueError(
                            f"SweepSpec {spec.name!r}: field {field!r} set twice in one point"
                        )
                    merged[field] = value
            for seed in spec.seeds:
                points.append(
                    Point(spec.config, variant, spec.common_arg, seed, tuple(merged.items()), fixed)
                )
    names = [p.name for p in points]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"SweepSpec {spec.name!r}: points share names {dupes}")
    return points


def warm_start_point(spec: SweepSpec, seed: int) -> Point:
    """The SFT-only run whose `<workdir>/warm_start` policy the seed's points load.

    It keeps the spec's fixed overrides that shape the warm start (`affects_warm_start`)
    and drops the rest, so sweeps of one config with other RL budgets share it.
    """
    shaping = {k: v for k, v in spec.fixed.items() if affects_warm_start(k)}
    fixed = {**shaping, **WARM_START_OVERRIDES}
    return Point(spec.config, spec.base_variant, spec.common_arg, seed, (), tuple(fixed.items()))


def affects_warm_start(field: str) -> bool:
    """Whether a fixed override can change the SFT warm start (model, SFT, init, mesh, and
    the task: env.* except the evaluation size and the RL group size)."""
    section = field.split(".", 1)[0]
    return section in WARM_START_SECTIONS and field not in ("env.eval_size", "env.group_size")


def warm_start_name(spec: SweepSpec, seed: int) -> str:
    stem = pathlib.Path(spec.config).stem
    arg = _slug(spec.common_arg) if spec.common_arg else "default"
    return f"{WARM_START_PREFIX}{stem}__{arg}__seed={seed}"


# --------------------------------------------------------------------------- commands


def point_argv(
    point: Point,
    workdir: str | os.PathLike,
    *,
    warm_start_dir: str | os.PathLike | None = None,
    python: str = sys.executable,
    entry: str = TRAIN_MODULE,
) -> list[str]:
    """The command line of one point (a list for subprocess, no shell)."""
    overrides = point_overrides(point, warm_start_dir)
    argv = [
        python,
        "-m",
        entry,
        f"--config={point.config_path}",
        f"--workdir={workdir}",
        f"--config.seed={point.seed}",
    ]
    argv += [f"--config.{k}={flag_value(v)}" for k, v in overrides.items()]
    return argv


def point_overrides(point: Point, warm_start_dir: str | os.PathLike | None) -> dict[str, Any]:
    """Every `--config.<field>` of a point but the seed: fixed, grid, then the warm start."""
    overrides = point.all_overrides()
    if warm_start_dir is not None:
        overrides["init.kind"] = "params"
        overrides["init.params_path"] = str(pathlib.Path(warm_start_dir) / WARM_START_SUBDIR)
    return overrides


def set_field(config: ConfigDict, field: str, value: Any) -> None:
    """config['a']['b'] = value for field 'a.b'; ConfigError if the field does not exist."""
    *path, last = field.split(".")
    node = config
    for part in path:
        if part not in node:
            raise ConfigError(f"config field {field}: no section {part!r}")
        node = node[part]
    if last not in node:
        raise ConfigError(f"config field {field}: no such field")
    node[last] = value


def point_config(config_path: str, seed: int, overrides: Mapping[str, Any]) -> ConfigDict:
    """The config a point's command builds (file[:variant], seed, overrides), unvalidated."""
    c = config_lib.load_config(config_path)
    c.seed = seed
    for field, value in overrides.items():
        set_field(c, field, value)
    return c


def flag_value(value: Any) -> str:
    """Text of a `--config.<field>=` override: strings raw, bools lower-case, else repr."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, tuple, list)) or value is None:
        return repr(tuple(value) if isinstance(value, list) else value)
    raise TypeError(f"override value {value!r}: expected str, bool, number, tuple or None")


def launcher_argv(launcher: str, argv: Sequence[str], name: str) -> list[str]:
    """`argv` (a local point command) as run on a pod through experiments/launch.py.

    'local' returns argv unchanged. 'tpu'/'gpu' hand the point's module and flags to
    the multi-host launcher: `python -m experiments.launch --platform=<launcher>
    --name=<name> -- <module> <flags...>`; it starts the same command on every host.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: must be one of {LAUNCHERS}")
    if launcher == "local":
        return list(argv)
    python, dash_m, module, *flags = argv
    if dash_m != "-m":
        raise ValueError(f"launcher_argv: expected '<python> -m <module> ...', got {argv[:3]}")
    head = [python, "-m", LAUNCH_MODULE, f"--platform={launcher}", f"--name={name}", "--"]
    return [*head, module, *flags]


# --------------------------------------------------------------------------- running


@dataclasses.dataclass
class Job:
    """One process to run: `argv` with its workdir."""

    name: str
    argv: list[str]
    workdir: pathlib.Path
    warm_start: bool = False  # done once <workdir>/warm_start holds a checkpoint
    config: tuple[str, int, dict[str, Any]] | None = None  # (file[:variant], seed, overrides)


def has_output(job: Job) -> bool:
    """A point: summary.json. A warm start: a committed step under <workdir>/warm_start
    (orbax renames a step's tmp dir to the bare step number on commit); this does not
    depend on the process getting past RL step 0 (see docs/experiments.md)."""
    if not job.warm_start:
        return (job.workdir / SUMMARY_FILE).is_file()
    ws = job.workdir / WARM_START_SUBDIR
    return ws.is_dir() and any(p.is_dir() and p.name.isdigit() for p in ws.iterdir())


def is_finished(job: Job) -> bool:
    """Its output is there and point.json records this command."""
    return has_output(job) and _recorded_argv(job.workdir) == job.argv


def side_file(workdir: str | os.PathLike, kind: str) -> pathlib.Path:
    """The runner's file `kind` (POINT_FILE, FAILED_FILE, ...) about the point in `workdir`."""
    workdir = pathlib.Path(workdir)
    return workdir.parent / SIDE_DIR / f"{workdir.name}.{kind}"


def check_workdir(job: Job) -> None:
    """Refuses a workdir that holds another command's run, or a run whose config.json
    differs from what the command builds now (the config file was edited since): such
    results are never reused nor overwritten."""
    recorded = _recorded_argv(job.workdir)
    if recorded is not None and recorded != job.argv:
        raise ValueError(
            f"sweep point {job.name!r}: {side_file(job.workdir, POINT_FILE)} records another "
            f"command; move it away or use another sweep dir.\n  recorded: {shlex.join(recorded)}\n"
            f"  now:      {shlex.join(job.argv)}"
        )
    saved = job.workdir / CONFIG_FILE
    if job.config is None or not saved.is_file():
        return
    expected = encode_meta(point_config(*job.config).to_dict(), "config")
    blocking, _ = config_differences(
        json.loads(saved.read_text()), json.loads(json.dumps(expected))
    )
    if blocking:
        raise ValueError(
            f"sweep point {job.name!r}: {saved} differs from what {job.config[0]} builds now "
            f"in {blocking[:3]} (the config changed since that run); move the workdir away "
            f"or use another sweep dir"
        )


def _recorded_argv(workdir: pathlib.Path) -> list[str] | None:
    path = side_file(workdir, POINT_FILE)
    if not path.is_file():
        return None
    try:
        return list(json.loads(path.read_text())["argv"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"sweep: {path} is not a point file ({e})") from e


def run_jobs(
    jobs: Sequence[Job],
    *,
    parallel: int = 1,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
    poll_s: float = 0.5,
) -> dict[str, str]:
    """Runs every unfinished job, `parallel` at a time; returns name -> status.

    Status: 'skipped' (already finished), 'done', or 'failed' (failed.json written with
    the exit code and stderr tail). A failure never stops the other jobs.
    """
    if parallel < 1:
        raise ValueError(f"parallel: must be >= 1, got {parallel}")
    for job in jobs:
        check_workdir(job)
    status = {j.name: "skipped" for j in jobs if is_finished(j)}
    for job in jobs:
        if job.name in status:  # a failure record of an attempt before the one that finished
            side_file(job.workdir, FAILED_FILE).unlink(missing_ok=True)
    pending = [j for j in jobs if j.name not in status]
    running: list[tuple[Job, subprocess.Popen, float, list]] = []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            running.append((job, *_start(job, env, cwd)))
            log(f"[sweep] start {job.name}")
        time.sleep(poll_s)
        still = []
        for job, proc, t0, files in running:
            rc = proc.poll()
            if rc is None:
                still.append((job, proc, t0, files))
                continue
            for f in files:
                f.close()
            status[job.name] = _finish(job, rc, time.time() - t0)
            log(f"[sweep] {status[job.name]} {job.name} ({time.time() - t0:.0f} s)")
        running = still
    return status


def _start(job: Job, env, cwd) -> tuple[subprocess.Popen, float, list]:
    side_file(job.workdir, POINT_FILE).parent.mkdir(parents=True, exist_ok=True)
    side_file(job.workdir, FAILED_FILE).unlink(missing_ok=True)
    side_file(job.workdir, POINT_FILE).write_text(json.dumps({"argv": job.argv}, indent=1))
    out = open(side_file(job.workdir, STDOUT_FILE), "a")  # noqa: SIM115 (closed at the end)
    err = open(side_file(job.workdir, STDERR_FILE), "a")  # noqa: SIM115
    env = dict(os.environ if env is None else env)
    proc = subprocess.Popen(job.argv, stdout=out, stderr=err, env=env, cwd=cwd)
    return proc, time.time(), [out, err]


def _finish(job: Job, returncode: int, wall_s: float) -> str:
    if has_output(job) and (returncode == 0 or job.warm_start):
        return "done"
    lines = side_file(job.workdir, STDERR_FILE).read_text(errors="replace").splitlines()
    record = dict(
        returncode=returncode,
        wall_s=wall_s,
        argv=job.argv,
        stderr_tail="\n".join(lines[-STDERR_TAIL_LINES:]),
        reason="exit code 0 but no summary.json" if returncode == 0 else "non-zero exit",
    )
    side_file(job.workdir, FAILED_FILE).write_text(json.dumps(record, indent=1))
    return "failed"


# --------------------------------------------------------------------------- sweeps


def sweep_jobs(
    spec: SweepSpec,
    sweep_dir: str | os.PathLike,
    *,
    python: str = sys.executable,
    launcher: str = "local",
) -> tuple[list[Job], list[tuple[Point, Job]]]:
    """(warm-start jobs, [(point, job)]) of a sweep; commands only, nothing runs."""
    root = pathlib.Path(sweep_dir)
    warm: dict[int, Job] = {}
    if spec.warm_start:
        for seed in spec.seeds:
            name = warm_start_name(spec, seed)
            ws = warm_start_point(spec, seed)
            argv = point_argv(ws, root / name, python=python, entry=spec.entry)
            config = (ws.config_path, seed, point_overrides(ws, None))
            argv = launcher_argv(launcher, argv, name)
            warm[seed] = Job(name, argv, root / name, warm_start=True, config=config)
    pairs = []
    for p in expand(spec):
        ws = warm[p.seed].workdir if spec.warm_start else None
        argv = point_argv(p, root / p.name, warm_start_dir=ws, python=python, entry=spec.entry)
        config = (p.config_path, p.seed, point_overrides(p, ws))
        argv = launcher_argv(launcher, argv, p.name)
        pairs.append((p, Job(p.name, argv, root / p.name, config=config)))
    return list(warm.values()), pairs


def run_sweep(
    spec: SweepSpec,
    sweep_dir: str | os.PathLike,
    *,
    parallel: int = 1,
    launcher: str = "local",
    dry_run: bool = False,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> list[PointResult]:
    """Runs (or resumes) a sweep: warm starts first, then every point; collects results.

    Points whose seed's warm start failed are not started (their result says so).
    `dry_run` prints the commands and runs nothing.
    """
    warm, pairs = sweep_jobs(spec, sweep_dir, python=python, launcher=launcher)
    if dry_run:
        for job in warm + [j for _, j in pairs]:
            log(shlex.join(job.argv))
        return collect(spec, sweep_dir, [p for p, _ in pairs])
    env = sweep_env(sweep_dir, env)
    ws_status = run_jobs(warm, parallel=parallel, env=env, log=log)
    failed_ws = {int(n.rsplit("=", 1)[1]) for n, s in ws_status.items() if s == "failed"}
    jobs = [j for p, j in pairs if p.seed not in failed_ws]
    status = run_jobs(jobs, parallel=parallel, env=env, log=log)
    results = collect(spec, sweep_dir, [p for p, _ in pairs], failed_warm_starts=failed_ws)
    for r in results:
        r.reused = status.get(r.point.name) == "skipped"
    return results


def sweep_env(sweep_dir: str | os.PathLike, env: Mapping[str, str] | None) -> dict[str, str]:
    """The points' environment: JAX's persistent compilation cache under the sweep dir
    (points of one sweep compile the same programs), unless the caller set one."""
    out = dict(os.environ if env is None else env)
    cache = pathlib.Path(sweep_dir) / ".jax_cache"
    out.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache.absolute()))
    out.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    out.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return out


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class PointResult:
    """What one point left in its workdir."""

    point: Point
    workdir: pathlib.Path
    status: str  # 'done' | 'failed' | 'missing' | 'running' | 'no warm start'
    summary: dict[str, Any] | None
    history: list[dict[str, Any]]  # metrics.jsonl records
    error: str = ""  # stderr tail of a failure
    reused: bool = False  # finished before this run_sweep call (skipped)

    @property
    def row(self) -> str:
        return self.point.row


def collect(
    spec: SweepSpec,
    sweep_dir: str | os.PathLike,
    points: Sequence[Point] | None = None,
    *,
    failed_warm_starts: set[int] = frozenset(),
) -> list[PointResult]:
    """summary.json + metrics.jsonl of every point (partial histories of failed ones)."""
    root = pathlib.Path(sweep_dir)
    out = []
    for p in expand(spec) if points is None else points:
        wd = root / p.name
        summary = _read_json(wd / SUMMARY_FILE)
        history = read_jsonl(wd / METRICS_FILE) if (wd / METRICS_FILE).is_file() else []
        failed = _read_json(side_file(wd, FAILED_FILE))
        if summary is not None:
            status, error = "done", ""
        elif failed is not None:
            status, error = "failed", failed.get("stderr_tail", "")
        elif p.seed in failed_warm_starts:
            status, error = "no warm start", f"warm start of seed {p.seed} failed"
        else:
            status, error = ("running" if wd.is_dir() else "missing"), ""
        out.append(PointResult(p, wd, status, summary, history, error))
    return out


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"sweep: {path} is not valid JSON ({e})") from e


# --------------------------------------------------------------------------- names

_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _check_field(field: str, where: str) -> None:
    if not isinstance(field, str) or not _FIELD_RE.match(field):
        raise ValueError(f"{where}: {field!r} is not a dotted config field name")
    if field == "seed":
        raise ValueError(f"{where}: 'seed' is a sweep axis of its own (SweepSpec.seeds)")


def _short(field: str) -> str:
    """A field's name in a point name: its last part ('optim.policy.lr' -> 'lr')."""
    return field.rsplit(".", 1)[-1]


def _slug(value: Any) -> str:
    """A value as file-name-safe text: (40, 80) -> '40-80', 'a,b' -> 'a,b'."""
    text = value if isinstance(value, str) else flag_value(value)
    text = re.sub(r",\s*", "-", text.strip("()[]"))
    return re.sub(r"[^A-Za-z0-9._=+,-]", "", text) or "none"
