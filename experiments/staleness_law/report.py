"""The report of experiments/staleness_law/: is the collapse time of stale training
proportional to 1 / lr (t_collapse x lr constant), and how far does DIS move it?

The source cites, for uncorrected asynchronous GRPO, a collapse horizon proportional to
1 / eta with t_collapse x eta ~ 3.2e-5 (docs/method.md section 7: a stale step is biased
by O(S eta)). Per run:

- collapse: the first step of experiments/ablations/collapse.py `detect_collapse`
  (docs/experiments.md, "Metrics and definitions").
- t_collapse, in policy versions: a collapse seen in training success (reason 'success')
  is seen on trajectories the sampler drew up to S versions earlier, so its step is moved
  back by the mean staleness of the batch at that record (`train/staleness`); the other
  reasons (held-out, entropy, non-finite) are measured on the learner's current policy
  and keep their step. At least 1.
- censoring: a run with no collapse says only t_collapse > c, c = the last step at which
  a success collapse could still start and be seen within the budget (the
  `patience`-th last log record) less the staleness of the last record. Censored runs
  stay in every estimate (Kaplan-Meier medians, the censored regression): none is dropped
  and none is counted as collapsing at the budget.
- runs that did not finish for another reason than a non-finite collapse are left out
  and listed.

The law is read from a censored log-normal regression (experiments/staleness_law/survival.py):
  log t = a + b log lr + c log S (+ d [DIS]) + sigma e,
b = -1 is "t x lr constant", c = -1 "t x S constant"; exp(d) is the factor by which DIS
multiplies the collapse time at equal lr and S. Terms whose factor has one level in the
sweep are left out.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations import report as table
from sao_jax.experiments.staleness_law import survival

from sao_jax import sweep
from sao_jax.report import compare, stats, tables
from sao_jax.report.experiment import Experiment, failures

ROWS = {"sao": "DIS", "vanilla_vapo": "no DIS"}
SEED_PRODUCT = 3.2e-5  # t_collapse x eta the source cites for uncorrected async GRPO
RULE = collapse.CollapseRule()


@dataclasses.dataclass(frozen=True)
class CollapseTime:
    """A run's collapse time in policy versions: observed (t) or censored (t > value)."""

    value: float
    observed: bool
    step: int | None  # the detected step (None: censored)
    reason: str  # collapse reason, or 'censored'


def collapse_time(
    history: tables.History, *, error: str = "", rule: collapse.CollapseRule = RULE
) -> CollapseTime | None:
    """The run's collapse time (module docstring); None when it logged too little to say."""
    c = collapse.detect_collapse(history, rule, error=error)
    steps, lag = tables.series(history, "train/staleness")
    lag_at = dict(zip(steps.tolist(), lag.tolist(), strict=True))
    if c is not None:
        shift = lag_at.get(c.step, 0.0) if c.reason == "success" else 0.0
        return CollapseTime(max(c.step - shift, 1.0), True, c.step, c.reason)
    logged, _ = tables.series(history, rule.metric)
    if logged.size < rule.patience:
        return None
    last_start = int(logged[-rule.patience])
    end_lag = lag_at.get(int(logged[-1]), 0.0)
    return CollapseTime(max(last_start - end_lag, 1.0), False, None, "censored")


MARK = {"success": "", "heldout": "h", "entropy": "e", "nonfinite": "n"}  # reason marks


def fmt_time(t: CollapseTime) -> str:
    """'17', '40h' (a held-out collapse: seen at an evaluation), '>33' (censored)."""
    return f"{t.value:.0f}{MARK.get(t.reason, '')}" if t.observed else f">{t.value:.0f}"


def cell_key(r: sweep.PointResult) -> tuple[str, int, float]:
    ov = dict(r.point.overrides)
    return r.point.variant, int(ov["sampling.max_staleness"]), float(ov["optim.policy.lr"])


def cell_times(results: Sequence[sweep.PointResult]) -> dict[tuple, list[CollapseTime]]:
    """{(row, S, lr): collapse times of its runs} over the runs that count (module doc)."""
    out: dict[tuple, list[CollapseTime]] = collections.defaultdict(list)
    for r in results:
        if r.status != "done" and "NonFiniteError" not in r.error:
            continue
        t = collapse_time(r.history, error=r.error)
        if t is not None:
            out[cell_key(r)].append(t)
    return dict(out)


