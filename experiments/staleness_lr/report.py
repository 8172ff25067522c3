"""The reading of experiments/staleness_lr: per cell of max staleness x policy lr, DIS
(sao) and no DIS (vanilla_vapo): collapse, success, measured staleness, keep rate, and the
DIS-minus-no-DIS difference per cell."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations import report as table

from sao_jax import sweep
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment, failures

ROWS = {"sao": "DIS", "vanilla_vapo": "no DIS"}


def measured_staleness(r: sweep.PointResult) -> str:
    """'mean / max' staleness of the trajectories the run trained on, and how many
    trajectories the cap dropped."""
    s = r.summary or {}
    hist = {int(k): int(v) for k, v in (s.get("staleness_hist") or {}).items()}
    dropped = (s.get("counters") or {}).get("dropped_stale", 0)
    if not hist:
        return "0 / 0 (sync)" if dict(r.point.overrides).get("train.rollouts") == "sync" else "n/a"
    n = sum(hist.values())
    mean = sum(k * v for k, v in hist.items()) / max(n, 1)
    return f"{mean:.2f} / {max(hist)} (dropped {dropped})"


KEEP = "policy/keep_rate"  # share of action tokens the policy loss keeps (DIS band, PPO clip)


def keep_rate(rs: Sequence[sweep.PointResult]) -> str:
    """Mean over the run of the logged keep rate (mean ± SE over seeds) and its lowest
    logged value: below 100% means the loss masked (DIS) or clipped (PPO) some tokens."""
    text = table.fmt_run_means(rs, KEEP, digits=2)
    return "n/a" if text == "-" else text


def cell(rs: Sequence[sweep.PointResult]) -> list[str]:
    # runs that never ended (running, missing) are listed below the table, not counted here
    rs = [r for r in rs if r.status in ("done", "failed")]
    if not rs:
        return ["-"] * 5
    collapses = [collapse.detect_collapse(r.history, error=r.error) for r in rs]
    train = [tables.series(r.history, "train/success")[1] for r in rs]
    after = [tables.finite((r.summary or {}).get("after", {}).get(table.METRIC)) for r in rs]
    return [
        collapse.fmt_collapses(collapses),
        compare.fmt_mean_se([t[-1] if t.size else None for t in train]),
        compare.fmt_mean_se(after),
        keep_rate(rs),
        "; ".join(measured_staleness(r) if r.status == "done" else r.status for r in rs[:1]),
    ]


def dis_difference(index, s, lr) -> compare.Difference:
    """Held-out success of DIS minus no DIS in grid cell (s, lr), paired by seed."""
    after = {
        v: {
            r.point.seed: tables.finite((r.summary or {}).get("after", {}).get(table.METRIC))
            for r in index.get((v, s, lr), [])
            if r.status == "done"
        }
        for v in ROWS
    }
    return compare.paired_difference(after["sao"], after["vanilla_vapo"])


def report(exp: Experiment, spec: sweep.SweepSpec, results, wall_s: float) -> str:
    index = collections.defaultdict(list)
    for r in results:
        ov = dict(r.point.overrides)
        key = (r.point.variant, ov.get("sampling.max_staleness"), ov.get("optim.policy.lr"))
        index[key].append(r)
    grid = sorted({(s, lr) for _, s, lr in index})
    headers = ["max staleness S", "policy lr"]
    for name in ROWS.values():
        headers += [
            f"{name}: collapsed runs",
            f"{name}: final train success %",
            f"{name}: held-out success %",
            f"{name}: keep rate % (min)",
            f"{name}: staleness mean / max (seed {spec.seeds[0]})",
        ]
    headers += ["held-out: DIS - no DIS (paired) [95% CI]", f"test (Holm over {len(grid)} cells)"]
    headers += [compare.MDD_HEADER]
    diffs = {(s, lr): dis_difference(index, s, lr) for s, lr in grid}
    holm = compare.holm_family(diffs)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    body = [
        [
            s,
            f"{lr:g}",
            *[x for v in ROWS for x in cell(index.get((v, s, lr), []))],
            compare.fmt_difference(diffs[(s, lr)]),
            instead or compare.fmt_test(diffs[(s, lr)], holm[(s, lr)]),
            compare.fmt_mdd(diffs[(s, lr)], len(diffs)),
        ]
        for s, lr in grid
    ]
    total = spec.fixed["train.total_steps"]
    text = exp.header(
        "Staleness x learning rate: collapse with and without DIS", spec, results, wall_s
    )
    text += "\n" + tables.markdown_table(headers, body)
    text += (
        f"\n'none' = no collapse within the {total}-step budget. Paper (docs/method.md section 7): "
        "the bias of a step grows like S x lr, collapse time like 1/lr; compare collapse "
        "steps only at equal learning rates. The paper reports vanilla GRPO collapsing near "
        "step 160 and VAPO without DIS near step 90, SAO stable for ~1000 steps.\n"
        "- keep rate: the logged share of action tokens the policy loss keeps (DIS: ratio "
        "to the rollout engine inside (0.7, 6.0); PPO: not clipped), averaged over the run, "
        "mean ± SE over seeds, with the lowest logged value. 100% means the mechanism never "
        "fired at that staleness and learning rate.\n"
        "- cells are mean ± SE over seeds; collapse: runs collapsed / runs.\n"
        "- DIS - no DIS: held-out success of the DIS row minus the no-DIS row of the same "
        "cell, paired by seed, ± SE [95% t interval]; test: t on n - 1 df, two-sided p, "
        "Holm-adjusted over the family of the grid's cells (one test per cell).\n"
        + compare.MDD_NOTE
    )
    text += "\n" + table.definitions_text(f"budget: {total} RL steps; held-out success at the end.")
    text += "\n## Plots\n\n"
    for variant, name in ROWS.items():
        curves = {
            f"S={s}, lr={lr:g}": plots.mean_curve(
                [r.history for r in index[(variant, s, lr)]], "train/success"
            )
            for s, lr in grid
            if (variant, s, lr) in index
        }
        path = exp.plot_path(f"staleness_lr_{variant}")
        plots.plot_curves(path, f"Training success, {name}", "success", curves)
        text += f"![{path.stem}](plots/{path.name})\n"
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, table.METRIC)
    return text
