"""Sweep runner: one process per point, resumable, seed by seed from shared warm starts.

`sweep_jobs` builds each point's command (`point_argv`; on pods handed to
experiments/launch.py by `launcher_argv`); `run_jobs` runs `parallel` of them at a time,
each point once its seed's warm start is done, skips finished ones, refuses workdirs of
another command or config, and records failures without stopping; `run_sweep` does both
for a sweep, or a table's several as one set of jobs, and collects the results. SIGTERM
or SIGINT to the sweep stops it cleanly: the running points get SIGTERM (a training run
saves and exits 0), none is started after, and the sweep exits 0 once they have ended
(`SweepStopped`); the same command resumes every one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sao_jax import config as config_lib
from sao_jax.checkpointing.meta import encode_meta
from sao_jax.checkpointing.workdir import CONFIG_FILE, config_differences
from sao_jax.cli import entry_module
from sao_jax.defaults import default_config
from sao_jax.run import accounting
from sao_jax.run.settings import WARM_START_CRITIC_SUBDIR, pretraining_fields
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.sweep.results import (
    FAILED_FILE,
    POINT_FILE,
    STDERR_FILE,
    STDOUT_FILE,
    SUMMARY_FILE,
    PointResult,
    collect,
    side_file,
)
from sao_jax.sweep.spec import (
    TRAIN_MODULE,
    WARM_START_SUBDIR,
    Point,
    SweepSpec,
    expand,
    flag_value,
    set_field,
    warm_start_name,
    warm_start_point,
)

LAUNCHERS = ("local", "tpu", "gpu")
LAUNCH_MODULE = entry_module("experiments.launch")  # likewise
STDERR_TAIL_LINES = 40

# --------------------------------------------------------------------------- commands


def point_argv(
    point: Point,
    workdir: str | os.PathLike,
    *,
    warm_start_dir: str | os.PathLike | None = None,
    critic: bool = False,
    python: str = sys.executable,
    entry: str = TRAIN_MODULE,
) -> list[str]:
    """The command line of one point (a list for subprocess, no shell)."""
    overrides = point_overrides(point, warm_start_dir, critic=critic)
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


def point_overrides(
    point: Point, warm_start_dir: str | os.PathLike | None, *, critic: bool = False
) -> dict[str, Any]:
    """Every `--config.<field>` of a point but the seed: fixed, grid, then the warm start
    (the SFT policy; with `critic`, also the value-pretrained critic)."""
    overrides = point.all_overrides()
    if warm_start_dir is not None:
        overrides["init.kind"] = "params"
        overrides["init.params_path"] = str(pathlib.Path(warm_start_dir) / WARM_START_SUBDIR)
        if critic:
            path = pathlib.Path(warm_start_dir) / WARM_START_CRITIC_SUBDIR
            overrides["init.critic_path"] = str(path)
    return overrides


def pretrains_critic(config: ConfigDict) -> bool:
    """Whether a run of `config` value-pretrains a critic (a critic estimator, steps > 0)."""
    from sao_jax.rl.advantages import estimator

    return estimator(config.rl.advantage).needs_values and config.value_pretrain.steps > 0


def shares_critic(warm_start: ConfigDict, point: ConfigDict) -> bool:
    """Whether a point starts from its warm start's pretrained critic: both pretrain one,
    reading the same fields (RL-time settings such as rl.k_critic or the RL critic's
    frozen attention may differ; value pretraining does not read them)."""
    return (
        pretrains_critic(warm_start)
        and pretrains_critic(point)
        and pretraining_fields(warm_start) == pretraining_fields(point)
    )


def point_config(config_path: str, seed: int, overrides: Mapping[str, Any]) -> ConfigDict:
    """The config a point's command builds (file[:variant], seed, overrides), unvalidated."""
    c = config_lib.load_config(config_path)
    c.seed = seed
    for field, value in overrides.items():
        set_field(c, field, value)
    return c


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
    critic: bool = False  # a warm start that also pretrains the critic (warm_start_critic)
    config: tuple[str, int, dict[str, Any]] | None = None  # (file[:variant], seed, overrides)
    after: str | None = None  # the job (its seed's warm start) that must be done first


