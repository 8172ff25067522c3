"""The report of the per-user online shift (configs/online_shift.py, experiments/online_shift/).

Each user of the `user_style` task (sao_jax/envs/user_style.py) switches its target style at
its own steps; every judged line logs its success under where its user stands
(`info["log"]`, logged by the trainer as `env/<name>` with `env/<name>/count` per step,
sao_jax/run/accounting.py EnvLog). Per run:

  recovering  success of the lines judged in their user's first RECOVERY_STEPS steps after
              a switch, pooled over users and switches (sum of successes / lines): the
              primary metric, how fast a row re-aligns. Every line is judged before the
              policy trains on it (prequential), so this is no in-sample number.
  recovering, equal weight per user   the same, the mean over users of each user's pooled
              success (beside the pooled one, which weights users by their lines)
  initial / settled   before the user's first switch / later than RECOVERY_STEPS after one
  since switch <k>    success in bins of steps since the switch (the recovery curve)

Rows are paired by seed (shared warm start and prompt stream). Tests: Student t on the
paired differences, Holm-adjusted within a family: the pre-registered primary family
(SAO - moving average at the paper's window, ceiling - moving average, ceiling - SAO),
and a secondary family (every other row - SAO, those two rows aside: `secondary_rows`).
The tracking table (a half fraction of critic lr x K x attention x clip) estimates each
factor's main effect per seed (mean of the four cells at 'high' - mean of the four at
'low'), Holm over the four factors.
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Mapping, Sequence

import numpy as np
from sao_jax.configs.online_shift import MAIN_ROWS
from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations.report import by_row, fmt_run_means, mechanisms_text

from sao_jax import sweep
from sao_jax.envs.user_style import BIN_STEPS, RECOVERY_STEPS, success_bin
from sao_jax.report import compare, stats, tables
from sao_jax.report.experiment import INCOMPLETE, PILOT, Experiment, failures
from sao_jax.run.accounting import ENV_PREFIX

PRIMARY = "success_recovering"
PAPER_ROW = "moving_average"  # R - mean of the last 128 rewards: the paper's baseline
PRIMARY_FAMILY = (("sao", PAPER_ROW), ("ceiling", PAPER_ROW), ("ceiling", "sao"))
# the primary family's cells in a table made under the secondary family's pre-registration
DESCRIPTIVE = "descriptive: not a test of this pre-registration"
LABELS = {
    "sao": "SAO",
    "moving_average": "moving average, 128 rewards (the paper's)",
    "moving_average_per_user": "oracle: one moving average per user",
    "sao_lambda1": "SAO, policy lambda 1",
    "sao_policy_first": "SAO, policy step first",
    "ceiling": "ceiling: critic sees the current target",
}
TRACK_MECHANISMS = (  # (column, metric, scale, digits)
    ("critic EV before its update", "critic/ev_pre_update", 1.0, 2),
    ("critic clip fraction %", "critic/grad_clipped", 100.0, 1),
    ("critic grad norm", "critic/grad_norm", 1.0, 2),
)


def label(variant: str) -> str:
    """The row's name in the tables."""
    m = re.fullmatch(r"moving_average_w(\d+)", variant)
    if m:
        return f"moving average, {m.group(1)} steps of rewards"
    if variant.startswith("track_"):
        return "tracking: " + " + ".join(variant.split("_")[1:])
    return LABELS.get(variant, variant)


# --------------------------------------------------------------------------- per run


def pooled(history: Sequence[Mapping], name: str) -> float | None:
    """sum / count of the env metric `name` over the run: each step's mean `env/<name>`
    times its `env/<name>/count`, summed, over the summed counts (None if never logged)."""
    key, count = ENV_PREFIX + name, f"{ENV_PREFIX}{name}/count"
    s = c = 0.0
    for rec in history:
        if key in rec and count in rec:
            v, n = tables.finite(rec[key]), tables.finite(rec[count])
            if v is not None and n:
                s, c = s + v * n, c + n
    return s / c if c else None


