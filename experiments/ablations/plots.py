"""The table reports' plots: mean ± std curves over a row's runs, bars with error bars,
and the '## Plots' section that links them, drawn on matplotlib's Agg canvas (no pyplot,
never a window). The ablation report draws both kinds; the other table reports draw
theirs with these.
"""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sao_jax.report.experiment import Experiment
from sao_jax.report.tables import History, series

Curve = tuple[np.ndarray, np.ndarray, np.ndarray]  # steps [S], mean [S], std [S]


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


def mean_curves(
    exp: Experiment, name: str, title: str, ylabel: str, metric: str, rows: dict[str, Sequence]
) -> pathlib.Path:
    """<out>/plots/<name>.png: `metric`'s mean ± std curve over each row's runs."""
    curves = {k: mean_curve([r.history for r in rs], metric) for k, rs in rows.items()}
    path = exp.plot_path(name)
    plot_curves(path, title, ylabel, curves)
    return path


def plot_bars(
    path: str | pathlib.Path,
    title: str,
    ylabel: str,
    bars: Mapping[str, tuple[float, float]],
    *,
    reference: Mapping[str, float] | None = None,
    reference_label: str = "paper",
) -> None:
    """One bar (mean, std error bar) per row; optional reference markers (paper numbers)."""
    labels = list(bars)
    fig, ax = figure(max(6.4, 0.9 * len(labels)), 3.8)
    x = np.arange(len(labels))
    means = [bars[k][0] for k in labels]
    stds = [bars[k][1] for k in labels]
    ax.bar(x, means, yerr=stds, capsize=3, color="tab:blue", alpha=0.8, label="ours")
    if reference:
        ref = [(i, reference[k]) for i, k in enumerate(labels) if k in reference]
        if ref:
            ax.scatter(*zip(*ref), marker="_", s=300, color="tab:red", label=reference_label)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize="small")
    ax.set(title=title, ylabel=ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})


def plots_text(paths) -> str:
    """The report's '## Plots' section: a link to each PNG under plots/."""
    return "\n## Plots\n\n" + "".join(f"![{p.stem}](plots/{p.name})\n" for p in paths)