def has_output(job: Job) -> bool:
    """A point: summary.json. A warm start: a committed step under <workdir>/warm_start
    (orbax renames a step's tmp dir to the bare step number on commit), and under
    <workdir>/warm_start_critic when it pretrains the critic; this does not depend on
    the process getting past RL step 0 (see docs/experiments.md)."""
    if not job.warm_start:  # a run a signal stopped writes one too: not finished
        path = job.workdir / SUMMARY_FILE
        return path.is_file() and accounting.complete(json.loads(path.read_text()))
    subdirs = (WARM_START_SUBDIR, WARM_START_CRITIC_SUBDIR) if job.critic else (WARM_START_SUBDIR,)
    return all(_committed(job.workdir / d) for d in subdirs)


def _committed(path: pathlib.Path) -> bool:
    return path.is_dir() and any(p.is_dir() and p.name.isdigit() for p in path.iterdir())


def is_finished(job: Job) -> bool:
    """Its output is there and point.json records this command."""
    return has_output(job) and _same_command(_recorded_argv(job.workdir), job.argv)


def _same_command(recorded: list[str] | None, argv: list[str]) -> bool:
    """The same command but for the interpreter's path (argv[0]: a virtualenv re-created
    elsewhere, or a second checkout's, runs the same command; config.json is checked on
    its own)."""
    return recorded is not None and recorded[1:] == argv[1:]


def check_workdir(job: Job) -> None:
    """Refuses a workdir that holds another command's run, or a run whose config.json
    differs from what the command builds now (the config file was edited since): such
    results are never reused nor overwritten."""
    recorded = _recorded_argv(job.workdir)
    if recorded is not None and not _same_command(recorded, job.argv):
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
        json.loads(saved.read_text()),
        json.loads(json.dumps(expected)),
        defaults=default_config().to_dict(),
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


class SweepStopped(SystemExit):
    """A signal stopped the sweep after its running points saved: exit status 0 (nothing
    failed; the same command resumes)."""


@contextlib.contextmanager
def _stop_on_signals():
    """An Event set by SIGTERM or SIGINT while the block runs (in the main thread only:
    elsewhere signals cannot be caught, and the Event is never set)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in sigs}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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

    A free slot takes the first pending job, in the given order, whose `after` job is
    done: a seed's points start as soon as its warm start is done, beside the warm starts
    and points still running (no barrier between them). Status: 'skipped' (already
    finished), 'done', 'failed' (failed.json written with the exit code and stderr tail)
    or 'blocked' (its `after` job failed; not started). A failure never stops the other
    jobs. SIGTERM or SIGINT forwards SIGTERM to the running jobs, starts no other, waits
    for them to end and raises `SweepStopped` (exit 0); a job it stopped is neither done
    nor failed. A job's end wakes the loop at once (a thread waits on each process);
    `poll_s` bounds the wait otherwise (a stop signal is seen within it).
    """
    if parallel < 1:
        raise ValueError(f"parallel: must be >= 1, got {parallel}")
    names = [j.name for j in jobs]
    for job in jobs:
        if names.count(job.name) > 1:
            raise ValueError(f"sweep: two jobs named {job.name!r} (sweeps sharing a point?)")
        if job.after is not None and job.after not in names:
            raise ValueError(f"sweep: job {job.name!r} waits for {job.after!r}, not a job here")
        check_workdir(job)
    status = {j.name: "skipped" for j in jobs if is_finished(j)}
    for job in jobs:
        if job.name in status:  # a failure record of an attempt before the one that finished
            side_file(job.workdir, FAILED_FILE).unlink(missing_ok=True)
    pending = [j for j in jobs if j.name not in status]
    running: list[tuple[Job, subprocess.Popen, float, list]] = []
    ended = threading.Event()  # set by a job's waiter thread when its process exits
    stopping = False
    with _stop_on_signals() as stop:
        while pending or running:
            if stop.is_set() and not stopping:
                stopping, pending = True, []
                log(f"[sweep] stopping: SIGTERM to {len(running)} running point(s)")
                for _, proc, _, _ in running:
                    proc.send_signal(signal.SIGTERM)
            while len(running) < parallel and (job := _next_ready(pending, status, log)):
                pending.remove(job)
                running.append((job, *_start(job, env, cwd, ended)))
                log(f"[sweep] start {job.name}")
            if pending and not running:  # each waits on another pending job
                raise ValueError(f"sweep: jobs wait on each other: {[j.name for j in pending]}")
            ended.wait(poll_s)
            ended.clear()  # every process that ended before this is seen by the polls below
            still = []
            for job, proc, t0, files in running:
                rc = proc.poll()
                if rc is None:
                    still.append((job, proc, t0, files))
                    continue
                for f in files:
                    f.close()
                if stopping and not has_output(job):
                    log(f"[sweep] stopped {job.name} (exit {rc}; the same command resumes it)")
                    continue
                status[job.name] = _finish(job, rc, time.time() - t0)
                log(f"[sweep] {status[job.name]} {job.name} ({time.time() - t0:.0f} s)")
            running = still
    if stopping:
        log("[sweep] stopped by a signal; rerun the same command to resume")
        raise SweepStopped(0)
    return status


