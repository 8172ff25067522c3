"""The report of the global style shift: the online-shift experiment's previous design
(configs/online_shift.py:global_style; experiments/online_shift.py --design=global).

One target style for every prompt, switching cute -> chuunibyou -> classical at two steps
(sao_jax/envs/style.py). Per seed, the score is the mean training reward over the phases
after the switches; rows are paired by seed with SAO, t intervals and Holm within the
report's family; the critic's EV and the policy signal around the switches; time to
recover. Why this design cannot test the paper's claim: docs/experiments.md.
"""

from __future__ import annotations

import math

import numpy as np

from sao_jax import sweep
from sao_jax.envs.style import STYLES
from sao_jax.report import ablations as table
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment, by_row, failures

METRIC = "train/reward"  # r_quality * r_style under the current target style
RECOVER_FRACTION = 0.8  # recovered: reward back to 0.8 x its pre-switch level
MIN_LEVEL = 0.1  # a pre-switch reward below this leaves nothing to recover
EV_METRIC = "critic/ev_pre_update"  # the critic's EV on each fresh batch before its update
EARLY_STEPS = 10  # the critic EV table splits each phase into its first 10 steps and the rest
ADV_METRICS = {  # the policy signal: metric -> its name in the report
    "adv/advantage": "mean advantage",
    "adv/advantage_std": "advantage std",
    "policy/grad_norm": "policy grad norm",
}
LABELS = {
    "sao": "SAO",
    "moving_average": "moving-average baseline",
    "sao_sync": "SAO, synchronous rollouts",
    "moving_average_sync": "moving-average baseline, synchronous rollouts",
}
IN_PROSE = {  # each row's name inside a sentence of the verdicts
    "sao": "SAO",
    "moving_average": "the moving average",
    "sao_sync": "synchronous SAO",
    "moving_average_sync": "the synchronous moving average",
}
# (row, its reference) compared in the verdicts, paired by seed: the async pair, and the
# synchronous pair (no staleness: any gap left is the advantage estimator alone).
PAIRS = (("moving_average", "sao"), ("moving_average_sync", "sao_sync"))
PAIR_QUESTIONS = {
    "moving_average": "does laptop scale reproduce the paper's claim?",
    "moving_average_sync": "with the staleness confound removed (both rows synchronous, "
    "SAO vs the moving average paired by seed)?",
}


# --------------------------------------------------------------------------- report


