"""The report of the stale-critic correction (experiments/critic_correction/): BRACE-style
critic targets (row `sao_brace`, rl.critic_target = 'brace', docs/method.md section 8)
against SAO's lambda = 1 targets (row `sao`), paired by seed, in every cell of the
staleness grid (max staleness S x policy lr on the graded task: configs/ablations.py's
`brace_staleness` sweep) and on the per-user online task (configs/online_shift.py's
`brace` table). A point's cell: (S, lr) from its grid overrides; the online task's
points have none (`ONLINE`).

Per run:
  EV          mean over its log records of `critic/ev_pre_update`: the critic's explained
              variance of the Monte-Carlo returns of each fresh batch, from its values
              before that batch's critic steps (values it never trained on), in %
  EV, stale   the same over the records whose batch lagged at least HIGH_LAG policy
              versions on average (`train/staleness`): none at S = 0, nor where the lag
              stays lower (the online task's one batch of queue)
  success     graded task: held-out sampled success after the last step (the summary's
              `after`); online task: recovering success, the lines judged in their user's
              first steps after a switch (experiments/online_shift/report.py `pooled`)
  keep rate, staleness, target shift   run means of `policy/keep_rate` (the DIS band),
              `train/staleness` (mean lag of the trained tokens), `critic/target_shift`
              (BRACE's target minus the Monte-Carlo return; not logged by lambda targets)
  s / step    RL wall time per step: the median over consecutive training log records of
              (time difference) / (step difference), so start-up and compilation (before
              the first record) and pauses (a resume, an evaluation) do not count

Differences `ROW` - `REFERENCE`, paired by seed (shared warm start, critic pretraining,
prompt stream and sampling keys), Student t on n - 1 df. Two Holm families over the
table's cells (every S x lr cell and the online task): critic EV, and success, separately.
The stale-step EV, keep-rate and staleness differences are descriptive (unadjusted p).
Step time: per seed the log of the ratio ROW / REFERENCE, its mean and t interval,
exponentiated (a geometric-mean ratio), per cell and over every pair of the table.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations import report as table
from sao_jax.experiments.online_shift import report as user_shift

from sao_jax import sweep
from sao_jax.report import compare, stats, tables
from sao_jax.report.experiment import Experiment, failures

REFERENCE, ROW = ROWS = ("sao", "sao_brace")  # lambda = 1 targets, BRACE-style targets
LABELS = {"sao": "lambda = 1 targets (SAO)", "sao_brace": "BRACE-style targets"}
METRIC = table.METRIC  # held-out sampled success (graded task)
EV = "critic/ev_pre_update"
LAG = "train/staleness"  # mean policy-version lag of the batch's action tokens
KEEP = "policy/keep_rate"
SHIFT = "critic/target_shift"
TIME = "time"  # every log record's wall-clock time (sao_jax/metrics.py JsonlWriter)
HIGH_LAG = 4.0  # a record is 'stale' at this mean lag or more: half the grid's S = 8
NO_COST_MARGIN = 0.05  # 'does not cost success': the 95% interval's low end above -5 points
STALENESS_FIELD, LR_FIELD = "sampling.max_staleness", "optim.policy.lr"
ONLINE = ("online",)  # the online task's cell

Cell = tuple[Any, ...]  # (S, lr) on the graded task; ONLINE on the online task
History = Sequence[Mapping[str, Any]]
BySeed = dict[int, float | None]


def cell_of(point: sweep.Point) -> Cell:
    """(max staleness, policy lr) of a staleness-grid point; ONLINE for the online task."""
    ov = dict(point.overrides)
    if STALENESS_FIELD in ov:
        return (ov[STALENESS_FIELD], ov[LR_FIELD])
    return ONLINE


def cell_label(cell: Cell) -> str:
    if cell == ONLINE:
        return "online task (per-user shift)"
    s, lr = cell
    return f"S={s}{' (sync)' if s == 0 else ''}, lr {lr:g}"


# --------------------------------------------------------------------------- per run


def run_mean(history: History, name: str) -> float | None:
    """Mean of `name` over the run's log records (None if never logged)."""
    _, v = tables.series(history, name)
    return float(np.mean(v)) if v.size else None


