"""The report of the ablation tables (Table 4, Table 5): held-out success per row and
budget, each row's paired difference from SAO with what the design can detect, whether
each row's mechanism fires, the paper's ordering beside ours, plots.
experiments/ablations/ and experiments/gae_granularity/ write it; the other table
scripts share its pieces (`by_row`, `fmt_run_means`, `mechanisms_text`,
`definitions_text`)."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np
from sao_jax.experiments.ablations import collapse, plots

from sao_jax import sweep
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment, failures

# Held-out success, pass@1 sampled at temperature 1: the distribution RL trains. Greedy
# decoding of a converged SFT policy is already near its ceiling here (90-93%).
METRIC = "eval/sampled_success"
GREEDY = "eval/greedy_success"  # the same prompts, greedy decoding
# docs/method.md section 5 (AIME2025, BeyondAIME), and where the paper saw collapses.
PAPER = {
    "sao": (97.3, 74.8),
    "no_faster_value": (95.0, 69.8),
    "no_frozen_attention": (90.6, 74.5),
    "vanilla_vapo": (91.3, 69.0),
    "moving_average": (79.8, 55.3),
    "grpo_dis": (93.5, 70.8),
    "grpo": (84.2, 54.8),
    "sft": (80.4, 53.3),
}
PAPER_COLLAPSE = {"sao": "none (~1000 steps)", "grpo": "~160", "vanilla_vapo": "~90"}
LABELS = {
    "sao": "SAO",
    "no_faster_value": "w/o faster value (K=1)",
    "no_frozen_attention": "w/o frozen attention",
    "vanilla_vapo": "vanilla VAPO (no DIS)",
    "moving_average": "moving-average baseline",
    "grpo_dis": "GRPO + DIS",
    "grpo": "GRPO",
    "sft": "SFT warm start",
    "step_mean": "step-level (mean)",
    "step_last": "step-level (last)",
    "cross_observation": "cross-observation GAE",
}


def by_row(results: Sequence[sweep.PointResult]) -> dict[str, list[sweep.PointResult]]:
    """{row: its runs}, rows in the order of their first run."""
    out: dict[str, list[sweep.PointResult]] = collections.defaultdict(list)
    for r in results:
        out[r.row].append(r)
    return dict(out)


def eval_steps(spec: sweep.SweepSpec) -> list[int]:
    """The fixed step budgets: every eval step, the last one included."""
    total, every = spec.fixed["train.total_steps"], spec.fixed["train.eval_every"]
    steps = list(range(every, total + 1, every)) if every else []
    return steps if steps and steps[-1] == total else [*steps, total]


def final_by_seed(rs: Sequence[sweep.PointResult], metric: str, step: int) -> dict[int, float]:
    """{seed: `metric` at `step`} of the runs that logged it."""
    out = {}
    for r in rs:
        v = tables.value_at(r.history, metric, step)
        if v is not None:
            out[r.point.seed] = v
    return out


def sft_by_seed(results: Sequence[sweep.PointResult]) -> dict[int, float]:
    """{seed: held-out success of the seed's shared warm start} (each run's step-0 eval)."""
    out = {}
    for r in results:
        v = tables.finite((r.summary or {}).get("before", {}).get(METRIC))
        if v is not None:
            out[r.point.seed] = v
    return out


def ablation_report(
    exp: Experiment,
    title: str,
    name: str,
    spec: sweep.SweepSpec,
    results: Sequence[sweep.PointResult],
    wall_s: float,
    *,
    paper: Mapping[str, tuple[float, ...]],
    paper_columns: Sequence[str],
    paper_collapse: Mapping[str, str] | None = None,
    paper_base: float | None = None,
) -> str:
    """Markdown (and plots) of a rows x seeds sweep: held-out success at each budget
    (mean ± SE), each row's paired difference from SAO at the last budget with its SE,
    95% t interval, p-value and Holm-adjusted p over the table's rows (one family), the
    difference the design detects, and each row's gain over its start as a share of
    SAO's beside the paper's same share."""
    rows, steps = by_row(results), eval_steps(spec)
    done = {row: [r for r in rs if r.status == "done"] for row, rs in rows.items()}
    cols = [0, *steps]  # step 0: the shared SFT warm start, before RL
    last = steps[-1]
    sft = sft_by_seed(results)
    finals = {rs[0].point.variant: final_by_seed(rs, METRIC, last) for rs in rows.values()}
    ref = finals.get("sao", {})
    gain = compare.paired_difference(ref, sft).diff if ref and sft else float("nan")
    paper0 = {k: v[0] for k, v in paper.items()}
    if paper_base is not None:
        paper0.setdefault("sft", paper_base)
    diffs = {
        v: compare.paired_difference(f, ref) for v, f in finals.items() if v != "sao"
    }  # the family: every row's difference from SAO at the last budget
    holm = compare.holm_family(diffs)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    headers = ["row", "runs", *(f"success % @{s}" for s in cols)]
    headers += [f"greedy % @{last}", f"Δ vs SAO @{last} (paired, ± SE [95% CI])"]
    headers += [f"test (Holm over {len(diffs)} rows)", "verdict", compare.MDD_HEADER]
    headers += ["gain over start (share of SAO's)"]
    headers += ["paper: share of SAO's gain", "collapse", *(f"paper {c}" for c in paper_columns)]
    if paper_collapse is not None:
        headers.append("paper collapse")
    body, means = [], {}
    if sft:
        line = ["SFT warm start (step 0)", len(sft), compare.fmt_mean_se(list(sft.values()))]
        d = compare.paired_difference(sft, ref)
        line += ["-"] * len(steps) + ["-", compare.fmt_difference(d)]
        line += [instead or compare.fmt_test(d), "SAO's gain (not in the family)", "-", "-", "-"]
        line += ["-"]
        line += [f"{x}" for x in paper.get("sft", ("-",) * len(paper_columns))]
        line += ["-"] if paper_collapse is not None else []
        body.append(line)
        means["sft"] = compare.mean_se(list(sft.values()))[0]
    for row, rs in rows.items():
        variant = rs[0].point.variant
        cells = [
            compare.fmt_mean_se([tables.value_at(r.history, METRIC, s) for r in rs]) for s in cols
        ]
        cells.append(compare.fmt_mean_se([tables.value_at(r.history, GREEDY, last) for r in rs]))
        line = [LABELS.get(variant, row), f"{len(done[row])}/{len(rs)}", *cells]
        if variant == "sao":
            line += ["(reference)", "-", "-", "-"]
        else:
            d = diffs[variant]
            line += [compare.fmt_difference(d), instead or compare.fmt_test(d, holm[variant])]
            line.append(instead or compare.verdict(d, holm[variant]))
            line.append(compare.fmt_mdd(d, len(diffs)))
        line.append(fmt_gain(compare.paired_difference(finals[variant], sft).diff, gain))
        share = paper_share(paper0, variant, "sao", "sft")
        line.append("-" if share != share else f"{100 * share:.0f}%")
        collapses = [collapse.detect_collapse(r.history, error=r.error) for r in rs]
        line.append(collapse.fmt_collapses(collapses))
        line += [f"{x}" for x in paper.get(variant, ("-",) * len(paper_columns))]
        if paper_collapse is not None:
            line.append(paper_collapse.get(variant, "-"))
        body.append(line)
        means[variant] = compare.mean_se(list(finals[variant].values()))[0]
    text = exp.header(title, spec, results, wall_s) + "\n"
    text += tables.markdown_table(headers, body)
    text += "\n" + design_text(diffs, gain, len(ref), spec)
    text += "\n" + mechanisms_text(rows)
    text += "\n" + ordering_text(means, paper0, paper_columns[0])
    text += "\n" + definitions_text(f"budgets: evaluations at steps {', '.join(map(str, cols))}.")
    text += _plots(exp, name, rows, steps, paper)
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, METRIC)
    return text


def run_means(rs: Sequence[sweep.PointResult], name: str) -> tuple[list[float], float | None]:
    """Per finished or failed run, the mean of the logged `name` over the run; and the
    lowest single logged value over all of them (None where nothing was logged)."""
    means, low = [], None
    for r in rs:
        _, v = tables.series(r.history, name)
        if v.size:
            means.append(float(np.mean(v)))
            low = float(np.min(v)) if low is None else min(low, float(np.min(v)))
    return means, low


def fmt_run_means(rs: Sequence[sweep.PointResult], name: str, *, scale=100.0, digits=1) -> str:
    """'mean ± SE (min m)' over runs of each run's mean `name`; '-' if never logged."""
    means, low = run_means(rs, name)
    if not means:
        return "-"
    mean = compare.fmt_mean_se(means, scale=scale, digits=digits)
    return f"{mean} (min {scale * low:.{digits}f})"


