"""The report of the observation-signal experiment (experiments/observation_signal/):
per task, observation-skipping (SAO) vs cross-observation GAE paired by seed, and the
critic's value change across observations (sao_jax/rl/value_jumps.py) per task and row.

The experiment is one sweep per task, each named by its task (configs/observation_signal.py
`sweeps`), with the rows REFERENCE and ROW. The family of the Holm adjustment is the
table's differences, one per task: ROW minus REFERENCE in held-out sampled success at
the last budget."""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence

import numpy as np
from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations import report as table

from sao_jax import sweep
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment, failures

METRIC = table.METRIC  # held-out sampled success (pass@1, T = 1)
# The rows of configs/observation_signal.py; the difference is ROW - REFERENCE.
REFERENCE, ROW = ROWS = ("sao", "cross_observation")
TASK_LABELS = {
    "code": "code with hidden tests (code_feedback): the observation decides",
    "levels": "graded calculator (arithmetic_levels): results follow from the call",
}
ROW_LABELS = {"sao": "SAO (obs-skipping GAE)", "cross_observation": "cross-observation GAE"}
JUMP_SQ, RETURN_VAR = "obs/value_jump_sq", "obs/return_var"
# (column, metric, scale, digits): the critic's value change across observation spans.
JUMPS = (
    ("mean dV", "obs/value_jump"),
    ("mean dV, rows that succeed", "obs/value_jump_success"),
    ("mean dV, rows that fail", "obs/value_jump_failure"),
    ("mean abs(dV)", "obs/value_jump_abs"),
    ("spans per trajectory", "obs/spans"),
    ("critic EV, pre-update", "critic/ev_pre_update"),
)


def by_task_row(
    specs: Sequence[sweep.SweepSpec], results: Sequence[sweep.PointResult]
) -> dict[str, dict[str, list[sweep.PointResult]]]:
    """{task: {row: results}}, tasks in the order of `specs` (a point's task: the name of
    the sweep of its config file)."""
    task_of = {s.config: s.name for s in specs}
    out = {s.name: collections.defaultdict(list) for s in specs}
    for r in results:
        out[task_of[r.point.config]][r.point.variant].append(r)
    return {t: dict(rows) for t, rows in out.items()}


def run_share(history) -> float | None:
    """A run's share of the return's variance at observations: the mean over its logged
    records of `obs/value_jump_sq` over the mean of `obs/return_var` (the ratio of the
    run's pooled numerator and denominator, sao_jax/rl/value_jumps.py); None if unlogged
    or Var(G) was 0."""
    _, sq = tables.series(history, JUMP_SQ)
    _, var = tables.series(history, RETURN_VAR)
    if not sq.size or not var.size or np.mean(var) <= 0:
        return None
    return float(np.mean(sq) / np.mean(var))


def shares_by_seed(rs: Sequence[sweep.PointResult]) -> dict[int, float]:
    return {r.point.seed: s for r in rs if (s := run_share(r.history)) is not None}


def task_differences(
    grouped: Mapping[str, Mapping[str, Sequence[sweep.PointResult]]], step: int
) -> dict[str, compare.Difference]:
    """Per task, ROW - REFERENCE in held-out sampled success at `step`, paired by seed."""
    return {
        task: compare.paired_difference(
            table.final_by_seed(rows.get(ROW, []), METRIC, step),
            table.final_by_seed(rows.get(REFERENCE, []), METRIC, step),
        )
        for task, rows in grouped.items()
    }


