"""The end-of-run report: workdir/report.md with PNG plots under workdir/plots/.

Input is the metric history (the records of workdir/metrics.jsonl: {"step", "time",
name: value}), an optional run summary and an optional staleness histogram. Series are
picked by name, so train and eval records of any writer fit:

  success            names whose last part contains "success" (train/success,
                     eval/greedy_success, eval/sampled_success, ...)
  reward             names whose last part contains "reward", and batch/outcome
  value loss         .../value_loss (critic_first/ = before the K critic steps)
  explained var.     .../explained_variance, .../ev_pre_update (the values before the
                     update's critic steps: the honest number), .../ev_post_update
  DIS keep-rate      .../keep_rate; per staleness bucket .../keep_rate_stale_<bucket>
  staleness          the `staleness_hist` argument, else summary["staleness_hist"], else
                     the last record's sampler/staleness_hist/<k> (cumulative counts)
  skipped updates    .../skipped_steps (cumulative), else the per-window fraction
                     `skipped` times the steps since the previous record (approximate)

Value pretraining records (sao_jax/run/value_pretrain.py: `value_pretrain/*` names, logged at
step 0 with their own counter `value_pretrain/step`) get plots of their own against that
counter (held-out and fresh-batch explained variance; value loss) and a table of every
held-out evaluation; they stay out of the other plots.

A plot whose series are all absent (or all null) is not drawn (a PNG of that name left by
an earlier report stays, unlinked: a report never deletes files). Series of one concern
share a panel: per-level series (`..._level<k>`, sao_jax/run/evaluation.py) get a panel
of their own below the overall ones, coloured by level and dashed per decoding mode;
other series get distinct colours; legends sit outside the data, right of each panel.
Figures are drawn on matplotlib's Agg canvas directly (no pyplot, never a window). The
markdown depends only on the inputs.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sao_jax.metrics import METRICS_FILE, read_jsonl
from sao_jax.report.tables import finite

REPORT_FILE = "report.md"
PLOTS_DIR = "plots"
STALENESS_HIST_PREFIX = "sampler/staleness_hist/"  # + k: trajectories taken at staleness k
MARKERS_UP_TO = 30  # series with at most this many points get markers (sparse evals)
PRETRAIN_PREFIX = "value_pretrain/"  # sao_jax.run.value_pretrain.PREFIX + "/"
PRETRAIN_STEP = PRETRAIN_PREFIX + "step"  # its step counter (value_pretrain.STEP_KEY)
PRETRAIN_HELDOUT_EV = PRETRAIN_PREFIX + "heldout/explained_variance"

Series = dict[str, tuple[list[int], list[float]]]  # name -> (steps, values)

# (summary key, label) shown first in the summary table, in this order.
SUMMARY_ROWS = (
    ("eval_success_before", "Eval success before training"),
    ("eval_success_after", "Eval success after training"),
    ("steps", "Steps"),
    ("wall_time_s", "Wall time"),
    ("machine", "Machine"),
    ("interrupted", "Interrupted"),
)
EVAL_KEYS = ("before", "after")  # summary mappings of eval metrics: a before/after table
SHOWN_ELSEWHERE = ("last_train", "staleness_hist")  # the last-values table, the histogram


def _last(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _stale_order(name: str) -> tuple[float, str]:
    """Bucket order of keep_rate_stale_<bucket>: 0, 1, 2, 3_4, 5_8, gt8."""
    bucket = name.rsplit("keep_rate_stale_", 1)[-1]
    nums = [int(n) for n in re.findall(r"\d+", bucket)]
    first = (nums[0] + 0.5 if bucket.startswith("gt") else nums[0]) if nums else math.inf
    return first, bucket


# (file stem, title, y label, name selector, sort key)
LINE_PLOTS: tuple[tuple[str, str, str, Callable[[str], bool], Callable[[str], Any]], ...] = (
    ("success", "Success rate", "success", lambda n: "success" in _last(n), str),
    ("reward", "Reward", "reward", lambda n: "reward" in _last(n) or n == "batch/outcome", str),
    ("value_loss", "Value loss", "0.5 (V - R)^2", lambda n: _last(n) == "value_loss", str),
    (
        "explained_variance",
        "Critic explained variance",
        "1 - Var(R - V) / Var(R)",
        lambda n: _last(n) in ("explained_variance", "ev_pre_update", "ev_post_update"),
        str,
    ),
    ("keep_rate", "DIS keep-rate", "kept / action tokens", lambda n: _last(n) == "keep_rate", str),
    (
        "keep_rate_staleness",
        "DIS keep-rate per staleness bucket",
        "kept / action tokens",
        lambda n: _last(n).startswith("keep_rate_stale_"),
        _stale_order,
    ),
)
# Value pretraining, against value_pretrain/step: (file stem, title, y label, names).
PRETRAIN_PLOTS = (
    (
        "value_pretrain_ev",
        "Value pretraining: explained variance",
        "1 - Var(R - V) / Var(R)",
        (
            PRETRAIN_HELDOUT_EV,
            PRETRAIN_PREFIX + "heldout/best_explained_variance",
            PRETRAIN_PREFIX + "batch/explained_variance",
        ),
    ),
    (
        "value_pretrain_loss",
        "Value pretraining: value loss",
        "0.5 (V - R)^2",
        (PRETRAIN_PREFIX + "heldout/value_loss", PRETRAIN_PREFIX + "batch/value_loss"),
    ),
)
LEVEL_SUFFIX = re.compile(r"_level(\d+)$")  # per-level series: evaluation.success_by_level
LINE_STYLES = ("-", "--", ":", "-.")


def _check_history(history: Sequence[Mapping[str, Any]]) -> None:
    for i, record in enumerate(history):
        if not (isinstance(record, Mapping) and isinstance(record.get("step"), int)):
            raise ValueError(f"history[{i}]: expected a mapping with an integer 'step'")


def collect_series(history: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Series:
    """name -> (steps, values), by step, over the records holding a finite number for it."""
    out: Series = {}
    for name in names:
        points = [(r["step"], finite(r.get(name))) for r in history]
        points = sorted(((s, v) for s, v in points if v is not None), key=lambda p: p[0])
        if points:
            out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def _names(history: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for record in history:
        seen.update(dict.fromkeys(k for k in record if k not in ("step", "time")))
    return list(seen)


def staleness_from_history(history: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """The last record's cumulative staleness histogram ({} if none was logged)."""
    for record in reversed(history):
        hist = {
            int(k.removeprefix(STALENESS_HIST_PREFIX)): int(v)
            for k, v in record.items()
            if k.startswith(STALENESS_HIST_PREFIX) and finite(v) is not None
        }
        if hist:
            return dict(sorted(hist.items()))
    return {}


