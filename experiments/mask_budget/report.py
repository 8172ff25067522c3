"""The calibration and report of experiments/mask_budget/: DIS, ESTR and IcePop at a
matched mask budget.

Calibration (`calibrate_pilots`): the pilot runs (DIS at its default band, one per seed,
at the cell's staleness and lr) dump the action tokens of the calibration steps
(sao_jax/run/token_dump.py); pooled over the pilots, each rule's parameter is set to mask
each budget's share of them (sao_jax/rl/mask_budget.py). Step 1 is dumped too: its ratios
carry no staleness (all tokens sampled by the current policy), and the report states how
far from 1 they are.

Per run of the budget sweep (all logged every step, metrics.jsonl):
- achieved mask fraction at the calibration steps: 1 - `policy/keep_rate` over those
  steps (the rule on its own run's batches: the policies have diverged from the pilot's
  by then, and the seeds differ, so it is not exactly the target);
- keep rate over the run: the mean of the logged `policy/keep_rate`;
- mean entropy of the masked and of the kept tokens over the run, token-weighted: each
  record's `policy/masked_entropy` weighted by its masked tokens, (1 - keep rate) x
  `train/action_tokens` (and the kept alike);
- collapse (experiments/ablations/collapse.py `detect_collapse`) and held-out success at
  the end.
Each rule's differences from DIS at the same budget are paired by seed; the held-out
differences are one Holm family (every rule x budget), the masked-token entropy
differences another.
"""

from __future__ import annotations

import collections
import math
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np
from sao_jax.experiments.ablations import collapse, plots
from sao_jax.experiments.ablations import report as table

from sao_jax import sweep
from sao_jax.report import compare, tables
from sao_jax.report.experiment import Experiment, failures
from sao_jax.rl import losses
from sao_jax.rl import mask_budget as mb
from sao_jax.run import token_dump

ROWS = {"sao": "dis", "estr": "estr", "icepop": "icepop"}  # the sweep's row -> its rule
KEEP, MASKED_H, KEPT_H = "policy/keep_rate", "policy/masked_entropy", "policy/kept_entropy"


def calibrate_pilots(
    workdirs: Sequence[pathlib.Path],
    steps: Sequence[int],
    budgets: Sequence[float],
    path: pathlib.Path,
    meta: Mapping,
) -> dict:
    """Calibrates every rule to every budget on the pooled tokens of `steps` of the pilot
    runs in `workdirs`, writes the calibration file `path` (with `meta`, the tokens'
    summary and each rule's mask at its default parameters) and returns its contents."""
    tok = token_dump.read(workdirs, steps)
    cals = [mb.calibrate(r, tok.log_ratio, tok.entropy, f) for f in budgets for r in mb.RULES]
    defaults = {}
    for name, rule in mb.RULES.items():
        params = dict(losses.LOSSES.get(rule.loss).params)
        got = mb.mask_stats(name, params, tok.log_ratio, tok.entropy)
        defaults[name] = dict(params=params, **got._asdict())
    info = dict(
        meta,
        pilots=[str(w) for w in workdirs],
        steps=list(steps),
        tokens=tok.size,
        mean_staleness=float(np.mean(tok.staleness)),
        mean_abs_log_ratio=float(np.mean(np.abs(tok.log_ratio))),
        mean_entropy=float(np.mean(tok.entropy)),
        defaults=_finite(defaults),
        step_one=step_one(workdirs),
    )
    mb.write_calibration(path, cals, info)
    return mb.read_calibration(path)


def _finite(x):
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return None if isinstance(x, float) and not math.isfinite(x) else x


def step_one(workdirs: Sequence[pathlib.Path]) -> dict:
    """The pilots' step-1 batches (sampled by the very policy that trains on them): how
    many tokens, the largest |log r| and the share with |log r| > 1e-3."""
    tok = token_dump.read(workdirs, [1])
    a = np.abs(tok.log_ratio)
    return dict(
        tokens=tok.size,
        max_abs_log_ratio=float(np.max(a, initial=0.0)),
        share_above_1e3=float(np.mean(a > 1e-3)) if a.size else 0.0,
        max_staleness=int(np.max(tok.staleness, initial=0)),
    )


def budget_of(r: sweep.PointResult, levels: Mapping[float, Mapping[str, float]]) -> float | None:
    """The budget whose calibrated level the point's overrides hold (None: none does)."""
    ov = dict(r.point.overrides)
    for f, level in levels.items():
        if all(ov.get(k) == v for k, v in level.items()):
            return f
    return None