def _next_ready(pending: list[Job], status: dict[str, str], log) -> Job | None:
    """The first pending job whose `after` job is done (or skipped); pending jobs whose
    `after` job failed are marked 'blocked' and dropped on the way."""
    for job in list(pending):
        after = status.get(job.after) if job.after is not None else "done"
        if after in ("done", "skipped"):
            return job
        if after in ("failed", "blocked"):
            pending.remove(job)
            status[job.name] = "blocked"
            log(f"[sweep] blocked {job.name} ({job.after} failed)")
    return None


def _start(job: Job, env, cwd, ended: threading.Event) -> tuple[subprocess.Popen, float, list]:
    side_file(job.workdir, POINT_FILE).parent.mkdir(parents=True, exist_ok=True)
    side_file(job.workdir, FAILED_FILE).unlink(missing_ok=True)
    side_file(job.workdir, POINT_FILE).write_text(json.dumps({"argv": job.argv}, indent=1))
    out = open(side_file(job.workdir, STDOUT_FILE), "a")  # noqa: SIM115 (closed at the end)
    err = open(side_file(job.workdir, STDERR_FILE), "a")  # noqa: SIM115
    env = dict(os.environ if env is None else env)
    proc = subprocess.Popen(job.argv, stdout=out, stderr=err, env=env, cwd=cwd)
    threading.Thread(target=lambda: (proc.wait(), ended.set()), daemon=True).start()
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
    ws_configs: dict[int, ConfigDict | None] = {}
    if spec.warm_start:
        for seed in spec.seeds:
            name = warm_start_name(spec, seed)
            ws = warm_start_point(spec, seed)
            argv = point_argv(ws, root / name, python=python, entry=spec.entry)
            config = (ws.config_path, seed, point_overrides(ws, None))
            argv = launcher_argv(launcher, argv, name)
            try:
                ws_configs[seed] = point_config(*config)
                critic = pretrains_critic(ws_configs[seed])
            except ConfigError:  # the process reports it
                ws_configs[seed], critic = None, False
            warm[seed] = Job(name, argv, root / name, warm_start=True, config=config, critic=critic)
    pairs = []
    for p in expand(spec):
        ws = warm[p.seed].workdir if spec.warm_start else None
        critic = spec.warm_start and _shares(ws_configs[p.seed], p, ws)
        argv = point_argv(
            p, root / p.name, warm_start_dir=ws, critic=critic, python=python, entry=spec.entry
        )
        config = (p.config_path, p.seed, point_overrides(p, ws, critic=critic))
        argv = launcher_argv(launcher, argv, p.name)
        after = warm[p.seed].name if spec.warm_start else None
        pairs.append((p, Job(p.name, argv, root / p.name, config=config, after=after)))
    return list(warm.values()), pairs