def report(exp: Experiment, specs: Sequence[sweep.SweepSpec], results, wall_s: float) -> str:
    """Markdown and plots of both tasks' sweeps."""
    grouped = by_task_row(specs, results)
    steps = table.eval_steps(specs[0])
    last = steps[-1]
    diffs = task_differences(grouped, last)
    holm = compare.holm_family(diffs)
    text = exp.header(
        "Does skipping observations lose signal when the observation is the signal?",
        specs[0],
        results,
        wall_s,
    )
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    text += "\n" + success_text(grouped, steps, diffs, holm, instead)
    text += "\n" + jumps_text(grouped, instead)
    text += "\n" + design_text(diffs, specs[0])
    text += "\n" + table.definitions_text(
        f"budgets: evaluations at steps {', '.join(map(str, [0, *steps]))}."
    )
    text += _plots(exp, grouped)
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, METRIC)
    return text


def success_text(grouped, steps, diffs, holm, instead: str = "") -> str:
    last = steps[-1]
    headers = ["task", "row", "runs", *(f"success % @{s}" for s in (0, *steps))]
    headers += [f"greedy % @{last}", f"Δ {ROW_LABELS[ROW]} - SAO @{last} (paired, ± SE [95% CI])"]
    headers += [f"test (Holm over {len(diffs)} tasks)", "verdict", compare.MDD_HEADER]
    body = []
    for task in grouped:
        rows = grouped.get(task, {})
        warm = table.sft_by_seed([r for rs in rows.values() for r in rs])
        for row in ROWS:
            rs = rows.get(row, [])
            done = sum(r.status == "done" for r in rs)
            cells = [compare.fmt_mean_se(list(warm.values()))] if warm else ["n/a"]
            cells += [
                compare.fmt_mean_se([tables.value_at(r.history, METRIC, s) for r in rs])
                for s in steps
            ]
            greedy = [tables.value_at(r.history, table.GREEDY, last) for r in rs]
            line = [task, ROW_LABELS[row], f"{done}/{len(rs)}", *cells]
            line.append(compare.fmt_mean_se(greedy))
            if row == REFERENCE or task not in diffs:
                line += ["(reference)" if row == REFERENCE else "n/a", "-", "-", "-"]
            else:
                d = diffs[task]
                line += [compare.fmt_difference(d), instead or compare.fmt_test(d, holm[task])]
                line.append(instead or compare.verdict(d, holm[task]))
                line.append(compare.fmt_mdd(d, len(diffs)))
            body.append(line)
    lines = ["## Held-out success, per task", "", tables.markdown_table(headers, body)]
    lines.append(
        "- tasks: " + "; ".join(f"`{t}` = {TASK_LABELS.get(t, t)}" for t in grouped) + ". "
        "success % @0 is each seed's shared warm start (SFT), before RL."
    )
    return "\n".join(lines) + "\n"


def jumps_text(grouped, instead: str = "") -> str:
    """Per task and row: the critic's value change across observation spans and the share
    of the return's variance it explains; then the share's difference between tasks."""
    headers = ["task", "row", *(c for c, _ in JUMPS), "share of Var(G) at observations"]
    body, share_of = [], {}
    for task in grouped:
        for row in ROWS:
            rs = [r for r in grouped.get(task, {}).get(row, []) if r.status in ("done", "failed")]
            shares = shares_by_seed(rs)
            share_of[(task, row)] = shares
            line = [task, ROW_LABELS[row]]
            line += [table.fmt_run_means(rs, m, scale=1.0, digits=3) for _, m in JUMPS]
            line.append(compare.fmt_mean_se(list(shares.values()), scale=1.0, digits=3))
            body.append(line)
    first, second = [*grouped, "-", "-"][:2]
    d = welch_difference(
        list(share_of.get((first, REFERENCE), {}).values()),
        list(share_of.get((second, REFERENCE), {}).values()),
    )
    lines = [
        "## The critic's value change across observations",
        "",
        tables.markdown_table(headers, body),
        "- dV = V(first action token after an observation span) - V(last action token "
        "before it), from the critic's values before each update's critic steps (values "
        "it has not trained on), averaged over the spans of each logged batch; each cell "
        "is the mean ± SE over seeds of the run's mean over its logged steps, with the "
        "lowest single logged value in brackets (sao_jax/rl/value_jumps.py).",
        "- share of Var(G) at observations: per run, mean(sum over a trajectory's spans of "
        "dV^2) / Var(G) over its logged batches, G the trajectory's return; for an exact "
        "critic (values a martingale) it is the part of the return's variance resolved by "
        "what the environment wrote, the rest resolved by the prompt (the first value) and "
        "the model's own tokens; critic noise inflates it. Mean ± SE over seeds.",
        f"- share, {first} - {second} (SAO rows, Welch, not paired: the tasks' warm starts "
        f"differ): {compare.fmt_difference(d, scale=1.0, digits=3)}, "
        f"{instead or compare.fmt_test(d)} (secondary, outside the Holm family).",
    ]
    return "\n".join(lines) + "\n"


