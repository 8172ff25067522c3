"""Aggregating sweep results: mean +/- std over seeds, collapse, tables, plots.

Inputs are metric histories (the records of a run's metrics.jsonl: {"step", name: value})
and summaries (summary.json). Everything here is plain host-side numpy and matplotlib
(Agg canvas, no pyplot), so experiment scripts stay thin.

Collapse (`detect_collapse`, docs/experiments.md), the earliest of:
  success   after the running max of `metric` reached `min_peak`, `metric` stays below
            `drop_fraction` x its running max for `patience` consecutive log records;
            the collapse step is the first of them;
  heldout   held-out success (`eval_metric`) at step 0 was >= `min_peak`, and from some
            eval on every later eval is below `drop_fraction` x that value (catches runs
            that fall apart before training success had a peak); step: that eval;
  entropy   policy entropy below `min_entropy` for `patience` consecutive log records;
  nonfinite the cumulative count of skipped (non-finite) updates reaches `max_skipped`,
            or the run died of a NonFiniteError (step: its last log record).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

History = Sequence[Mapping[str, Any]]
Curve = tuple[np.ndarray, np.ndarray, np.ndarray]  # steps [S], mean [S], std [S]


def finite(value: Any) -> float | None:
    """A finite float, or None (null, NaN, text, bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


# --------------------------------------------------------------------------- statistics


def fmt_spread(
    stats: tuple[float, float, int], n_values: int, *, scale: float = 100.0, digits: int = 1
) -> str:
    """'mean ± spread' of (mean, spread, n finite) over `n_values` values, scaled: the bare
    mean for one finite value; 'n/a' if none; '(n=k)' appended when some are missing."""
    mean, spread, n = stats
    if n == 0:
        return "n/a"
    text = f"{scale * mean:.{digits}f}"
    if n > 1:
        text += f" ± {scale * spread:.{digits}f}"
    return text if n == n_values else f"{text} (n={n})"


def series(history: History, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], values [S]) of the records holding a finite `name`, by step; the last
    record wins when a step repeats."""
    by_step = {}
    for record in history:
        v = finite(record.get(name))
        if v is not None:
            by_step[int(record["step"])] = v
    steps = np.array(sorted(by_step), np.int64)
    return steps, np.array([by_step[s] for s in steps], np.float64)


def value_at(history: History, name: str, step: int) -> float | None:
    """`name` at exactly `step` (None if it was not logged there)."""
    steps, values = series(history, name)
    hit = np.nonzero(steps == step)[0]
    return float(values[hit[-1]]) if hit.size else None


def mean_curve(histories: Sequence[History], name: str) -> Curve:
    """Mean and std over runs of `name` at every step some run logged (NaN-aware)."""
    per_run = [dict(zip(*series(h, name))) for h in histories]
    steps = np.array(sorted(set(itertools.chain.from_iterable(per_run))), np.int64)
    if steps.size == 0:
        empty = np.zeros((0,), np.float64)
        return steps, empty, empty
    table_rs = np.array([[r.get(s, np.nan) for s in steps] for r in per_run])  # [R, S]
    count_s = np.sum(np.isfinite(table_rs), axis=0)
    with np.errstate(invalid="ignore"):
        mean_s = np.nansum(table_rs, axis=0) / count_s
        dev_rs = np.where(np.isfinite(table_rs), table_rs - mean_s, 0.0)
        std_s = np.sqrt(np.sum(dev_rs**2, axis=0) / np.maximum(count_s - 1, 1))
    return steps, mean_s, std_s


# --------------------------------------------------------------------------- collapse


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """When a run counts as collapsed; see the module docstring."""

    metric: str = "train/success"
    drop_fraction: float = 0.5
    min_peak: float = 0.1
    patience: int = 3
    eval_metric: str = "eval/greedy_success"
    entropy_metric: str = "policy/entropy"
    min_entropy: float = 0.05
    skipped_metric: str = "train/skipped_steps"
    max_skipped: int = 5

    def __post_init__(self):
        if not 0 < self.drop_fraction < 1:
            raise ValueError(f"CollapseRule.drop_fraction: must be in (0, 1), got {self}")
        if self.patience < 1 or self.max_skipped < 1:
            raise ValueError(f"CollapseRule: patience and max_skipped must be >= 1, got {self}")


@dataclasses.dataclass(frozen=True)
class Collapse:
    step: int
    reason: str  # 'success' | 'heldout' | 'entropy' | 'nonfinite'


def _first_run(mask: np.ndarray, length: int) -> int | None:
    """Index of the first run of `length` consecutive True values in `mask` [S]."""
    count = 0
    for i, m in enumerate(mask):
        count = count + 1 if m else 0
        if count == length:
            return i - length + 1
    return None


def detect_collapse(
    history: History, rule: CollapseRule = CollapseRule(), *, error: str = ""
) -> Collapse | None:
    """The earliest collapse of a run by `rule` (None if it did not collapse).

    `error` is the stderr tail of a failed run: a NonFiniteError there is a collapse.
    """
    found: list[Collapse] = []
    steps, v = series(history, rule.metric)
    if steps.size:
        peak = np.maximum.accumulate(v)  # running max [S]
        low = (peak >= rule.min_peak) & (v < rule.drop_fraction * peak)
        i = _first_run(low, rule.patience)
        if i is not None:
            found.append(Collapse(int(steps[i]), "success"))
    steps, ev = series(history, rule.eval_metric)
    if steps.size > 1 and steps[0] == 0 and ev[0] >= rule.min_peak:
        low = ev < rule.drop_fraction * ev[0]
        stays = np.flip(np.logical_and.accumulate(np.flip(low)))  # low from here to the end
        hit = np.nonzero(stays[1:])[0]
        if hit.size:
            found.append(Collapse(int(steps[1 + hit[0]]), "heldout"))
    steps, ent = series(history, rule.entropy_metric)
    i = _first_run(ent < rule.min_entropy, rule.patience) if steps.size else None
    if i is not None:
        found.append(Collapse(int(steps[i]), "entropy"))
    steps, skipped = series(history, rule.skipped_metric)
    hit = np.nonzero(skipped >= rule.max_skipped)[0]
    if hit.size:
        found.append(Collapse(int(steps[hit[0]]), "nonfinite"))
    if "NonFiniteError" in error:
        logged = [int(r["step"]) for r in history]
        found.append(Collapse(max(logged, default=0), "nonfinite"))
    return min(found, key=lambda c: c.step) if found else None


def _fmt_collapse(c: Collapse | None) -> str:
    return "none" if c is None else f"{c.step} ({c.reason})"


def fmt_collapses(collapses: Sequence[Collapse | None]) -> str:
    """'none' or 'k/n at <steps> (<reasons>)'."""
    hit = [c for c in collapses if c is not None]
    if not hit:
        return f"none (0/{len(collapses)})"
    steps = ", ".join(str(c.step) for c in sorted(hit, key=lambda c: c.step))
    reasons = ", ".join(sorted({c.reason for c in hit}))
    return f"{len(hit)}/{len(collapses)} at {steps} ({reasons})"


# --------------------------------------------------------------------------- output


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are str()-ed with '|' escaped."""
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: row {i} has {len(row)} cells, need {len(headers)}")

    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, headers)) + " |"]
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def figure(width: float = 6.4, height: float = 3.8) -> tuple[Figure, Any]:
    """A figure on the Agg canvas (no pyplot) and its one axes."""
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def plot_curves(
    path: str | pathlib.Path,
    title: str,
    ylabel: str,
    curves: Mapping[str, Curve],
    *,
    vlines: Sequence[int] = (),
    vline_label: str = "",
    xlabel: str = "step",
) -> None:
    """Mean lines with +/- std bands against the step; dashed vertical lines at `vlines`."""
    fig, ax = figure()
    for label, (steps, mean, std) in curves.items():
        if len(steps) == 0:
            continue
        marker = "o" if len(steps) <= 30 else None
        (line,) = ax.plot(steps, mean, marker=marker, markersize=3, linewidth=1.3, label=label)
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    for i, x in enumerate(vlines):
        ax.axvline(
            x, color="gray", linestyle="--", linewidth=1, label=vline_label if i == 0 else None
        )
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if any(len(steps) for steps, _, _ in curves.values()):
        ax.legend(fontsize="x-small")
    else:  # say so in the figure, not an empty frame (runs that logged none of these keys)
        ax.text(0.5, 0.5, "no logged points", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})