def phases(switches: tuple[int, ...], total: int) -> list[tuple[str, int, int]]:
    """(style, first step, end step) of each target style."""
    edges = [0, *switches, total + 1]
    return [(STYLES[i], edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def phase_means(history, switches: tuple[int, ...], total: int) -> list[float | None]:
    """Mean `METRIC` over each phase's logged steps (None where nothing was logged)."""
    steps, v = tables.series(history, METRIC)
    out = []
    for _, a, b in phases(switches, total):
        sel = v[(steps >= a) & (steps < b)]
        out.append(float(np.mean(sel)) if sel.size else None)
    return out


def recovery_score(history, switches: tuple[int, ...], total: int) -> float | None:
    """The per-seed score of the table: mean training reward over the phases after a
    switch (every phase but the first), i.e. the area under the reward curve while the
    policy chases a new target. Higher = recovers sooner and further."""
    after = phase_means(history, switches, total)[1:]
    return float(np.mean(after)) if after and all(x is not None for x in after) else None


def phase_ev(history, switches: tuple[int, ...], total: int) -> list[float | None]:
    """Mean `EV_METRIC` over each phase's first `EARLY_STEPS` steps, then over the rest of
    the phase: [phase0 early, phase0 rest, phase1 early, ...] (None where nothing logged)."""
    steps, v = tables.series(history, EV_METRIC)
    out = []
    for _, a, b in phases(switches, total):
        for lo, hi in ((a, min(a + EARLY_STEPS, b)), (min(a + EARLY_STEPS, b), b)):
            sel = v[(steps >= lo) & (steps < hi)]
            out.append(float(np.mean(sel)) if sel.size else None)
    return out


def window_mean(history, metric: str, lo: int, hi: int) -> float | None:
    """Mean of `metric` over the logged steps lo <= step < hi (None if none logged)."""
    steps, v = tables.series(history, metric)
    sel = v[(steps >= lo) & (steps < hi)]
    return float(np.mean(sel)) if sel.size else None


def signal_windows(switches: tuple[int, ...], total: int) -> list[tuple[str, int, int]]:
    """(label, lo, hi) of the advantage table, in step order: for each phase after a
    switch, its first `EARLY_STEPS` steps (does the baseline lag?), then the rest."""
    out = []
    for _, a, b in phases(switches, total)[1:]:
        e = min(a + EARLY_STEPS, b)
        out += [(f"steps {a}-{e - 1}", a, e), (f"steps {e}-{b - 1}", e, b)]
    return out


def signal_text(rows, switches: tuple[int, ...], total: int) -> str:
    """How large and how centred each row's policy signal is around the switches: mean
    and std of the advantages of action tokens and the policy gradient norm per window."""
    windows = signal_windows(switches, total)
    headers = ["row", "quantity", *(w[0] for w in windows)]
    body = []
    for metric, name in ADV_METRICS.items():
        for row, rs in rows.items():
            per_window = [
                [window_mean(r.history, metric, lo, hi) for r in rs] for _, lo, hi in windows
            ]
            if all(x is None for w in per_window for x in w):
                continue  # the row does not log it
            cells = [compare.fmt_mean_se(w, scale=1.0, digits=3) for w in per_window]
            body.append([LABELS.get(rs[0].point.variant, row), name, *cells])
    if not body:
        return ""
    return (
        "\n## The policy signal around the switches\n\n"
        + tables.markdown_table(headers, body)
        + f"\n- Each cell: mean ± SE over seeds of the run's mean of the logged "
        f"`{'`, `'.join(ADV_METRICS)}` (advantages over the action tokens of each batch) in "
        f"the window: the first {EARLY_STEPS} steps after each switch, then the rest of the "
        "phase. A negative mean after a switch is a baseline (critic value or reward "
        "average) still at the old style's level; the std and the gradient norm are the "
        "size of the signal the policy step gets at the same learning rate (the DIS and "
        "policy-gradient losses do not normalise advantages).\n"
    )


def critic_text(rows, switches: tuple[int, ...], total: int) -> str:
    """Does the critic see the switches? Its pre-update EV per phase, early vs late."""
    headers = ["row"]
    for style, a, b in phases(switches, total):
        e = min(a + EARLY_STEPS, b)
        headers += [f"critic EV {style}, steps {a}-{e - 1}", f"steps {e}-{b - 1}"]
    body = []
    for row, rs in rows.items():
        per_run = [phase_ev(r.history, switches, total) for r in rs]
        if not any(x is not None for p in per_run for x in p):
            continue
        line = [LABELS.get(rs[0].point.variant, row)]
        for i in range(2 * (len(switches) + 1)):
            line.append(compare.fmt_mean_se([p[i] for p in per_run], scale=1.0, digits=2))
        body.append(line)
    if not body:
        return ""
    return (
        "\n## The critic around the switches\n\n"
        + tables.markdown_table(headers, body)
        + f"\n- Each cell: mean ± SE over seeds of the run's mean `{EV_METRIC}` (explained "
        "variance of the critic's values on each fresh batch, before the critic trains on "
        f"it) over the first {EARLY_STEPS} steps of a phase and over the rest. EV <= 0: "
        "the critic's values explain none of the returns, so SAO's advantages are noise "
        "plus a shift (the moving average's 128-reward window also lags; compare their "
        "mean advantages after each switch in the next table).\n"
    )


def report(exp: Experiment, spec: sweep.SweepSpec, results, wall_s: float) -> str:
    switches = tuple(spec.fixed["env.params.switch_steps"])
    total = spec.fixed["train.total_steps"]
    window = max(4, min(switches[0], switches[-1] - switches[0]) // 2)
    rows = by_row(results)
    headers = ["row", "runs"]
    headers += [
        f"mean reward % {style}, steps {a}-{b - 1}" for style, a, b in phases(switches, total)
    ]
    scores = {
        rs[0].point.variant: {r.point.seed: recovery_score(r.history, switches, total) for r in rs}
        for rs in rows.values()
    }
    diffs = family(scores)
    holm = compare.holm_family(diffs)
    headers += ["score: mean reward % after the switches", "Δ vs SAO (paired, ± SE [95% CI])"]
    headers += [f"test (Holm over {len(diffs)})", "verdict"]
    headers += [f"steps to recover after {s}" for s in switches]
    headers += ["lowest reward % after a switch (mean over switches)"]
    ref = scores.get("sao", {})
    body = []
    for row, rs in rows.items():
        variant = rs[0].point.variant
        n_done = sum(r.status == "done" for r in rs)
        line = [LABELS.get(variant, row), f"{n_done}/{len(rs)}"]
        per_phase = [phase_means(r.history, switches, total) for r in rs]
        for i in range(len(switches) + 1):
            line.append(compare.fmt_mean_se([p[i] for p in per_phase]))
        line.append(compare.fmt_mean_se(list(scores[variant].values())))
        if variant == "sao":
            line += ["(reference)", "-", "-"]
        else:
            d, p = diffs[(variant, "sao")], holm[(variant, "sao")]
            line += [compare.fmt_difference(d), compare.fmt_test(d, p), compare.verdict(d, p)]
        dips = []
        for i, s in enumerate(switches):
            until = switches[i + 1] if i + 1 < len(switches) else None
            recs = [
                tables.time_to_recover(
                    *tables.series(r.history, METRIC),
                    s,
                    window=window,
                    fraction=RECOVER_FRACTION,
                    until=until,
                    min_level=MIN_LEVEL,
                )
                for r in rs
            ]
            got = [x.steps for x in recs if x is not None and x.steps is not None]
            dips += [x.dip for x in recs if x is not None]
            n_def = sum(x is not None for x in recs)
            if n_def == 0:
                line.append(f"n/a (reward before the switch < {100 * MIN_LEVEL:g}%)")
            elif got:
                steps_text = compare.fmt_mean_se(got, scale=1, digits=0)
                line.append(f"{steps_text} ({len(got)}/{n_def} recovered)")
            else:
                line.append(f"not within the phase (0/{n_def})")
        line.append(compare.fmt_mean_se(dips))
        body.append(line)
    curves = {
        LABELS.get(rs[0].point.variant, row): tables.mean_curve([r.history for r in rs], METRIC)
        for row, rs in rows.items()
    }
    path = exp.plot_path("online_shift_reward")
    tables.plot_curves(
        path,
        "Reward under a moving target style",
        "reward (quality x style)",
        curves,
        vlines=switches,
        vline_label="style switch",
    )
    text = exp.header("Online learning with a moving target (style shift)", spec, results, wall_s)
    text += "\n" + tables.markdown_table(headers, body)
    n_seeds = len(ref)
    text += (
        f"\n- score: per seed, the mean training reward over the phases after the "
        f"switches (steps {switches[0]}-{total}): the area under the reward curve while the "
        "policy chases a new target; mean ± standard error over seeds. Δ vs SAO: paired by "
        f"seed (same seed = same warm start and prompt stream), d = row - SAO, SE = std(d) / "
        f"sqrt(n), {n_seeds} seeds, with its 95% Student t interval (n - 1 degrees of "
        "freedom). test: t = Δ / SE, two-sided p, and the p Holm-adjusted over the family "
        f"of this report's {len(diffs)} paired differences (every row minus SAO, and each "
        "pair below that is not among them: the synchronous moving average minus "
        "*synchronous* SAO); a verdict or a pair's answer calls a difference only at Holm "
        f"p < {compare.ALPHA:g}.\n"
        f"- steps to recover: from the switch to the first logged step where the training "
        f"reward, after dropping below {RECOVER_FRACTION:g} x its mean over the {window} "
        "steps before the switch, is back above it, within the same phase (records before "
        "the drop still hold rewards judged before the switch); mean ± SE over the seeds "
        "that recovered.\n"
        "- reachability: consecutive styles share 3 of their 12 marker words "
        "(sao_jax/envs/style.py), so lines of the old style that use two shared words are "
        "already rewarded under the new one; the warm start imitates all three styles.\n"
        "- paper (docs/method.md section 6): SAO's critic re-aligns quickly after each switch; "
        "the moving-average baseline lags because its 128-reward window still reflects the "
        "old style (here 128 rewards = 2 batches). The paper gives no number for the gap. "
        "GRPO cannot run here (one trajectory per prompt).\n"
    )
    text += pairs_text(scores, holm)
    text += critic_text(rows, switches, total)
    text += signal_text(rows, switches, total)
    text += "\n" + table.mechanisms_text(rows, labels=LABELS)
    text += f"\n## Plots\n\n![{path.stem}](plots/{path.name})\n"
    text += failures(results)
    text += "\n## Every run\n\n" + tables.points_table(results, rule=None)
    return text


def family(scores: dict[str, dict[int, float | None]]) -> dict[tuple[str, str], compare.Difference]:
    """The report's tested differences, paired by seed, keyed (row, reference): every row
    minus SAO (the table's Δ column), then each `PAIRS` entry not among them (the
    synchronous pair: synchronous moving average minus synchronous SAO). One Holm family."""
    keys = [(v, "sao") for v in scores if v != "sao"]  # no SAO run: n/a, not in the family
    keys += [k for k in PAIRS if k not in keys and k[0] in scores and k[1] in scores]
    return {
        (row, ref): compare.paired_difference(scores[row], scores.get(ref, {})) for row, ref in keys
    }


def pairs_text(
    scores: dict[str, dict[int, float | None]], holm: dict[tuple[str, str], float] | None = None
) -> str:
    """One verdict line per `PAIRS` entry whose two rows ran (row - reference, paired),
    read at its Holm-adjusted p over `family(scores)` (computed here when not given)."""
    holm = compare.holm_family(family(scores)) if holm is None else holm
    out = ""
    for row, ref in PAIRS:
        if row in scores and ref in scores:
            d = compare.paired_difference(scores[row], scores[ref])
            verdict = shift_verdict(d, holm[(row, ref)], sao=IN_PROSE[ref], ma=IN_PROSE[row])
            out += f"- {PAIR_QUESTIONS[row]} {verdict}\n"
    return out


def shift_verdict(
    d: compare.Difference | None,
    holm_p: float = math.nan,
    *,
    sao: str = "SAO",
    ma: str = "the moving average",
) -> str:
    """SAO vs the moving average after the switches (d = moving average - SAO, paired):
    yes / the opposite / not shown at Holm-adjusted p < compare.ALPHA (the unadjusted p
    when `holm_p` is NaN), with the 95% t interval and what the design detects.
    `sao` / `ma` name the two rows (e.g. their synchronous versions)."""
    if d is None or d.n < 2 or d.se != d.se:
        return "**Not decidable**: fewer than two paired seeds."
    p, which = (holm_p, "Holm p") if math.isfinite(holm_p) else (d.p, "p")
    lo, hi = d.interval()  # of ma - sao; sao - ma is [-hi, -lo]
    test = (
        f"t {d.t:+.1f} on {d.dof:g} df, {which} {compare.fmt_p(p)}; 95% interval for {sao} "
        f"minus {ma}: [{100 * -hi:+.1f}, {100 * -lo:+.1f}] points; this design detects "
        f"differences of {100 * d.mdd:.1f} points or more (80% power)"
    )
    if p < compare.ALPHA and d.diff < 0:
        return (
            f"**Yes**: {sao}'s score is {100 * -d.diff:.1f} ± {100 * d.se:.1f} points "
            f"above {ma}'s ({test})."
        )
    if p < compare.ALPHA:
        return (
            f"**No, the opposite**: {ma} scores {100 * d.diff:.1f} ± {100 * d.se:.1f} points "
            f"above {sao} ({test}). The interval excludes every gain in the paper's "
            "direction: the claim is absent here, not unmeasured; the tables below show why."
        )
    return (
        f"**Not shown**: the difference ({100 * -d.diff:+.1f} ± {100 * d.se:.1f} points for "
        f"{sao}) is not significant ({test})."
    )