def welch_df(se1: float, n1: int, se2: float, n2: int) -> float:
    """Welch-Satterthwaite degrees of freedom of a difference of two independent means
    with standard errors se1, se2 over n1, n2 values."""
    if n1 < 2 or n2 < 2:
        return math.nan
    num = (se1**2 + se2**2) ** 2
    den = se1**4 / (n1 - 1) + se2**4 / (n2 - 1)
    return num / den if den > 0 else math.nan


def welch_difference(row: Sequence[float], ref: Sequence[float]) -> compare.Difference:
    """Unpaired (the tasks' warm starts differ): mean(row) - mean(ref), SE =
    sqrt(SE_row^2 + SE_ref^2) on Welch's degrees of freedom."""
    m1, s1, n1 = compare.mean_se(row)
    m0, s0, n0 = compare.mean_se(ref)
    df = welch_df(s1, n1, s0, n0)
    return compare.Difference(m1 - m0, math.sqrt(s1**2 + s0**2), min(n1, n0), False, df)


def design_text(diffs: Mapping[str, compare.Difference], spec: sweep.SweepSpec) -> str:
    lines = [
        "## What this design can detect",
        "",
        f"- {len(spec.seeds)} seeds; each run is scored on {spec.fixed.get('env.eval_size')} "
        "held-out prompts (one sampled rollout each). Within a task, both rows of a seed "
        "share the warm start (SFT policy and value-pretrained critic), the prompt stream, "
        "the held-out prompts and the sampling keys, so each difference is paired by seed "
        "and read with Student's t on n - 1 degrees of freedom (95% interval, two-sided p).",
        f"- The family: the {len(diffs)} differences of the table (cross-observation minus "
        "SAO, one per task); each p is Holm-adjusted over them, and a verdict says "
        f"'higher'/'lower' only at Holm p < {compare.ALPHA:g}.",
        "- With lambda = 1 (the critic's targets, rl.lam_critic) both GAEs give the same "
        "returns: the rows train their critics alike and differ in the policy advantages "
        "only, where cross-observation GAE discounts what follows an observation by "
        "(gamma lambda)^(observation length) more and reads the critic's values on "
        "observation tokens, which no loss trains.",
    ]
    return "\n".join(lines) + "\n" + compare.MDD_NOTE


def _plots(exp: Experiment, grouped) -> str:
    paths = [
        plots.mean_curves(
            exp,
            f"observation_signal_{task}_success",
            f"Held-out success (sampled), {task}",
            "success",
            METRIC,
            {ROW_LABELS[row]: rows.get(row, []) for row in ROWS},
        )
        for task, rows in grouped.items()
    ]
    bars = {}
    for task in grouped:
        for row in ROWS:
            shares = shares_by_seed(grouped.get(task, {}).get(row, []))
            m, se, _ = compare.mean_se(list(shares.values()))
            bars[f"{task}: {ROW_LABELS[row]}"] = (m, 0.0 if se != se else se)
    path = exp.plot_path("observation_signal_variance_share")
    plots.plot_bars(path, "Share of Var(G) at observations (mean ± SE)", "share", bars)
    return plots.plots_text([*paths, path])