def stale_mean(history: History, name: str, high: float = HIGH_LAG) -> float | None:
    """Mean of `name` over the log records whose mean lag `train/staleness` >= `high`
    (None if there is none)."""
    lag_steps, lags = tables.series(history, LAG)
    stale = {int(s) for s, lag in zip(lag_steps, lags, strict=True) if lag >= high}
    steps, v = tables.series(history, name)
    picked = [x for s, x in zip(steps, v, strict=True) if int(s) in stale]
    return float(np.mean(picked)) if picked else None


def step_seconds(history: History) -> float | None:
    """Median RL wall seconds per step over consecutive training log records (those with
    `train/staleness`; the last record of a step wins); None with fewer than two."""
    times = {}
    for rec in history:
        if tables.finite(rec.get(LAG)) is not None and tables.finite(rec.get(TIME)) is not None:
            times[int(rec["step"])] = float(rec[TIME])
    steps = sorted(times)
    rates = [(times[b] - times[a]) / (b - a) for a, b in itertools.pairwise(steps)]
    return float(np.median(rates)) if rates else None


def run_success(r: sweep.PointResult) -> float | None:
    """Graded task: held-out sampled success after the last step; online task: pooled
    recovering success."""
    if cell_of(r.point) == ONLINE:
        return user_shift.pooled(r.history, user_shift.PRIMARY)
    return tables.finite(((r.summary or {}).get("after") or {}).get(METRIC))


MEASURES: dict[str, Callable[[sweep.PointResult], float | None]] = {
    "ev": lambda r: run_mean(r.history, EV),
    "ev_stale": lambda r: stale_mean(r.history, EV),
    "success": run_success,
    "keep": lambda r: run_mean(r.history, KEEP),
    "lag": lambda r: run_mean(r.history, LAG),
    "shift": lambda r: run_mean(r.history, SHIFT),
    "seconds": lambda r: step_seconds(r.history),
}


# --------------------------------------------------------------------------- per cell


def by_cell_row(
    results: Sequence[sweep.PointResult],
) -> dict[Cell, dict[str, list[sweep.PointResult]]]:
    """{cell: {row: results}}: the graded cells by S then lr, the online task last."""
    out: dict[Cell, dict[str, list]] = collections.defaultdict(lambda: {v: [] for v in ROWS})
    for r in results:
        if r.point.variant in ROWS:
            out[cell_of(r.point)][r.point.variant].append(r)
    order = sorted((c for c in out if c != ONLINE), key=lambda c: (c[0], c[1]))
    return {c: out[c] for c in [*order, *([ONLINE] if ONLINE in out else [])]}


def seed_values(rs: Sequence[sweep.PointResult]) -> dict[str, BySeed]:
    """{measure: {seed: value}} over a row's finished runs."""
    done = [r for r in rs if r.status == "done"]
    return {m: {r.point.seed: fn(r) for r in done} for m, fn in MEASURES.items()}


def differences(values, measure: str) -> dict[Cell, compare.Difference]:
    """{cell: ROW - REFERENCE in `measure`, paired by seed}."""
    return {
        c: compare.paired_difference(v[ROW][measure], v[REFERENCE][measure])
        for c, v in values.items()
    }


def _logs(by_seed: Mapping[Any, float | None]) -> dict[Any, float]:
    return {s: math.log(x) for s, x in by_seed.items() if tables.finite(x) and x > 0}


def time_ratio(row: Mapping[Any, float | None], ref: Mapping[Any, float | None]):
    """log(ROW / REFERENCE) step time, paired: a Difference of logs (exp: the ratio)."""
    return compare.paired_difference(_logs(row), _logs(ref))


def pooled_time_ratio(values) -> compare.Difference:
    """`time_ratio` over every (cell, seed) pair of the table."""
    row, ref = {}, {}
    for i, v in enumerate(values.values()):
        row.update({(i, s): x for s, x in v[ROW]["seconds"].items()})
        ref.update({(i, s): x for s, x in v[REFERENCE]["seconds"].items()})
    return time_ratio(row, ref)


