"""The reading of experiments/rescore: a table's runs scored again on more held-out prompts,
per row against SAO (paired by seed, Holm over the table's rows), beside the runs' own
evaluation, and per level where the task has levels."""

from __future__ import annotations

import numpy as np
from sao_jax.experiments.ablations import report as table
from sao_jax.experiments.baseline_ceiling.levels import LEVEL, UNIFORM, is_level
from sao_jax.experiments.gae_granularity import report as gae

from sao_jax.report import compare, tables
from sao_jax.report.experiment import machine_of

TABLES = {  # --table -> (report name, title, the paper's rows)
    "table4": ("ablations", "Table 4", table.PAPER),
    "gae": ("gae_granularity", "Table 5", gae.PAPER),
}
SFT = "sft"  # the SAO row's step-0 checkpoint: the seed's warm start


def per_seed(rescored, row: str, metric: str) -> dict[int, float]:
    """{seed: `metric`} of `row` in `rescored` ((row, seed) -> scores)."""
    return {s: v[metric] for (r, s), v in rescored.items() if r == row and metric in v}


def level_text(rescored, order: list[str], labels: dict[str, str]) -> str:
    """Per row: success with every level weighted alike (the training stream draws levels
    uniformly; the held-out split holds fewer of the easy levels the larger it is), and
    per level, each with its paired difference from SAO."""
    keys = {k for (r, _), v in rescored.items() if r == "sao" for k in v}
    levels = sorted(int(k[len(LEVEL) :]) for k in keys if is_level(k))
    if not levels:
        return ""
    metrics = [(UNIFORM, "levels weighted alike")]
    metrics += [(f"{LEVEL}{k}", f"level {k}") for k in levels]
    body = []
    for row in order:
        line = [labels[row]]
        for m, _ in metrics:
            cell = compare.fmt_mean_se(list(per_seed(rescored, row, m).values()))
            if row != "sao":
                d = compare.paired_difference(
                    per_seed(rescored, row, m), per_seed(rescored, "sao", m)
                )
                cell += f"; Δ {compare.fmt_difference(d)}, p {compare.fmt_p(d.p)}"
            line.append(cell)
        body.append(line)
    headers = ["row", *(f"{name} %" for _, name in metrics)]
    return (
        "\n## By difficulty level\n\n"
        + tables.markdown_table(headers, body)
        + "\n- Each cell: sampled success on the prompts of that level, mean ± SE over seeds, "
        "and its paired difference from SAO (± SE [95% t interval], unadjusted p: these "
        "cells are descriptive, not a tested family). 'levels weighted alike': the mean of "
        "the per-level successes, the mix the training stream draws.\n"
    )


