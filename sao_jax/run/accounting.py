"""Bookkeeping of the main job (sao_jax/train.py): trajectory counters across resumed
segments, host-side batch statistics, sampler gauges, wall time, strict-JSON values, and
whether a workdir's run is finished (its summary.json)."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import platform
import time
from typing import Any

import jax
import numpy as np

from sao_jax.sampling.trajectory import Trajectory

log = logging.getLogger("sao_jax")
SUMMARY_FILE = "summary.json"  # <workdir>/...: written once a run (segment) ends


def host_stats(trajs: list[Trajectory], version: int) -> dict[str, float]:
    lags = np.concatenate([version - t.versions[t.action_mask] for t in trajs])
    return {
        "train/reward": float(np.mean([t.outcome for t in trajs])),
        "train/success": float(np.mean([bool(t.info.get("success", False)) for t in trajs])),
        "train/truncated": float(np.mean([t.truncated for t in trajs])),
        "train/action_tokens": float(np.mean([t.num_actions for t in trajs])),
        "train/staleness": float(np.mean(lags)),
        "train/max_staleness": float(np.max(lags)),
    }


ENV_PREFIX = "env/"  # the tasks' own per-episode metrics (EnvLog)


class EnvLog:
    """The tasks' own per-episode metrics between two log steps, as host (sum, count).

    An env may put `info["log"] = {name: value}` in the info of an episode's last turn
    (e.g. the user-style task's success by where its user stands in its switch schedule,
    sao_jax/envs/user_style.py); names differ between episodes. `scalars()` gives, per
    name, `env/<name>` = the mean over the episodes that logged it and
    `env/<name>/count` = how many did, so pooled means over steps are exact
    (sum = mean x count), then starts a new window.
    """

    def __init__(self) -> None:
        self._totals: dict[str, list[float]] = {}

    def add(self, trajs: list[Trajectory]) -> None:
        for t in trajs:
            turns = t.info.get("turn_infos") or [{}]
            for name, value in (turns[-1].get("log") or {}).items():
                acc = self._totals.setdefault(name, [0.0, 0.0])
                acc[0] += float(value)
                acc[1] += 1.0

    def scalars(self) -> dict[str, float]:
        out = {}
        for name, (s, c) in sorted(self._totals.items()):
            out[f"{ENV_PREFIX}{name}"] = s / c
            out[f"{ENV_PREFIX}{name}/count"] = c
        self._totals = {}
        return out


def wall_time(extra: dict) -> float:
    """Wall time of the whole run: earlier segments (before a resume) + this one."""
    return extra["prior_wall_time"] + time.time() - extra["t_start"]


def cpu_model() -> str:
    """The host CPU's model name ('' when unknown). XLA:CPU compiles for the host's
    instruction set, so one run on two CPU models can round differently (a warm start
    re-created on another CPU is not the same tensors): run summaries name it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> str:
    dev = jax.devices()[0]
    cpu = cpu_model()
    return (
        f"{platform.machine()}{f' ({cpu})' if cpu else ''}, {os.cpu_count()} CPU cores, "
        f"{jax.device_count()} x {dev.platform} ({dev.device_kind})"
    )


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    if not rows:
        return {}
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def sampler_scalars(stats: dict[str, Any], base: dict) -> dict[str, float]:
    """The sampler's gauges (queued, version, ...); generated / taken / dropped are run
    totals (earlier segments included), so a resumed run continues the curves."""
    out = {f"sampler/{k}": float(v) for k, v in stats.items() if isinstance(v, (int, float))}
    totals = counters(base, stats)
    out["sampler/generated"] = float(totals["generated"])
    out["sampler/taken"] = float(totals["trained"])
    out["sampler/dropped"] = float(totals["dropped_stale"] + totals["dropped_episodes"])
    return out


def nan_from_json(x: Any) -> Any:
    """None (a non-finite value stored as null) back to NaN."""
    return math.nan if x is None else x


def finite(x: Any) -> Any:
    """`x` with non-finite floats replaced by None (strict JSON, as in metrics.jsonl)."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def resume_counters(saved: dict) -> dict:
    """Totals of earlier run segments; what was in flight at their save is discarded."""
    keys = ("generated", "trained", "dropped_stale", "dropped_episodes", "discarded")
    base = {k: int(saved.get(k, 0)) for k in keys}
    base["discarded"] += int(saved.get("in_flight", 0))
    return base


def counters(base: dict, stats: dict[str, Any]) -> dict:
    """Trajectory counters since the run began (`base`: earlier segments, `stats`: the
    source's). Balance, checked by the tests: generated == trained + dropped_stale +
    discarded + in_flight (finished, not yet trained); dropped_episodes never finished
    (env errors, prompts too long, ...)."""
    dropped = dict(stats.get("dropped", {}))
    stale = int(dropped.pop("stale", 0))
    out = {
        "generated": base["generated"] + int(stats.get("generated", 0)),
        "trained": base["trained"] + int(stats.get("taken", 0)),
        "dropped_stale": base["dropped_stale"] + stale,
        "dropped_episodes": base["dropped_episodes"] + int(sum(dropped.values())),
        "discarded": base["discarded"],
        "in_flight": int(stats.get("queued", 0)) + int(stats.get("in_open_groups", 0)),
    }
    return out


def complete(summary: Any) -> bool:
    """A run's summary.json says it ended by itself: not interrupted (a signal's save
    writes one too), and its final evaluation ran."""
    return (
        isinstance(summary, dict)
        and not summary.get("interrupted", True)
        and bool(summary.get("after"))
    )


def finished(workdir: pathlib.Path, total_steps: int) -> dict | None:
    """The summary of the run in `workdir` when it is finished for `total_steps` (it
    reached at least that step, was not interrupted and ran its final evaluation, which
    comes before the final checkpoint), after one log line saying so; else None (a new,
    interrupted or shorter run)."""
    path = pathlib.Path(workdir) / SUMMARY_FILE
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (complete(summary) and int(summary.get("steps") or 0) >= total_steps):
        return None
    log.info(
        "the run in %s already finished at step %d (train.total_steps=%d): nothing to do; a "
        "larger --config.train.total_steps continues it",
        workdir, summary["steps"], total_steps,
    )  # fmt: skip
    return summary