def fmt_ratio(d: compare.Difference) -> str:
    """'1.082 [1.010, 1.160] (n=5)': exp of a mean log ratio and of its 95% t interval."""
    if d.n == 0 or not math.isfinite(d.diff):
        return "n/a"
    if not math.isfinite(d.se):
        return f"{math.exp(d.diff):.3f} (n={d.n}, no interval)"
    lo, hi = d.interval()
    return f"{math.exp(d.diff):.3f} [{math.exp(lo):.3f}, {math.exp(hi):.3f}] (n={d.n})"


def success_reading(d: compare.Difference, holm_p: float) -> str:
    """The pre-registered reading of a success difference: it costs success (Holm p <
    ALPHA, lower), it does not (the 95% interval's low end above -NO_COST_MARGIN), or
    undecided."""
    if d.n < 2 or not math.isfinite(d.se):
        return "not decidable (fewer than 2 paired seeds)"
    lo, _ = d.interval()
    if holm_p < compare.ALPHA and d.diff < 0:
        return f"costs success (Holm p {compare.fmt_p(holm_p)})"
    if lo > -NO_COST_MARGIN:
        return f"does not cost success (95% low end {100 * lo:+.1f} > {-100 * NO_COST_MARGIN:g})"
    return f"undecided (95% low end {100 * lo:+.1f} <= {-100 * NO_COST_MARGIN:g})"


def holm_over_cells(diffs: Mapping[Cell, compare.Difference]) -> dict[Cell, float]:
    """Holm-adjusted p of each cell over every cell that ran (the pre-registered family,
    results/critic_correction/PREREGISTRATION.md): a cell whose pairs are identical (SE 0,
    no p) stays in the family as not rejected (p 1) rather than dropping out, so the others
    are adjusted over all cells; its own adjusted p stays NaN (no test)."""
    ran = {c: d.p if math.isfinite(d.p) else 1.0 for c, d in diffs.items() if d.n > 1}
    holm = stats.holm(ran)
    return {c: holm[c] if math.isfinite(diffs[c].p) and c in holm else math.nan for c in diffs}


# --------------------------------------------------------------------------- report


def report(exp: Experiment, specs: Sequence[sweep.SweepSpec], results, wall_s: float) -> str:
    """Markdown and plots of both sweeps (the graded task's grid, the online task)."""
    grouped = by_cell_row(results)
    values = {c: {v: seed_values(rs.get(v, [])) for v in ROWS} for c, rs in grouped.items()}
    ev, success = differences(values, "ev"), differences(values, "success")
    ev_holm, success_holm = holm_over_cells(ev), holm_over_cells(success)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    text = exp.header(
        "A stale-critic correction: BRACE-style vs lambda = 1 critic targets",
        specs[0],
        results,
        wall_s,
    )
    text += "\n" + rows_text(grouped, values)
    text += "\n" + ev_text(values, ev, ev_holm, instead)
    text += "\n" + success_text(success, success_holm, instead)
    text += "\n" + cost_text(values)
    text += "\n" + (
        f"## Reading\n\n- {instead}: no reading of the pre-registered tests.\n"
        if instead
        else reading_text(ev, ev_holm, success, success_holm)
    )
    text += "\n" + design_text(specs)
    text += _plots(exp, grouped)
    text += failures(results)
    graded = [r for r in results if cell_of(r.point) != ONLINE]
    online = [r for r in results if cell_of(r.point) == ONLINE]
    if graded:
        text += "\n## Every run, graded task\n\n" + collapse.points_table(graded, METRIC)
    if online:
        text += "\n## Every run, online task\n\n" + collapse.points_table(online, METRIC, rule=None)
    return text