def design(
    times: Mapping[tuple, Sequence[CollapseTime]], *, with_dis: bool
) -> tuple[np.ndarray, list[float], list[bool], tuple[str, ...]]:
    """(X [N, P], times, observed, names) of the regression over `times`' cells: an
    intercept, log lr and log S where they take several values, [DIS] if `with_dis`."""
    keys = [k for k, ts in times.items() for _ in ts]
    flat = [t for ts in times.values() for t in ts]
    cols, names = [np.ones(len(flat))], ["intercept"]
    for name, i in (("log lr", 2), ("log S", 1)):
        x = np.log([float(k[i]) for k in keys]) if keys else np.zeros(0)
        if len(set(x.tolist())) > 1:
            cols.append(x)
            names.append(name)
    if with_dis:
        cols.append(np.array([k[0] == "sao" for k in keys], np.float64))
        names.append("DIS")
    x_np = np.stack(cols, axis=1)
    return x_np, [t.value for t in flat], [t.observed for t in flat], tuple(names)


def fit(times: Mapping[tuple, Sequence[CollapseTime]], *, with_dis: bool):
    """The censored regression, or the reason it cannot be estimated (a string)."""
    x_np, t, obs, names = design(times, with_dis=with_dis)
    try:
        return survival.lognormal_regression(x_np, t, obs, names)
    except ValueError as e:
        return f"not estimable: {str(e).split(': ', 1)[-1]}"


def law_tests(fits: Mapping[str, object]) -> dict[str, tuple[float, float, float, float]]:
    """The family: {name: (estimate, lo, hi, p)} of slope on log lr = -1 per row and the
    DIS factor's log = 0 (joint fit); p Holm-adjusted separately by `holm`."""
    out = {}
    for name, f in fits.items():
        coef, null = ("DIS", 0.0) if name == "joint" else ("log lr", -1.0)
        if isinstance(f, survival.Fit) and coef in f.names:
            lo, hi = f.interval(coef)
            out[name] = (f.value(coef), lo, hi, f.p(coef, null))
    return out


def _fmt_slope(f, coef: str) -> str:
    if not isinstance(f, survival.Fit) or coef not in f.names:
        return "-" if isinstance(f, survival.Fit) else f
    lo, hi = f.interval(coef)
    return f"{f.value(coef):+.2f} ± {f.se(coef):.2f} [{lo:+.2f}, {hi:+.2f}]"


def _fmt_mdd(f, name: str, m: int) -> str:
    """The tested coefficient's MDD (`stats.detectable` of its SE on the fit's df),
    unadjusted and at alpha / m."""
    se = f.se("DIS" if name == "joint" else "log lr")
    mdd = lambda alpha: stats.detectable(se, f.df, alpha)
    return f"{mdd(stats.ALPHA):.2f} ({mdd(stats.ALPHA / m):.2f})"


def cell_rows(times, after) -> list[list]:
    body = []
    for key in sorted(times, key=lambda k: (k[1], k[2], list(ROWS).index(k[0]))):
        row, s, lr = key
        ts = times[key]
        med = survival.km_median([t.value for t in ts], [t.observed for t in ts])
        hit = sum(t.observed for t in ts)
        body.append(
            [
                ROWS.get(row, row),
                s,
                f"{lr:g}",
                f"{hit}/{len(ts)}",
                ", ".join(fmt_time(t) for t in sorted(ts, key=lambda t: t.value)),
                "> budget" if math.isinf(med) else f"{med:.0f}",
                "-" if math.isinf(med) else f"{med * lr:.2g}",
                compare.fmt_mean_se(after.get(key, [])),
            ]
        )
    return body