def report_header(
    title: str,
    *,
    command: str,
    mode: str,
    seeds: Sequence[int],
    wall_s: float,
    points_wall_s: float,
    runs: int,
    reused: int,
    machine: str = "",
) -> str:
    """The top of an experiment's markdown: how to regenerate it and what it cost."""
    lines = [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- mode: {mode}; seeds: {', '.join(map(str, seeds))}",
        f"- training runs: {runs}, of which {reused} were finished by an earlier "
        f"invocation and reused",
        f"- wall time of this invocation: {wall_s / 60:.1f} min; the runs' own wall times "
        f"add up to {points_wall_s / 60:.1f} min (shared warm starts not included)",
    ]
    if machine:
        lines.append(f"- machine: {machine}")
    return "\n".join(lines) + "\n"


def points_table(
    results: Sequence[Any],
    metric: str = "eval/greedy_success",
    rule: CollapseRule | None = CollapseRule(),
) -> str:
    """One markdown row per sweep point (sao_jax.sweep.PointResult): status, steps,
    `metric` before/after (%), collapse, wall time, the error's last line."""
    rows = []
    for r in results:
        s = r.summary or {}
        before = finite(s.get("before", {}).get(metric))
        after = finite(s.get("after", {}).get(metric))
        collapse = detect_collapse(r.history, rule, error=r.error) if rule else None
        wall = finite(s.get("wall_time_s"))
        rows.append(
            [
                r.point.name,
                r.status,
                s.get("steps", "n/a"),
                "n/a" if before is None else f"{100 * before:.1f}",
                "n/a" if after is None else f"{100 * after:.1f}",
                "-" if rule is None else _fmt_collapse(collapse),
                "n/a" if wall is None else f"{wall / 60:.1f}",
                (r.error.strip().splitlines() or [""])[-1][:120],
            ]
        )
    headers = ["point", "status", "steps", f"{metric} before %", "after %", "collapse"]
    return markdown_table([*headers, "wall min", "error"], rows)