def per_user_equal(history: Sequence[Mapping], users: int) -> float | None:
    """The mean over users 0..users-1 of each user's pooled recovering success (users
    with no recovering line left out; None if none has one)."""
    per_user = [pooled(history, f"{PRIMARY}_u{u}") for u in range(users)]
    per_user = [x for x in per_user if x is not None]
    return float(np.mean(per_user)) if per_user else None


def recovery_curve(history: Sequence[Mapping], longest: int, bin_steps: int) -> dict[int, float]:
    """{first step of the bin since the switch: pooled success in that bin}, for the
    bins of `bin_steps` steps up to `longest` steps after a switch."""
    out = {k: pooled(history, success_bin(k, bin_steps)) for k in range(0, longest, bin_steps)}
    return {k: v for k, v in out.items() if v is not None}


def scores(rs: Sequence[sweep.PointResult], fn) -> dict[int, float | None]:
    """{seed: fn(history)} of a row's finished runs."""
    return {r.point.seed: fn(r.history) for r in rs if r.status == "done"}


def _metric(name: str):
    return lambda h: pooled(h, name)


# --------------------------------------------------------------------------- tables


def family(
    by_variant: Mapping[str, Mapping[int, float | None]], pairs: Sequence[tuple[str, str]]
) -> dict[tuple[str, str], compare.Difference]:
    """The paired differences (row - reference) of `pairs` whose two rows ran."""
    return {
        (a, b): compare.paired_difference(by_variant[a], by_variant[b])
        for a, b in pairs
        if a in by_variant and b in by_variant
    }


def verdict_text(diffs, holm) -> str:
    """The pre-registered reading (results/online_shift/PREREGISTRATION.md): SAO faster
    than the moving average at the paper's window, with the ceiling bounding it; or a
    null that says only what it could detect (the ceiling separates from the moving
    average, SAO does not: `null_text`); or a design that cannot see the effect (not even
    the ceiling separates); or no reading of a null when the ceiling row did not run."""
    sao, ceil = ("sao", PAPER_ROW), ("ceiling", PAPER_ROW)
    if sao not in diffs:
        return "**Not decidable**: SAO or the moving average did not run."
    d, p = diffs[sao], holm[sao]
    if d.n < 2 or not math.isfinite(d.se):
        return "**Not decidable**: fewer than two paired seeds."
    said = (
        f"SAO minus the moving average {compare.fmt_difference(d)} points of recovering "
        f"success ({compare.fmt_test(d, p)}; detectable with 80% power: {100 * d.mdd:.1f})"
    )
    dc = diffs.get(ceil)
    ceiling_ok = dc is not None and dc.diff > 0 and holm[ceil] < compare.ALPHA
    ceiling = (
        f"the ceiling minus the moving average {compare.fmt_difference(dc)} "
        f"({compare.fmt_test(dc, holm[ceil])})"
        if dc is not None
        else "the ceiling row did not run"
    )
    if p < compare.ALPHA and d.diff > 0:
        bound = diffs.get(("ceiling", "sao"))
        room = (
            f"; the ceiling is {compare.fmt_difference(bound)} points above SAO "
            f"({compare.fmt_test(bound, holm[('ceiling', 'sao')])})"
            if bound is not None
            else ""
        )
        return f"**Yes**: SAO recovers faster than the moving average: {said}; {ceiling}{room}."
    if p < compare.ALPHA:
        return f"**No, the opposite**: the moving average recovers faster: {said}; {ceiling}."
    if dc is None:  # a table of other rows (e.g. the secondary family's own run)
        return (
            f"**No reading**: without the ceiling row a null cannot be told from a design "
            f"that cannot see the effect; {said}."
        )
    if ceiling_ok:
        return null_text(d, dc, said, ceiling, len(diffs))
    return (
        f"**The design cannot show the effect**: not even the ceiling separates from the "
        f"moving average ({ceiling}); {said}."
    )