def report(exp: Experiment, spec: sweep.SweepSpec, results, wall_s: float) -> str:
    times = cell_times(results)
    after: dict[tuple, list] = collections.defaultdict(list)
    for r in results:
        if r.status == "done":
            after[cell_key(r)].append((r.summary or {}).get("after", {}).get(table.METRIC))
    fits = {
        name: fit({k: v for k, v in times.items() if k[0] == row}, with_dis=False)
        for row, name in ROWS.items()
    }
    fits["joint"] = fit(times, with_dis=True)
    tests = law_tests(fits)
    holm = stats.holm({k: v[3] for k, v in tests.items()})
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    total = spec.fixed["train.total_steps"]
    text = exp.header(
        "The staleness-learning-rate law: collapse time x lr, with and without DIS",
        spec,
        results,
        wall_s,
    )
    headers = ["row", "max staleness S", "policy lr", "collapsed", "t_collapse per run"]
    headers += ["Kaplan-Meier median t", "median t x lr", "held-out success %"]
    text += "\n" + tables.markdown_table(headers, cell_rows(times, after))
    text += (
        f"\n- t_collapse: policy versions until the run collapsed (budget {total} steps); "
        "'>c': no collapse, censored at c; a mark gives a reason other than training "
        "success: h = held-out success halved (seen only at an evaluation, here the last "
        "one: an upper bound), e = entropy, n = non-finite updates. Kaplan-Meier median: "
        "'> budget' when more than half the cell's runs outlived the budget (then no "
        "product is given). The source "
        f"cites t x lr ~ {SEED_PRODUCT:g} for uncorrected async GRPO (a 30B model, its "
        "own lr scale: compare whether the product is constant, not its value).\n"
    )
    text += "\n## Is t_collapse x lr constant? (censored log-normal regression)\n\n"
    fit_rows = []
    for name, f in fits.items():
        label = "DIS and no DIS, common slopes + DIS shift" if name == "joint" else name
        line = [label, _fmt_slope(f, "log lr"), _fmt_slope(f, "log S")]
        if isinstance(f, survival.Fit):
            line += [f"{f.sigma:.2f}", f"{f.events}/{f.n}"]
        else:
            line += ["-", "-"]
        t = tests.get(name)
        line.append(
            "-"
            if t is None
            else instead
            or f"p {compare.fmt_p(t[3])}, Holm p {compare.fmt_p(holm.get(name, math.nan))}"
        )
        line.append("-" if t is None else _fmt_mdd(f, name, len(tests)))
        fit_rows.append(line)
    text += tables.markdown_table(
        [
            "fit",
            "slope on log lr ± SE [95% CI]",
            "slope on log S ± SE [95% CI]",
            "sigma",
            "events / runs",
            "test (b = -1 per row; DIS shift = 0 joint)",
            "MDD of that coefficient (80% power, alpha 0.05; at alpha / m)",
        ],
        fit_rows,
    )
    joint = fits["joint"]
    if isinstance(joint, survival.Fit) and "DIS" in joint.names:
        d, (lo, hi) = joint.value("DIS"), joint.interval("DIS")
        text += (
            f"\n- DIS multiplies the collapse time (and t x lr) by {math.exp(d):.2f} "
            f"[95% CI {math.exp(lo):.2f}, {math.exp(hi):.2f}] at equal lr and S (joint "
            "fit, one slope for both rows).\n"
        )
    text += (
        "\n- Model: log t = a + b log lr + c log S (+ d [DIS]) + sigma e, e ~ N(0, 1); "
        "censored runs enter as P(log t > log c). b = -1: t x lr constant (the cited "
        "law); c = -1: t x S constant. Wald intervals from the observed information, "
        "Student's t on events - coefficients degrees of freedom.\n"
        f"- The family for Holm: the {len(tests)} tests of this table (slope on log lr "
        "= -1 for each row; DIS shift = 0 in the joint fit). A p above 0.05 for b = -1 "
        "is no evidence that b = -1: read the interval's width. MDD: the departure of the "
        "tested coefficient from its null that the test detects with 80% power, "
        "(t_{1 - alpha/2, df} + t_{0.8, df}) x its SE (two-sided alpha 0.05, unadjusted; in "
        "brackets at alpha / m, Holm's first step over the m tests).\n"
    )
    text += "\n" + _definitions(total)
    text += _plots(exp, results)
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, table.METRIC)
    return text


def _definitions(total: int) -> str:
    return (
        "## Definitions\n\n"
        f"- collapse: as docs/experiments.md (train success below {RULE.drop_fraction:g} x "
        f"its running max once that reached {RULE.min_peak:g}, for {RULE.patience} log "
        "records; held-out greedy success halved to the end; entropy below "
        f"{RULE.min_entropy:g}; >= {RULE.max_skipped} non-finite updates), every step "
        "logged.\n"
        "- t_collapse in policy versions: a training-success collapse is moved back by "
        "the batch's mean staleness (its trajectories were sampled that many versions "
        "earlier); censored runs: t > (the step of the last record at which a collapse "
        f"could still be seen) - (the last batch's staleness). Budget: {total} steps.\n"
    )


def _plots(exp: Experiment, results) -> str:
    text = "\n## Plots\n\n"
    by_cell: dict[tuple, list] = collections.defaultdict(list)
    for r in results:
        by_cell[cell_key(r)].append(r.history)
    for row, name in ROWS.items():
        curves = {
            f"S={s}, lr={lr:g}": plots.mean_curve(hs, "train/success")
            for (v, s, lr), hs in sorted(by_cell.items())
            if v == row
        }
        path = exp.plot_path(f"staleness_law_{row}")
        plots.plot_curves(path, f"Training success, {name}", "success", curves)
        text += f"![{path.stem}](plots/{path.name})\n"
    return text
