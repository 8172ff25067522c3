"""When a run collapsed, and the table of every run that shows it.

The ablation table's collapse column (the paper reports where its baselines collapse);
the staleness, mask-budget and learning-rate tables read the same rule, and every table
report ends with `points_table`. Collapse (`detect_collapse`, docs/experiments.md), the
earliest of:
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from sao_jax.report.tables import History, finite, markdown_table, series


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