def report(exp, spec, results, rescored, step: int, heldout: int, wall_s: float, which: str) -> str:
    """Markdown: rows x (rescored sampled on the training mix, raw, greedy, Δ vs SAO with
    t interval and Holm-adjusted p) and the runs' own Δ, for `which` table (TABLES)."""
    _, title, paper = TABLES[which]
    rows = table.by_row(results)
    paper0 = {k: v[0] for k, v in paper.items()}
    leveled = any(UNIFORM in v for v in rescored.values())
    primary = UNIFORM if leveled else table.METRIC  # the training stream's mix where known
    ref = per_seed(rescored, "sao", primary)
    sft = per_seed(rescored, SFT, primary)
    gain = compare.paired_difference(ref, sft).diff if ref and sft else float("nan")
    variants = {row: rows[row][0].point.variant for row in rows}
    diffs = {
        v: compare.paired_difference(per_seed(rescored, v, primary), ref)
        for v in variants.values()
        if v != "sao"
    }  # the family: every row's difference from SAO on the primary metric
    holm = compare.holm_family(diffs)
    what = "levels weighted alike (the training mix)" if leveled else "the rescored prompts"
    headers = ["row", "runs", f"success % @{step}, {what} (primary)", "Δ vs SAO (paired)"]
    headers += [f"test (Holm over {len(diffs)} rows)", "verdict", "gain over start (share)"]
    headers += ["paper: share of SAO's gain"]
    if leveled:
        headers += ["success %, raw held-out mix", "Δ vs SAO, raw mix"]
    headers += ["greedy %", "own eval: Δ vs SAO (same seeds)"]
    body, mdds = [], []
    for row in [SFT, *rows]:
        variant = row if row == SFT else variants[row]
        label = "SFT warm start (step 0)" if row == SFT else table.LABELS.get(variant, row)
        line = [label, len(per_seed(rescored, variant, primary))]
        line.append(compare.fmt_mean_se(list(per_seed(rescored, variant, primary).values())))
        if variant == "sao":
            line += ["(reference)", "-", "-", "-", "-"]
        elif row == SFT:
            d = compare.paired_difference(per_seed(rescored, SFT, primary), ref)
            line += [compare.fmt_difference(d), compare.fmt_test(d)]
            line += ["SAO's gain (not in the family)", "-", "-"]
        else:
            d = diffs[variant]
            mdds.append(d.mdd)
            line += [compare.fmt_difference(d), compare.fmt_test(d, holm[variant])]
            line.append(compare.verdict(d, holm[variant]))
            own_gain = compare.paired_difference(per_seed(rescored, variant, primary), sft)
            line.append(table.fmt_gain(own_gain.diff, gain))
            share = table.paper_share(paper0, variant, "sao", "sft")
            line.append("-" if share != share else f"{100 * share:.0f}%")
        if leveled:
            raw = per_seed(rescored, variant, table.METRIC)
            line.append(compare.fmt_mean_se(list(raw.values())))
            raw_ref = per_seed(rescored, "sao", table.METRIC)
            d_raw = compare.paired_difference(raw, raw_ref)
            line.append("-" if variant == "sao" else compare.fmt_difference(d_raw))
        line.append(compare.fmt_mean_se(list(per_seed(rescored, variant, table.GREEDY).values())))
        if row in (SFT, "sao") or variant == "sao":
            line.append("-" if row == SFT else "(reference)")
        else:
            own = table.final_by_seed(rows[row], table.METRIC, step)
            own_ref = table.final_by_seed(rows["sao"], table.METRIC, step)
            line.append(compare.fmt_difference(compare.paired_difference(own, own_ref)))
        body.append(line)
    machine = machine_of(results)
    text = (
        f"# {title} rescored on {heldout} held-out prompts\n\n"
        f"- command: `{exp.command}`\n"
        f"- mode: {exp.mode}; seeds: {', '.join(map(str, spec.seeds))}\n"
        f"- rescored: {len(results)} finished runs' checkpoints at step {step}, and the SAO "
        "runs' step 0 (the shared warm start); nothing trained\n"
        f"- wall time of this invocation: {wall_s / 60:.1f} min (scores cached beside the "
        "runs are reused)\n"
        f"- machine of the runs: {machine}\n"
    )
    if leveled:
        text += (
            "- the training stream draws the levels alike, the held-out split does not (it "
            "holds fewer of the easy levels the larger it is), so the primary score weights "
            "the levels alike and the raw held-out mix is beside it\n"
        )
    text += "\n" + tables.markdown_table(headers, body)
    text += (
        "\n- success: held-out pass@1 sampled at temperature 1 on the rescored prompts (the "
        "seed's held-out split; its first prompts are the ones the run's own evaluation "
        "scored), mean ± SE over seeds; greedy: the same prompts decoded greedily (raw mix).\n"
        "- Δ vs SAO: paired by seed (rows of a seed share warm start, prompts and sampling "
        "keys), SE = std(d) / sqrt(n), [95% t interval]; test: t on n - 1 df, two-sided p, "
        f"Holm-adjusted over the family of the {len(diffs)} rows' differences from SAO on the "
        f"primary score; verdict at Holm p < {compare.ALPHA:g}. gain over start: the row's "
        "own gain over the warm start and its share of SAO's, beside the paper's same share "
        "(docs/experiments.md). own eval Δ: the same difference on the runs' own evaluation "
        "(raw mix) at the same step and seeds, for comparison.\n"
    )
    if mdds:
        text += (
            "- True differences this design detects with 80% power (two-sided t, alpha "
            f"{compare.ALPHA:g}): {100 * min(mdds):.1f} to {100 * max(mdds):.1f} points "
            f"(median {100 * float(np.median(mdds)):.1f}).\n"
        )
    labels = {SFT: "SFT warm start (step 0)"}
    labels.update({v: table.LABELS.get(v, r) for r, v in variants.items()})
    return text + level_text(rescored, list(labels), labels)
