"""Sweep results: the files a point leaves beside and in its workdir, collected per point.

`collect` reads each point's `summary.json` and `metrics.jsonl` (partial histories of failed
points) and the runner's side files (`<sweep_dir>/_sweep/<name>.failed.json`) into
`PointResult`s; sao_jax/report/tables.py turns them into the points table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from sao_jax.checkpointing import integrity
from sao_jax.metrics import METRICS_FILE, read_jsonl
from sao_jax.run import accounting
from sao_jax.run.settings import WARM_START_CRITIC_SUBDIR
from sao_jax.sweep.spec import WARM_START_SUBDIR, Point, SweepSpec, expand, warm_start_name

SUMMARY_FILE = "summary.json"  # written by sao_jax.train.run at the end of a run
# The runner's files about a point live beside its workdir (the trainer wants that empty):
# <sweep_dir>/_sweep/<point name>.<kind>
SIDE_DIR = "_sweep"
POINT_FILE = "point.json"  # the command of a point, written before it starts
FAILED_FILE = "failed.json"  # exit code + stderr tail of the last failed attempt
STDOUT_FILE = "stdout.log"
STDERR_FILE = "stderr.log"


def side_file(workdir: str | os.PathLike, kind: str) -> pathlib.Path:
    """The runner's file `kind` (POINT_FILE, FAILED_FILE, ...) about the point in `workdir`."""
    workdir = pathlib.Path(workdir)
    return workdir.parent / SIDE_DIR / f"{workdir.name}.{kind}"


@dataclasses.dataclass
class PointResult:
    """What one point left in its workdir."""

    point: Point
    workdir: pathlib.Path
    status: str  # 'done' | 'failed' | 'stopped' | 'missing' | 'running' | 'no warm start'
    summary: dict[str, Any] | None
    history: list[dict[str, Any]]  # metrics.jsonl records
    error: str = ""  # stderr tail of a failure
    reused: bool = False  # finished before this run_sweep call (skipped)
    # digests of the seed's shared warm start ({'policy', 'critic'}: the tensors it starts
    # from, `integrity.stored_digest`; None where not stored): runs of one seed made by
    # different invocations (sessions) are checked to share one start
    warm_start: dict[str, str | None] | None = None

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
    """summary.json + metrics.jsonl of every point (partial histories of failed ones); a
    point is 'done' when its summary says it finished (`accounting.complete`, the runner's
    test too), 'stopped' when a signal's save wrote it."""
    root = pathlib.Path(sweep_dir)
    out = []
    digests: dict[int, dict[str, str | None]] = {}  # seed -> its warm start's digests
    for p in expand(spec) if points is None else points:
        wd = root / p.name
        summary = _read_json(wd / SUMMARY_FILE)
        history = read_jsonl(wd / METRICS_FILE) if (wd / METRICS_FILE).is_file() else []
        failed = _read_json(side_file(wd, FAILED_FILE))
        if accounting.complete(summary):
            status, error = "done", ""
        elif failed is not None:
            status, error = "failed", failed.get("stderr_tail", "")
        elif summary is not None:  # a signal's save: the same command resumes it
            status, error = "stopped", "stopped by a signal before it finished"
        elif p.seed in failed_warm_starts:
            status, error = "no warm start", f"warm start of seed {p.seed} failed"
        else:
            status, error = ("running" if wd.is_dir() else "missing"), ""
        result = PointResult(p, wd, status, summary, history, error)
        if spec.warm_start:  # read once per seed
            if p.seed not in digests:
                ws = root / warm_start_name(spec, p.seed)
                digests[p.seed] = {
                    "policy": integrity.stored_digest(ws / WARM_START_SUBDIR),
                    "critic": integrity.stored_digest(ws / WARM_START_CRITIC_SUBDIR),
                }
            result.warm_start = dict(digests[p.seed])
        out.append(result)
    return out


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"sweep: {path} is not valid JSON ({e})") from e