def null_text(
    d: compare.Difference, dc: compare.Difference, said: str, ceiling: str, m: int
) -> str:
    """SAO did not separate from the moving average where the ceiling did: no difference
    shown, with the minimum detectable difference (80% power, two-sided alpha, t on n - 1
    df times the SE: `stats.detectable`), unadjusted and at alpha / m (Holm's first step
    over the m tests of the family), and whether SAO's interval holds both no gain and the
    ceiling's whole gain (then the data cannot tell the two apart)."""
    lo, hi = d.interval()
    mdd, mdd_m = d.mdd, stats.detectable(d.se, d.dof, compare.ALPHA / m)
    text = (
        f"**No difference shown (MDD {100 * mdd:.1f})**: the ceiling separates from the "
        f"moving average ({ceiling}), SAO does not: {said}; SAO's interval "
        f"[{100 * lo:+.1f}, {100 * hi:+.1f}]. The minimum detectable difference (80% power) "
        f"is {100 * mdd:.1f} points at two-sided alpha {compare.ALPHA:g} and "
        f"{100 * mdd_m:.1f} at alpha {compare.ALPHA:g}/{m} (Holm's first step)"
    )
    if mdd > dc.diff:
        text += f", above the ceiling's own gain ({100 * dc.diff:+.1f})"
    if lo <= 0.0 <= dc.diff <= hi:
        text += (
            "; SAO's interval holds both no gain and the ceiling's whole gain: the data "
            "cannot tell them apart"
        )
    return text + "."


def main_report(exp: Experiment, spec: sweep.SweepSpec, results, wall_s: float) -> str:
    """The main table: every row's success by where its user stands, the pre-registered
    family, the window sweep against the paper's 128 rewards, the recovery curves."""
    rows = by_row(results)
    variants = {rs[0].point.variant: rs for rs in rows.values()}
    primary = {v: scores(rs, _metric(PRIMARY)) for v, rs in variants.items()}
    switches = spec.fixed.get("env.params.switch_steps") or ()
    equal = {
        v: scores(rs, lambda h: per_user_equal(h, len(switches))) for v, rs in variants.items()
    }
    diffs = family(primary, PRIMARY_FAMILY)
    holm = compare.holm_family(diffs)
    sdiffs = family(primary, [(v, "sao") for v in secondary_rows(variants)])
    sholm = compare.holm_family(sdiffs)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    secondary_prereg = (exp.prereg or {}).get("tests") == "secondary"
    unread = DESCRIPTIVE if secondary_prereg else instead  # the primary family's cells
    headers = [
        "row",
        "runs",
        "success % before the first switch",
        "recovering % (primary)",
        "recovering %, equal weight per user",
        "settled %",
        "Δ recovering vs SAO (paired, ± SE [95% CI])",
        "test",
        "held-out success % at the end (sampled)",
    ]
    body = []
    for v, rs in variants.items():
        n_done = sum(r.status == "done" for r in rs)
        line = [label(v), f"{n_done}/{len(rs)}"]
        line.append(compare.fmt_mean_se(list(scores(rs, _metric("success_initial")).values())))
        line.append(compare.fmt_mean_se(list(primary[v].values())))
        line.append(compare.fmt_mean_se(list(equal[v].values())))
        line.append(compare.fmt_mean_se(list(scores(rs, _metric("success_settled")).values())))
        key = (v, "sao")
        if v == "sao":
            line += ["(reference)", "-"]
        elif key in sdiffs:
            test = instead or compare.fmt_test(sdiffs[key], sholm[key])
            line += [compare.fmt_difference(sdiffs[key]), test]
        elif (key in diffs or key[::-1] in diffs) and "sao" in primary:
            # a primary-family pair, shown as row - SAO with the primary family's Holm p
            d = compare.paired_difference(primary[v], primary["sao"])
            p = holm[key] if key in diffs else holm[key[::-1]]
            line += [compare.fmt_difference(d), unread or compare.fmt_test(d, p)]
        else:
            line += ["n/a", "-"]
        after = [((r.summary or {}).get("after") or {}).get("eval/sampled_success") for r in rs]
        line.append(compare.fmt_mean_se(after))
        body.append(line)
    text = exp.header("Online learning with per-user moving targets", spec, results, wall_s)
    text += "\n" + tables.markdown_table(headers, body) + "\n"
    params = _env_params(results)
    text += _definitions(spec, params.get("recovery_steps", RECOVERY_STEPS)) + compare.MDD_NOTE
    text += _primary_heading(secondary_prereg, instead)
    text += _family_table(diffs, holm, "primary", unread)
    if unread == INCOMPLETE:  # a pilot's or a descriptive family's note says it already
        text += f"\n- {unread}: the verdict is not given.\n"
    elif not unread:
        text += "\n- " + _read_when_complete(variants) + verdict_text(diffs, holm) + "\n"
    if sdiffs:
        text += (
            f"\n## The pre-registered family ({exp.prereg['file']}): every other row "
            "against SAO\n\n"
            if secondary_prereg
            else "\n## Every other row against SAO (secondary family)\n\n"
        )
        text += _family_table(sdiffs, sholm, "secondary", instead)
        text += _incomplete_text(sdiffs, exp, instead) + "\n"
    text += _window_text(exp, variants, primary)
    bin_steps = params.get("bin_steps", BIN_STEPS)
    text += _curve_text(exp, variants, spec.fixed["train.total_steps"], bin_steps)
    text += "\n" + mechanisms_text(rows, labels={v: label(v) for v in variants})
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, "eval/sampled_success", rule=None)
    return text


