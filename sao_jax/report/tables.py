"""Reading sweep results: finite values, metric series and markdown tables.

Inputs are metric histories (the records of a run's metrics.jsonl: {"step", name: value})
and summaries (summary.json). Everything here is plain host-side Python and numpy, so
experiment scripts stay thin; their plots and the collapse rule are their reading
(experiments/ablations/plots.py, experiments/ablations/collapse.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

History = Sequence[Mapping[str, Any]]


def finite(value: Any) -> float | None:
    """A finite float, or None (null, NaN, text, bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


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