MECHANISMS = (  # (column, metric, scale, digits): does each row's mechanism fire?
    ("policy loss keeps % of action tokens (lowest record)", "policy/keep_rate", 100.0, 2),
    ("PPO clip fraction % (lowest record)", "policy/clip_frac", 100.0, 2),
    ("critic EV of pre-update values on each fresh batch", "critic/ev_pre_update", 1.0, 2),
    ("mean staleness of trained rollouts (policy versions)", "train/staleness", 1.0, 2),
)


def mechanisms_text(
    rows: Mapping[str, Sequence[sweep.PointResult]], labels: Mapping[str, str] | None = None
) -> str:
    """Per row, whether its mechanism fired: mean over seeds of each run's mean of the
    DIS / PPO keep rate, the PPO clip fraction, the critic's pre-update EV, staleness;
    and the value-pretrained critic every critic row starts from (held-out EV). Rows
    are named by `labels` (default: this table's LABELS)."""
    labels = LABELS if labels is None else labels
    headers = ["row", *(c for c, *_ in MECHANISMS)]
    body = []
    for row, rs in rows.items():
        rs = [r for r in rs if r.status in ("done", "failed")]
        line = [labels.get(rs[0].point.variant, row) if rs else row]
        line += [fmt_run_means(rs, m, scale=sc, digits=d) for _, m, sc, d in MECHANISMS]
        body.append(line)
    ev = {}
    for rs in rows.values():
        for r in rs:
            vp = (r.summary or {}).get("value_pretrain") or {}
            if tables.finite(vp.get("heldout_ev_final")) is not None:
                ev[r.point.seed] = (vp["heldout_ev_final"], vp.get("steps"), vp.get("rollouts"))
    lines = ["## Do the mechanisms fire?", "", tables.markdown_table(headers, body)]
    lines.append(
        "- Each cell: mean ± SE over seeds of the run's mean over its logged steps; in "
        "brackets the lowest single logged value of any seed. A keep rate of 100.00 means "
        "the DIS band (or PPO clip) never bound; '-': the row does not log it."
    )
    if ev:
        per_seed = ", ".join(
            f"seed {s}: {v:.2f} ({n} steps, {k} rollouts)" for s, (v, n, k) in sorted(ev.items())
        )
        lines.append(
            "- Value pretraining (shared by every critic row of a seed), explained variance "
            f"on held-out rollouts it never trained on: {per_seed}."
        )
    return "\n".join(lines) + "\n"