def weighted_entropy(history: tables.History, entropy: str, *, masked: bool) -> float | None:
    """Token-weighted mean over the run of a per-record entropy mean (module docstring)."""
    at = {}
    for key in (KEEP, entropy, "train/action_tokens"):
        steps, v = tables.series(history, key)
        at[key] = dict(zip(steps.tolist(), v.tolist(), strict=True))
    num = den = 0.0
    for step, h in at[entropy].items():
        keep, n = at[KEEP].get(step), at["train/action_tokens"].get(step)
        if keep is None or n is None:
            continue
        w = (1.0 - keep if masked else keep) * n
        num, den = num + w * h, den + w
    return num / den if den > 0 else None


def achieved(history: tables.History, steps: Sequence[int]) -> float | None:
    """1 - the mean logged keep rate over `steps` (None if none was logged)."""
    vals = [tables.value_at(history, KEEP, s) for s in steps]
    vals = [v for v in vals if v is not None]
    return 1.0 - float(np.mean(vals)) if vals else None


def _by_seed(rs, fn) -> dict[int, float]:
    out = {}
    for r in rs:
        v = fn(r)
        if v is not None and math.isfinite(v):
            out[r.point.seed] = v
    return out


def _after(r: sweep.PointResult) -> float | None:
    return tables.finite((r.summary or {}).get("after", {}).get(table.METRIC))


def _masked_h(r: sweep.PointResult) -> float | None:
    return weighted_entropy(r.history, MASKED_H, masked=True)


def _kept_h(r: sweep.PointResult) -> float | None:
    return weighted_entropy(r.history, KEPT_H, masked=False)


def calibration_text(cal: Mapping) -> str:
    """The calibration table: per budget and rule its parameters and what it masks on the
    pooled calibration tokens, with each rule's default parameters beside."""
    fmt_h = lambda x: "n/a" if x is None else f"{x:.3f}"
    body = []
    for key, by_rule in sorted(cal["budgets"].items(), key=lambda kv: float(kv[0])):
        for name in mb.RULES:
            c = by_rule[name]
            params = ", ".join(f"{k} {v:g}" for k, v in c["params"].items())
            body.append(
                [
                    f"{100 * float(key):g}%",
                    mb.RULES[name].label,
                    params,
                    f"{100 * c['achieved']:.2f}",
                    fmt_h(c.get("masked_entropy")),
                    fmt_h(c.get("kept_entropy")),
                ]
            )
    for name, d in cal.get("defaults", {}).items():
        params = ", ".join(f"{k} {v:g}" for k, v in d["params"].items())
        body.append(
            [
                "default",
                mb.RULES[name].label.split(",")[0],
                params,
                f"{100 * d['fraction']:.2f}",
                fmt_h(d.get("masked_entropy")),
                fmt_h(d.get("kept_entropy")),
            ]
        )
    headers = ["budget", "rule", "parameters", "masks % of calibration tokens"]
    headers += ["mean entropy, masked tokens", "mean entropy, kept tokens"]
    one = cal.get("step_one", {})
    lines = [
        "## Calibration",
        "",
        f"- tokens: the {cal['tokens']} action tokens of steps "
        f"{', '.join(map(str, cal['steps']))} of {len(cal['pilots'])} pilot run(s) (DIS at "
        f"its default band, seeds {', '.join(map(str, cal.get('seeds', [])))}), mean "
        f"staleness {cal['mean_staleness']:.2f} versions, mean |log r| "
        f"{cal['mean_abs_log_ratio']:.4f}, mean entropy {cal['mean_entropy']:.3f} nats.",
        f"- step 1 (staleness at most {one.get('max_staleness', '?')}, {one.get('tokens', '?')}"
        f" tokens): largest |log r| {one.get('max_abs_log_ratio', math.nan):.2g}, share above "
        f"1e-3 {100 * one.get('share_above_1e3', math.nan):.2f}%. The rollout engine and "
        "the learner agree there up to rounding, so a mask budget set at step 0 would "
        "calibrate rounding noise: the budget is set on the first batches that can carry "
        "the full staleness instead.",
        "",
        tables.markdown_table(headers, body),
    ]
    return "\n".join(lines)