def _read_when_complete(variants) -> str:
    """The pre-registration reads its tests only when every seed of each difference
    finished: a prefix saying so when a primary row has unfinished runs."""
    rows = sorted({v for pair in PRIMARY_FAMILY for v in pair})
    short = [v for v in rows if any(r.status != "done" for r in variants.get(v, []))]
    if not short:
        return ""
    return (
        f"**Not the pre-registered reading yet** (unfinished runs in: "
        f"{'; '.join(label(v) for v in short)}; the tests are read when every seed of a "
        "difference finished). Provisional, on the finished pairs: "
    )


def secondary_rows(variants: Sequence[str]) -> list[str]:
    """The rows of the secondary family (each minus SAO): every row but SAO whose
    difference with SAO is not in the primary family (the paper's moving average and the
    ceiling are tested there)."""
    primary = [set(pair) for pair in PRIMARY_FAMILY]
    return [v for v in variants if v != "sao" and {v, "sao"} not in primary]


def _primary_heading(secondary_prereg: bool, instead: str) -> str:
    """The primary family's section heading: the pre-registered family of a table read
    under the main table's pre-registration; the main table's family, not tested, in a
    pilot's table or one made under the secondary family's pre-registration."""
    if secondary_prereg:
        return (
            "\n## SAO - the moving average (the main table's family: descriptive here, not "
            "a test of this table's pre-registration)\n\n"
        )
    if instead == PILOT:
        return f"\n## The main table's family ({PILOT})\n\n"
    return "\n## The pre-registered family\n\n"


def _incomplete_text(sdiffs, exp: Experiment, instead: str) -> str:
    """A note when fewer rows ran than the pre-registered secondary family has: the
    secondary rows of the table's pre-registration (`exp.prereg['rows']`), or, where no
    pre-registration was looked for, the first design's (configs/online_shift.py
    MAIN_ROWS); its Holm adjustment is then provisional. None in a pilot's table (no
    family is pre-registered for it, no test read)."""
    if instead == PILOT:
        return ""
    family = secondary_rows(exp.prereg["rows"] if exp.prereg else MAIN_ROWS)
    ran = [a for a, _ in sdiffs]
    missing = [v for v in family if v not in ran]
    if not missing or not set(ran) <= set(family):
        return ""
    return (
        f"- Incomplete: {len(ran)} of the {len(family)} rows of the pre-registered secondary "
        f"family ran (not run: {'; '.join(label(v) for v in missing)}); the Holm adjustment "
        "over these is provisional, not the pre-registered test.\n"
    )