def rows_text(grouped, values) -> str:
    headers = [
        "cell",
        "row",
        "runs",
        "critic EV % (run mean)",
        f"critic EV %, records at lag >= {HIGH_LAG:g}",
        "success %",
        "DIS keep rate %",
        "mean staleness",
        "target shift (BRACE - MC return)",
        "s / RL step (median)",
    ]
    body = []
    for c, rows in grouped.items():
        for v in ROWS:
            vals = values[c][v]
            n_done = sum(r.status == "done" for r in rows[v])
            stale_runs = sum(x is not None for x in vals["ev_stale"].values())
            body.append(
                [
                    cell_label(c),
                    LABELS[v],
                    f"{n_done}/{len(rows[v])}",
                    compare.fmt_mean_se(list(vals["ev"].values())),
                    compare.fmt_mean_se(list(vals["ev_stale"].values()))
                    + ("" if stale_runs else " (no such records)"),
                    compare.fmt_mean_se(list(vals["success"].values())),
                    compare.fmt_mean_se(list(vals["keep"].values()), digits=2),
                    compare.fmt_mean_se(list(vals["lag"].values()), scale=1.0, digits=2),
                    compare.fmt_mean_se(list(vals["shift"].values()), scale=1.0, digits=3),
                    compare.fmt_mean_se(list(vals["seconds"].values()), scale=1.0, digits=2),
                ]
            )
    return (
        "## Per cell and row\n\n"
        + tables.markdown_table(headers, body)
        + "\n- Each cell: mean ± SE over seeds of a per-run number (finished runs). success: "
        "held-out sampled success after the last step on the graded task (pass@1, T = 1); "
        "recovering success (lines judged in their user's first steps after a switch, "
        "pooled) on the online task. Critic EV: the explained variance of each fresh "
        "batch's Monte-Carlo returns by the critic's values before its update on that "
        "batch, in %, averaged over the run's log records (or over those whose batch "
        f"lagged >= {HIGH_LAG:g} policy versions on average). '-' or n/a: not logged (lambda "
        "targets log no target shift).\n"
    )


def family_table(what: str, diffs, holm, extra, instead: str = "") -> str:
    """One Holm family's table: per cell the difference, its test, verdict and MDD, then
    the `extra` columns (((header, fn(cell) -> text), a test?), ...); `instead` (a pilot's or an
    incomplete table's reading, Experiment.withheld) in place of each test and verdict."""
    headers = [
        "cell",
        f"Δ {what}, points ± SE [95% CI]",
        f"test (Holm over {len(diffs)} cells)",  # identical pairs count (holm_over_cells)
        "verdict",
        compare.MDD_HEADER,
        *(h for (h, _), _ in extra),
    ]
    body = [
        [
            cell_label(c),
            compare.fmt_difference(d),
            instead or compare.fmt_test(d, holm[c]),
            instead or compare.verdict(d, holm[c]),
            compare.fmt_mdd(d, len(diffs)),
            *(instead or fn(c) if tested else fn(c) for (_, fn), tested in extra),
        ]
        for c, d in diffs.items()
    ]
    return tables.markdown_table(headers, body)


def ev_text(values, ev, ev_holm, instead: str = "") -> str:
    stale = differences(values, "ev_stale")
    extra = (
        (
            (
                f"Δ critic EV, points, records at lag >= {HIGH_LAG:g} ± SE [95% CI]",
                lambda c: compare.fmt_difference(stale[c]),
            ),
            False,
        ),
        (("test (unadjusted)", lambda c: compare.fmt_test(stale[c])), True),
    )
    return (
        "## Critic EV: BRACE - lambda, paired by seed (primary family)\n\n"
        + family_table("critic EV (run mean)", ev, ev_holm, extra, instead)
        + f"\n- The EV family: these {len(ev)} differences (BRACE minus lambda targets in the "
        "run-mean critic EV, one per cell), Holm-adjusted together; a verdict says "
        f"'higher'/'lower' only at Holm p < {compare.ALPHA:g}. The stale-record columns are "
        "descriptive (unadjusted), over the records each run has at that lag.\n"
    )


def success_text(success, success_holm, instead: str = "") -> str:
    reading = lambda c: success_reading(success[c], success_holm[c])
    extra = ((("does BRACE cost success?", reading), True),)
    return (
        "## Success: BRACE - lambda, paired by seed (second family)\n\n"
        + family_table("success", success, success_holm, extra, instead)
        + f"\n- The success family: these {len(success)} differences, Holm-adjusted "
        "together, apart from the EV family (a cell whose pairs are identical, SE 0, has no "
        "test and counts as not rejected). 'costs success': lower at Holm p < "
        f"{compare.ALPHA:g}; 'does not cost success': the 95% t interval's low end above "
        f"-{100 * NO_COST_MARGIN:g} points (fixed before the runs); otherwise undecided.\n"
    )