def skipped_series(history: Sequence[Mapping[str, Any]]) -> Series:
    """Cumulative skipped updates: logged .../skipped_steps, else sum of skipped x window."""
    logged = collect_series(history, [n for n in _names(history) if _last(n) == "skipped_steps"])
    if logged:
        return logged
    frac = collect_series(history, ["skipped"])
    if not frac:
        return {}
    steps, values = frac["skipped"]
    total, prev, cum = 0.0, 0, []
    for s, v in zip(steps, values):
        total += v * max(s - prev, 1)
        prev = s
        cum.append(total)
    return {"skipped (approx. cumulative)": (steps, cum)}


def _new_figure(panels: int = 1) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(7.4, 3.4 * panels), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, squeeze=False)
    return fig, list(axes[:, 0])


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None}, bbox_inches="tight")


def split_levels(series: Series) -> list[tuple[str, Series]]:
    """[(panel title, series)]: the overall series, then the per-level ones
    (`<name>_level<k>`) when there are any; empty panels left out."""
    per_level = {n: v for n, v in series.items() if LEVEL_SUFFIX.search(n)}
    overall = {n: v for n, v in series.items() if n not in per_level}
    if not per_level:
        return [("", overall)]
    return [(t, s) for t, s in (("overall", overall), ("per level", per_level)) if s]