def _family_table(diffs, holm, name: str, instead: str = "") -> str:
    """The family's differences with their tests and verdicts; `instead` (a pilot's or an
    incomplete table's reading, Experiment.reading, or DESCRIPTIVE) in place of each test
    and verdict. The note under it says how the family is tested: Holm's rule for a
    pre-registered family (read or not yet), none for a pilot's or a descriptive one."""
    headers = ["difference (paired by seed)", "points ± SE [95% t interval]", "test", "verdict"]
    body = [
        [
            f"{label(a)} - {label(b)}",
            compare.fmt_difference(d),
            instead or compare.fmt_test(d, holm[(a, b)]),
            instead or compare.verdict(d, holm[(a, b)]),
            compare.fmt_mdd(d, len(diffs)),
        ]
        for (a, b), d in diffs.items()
    ]
    table = tables.markdown_table([*headers, compare.MDD_HEADER], body)
    if instead in (PILOT, DESCRIPTIVE):
        what = "difference" if len(diffs) == 1 else f"{len(diffs)} differences"
        return table + f"\n- The {name} family's {what}, not tested here ({instead}): no verdict.\n"
    return (
        table
        + f"\n- The {name} family: "
        + (
            f"these {len(diffs)} differences of recovering success, Holm-adjusted together"
            if len(diffs) != 1
            else "this one difference of recovering success (Holm over one test: its p)"
        )
        + f"; a difference counts at Holm p < {compare.ALPHA:g}.\n"
    )


def _definitions(spec: sweep.SweepSpec, recovery_steps: int) -> str:
    switches = spec.fixed.get("env.params.switch_steps")
    offsets = spec.fixed.get("env.params.offsets")  # always set since offsets=spread is the
    # default; the runs of the first per-user design recorded none (no offsets then)
    paid = f" and earn {tuple(offsets)} on every line" if offsets and any(offsets) else ""
    return (
        f"\n- Users switch their target style at their own steps {switches} (per user){paid}; "
        f"recovering = the lines judged within the user's first {recovery_steps} steps after "
        "a switch, "
        "pooled over users and switches (successes / lines); equal weight per user = the "
        "mean over users of each user's pooled success; settled = later than that; "
        "before the first switch = the user's first phase. Every line is judged before the "
        "policy trains on it (prequential: no in-sample number). Each cell: mean ± SE over "
        "seeds; Δ: paired by seed (shared warm start and prompt stream), t on n - 1 df.\n"
        "- held-out success: sampled pass@1 on held-out prompts after the last step, "
        "judged under each user's target at that step.\n"
    )