def cost_text(values) -> str:
    keep, lag = differences(values, "keep"), differences(values, "lag")
    headers = [
        "cell",
        "Δ DIS keep rate, points ± SE [95% CI]",
        "Δ mean staleness, versions ± SE [95% CI]",
        "step time BRACE / lambda [95% CI]",
    ]
    body = [
        [
            cell_label(c),
            compare.fmt_difference(keep[c], digits=2),
            compare.fmt_difference(lag[c], scale=1.0, digits=2),
            fmt_ratio(time_ratio(v[ROW]["seconds"], v[REFERENCE]["seconds"])),
        ]
        for c, v in values.items()
    ]
    pooled = pooled_time_ratio(values)
    return (
        "## Mechanism and cost\n\n"
        + tables.markdown_table(headers, body)
        + "\n- Step time: per seed the ratio of the two runs' median RL wall time per step "
        "(consecutive training log records; start-up, compilation and pauses excluded), "
        "as a geometric mean with its 95% t interval over seeds. Over every pair of the "
        f"table: {fmt_ratio(pooled)}. **Measured on a shared CPU and noisy**: the runs of a "
        "pair do not run at the same time, other jobs load the machine differently, and "
        "the learner shares the cores with the asynchronous sampler (BRACE adds one policy "
        "forward per update, docs/method.md section 8). Keep rate and staleness: "
        "descriptive, unadjusted.\n"
    )


def reading_text(ev, ev_holm, success, success_holm) -> str:
    """The pre-registered reading (results/critic_correction/PREREGISTRATION.md): per
    stale cell, does BRACE raise the critic's EV, and does it cost success."""
    lines = ["## Reading (pre-registered)", ""]
    stale = [c for c in ev if c != ONLINE and c[0] > 0]
    for c in stale:
        d, p = ev[c], ev_holm[c]
        if d.n < 2 or not math.isfinite(d.se):
            said = "not decidable (fewer than 2 paired seeds)"
        elif p < compare.ALPHA:
            said = f"{'raises' if d.diff > 0 else 'lowers'} critic EV ({compare.fmt_test(d, p)})"
        else:
            said = (
                f"no EV difference shown ({compare.fmt_test(d, p)}; detectable with 80% "
                f"power: {100 * d.mdd:.1f} points)"
            )
        reading = success_reading(success[c], success_holm[c])
        lines.append(f"- {cell_label(c)}: BRACE {said}; success: {reading}.")
    if not stale:
        lines.append("- No cell with staleness ran: the hypotheses are not decidable.")
    controls = [cell_label(c) for c in ev if c == ONLINE or c[0] == 0]
    if controls:
        lines.append(
            f"- {'; '.join(controls)}: controls, in the same families (at S = 0 the ratios "
            "BRACE corrects are 1 up to rounding, so its targets are the lambda = 1 returns; "
            "the online task runs at its own low staleness)."
        )
    return "\n".join(lines) + "\n"


def design_text(specs: Sequence[sweep.SweepSpec]) -> str:
    lines = [
        "## What this design can detect",
        "",
        "- Seeds: "
        + "; ".join(f"{s.name} {', '.join(map(str, s.seeds))}" for s in specs)
        + ". Both rows of a seed share the warm start (SFT policy and value-pretrained "
        "critic: rl.critic_target is not a pretraining field), the prompt stream, the "
        "held-out prompts and the sampling keys; each difference is paired by seed, Student "
        "t on n - 1 df (95% interval, two-sided p).",
    ]
    return "\n".join(lines) + "\n" + compare.MDD_NOTE


def _plots(exp: Experiment, grouped) -> str:
    return plots.plots_text(
        plots.mean_curves(
            exp,
            f"critic_correction_ev_{'online' if c == ONLINE else f'S{c[0]}_lr{c[1]:.0e}'}",
            f"Critic EV before its update, {cell_label(c)}",
            "EV",
            EV,
            {LABELS[v]: rows[v] for v in ROWS if rows[v]},
        )
        for c, rows in grouped.items()
    )