def report(
    exp: Experiment,
    spec: sweep.SweepSpec,
    results: Sequence[sweep.PointResult],
    wall_s: float,
    *,
    calibration: Mapping,
    levels: Mapping[float, Mapping[str, float]],
    calibration_steps: Sequence[int],
) -> str:
    groups: dict[tuple, list] = collections.defaultdict(list)
    for r in results:
        groups[(budget_of(r, levels), r.point.variant)].append(r)
    total = spec.fixed["train.total_steps"]
    held, ent = {}, {}
    finals = {
        k: _by_seed([r for r in rs if r.status == "done"], _after) for k, rs in groups.items()
    }
    masked = {k: _by_seed(rs, _masked_h) for k, rs in groups.items()}
    for f, row in groups:
        if row != "sao" and (f, "sao") in groups:
            held[(f, row)] = compare.paired_difference(finals[(f, row)], finals[(f, "sao")])
            ent[(f, row)] = compare.paired_difference(masked[(f, row)], masked[(f, "sao")])
    holm_held, holm_ent = compare.holm_family(held), compare.holm_family(ent)
    instead = exp.withheld(results)  # a pilot's or an incomplete table's: no test read
    headers = ["budget", "rule", "runs", "achieved mask % at calibration steps"]
    headers += ["keep rate % over the run (min)", "entropy of masked tokens (nats)"]
    headers += ["entropy of kept tokens", "collapse", "held-out success %"]
    headers += ["held-out Δ vs DIS (paired) [95% CI]", f"test (Holm over {len(held)})"]
    headers += [f"held-out {compare.MDD_HEADER}"]
    headers += ["masked-entropy Δ vs DIS [95% CI]", f"test (Holm over {len(ent)})"]
    headers += [f"masked-entropy {compare.MDD_HEADER}"]
    body = []
    order = lambda k: (math.inf if k[0] is None else k[0], list(ROWS).index(k[1]))
    for key in sorted(groups, key=order):
        f, row = key
        rs = [r for r in groups[key] if r.status in ("done", "failed")]
        line = [
            "?" if f is None else f"{100 * f:g}%",
            mb.RULES[ROWS[row]].label if row in ROWS else row,
            f"{sum(r.status == 'done' for r in rs)}/{len(groups[key])}",
            compare.fmt_mean_se([achieved(r.history, calibration_steps) for r in rs], digits=2),
            table.fmt_run_means(rs, KEEP, digits=2),
            compare.fmt_mean_se([_masked_h(r) for r in rs], scale=1.0, digits=3),
            compare.fmt_mean_se([_kept_h(r) for r in rs], scale=1.0, digits=3),
            collapse.fmt_collapses(
                [collapse.detect_collapse(r.history, error=r.error) for r in rs]
            ),
            compare.fmt_mean_se(list(finals[key].values())),
        ]
        if key in held:
            line += [
                compare.fmt_difference(held[key]),
                instead or compare.fmt_test(held[key], holm_held[key]),
                compare.fmt_mdd(held[key], len(held)),
                compare.fmt_difference(ent[key], scale=1.0, digits=3),
                instead or compare.fmt_test(ent[key], holm_ent[key]),
                compare.fmt_mdd(ent[key], len(ent), scale=1.0, digits=3),
            ]
        else:
            line += ["(reference)" if row == "sao" else "-", "-", "-", "-", "-", "-"]
        body.append(line)
    s, lr = _cell(spec)
    text = exp.header(
        "Fixed band vs entropy-scaled band at a matched mask budget (DIS, ESTR, IcePop)",
        spec,
        results,
        wall_s,
    )
    text += "\n" + tables.markdown_table(headers, body)
    text += (
        f"\n- Every run: max staleness S = {s}, policy lr {lr:g}, {total} RL steps, logged "
        "every step; held-out success at the end (eval/sampled_success), mean ± SE over "
        "seeds. Each rule's parameters were calibrated to mask the budget's share of the "
        "same pilot tokens (## Calibration); 'achieved' is the share it masked on its own "
        f"run's batches at steps {', '.join(map(str, calibration_steps))}.\n"
        "- Entropies: token-weighted means over the run of the entropy of the tokens the "
        "rule masked (kept). ESTR's claim: at equal budget an entropy-scaled band masks "
        "lower-entropy tokens than a fixed band and trains more stably.\n"
        f"- Families for Holm: the {len(held)} held-out differences from DIS (every rule "
        f"and budget), and separately the {len(ent)} masked-entropy differences from DIS. "
        "Differences are paired by seed (shared warm start, prompts and sampling keys), "
        "read with Student's t on n - 1 df.\n" + compare.MDD_NOTE
    )
    text += "\n" + calibration_text(calibration) + "\n"
    text += "\n" + table.definitions_text(f"budget: {total} RL steps.")
    text += _plots(exp, groups)
    text += failures(results)
    text += "\n## Every run\n\n" + collapse.points_table(results, table.METRIC)
    return text


def _cell(spec: sweep.SweepSpec) -> tuple:
    level = {k: v for axis in spec.grid for lv in axis for k, v in lv.items()}
    return level.get("sampling.max_staleness"), level.get("optim.policy.lr", math.nan)


def _plots(exp: Experiment, groups) -> str:
    rows = {
        f"{mb.RULES[ROWS[row]].label.split(',')[0]}, {100 * f:g}%": rs
        for (f, row), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1]))
        if f is not None and row in ROWS
    }
    return plots.plots_text(
        plots.mean_curves(
            exp, f"mask_budget_{what}", f"{title} (mean ± std over seeds)", m, m, rows
        )
        for m, what, title in (
            ("train/success", "success", "Training success"),
            (MASKED_H, "masked_entropy", "Mean entropy of masked tokens"),
        )
    )