def _shares(ws_config: ConfigDict | None, point: Point, ws: pathlib.Path) -> bool:
    """`shares_critic` for a point; False when either config does not build (the point's
    own process then reports why)."""
    try:
        config = point_config(point.config_path, point.seed, point_overrides(point, ws))
        return ws_config is not None and shares_critic(ws_config, config)
    except ConfigError:
        return False


def run_sweep(
    specs: SweepSpec | Sequence[SweepSpec],
    sweep_dir: str | os.PathLike,
    *,
    parallel: int = 1,
    launcher: str = "local",
    dry_run: bool = False,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
) -> list[PointResult]:
    """Runs (or resumes) a sweep, or several (a table's tasks, each with its own warm
    starts) into one sweep dir as one set of jobs, seed by seed (`seed_order`): a free
    slot takes a ready point of the earliest seed first, else the next warm start, so the
    seeds finish in order (a sweep stopped early leaves whole seeds), points overlap the
    later warm starts and one sweep's warm starts overlap another's (`run_jobs`);
    collects the results of all, in the sweeps' order.

    Points whose seed's warm start failed are not started (their result says so).
    `dry_run` prints the commands and runs nothing. The sweeps' points and warm starts
    must not share names (ValueError).
    """
    specs = (specs,) if isinstance(specs, SweepSpec) else tuple(specs)
    built = [sweep_jobs(s, sweep_dir, python=python, launcher=launcher) for s in specs]
    jobs = seed_order(specs, built)
    if dry_run:
        for job in jobs:
            log(shlex.join(job.argv))
        return [r for s in specs for r in collect(s, sweep_dir)]
    status = run_jobs(jobs, parallel=parallel, env=sweep_env(sweep_dir, env), log=log)
    results = []
    for spec, (_, pairs) in zip(specs, built):
        failed = {s for s in spec.seeds if status.get(warm_start_name(spec, s)) == "failed"}
        part = collect(spec, sweep_dir, [p for p, _ in pairs], failed_warm_starts=failed)
        for r in part:
            r.reused = status.get(r.point.name) == "skipped"
        results += part
    return results


def seed_order(specs: Sequence[SweepSpec], built) -> list[Job]:
    """The sweeps' jobs (`built`: each sweep's `sweep_jobs`) seed by seed, in the order the
    seeds first appear: a seed's warm starts (every sweep's), then its points, each group
    in the sweeps' order and the points in each sweep's order."""
    rank = {s: i for i, s in enumerate(dict.fromkeys(s for spec in specs for s in spec.seeds))}
    keyed = []  # (seed's rank, 0 warm start | 1 point, job)
    for spec, (warm, pairs) in zip(specs, built, strict=True):
        keyed += [(rank[s], 0, j) for s, j in zip(spec.seeds, warm)]  # warm: one per seed
        keyed += [(rank[p.seed], 1, j) for p, j in pairs]
    return [j for *_, j in sorted(keyed, key=lambda k: k[:2])]  # stable: keeps the order


def sweep_env(sweep_dir: str | os.PathLike, env: Mapping[str, str] | None) -> dict[str, str]:
    """The points' environment: JAX's persistent compilation cache under the sweep dir
    (points of one sweep compile the same programs), unless the caller set one."""
    out = dict(os.environ if env is None else env)
    cache = pathlib.Path(sweep_dir) / ".jax_cache"
    out.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache.absolute()))
    out.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    out.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return out