def gain_share(gain: float, ref_gain: float) -> float:
    """A row's gain over its own start as a share of the reference row's, (row - start) /
    (SAO - start), comparable with the paper's same share (`paper_share`); NaN when the
    reference gained nothing or a number is missing. It replaces the earlier "paper-sized
    gap", whose yardstick for the moving average was a paper row below the paper's own SFT
    start (79.8 vs 80.4: a baseline that learned nothing)."""
    if not (math.isfinite(gain) and math.isfinite(ref_gain)) or ref_gain == 0:
        return math.nan
    return gain / ref_gain


def paper_share(paper: Mapping[str, float], row: str, ref: str, base: str) -> float:
    """The paper's (row - base) / (ref - base): its row's gain over the start as a share
    of its reference's (NaN when a number is missing)."""
    if not all(k in paper for k in (row, ref, base)):
        return math.nan
    return gain_share(paper[row] - paper[base], paper[ref] - paper[base])


def fmt_gain(gain: float, ref_gain: float) -> str:
    """'+12.3 (84%)': a row's gain over its start, in points, and as a share of SAO's."""
    if not math.isfinite(gain):
        return "n/a"
    share = gain_share(gain, ref_gain)
    return f"{100 * gain:+.1f}" + ("" if share != share else f" ({100 * share:.0f}%)")