def _window_text(exp: Experiment, variants, primary) -> str:
    """The moving average's recovering success against its window in steps, SAO and the
    ceiling beside it, the paper's 128 rewards marked."""
    batch = None
    points = []
    for v, rs in variants.items():
        if not (v == PAPER_ROW or v.startswith("moving_average_w")) or not rs:
            continue
        fixed = rs[0].point.all_overrides()
        cfg = sweep.point_config(rs[0].point.config_path, rs[0].point.seed, fixed)
        batch = cfg.rl.batch_size
        window = cfg.rl.moving_average_window
        points.append((window / batch, window, v))
    if not points:
        return ""
    points.sort()
    headers = ["window (steps of rewards)", "rewards", "recovering %", "Δ vs SAO (paired)"]
    body = []
    for steps, window, v in points:
        mark = " (the paper's 128)" if v == PAPER_ROW else ""
        d = compare.paired_difference(primary[v], primary.get("sao", {}))
        body.append(
            [
                f"{steps:g}{mark}",
                window,
                compare.fmt_mean_se(list(primary[v].values())),
                compare.fmt_difference(d),
            ]
        )
    path = exp.plot_path("online_shift_window")
    series = {steps: compare.mean_se(list(primary[v].values()))[:2] for steps, _, v in points}
    refs = {
        label(v): compare.mean_se(list(primary[v].values()))[:2]
        for v in ("sao", "ceiling")
        if v in primary
    }
    plot_window(
        path,
        "Recovering success against the moving average's window",
        "recovering success",
        series,
        {k: v for k, v in refs.items() if math.isfinite(v[0])},
        marker=128 / batch,
        marker_label="the paper's 128 rewards",
    )
    return (
        "\n## The moving average's window\n\n"
        + tables.markdown_table(headers, body)
        + "\n- Window in steps of rewards = rewards / batch size "
        f"({batch}); a window of W steps lags the reward by about W / 2 steps. "
        "Mean ± SE over seeds; Δ vs SAO paired by seed (these rows are in the secondary "
        "family above, the paper's window in the primary one).\n"
        f"\n![{path.stem}](plots/{path.name})\n"
    )


def _env_params(results: Sequence[sweep.PointResult]) -> dict:
    """The task parameters of the sweep's runs (the config file of its first point)."""
    if not results:
        return {}
    p = results[0].point
    return dict(sweep.point_config(p.config_path, p.seed, p.all_overrides()).env.params)


def _curve_text(exp: Experiment, variants, total_steps: int, bin_steps: int) -> str:
    curves = {}
    for v, rs in variants.items():
        per_run = [
            recovery_curve(r.history, total_steps, bin_steps) for r in rs if r.status == "done"
        ]
        bins = sorted({k for c in per_run for k in c})
        if bins:
            mean = np.array([np.mean([c[k] for c in per_run if k in c]) for k in bins])
            curves[label(v)] = (np.array(bins), mean, np.zeros_like(mean))
    if not curves:
        return ""
    path = exp.plot_path("online_shift_recovery")
    plots.plot_curves(
        path,
        "Success after a user's switch",
        "success (the user's current target)",
        curves,
        xlabel="steps since the user's switch (bin start)",
    )
    return (
        "\n## Recovery curves\n\n"
        f"Success of the lines judged k steps after their user's switch (bins of {bin_steps} "
        "steps, "
        "pooled over users and switches, mean over seeds).\n\n"
        f"![{path.stem}](plots/{path.name})\n"
    )


