"""The report of the baseline-ceiling table (experiments/baseline_ceiling/): how much of
the ideal per-prompt baseline SAO's critic recovers on the graded task.

Rows (configs/ablations.py, TABLES['baseline_ceiling']): SAO, the global moving average
over the last 128 outcomes (2 batches) and 160 (2.5 batches), and the oracle per-level
moving average (one window of 128 per difficulty level; the level alone explains about
half the return's variance, so its mean is close to the ideal per-prompt baseline).

Scores, per run, at the last budget: held-out sampled success on the training mix (the
levels weighted as the training stream draws them, alike: levels.py beside this file),
the primary score; and on the raw held-out mix, beside it.

Tests (sao_jax/report/compare.py): differences paired by seed, Student's t on n - 1 df.
One family per score, Holm-adjusted: the four comparisons of COMPARISONS (each moving
average against SAO, and the oracle against the global moving average, which says whether
there is a gap to recover). The primary family is the training mix; the raw mix's is
secondary.

Recovered share: (SAO - MA) / (oracle - MA), a ratio of paired means over the seeds, with
Fieller's 95% interval (no linearisation, no resampling: the values r for which the
paired t test of (SAO - MA)_s - r (oracle - MA)_s does not reject); undefined when the
oracle does not beat the moving average at p < 0.05 (unadjusted): nothing to recover.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from sao_jax.experiments.ablations import collapse
from sao_jax.experiments.ablations import report as table
from sao_jax.experiments.baseline_ceiling import levels, share

from sao_jax import sweep
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment, failures

SAO, MA, MA160, ORACLE = "sao", "moving_average", "moving_average_160", "moving_average_per_level"
LABELS = {
    **table.LABELS,
    MA: "moving average, window 128 (2 batches)",
    MA160: "moving average, window 160 (2.5 batches)",
    ORACLE: "oracle: per-level moving average, 128 per level",
}
# The family of each score: (row, reference) -> row - reference, paired by seed.
COMPARISONS = ((MA, SAO), (MA160, SAO), (ORACLE, SAO), (ORACLE, MA))
# The recovered share against each global moving average: MA (the family's) first.
RATIOS = (MA, MA160)
_RATIO_COLUMNS = ("oracle - MA (paired)", "SAO - MA (paired)", "recovered [95% Fieller]")

Score = Callable[[tables.History, int], float | None]
SCORES: dict[str, Score] = {  # name -> score of a run's history at a step
    "training mix": levels.training_mix_at,
    "raw held-out": lambda history, step: tables.value_at(history, table.METRIC, step),
}
PRIMARY = "training mix"


def by_seed(rs: Sequence[sweep.PointResult], score: Score, step: int) -> dict[int, float]:
    """{seed: score at `step`} of the runs that logged it."""
    out = {}
    for r in rs:
        v = score(r.history, step)
        if v is not None:
            out[r.point.seed] = v
    return out


def per_seed_differences(row: Mapping[int, float], ref: Mapping[int, float]) -> dict[int, float]:
    """{seed: row_s - ref_s} over the seeds both have."""
    return {s: row[s] - ref[s] for s in row if s in ref}


def family(
    finals: Mapping[str, Mapping[int, float]],
) -> tuple[dict[tuple[str, str], compare.Difference], dict[tuple[str, str], float]]:
    """The COMPARISONS present in `finals` (row -> {seed: score}), and their Holm p."""
    diffs = {
        (row, ref): compare.paired_difference(finals[row], finals[ref])
        for row, ref in COMPARISONS
        if row in finals and ref in finals
    }
    return diffs, compare.holm_family(diffs)


def recovered(finals: Mapping[str, Mapping[int, float]], ma: str) -> share.Ratio | None:
    """(SAO - ma) / (oracle - ma) over the seeds, with Fieller's interval (None when a
    row is missing)."""
    if not all(v in finals for v in (SAO, ma, ORACLE)):
        return None
    num = per_seed_differences(finals[SAO], finals[ma])
    return share.paired_ratio(num, per_seed_differences(finals[ORACLE], finals[ma]))


def _name(pair: tuple[str, str]) -> str:
    row, ref = pair
    short = {SAO: "SAO", MA: "MA 128", MA160: "MA 160", ORACLE: "oracle"}
    return f"{short[row]} - {short[ref]}"


def ceiling_report(
    exp: Experiment,
    spec: sweep.SweepSpec,
    results: Sequence[sweep.PointResult],
    wall_s: float,
) -> str:
    """Markdown: per row the score at step 0 and at the last budget on both mixes, its
    paired difference from SAO with t interval and Holm p; the oracle's gap over each
    global moving average and the share of it SAO recovers; what the design detects;
    whether the mechanisms fire; every run."""
    rows, last = table.by_row(results), table.eval_steps(spec)[-1]
    variants = {row: rs[0].point.variant for row, rs in rows.items()}
    finals = {
        name: {variants[row]: by_seed(rs, score, last) for row, rs in rows.items()}
        for name, score in SCORES.items()
    }
    start = {
        name: {r.point.seed: v for r in results if (v := score(r.history, 0)) is not None}
        for name, score in SCORES.items()
    }  # step 0: each seed's shared warm start
    tests = {name: family(f) for name, f in finals.items()}
    text = exp.header("SAO's critic against the ideal per-level baseline", spec, results, wall_s)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    text += "\n" + _main_table(rows, variants, finals, start, tests, last, instead)
    text += "\n" + _recovered_text(finals, tests, instead)
    text += "\n" + _design_text(tests[PRIMARY][0], spec)
    text += "\n" + table.mechanisms_text(rows, LABELS)
    text += "\n" + table.definitions_text(f"budgets: step 0 (the warm start) and step {last}.")
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, table.METRIC)
    return text


def _main_table(rows, variants, finals, start, tests, last, instead: str = "") -> str:
    headers = ["row", "runs"]
    for name in SCORES:
        which = " (primary)" if name == PRIMARY else ""
        headers += [f"{name} % @0", f"{name} % @{last}{which}", f"Δ vs SAO, {name}"]
        headers += [f"test, {name} (Holm over {len(tests[name][0])})"]
        headers += [f"{compare.MDD_HEADER}, {name}"]
    headers += ["verdict (primary)", "gain over start, training mix (share of SAO's)"]
    sao_gain = compare.paired_difference(finals[PRIMARY].get(SAO, {}), start[PRIMARY]).diff
    body = []
    for row, rs in rows.items():
        v = variants[row]
        done = sum(r.status == "done" for r in rs)
        line = [LABELS.get(v, row), f"{done}/{len(rs)}"]
        for name in SCORES:
            seeds = finals[name][v]
            line.append(compare.fmt_mean_se([start[name][s] for s in seeds if s in start[name]]))
            line.append(compare.fmt_mean_se(list(seeds.values())))
            diffs, holm = tests[name]
            if (v, SAO) in diffs:
                d = diffs[(v, SAO)]
                line += [compare.fmt_difference(d), instead or compare.fmt_test(d, holm[(v, SAO)])]
                line.append(compare.fmt_mdd(d, len(diffs)))
            else:
                line += ["(reference)" if v == SAO else "-", "-", "-"]
        diffs, holm = tests[PRIMARY]
        said = lambda d, p: instead or compare.verdict(d, p)
        line.append(said(diffs[(v, SAO)], holm[(v, SAO)]) if (v, SAO) in diffs else "-")
        gain = compare.paired_difference(finals[PRIMARY][v], start[PRIMARY]).diff
        line.append(table.fmt_gain(gain, sao_gain))
        body.append(line)
    return tables.markdown_table(headers, body)


def _recovered_text(finals, tests, instead: str = "") -> str:
    lines = ["## How much of the oracle's gain SAO recovers", ""]
    headers = ["reference", *(f"{what}, {name}" for name in SCORES for what in _RATIO_COLUMNS)]
    body = []
    for ma in RATIOS:
        line = [LABELS[ma]]
        for name in SCORES:
            r = recovered(finals[name], ma)
            if r is None:
                line += ["-"] * len(_RATIO_COLUMNS)
                continue
            gap = r.denominator
            holm_p = tests[name][1].get((ORACLE, ma), float("nan"))
            m = len(tests[name][0]) if (ORACLE, ma) in tests[name][0] else 1
            sao = compare.paired_difference(finals[name][SAO], finals[name][ma])
            test = instead or compare.fmt_test(gap, holm_p)
            line += [
                f"{compare.fmt_difference(gap)}; {test}; MDD {compare.fmt_mdd(gap, m)}",
                compare.fmt_difference(sao),
                share.fmt_ratio(r),
            ]
        body.append(line)
    lines.append(tables.markdown_table(headers, body))
    lines.append(
        "- recovered = (SAO - MA) / (oracle - MA): the share of the ideal per-level "
        "baseline's gain over the global moving average that SAO's critic gets, a ratio "
        "of the two paired means over the seeds. Its interval is Fieller's 95% interval "
        "(the values r for which the paired t test of (SAO - MA)_s - r (oracle - MA)_s "
        "does not reject; exact for normal per-seed differences, no delta-method "
        "linearisation, no resampling). It is undefined when the oracle does not beat the "
        "moving average at p < 0.05 (unadjusted): then there is no gap to recover and the "
        "interval is unbounded. A share above 100% is SAO beyond the per-level oracle; "
        "below 0, SAO below the moving average."
    )
    lines.append(
        "- The oracle's gap over MA 128 is in the Holm family of its score (Holm p shown); "
        "over MA 160 it is not (unadjusted p)."
    )
    return "\n".join(lines) + "\n"


def _design_text(diffs: Mapping[tuple[str, str], compare.Difference], spec) -> str:
    n = max((d.n for d in diffs.values()), default=0)
    lines = ["## What this design can detect", ""]
    lines.append(
        f"- {n} seeds; each run is scored on {spec.fixed.get('env.eval_size', '?')} "
        "held-out prompts (one sampled rollout each). Rows of one seed share the warm "
        "start, the prompt stream, the held-out prompts and the sampling keys, so every "
        "difference is paired by seed: d_s = row_s - ref_s, SE = std(d) / sqrt(n), "
        "Student's t on n - 1 degrees of freedom (95% interval, two-sided p)."
    )
    lines.append(
        f"- The family of each score: its {len(diffs)} comparisons "
        f"({', '.join(_name(k) for k in diffs)}), Holm-adjusted; a verdict says "
        f"'higher'/'lower' only at Holm p < {compare.ALPHA:g}. Primary: the training mix "
        "(the levels weighted alike, as the training stream draws them); the raw held-out "
        "mix (fewer easy prompts) is the secondary family."
    )
    return "\n".join(lines) + "\n" + compare.MDD_NOTE