def design_text(
    diffs: Mapping[str, compare.Difference], gain: float, n_ref: int, spec, *, what: str = ""
) -> str:
    """What differences this design can see, the family its Holm adjustment covers, and
    how to read the gain shares."""
    lines = ["## What this design can detect", ""]
    eval_size = spec.fixed.get("env.eval_size", "?")
    lines.append(
        f"- {n_ref} seeds; each run is scored on {eval_size} held-out prompts (one sampled "
        "rollout each). Rows of one seed share the SFT warm start, the prompt stream, the "
        "held-out prompts and the sampling keys (common random numbers: where two rows' "
        "policies differ little they draw mostly the same tokens), so each row's difference "
        "from SAO is paired by seed: d_s = row_s - SAO_s, SE = std(d) / sqrt(n), read with "
        "Student's t on n - 1 degrees of freedom (95% interval, two-sided p). This is why "
        "the paired SEs are far below the spread over seeds."
    )
    lines.append(
        f"- The family: the {len(diffs)} differences from SAO in this table ("
        + (what or ", ".join(LABELS.get(k, k) for k in diffs))
        + f"); each p is Holm-adjusted over them, and a verdict says 'higher'/'lower' only "
        f"when its Holm p < {compare.ALPHA:g}. The SFT row (SAO's own gain) is not in it."
    )
    if gain == gain:
        lines.append(
            f"- SAO's gain over its warm start: {100 * gain:+.1f} points. 'gain over start' "
            "is each row's own gain over the same warm start (its step 0), with its share of "
            "SAO's; the paper's column is the same share of the paper's rows (their gain over "
            "the paper's SFT start, as a share of SAO's). A share below 0 is a row that lost "
            "ground."
            + (
                " The paper's moving average (79.8) sits below its SFT start (80.4): its gap "
                "to SAO is more than SAO's whole gain and is no yardstick for ours."
                if "moving_average" in diffs
                else ""
            )
        )
    return "\n".join(lines) + "\n" + compare.MDD_NOTE


def ranking(values: Mapping[str, float], labels: Mapping[str, str] | None = None) -> str:
    """'a > b = c' by decreasing value (equal values joined by '=')."""
    labels = labels or {}
    order = sorted(values, key=lambda k: values[k], reverse=True)
    text = ""
    for i, k in enumerate(order):
        if i:
            text += " = " if values[k] == values[order[i - 1]] else " > "
        text += labels.get(k, k)
    return text


def ordering_agreement(
    ours: Mapping[str, float], paper: Mapping[str, float]
) -> tuple[int, int, list[tuple[str, str]]]:
    """(pairs ordered alike, pairs compared, pairs ordered differently) over rows in both.

    A pair (a, b) with paper[a] > paper[b] agrees when ours[a] > ours[b]; ties in the
    paper are skipped, ties in ours count as disagreement.
    """
    rows = [r for r in paper if r in ours and tables.finite(ours[r]) is not None]
    agree, total, bad = 0, 0, []
    for a, b in itertools.combinations(rows, 2):
        if paper[a] == paper[b]:
            continue
        hi, lo = (a, b) if paper[a] > paper[b] else (b, a)
        total += 1
        if ours[hi] > ours[lo]:
            agree += 1
        else:
            bad.append((hi, lo))
    return agree, total, bad