def tracking_report(exp: Experiment, spec: sweep.SweepSpec, results, wall_s: float) -> str:
    """The critic-tracking half fraction: per cell, recovering success and what the critic
    did; per factor, its main effect (paired by seed), Holm over the factors."""
    rows = by_row(results)
    variants = {rs[0].point.variant: rs for rs in rows.values()}
    primary = {v: scores(rs, _metric(PRIMARY)) for v, rs in variants.items()}
    headers = ["cell", "runs", "recovering %", "settled %"]
    headers += [c for c, *_ in TRACK_MECHANISMS]
    body = []
    for v, rs in variants.items():
        line = [label(v), f"{sum(r.status == 'done' for r in rs)}/{len(rs)}"]
        line.append(compare.fmt_mean_se(list(primary[v].values())))
        line.append(compare.fmt_mean_se(list(scores(rs, _metric("success_settled")).values())))
        line += [fmt_run_means(rs, m, scale=sc, digits=d) for _, m, sc, d in TRACK_MECHANISMS]
        body.append(line)
    effects = main_effects(primary, factors_of(variants))
    holm = compare.holm_family(effects)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    eff_rows = [
        [
            f,
            compare.fmt_difference(d),
            instead or compare.fmt_test(d, holm[f]),
            instead or compare.verdict(d, holm[f]),
            compare.fmt_mdd(d, len(effects)),
        ]
        for f, d in effects.items()
    ]
    text = exp.header("Critic tracking on the per-user online shift", spec, results, wall_s)
    text += "\n" + tables.markdown_table(headers, body) + "\n"
    text += _definitions(spec, _env_params(results).get("recovery_steps", RECOVERY_STEPS))
    text += (
        "- Cells: SAO (every factor at its default: critic lr 1e-3, K = 2, frozen "
        "attention, critic grad clip 1.0) and the cells of the half fraction I = ABCD of "
        "lr x4, K = 4, trained attention, no clip (each named by its factors at 'high'). "
        "Clip fraction: share of critic optimizer steps whose gradient norm exceeded the "
        "clip (0 without a clip).\n"
        "\n## Main effects on recovering success\n\n"
        + tables.markdown_table(
            [
                "factor at 'high'",
                "effect, points ± SE [95% t]",
                "test",
                "verdict",
                compare.MDD_HEADER,
            ],
            eff_rows,
        )
        + "\n- Per seed: mean recovering success of the four cells with the factor at "
        "'high' minus that of the four at 'low' (a resolution IV design: main effects are "
        "not confounded with two-factor interactions); t over seeds; Holm over the "
        f"{len(effects)} factors.\n" + compare.MDD_NOTE
    )
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, "eval/sampled_success", rule=None)
    return text


def factors_of(variants: Sequence[str]) -> tuple[str, ...]:
    """The factors the cells name (`track_a_b`: a and b), in order of first appearance."""
    seen: dict[str, None] = {}
    for v in variants:
        if v.startswith("track_"):
            seen.update(dict.fromkeys(v.split("_")[1:]))
    return tuple(seen)


def main_effects(
    primary: Mapping[str, Mapping[int, float | None]], factors: Sequence[str]
) -> dict[str, compare.Difference]:
    """{factor: the paired main effect}: per seed, mean over the cells with the factor at
    'high' minus mean over those at 'low' (cell 'sao' has every factor 'low'; a cell
    `track_a_b` has a and b 'high'); seeds missing a cell are left out."""
    cells = {v: set(v.split("_")[1:]) if v.startswith("track_") else set() for v in primary}
    out = {}
    for f in factors:
        high = [v for v in cells if f in cells[v]]
        low = [v for v in cells if f not in cells[v]]
        contrast = {}
        seeds = set.intersection(*(set(primary[v]) for v in cells)) if cells else set()
        for s in sorted(seeds):
            hi = [primary[v][s] for v in high]
            lo = [primary[v][s] for v in low]
            if high and low and all(x is not None for x in hi + lo):
                contrast[s] = float(np.mean(hi) - np.mean(lo))
        out[f] = compare.paired_difference(contrast, dict.fromkeys(contrast, 0.0))
    return out


def plot_window(
    path: str | pathlib.Path,
    title: str,
    ylabel: str,
    points: Mapping[float, tuple[float, float]],
    references: Mapping[str, tuple[float, float]],
    *,
    marker: float,
    marker_label: str,
) -> None:
    """A quantity against a window (log2 x axis): {window: (mean, SE)} as points with
    error bars; each reference (mean, SE) a horizontal line with its band; a dashed
    vertical line at `marker`."""
    fig, ax = plots.figure()
    xs = sorted(points)
    ax.errorbar(
        xs, [points[x][0] for x in xs], yerr=[points[x][1] for x in xs], marker="o",
        capsize=3, label="moving average",
    )  # fmt: skip
    for name, (mean, se) in references.items():
        line = ax.axhline(mean, linestyle="-.", linewidth=1.2, label=name)
        if math.isfinite(se):
            ax.axhspan(mean - se, mean + se, color=line.get_color(), alpha=0.12)
    ax.axvline(marker, color="gray", linestyle="--", linewidth=1, label=marker_label)
    ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel="window (steps of rewards)", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