def _styles(names: Sequence[str]) -> list[dict[str, Any]]:
    """Distinct colours (tab10, tab20 beyond 10 series); per-level series: the colour of
    their level, one line style per series family (greedy, sampled, ...)."""
    levels = [LEVEL_SUFFIX.search(n) for n in names]
    if all(levels):
        keys = sorted({int(m[1]) for m in levels})
        families = list(dict.fromkeys(LEVEL_SUFFIX.sub("", n) for n in names))
        cmap = matplotlib.colormaps["tab10" if len(keys) <= 10 else "tab20"]
        return [
            dict(
                color=cmap(keys.index(int(m[1])) % cmap.N),
                linestyle=LINE_STYLES[families.index(LEVEL_SUFFIX.sub("", n)) % 4],
            )
            for n, m in zip(names, levels)
        ]
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return [dict(color=cmap(i % cmap.N), linestyle="-") for i in range(len(names))]


def plot_lines(path: Path, title: str, ylabel: str, series: Series, xlabel: str = "step") -> None:
    """One line per series against the step, one panel per `split_levels` group; markers
    on sparse series; each panel's legend right of it."""
    panels = split_levels(series)
    fig, axes = _new_figure(len(panels))
    for ax, (panel, group) in zip(axes, panels):
        for (name, (steps, values)), style in zip(group.items(), _styles(list(group))):
            marker = "o" if len(steps) <= MARKERS_UP_TO else None
            ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label=name, **style)
        ax.set(title=f"{title}: {panel}" if panel else title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    _save(fig, path)


def plot_histogram(path: Path, hist: Mapping[int, int]) -> None:
    """Bar chart of trajectories taken per staleness (learner version - sampler version)."""
    fig, (ax,) = _new_figure()
    ks = sorted(hist)
    ax.bar(ks, [hist[k] for k in ks], color="tab:blue")
    ax.set(title="Staleness of taken trajectories", xlabel="staleness (versions)", ylabel="count")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "n/a"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _fmt_duration(seconds: Any) -> str:
    s = finite(seconds)
    if s is None:
        return _fmt(seconds)
    h, rem = divmod(round(s), 3600)
    return f"{h}h {rem // 60:02d}m {rem % 60:02d}s ({s:.0f} s)"


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """A two-column markdown table: SUMMARY_ROWS first, then other keys in given order;
    mappings are flattened to "key/subkey" (EVAL_KEYS and SHOWN_ELSEWHERE left out)."""
    flat: dict[str, Any] = {}
    for k, v in summary.items():
        if k in EVAL_KEYS + SHOWN_ELSEWHERE:
            continue
        flat |= {f"{k}/{sk}": sv for sk, sv in v.items()} if isinstance(v, Mapping) else {k: v}
    labels = dict(SUMMARY_ROWS)
    keys = [k for k, _ in SUMMARY_ROWS if k in flat] + [k for k in flat if k not in labels]
    lines = ["| | |", "|---|---|"]
    for k in keys:
        value = _fmt_duration(flat[k]) if k == "wall_time_s" else _fmt(flat[k])
        lines.append(f"| {labels.get(k, k)} | {value} |")
    return lines


def pretrain_lines(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """| step | held-out EV | fresh-batch EV | held-out loss | at every held-out evaluation
    of value pretraining ([] without one)."""
    p = PRETRAIN_PREFIX
    rows = [r for r in history if finite(r.get(PRETRAIN_HELDOUT_EV)) is not None]
    if not rows:
        return []
    lines = [
        "| step | held-out EV | best so far | batch EV before the update | held-out value loss |"
        " rollouts |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            r.get(x)
            for x in (
                PRETRAIN_HELDOUT_EV,
                p + "heldout/best_explained_variance",
                p + "batch/explained_variance",
                p + "heldout/value_loss",
                p + "rollouts",
            )
        ]
        lines.append(f"| {r[PRETRAIN_STEP]} | " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines


def eval_lines(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """| metric | before | after | over the names of either evaluation, in their order."""
    lines = ["| metric | before | after |", "|---|---:|---:|"]
    for name in dict.fromkeys([*before, *after]):
        lines.append(f"| {name} | {_fmt(before.get(name))} | {_fmt(after.get(name))} |")
    return lines


def _check_staleness(hist: Mapping[Any, Any]) -> dict[int, int]:
    """k -> count with k an int >= 0 (or its digits, as in a JSON summary), count >= 0."""
    out = {}
    for k, n in hist.items():
        k_int = int(k) if isinstance(k, str) and k.isdigit() else k
        if not (isinstance(k_int, int) and k_int >= 0 and isinstance(n, int | float) and n >= 0):
            raise ValueError(f"staleness_hist: expected int k >= 0 -> count >= 0, got {k!r}: {n!r}")
        out[k_int] = n
    return dict(sorted(out.items()))


def write_report(
    workdir: str | os.PathLike,
    *,
    history: Sequence[Mapping[str, Any]] | None = None,
    summary: Mapping[str, Any] | None = None,
    staleness_hist: Mapping[int, int] | None = None,
    title: str = "SAO training report",
) -> Path:
    """Writes workdir/report.md and its PNGs (workdir/plots/); returns the report's path.

    history: metric records (default: read workdir/metrics.jsonl, which must exist).
    summary: run facts for the summary table (see SUMMARY_ROWS; wall_time_s in seconds);
      "before" / "after" eval metric mappings make a comparison table.
    staleness_hist: staleness k -> count (default: summary["staleness_hist"], else the
      history's last logged histogram).
    """
    workdir = Path(workdir)
    if history is None:
        path = workdir / METRICS_FILE
        if not path.exists():
            raise FileNotFoundError(f"write_report: no history given and {path} does not exist")
        history = read_jsonl(path)
    _check_history(history)
    pretrain = [r for r in history if isinstance(r.get(PRETRAIN_STEP), int)]
    history = [r for r in history if PRETRAIN_STEP not in r]
    plots_dir = workdir / PLOTS_DIR
    plots_dir.mkdir(parents=True, exist_ok=True)
    names = [n for n in _names(history) if not n.startswith(PRETRAIN_PREFIX)]
    drawn: list[tuple[str, str]] = []  # (title, relative png path)
    last_values: list[tuple[str, int, float]] = []

    def emit(stem: str, title: str, draw: Callable[[Path], None]) -> None:
        draw(plots_dir / f"{stem}.png")
        drawn.append((title, f"{PLOTS_DIR}/{stem}.png"))

    for stem, plot_title, ylabel, select, order in LINE_PLOTS:
        series = collect_series(history, sorted((n for n in names if select(n)), key=order))
        if series:
            emit(
                stem, plot_title, lambda p, s=series, t=plot_title, y=ylabel: plot_lines(p, t, y, s)
            )
            last_values += [(n, st[-1], v[-1]) for n, (st, v) in series.items()]
    as_steps = [{**r, "step": r[PRETRAIN_STEP]} for r in pretrain]
    for stem, plot_title, ylabel, wanted in PRETRAIN_PLOTS:
        series = collect_series(as_steps, wanted)
        if series:
            draw = lambda p, s=series, t=plot_title, y=ylabel: plot_lines(
                p, t, y, s, xlabel="value pretraining step"
            )
            emit(stem, plot_title, draw)
    summary = summary or {}
    given = staleness_hist if staleness_hist is not None else summary.get("staleness_hist")
    hist = _check_staleness(given) if given else staleness_from_history(history)
    if hist:
        emit("staleness_hist", "Staleness histogram", lambda p: plot_histogram(p, hist))
    skipped = skipped_series(history)
    if skipped:
        title_sk = "Skipped updates (non-finite loss or gradient)"
        emit("skipped", title_sk, lambda p: plot_lines(p, title_sk, "cumulative count", skipped))

    lines = [f"# {title}", ""]
    if summary:
        lines += ["## Summary", "", *summary_lines(summary), ""]
    evals = [summary.get(k) or {} for k in EVAL_KEYS]
    if any(evals):
        lines += ["## Evaluation before and after training", "", *eval_lines(*evals), ""]
    table = pretrain_lines(pretrain)
    if table:
        lines += ["## Value pretraining (held-out rollouts, never trained on)", "", *table, ""]
    lines += ["## Last logged values", ""]
    if last_values:
        lines += ["| metric | step | value |", "|---|---:|---:|"]
        lines += [f"| {n} | {s} | {_fmt(v)} |" for n, s, v in last_values]
    else:
        lines.append("No metrics logged." if not history else "No plotted series.")
    lines += ["", "## Plots", ""]
    for plot_title, rel in drawn:
        lines += [f"### {plot_title}", "", f"![{plot_title}]({rel})", ""]
    if not drawn:
        lines += ["No series to plot.", ""]
    out = workdir / REPORT_FILE
    out.write_text("\n".join(lines), encoding="utf-8")
    return out