def ordering_text(ours: Mapping[str, float], paper: Mapping[str, float], column: str) -> str:
    """Plain statement of whether our final ordering matches the paper's."""
    agree, total, bad = ordering_agreement(ours, paper)
    common = {k: v for k, v in ours.items() if k in paper and tables.finite(v) is not None}
    lines = [
        "## Does laptop scale reproduce the paper's ordering?",
        "",
        f"- paper ({column}): {ranking({k: paper[k] for k in common}, LABELS)}",
        f"- ours (held-out sampled success at the last budget, mean over seeds): "
        f"{ranking(common, LABELS)}",
        f"- pairs ordered as in the paper: {agree} of {total} (a tie in ours counts as not).",
    ]
    if total == 0:
        lines.append("- **Not enough finished rows to compare.**")
    elif agree == total:
        lines.append("- **Yes**: every pair of rows is ordered as in the paper.")
    else:
        pairs = "; ".join(f"{LABELS.get(a, a)} > {LABELS.get(b, b)}" for a, b in bad)
        lines.append(f"- **No**: the paper has {pairs}; ours does not (or ties).")
    lines.append(
        "- An ordering is evidence only where the table's verdict calls the difference (Holm "
        "p < 0.05); see 'What this design can detect'."
    )
    return "\n".join(lines) + "\n"


def definitions_text(budget: str) -> str:
    rule = collapse.CollapseRule()
    return (
        "## Definitions\n\n"
        f"- success % @N: held-out success ({METRIC}: pass@1 sampled at temperature 1) after "
        "N RL steps, mean ± standard error over seeds (a bare number: one run); greedy: the "
        f"same prompts decoded greedily ({GREEDY}). The paper's columns are its AIME-style "
        "accuracies (different task and scale: compare orderings, not values).\n"
        f"- collapse: train success below {rule.drop_fraction:g} x its running max (once "
        f"that max reached {rule.min_peak:g}) for {rule.patience} consecutive log records; "
        f"or held-out greedy success below {rule.drop_fraction:g} x its step-0 value from some "
        f"eval to the end; or policy entropy below {rule.min_entropy:g} for "
        f"{rule.patience} records; or >= {rule.max_skipped} non-finite (skipped) updates. "
        f"Shown as runs collapsed / runs, at the first step of the collapse.\n"
        f"- {budget}\n"
    )


def _plots(exp: Experiment, name, rows, steps, paper) -> str:
    curves = {
        LABELS.get(rs[0].point.variant, row): plots.mean_curve([r.history for r in rs], METRIC)
        for row, rs in rows.items()
    }
    p1 = exp.plot_path(f"{name}_eval_success")
    plots.plot_curves(p1, "Held-out success (sampled, T = 1)", "success", curves)
    train = {
        LABELS.get(rs[0].point.variant, row): plots.mean_curve(
            [r.history for r in rs], "train/success"
        )
        for row, rs in rows.items()
    }
    p2 = exp.plot_path(f"{name}_train_success")
    plots.plot_curves(p2, "Training success (mean ± std over seeds)", "success", train)
    bars = {}
    for row, rs in rows.items():
        m, se, _ = compare.mean_se([tables.value_at(r.history, METRIC, steps[-1]) for r in rs])
        bars[LABELS.get(rs[0].point.variant, row)] = (m, 0.0 if se != se else se)
    ref = {LABELS.get(k, k): v[0] / 100 for k, v in paper.items()}
    p3 = exp.plot_path(f"{name}_final")
    title = f"Held-out success at step {steps[-1]} (mean ± SE)"
    plots.plot_bars(p3, title, "success", bars, reference=ref)
    return plots.plots_text((p1, p2, p3))
