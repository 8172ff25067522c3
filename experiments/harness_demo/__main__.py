r"""The harness demo that learns (issue 42 item 9): SFT on the calculator agent's
tool-format demonstrations, value pretraining, then async SAO on its episodes through the
rollout gateway, over seeds; the in-process `Env` path beside it as a descriptive row.

  python -m experiments.harness_demo --seeds=0,1,2 --out_dir=/tmp/harness_demo
  python -m experiments.harness_demo --from_runs=results/harness_demo/runs.jsonl

Each seed runs `experiments.train --config=configs/harness.py:seed=S` (row `gateway`:
examples/harness/calculator_agent.py processes) and `...:inprocess,seed=S` (row
`inprocess`), one run at a time (a 2-core machine). Held-out success is the run's greedy
evaluation on its 64 held-out prompts (the same rendered task: the agent's system
message, the calculator schema, experiments/harness_demo/task.py), at step 0 (after SFT
and value pretraining) and after the last update; before/after is paired per seed, with
a t-based 95% interval and the MDD (sao_jax/report/compare.py). Critic EV and the DIS
keep rate are the RL updates' means. Writes `<out_dir>/runs.jsonl` (one line per run)
and `<out_dir>/harness_demo.md`.
"""

from __future__ import annotations

import json
import math
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from sao_jax.report import compare

SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "seeds, run one after another")
OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/harness_demo", "where runs and the table go")
ROWS = flags.DEFINE_list("rows", ["gateway", "inprocess"], "rows to run")
FROM_RUNS = flags.DEFINE_string("from_runs", "", "regenerate the table from a runs file")
TIMEOUT_S = flags.DEFINE_integer("timeout_s", 900, "per run")

VARIANT = {"gateway": "", "inprocess": "inprocess,"}
SUCCESS = "eval/greedy_success"
SAMPLED = "eval/sampled_success"  # the same held-out prompts sampled at the run's law
EV_KEYS = ("critic/ev_pre_update",)  # the critic's EV on a batch before its update
KEEP_KEYS = ("policy/keep_rate",)  # the DIS mask's kept share of action tokens
VP_EV = "value_pretrain/heldout/explained_variance"


def _records(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _first_key(records: list[dict], keys) -> str | None:
    for k in keys:
        if any(k in r for r in records):
            return k
    return None


def _mean_of(records: list[dict], key: str | None) -> float:
    vals = [r[key] for r in records if key and isinstance(r.get(key), (int, float))]
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.mean(vals)) if vals else math.nan


def summarize(workdir: pathlib.Path) -> dict:
    """Before/after success, EV, keep rate and stage figures of one run's metrics."""
    recs = _records(workdir / "metrics.jsonl")
    evals = [r for r in recs if SUCCESS in r]
    rl = [r for r in recs if "train/success" in r]
    ev_key, keep_key = _first_key(rl, EV_KEYS), _first_key(rl, KEEP_KEYS)
    vp_ev = [r[VP_EV] for r in recs if VP_EV in r]
    return {
        "before": evals[0][SUCCESS] if evals else math.nan,
        "after": evals[-1][SUCCESS] if len(evals) > 1 else math.nan,
        "sampled_before": evals[0].get(SAMPLED, math.nan) if evals else math.nan,
        "sampled_after": evals[-1].get(SAMPLED, math.nan) if len(evals) > 1 else math.nan,
        "critic_ev": _mean_of(rl, ev_key),
        "ev_key": ev_key,
        "keep_rate": _mean_of(rl, keep_key),
        "keep_key": keep_key,
        # the episodes' mean reward (1 for a right answer, else 0: the task's success);
        # gateway episodes carry the harness's reward, not the env's `success` info
        "train_reward": _mean_of(rl, "train/reward"),
        "vp_heldout_ev": vp_ev[-1] if vp_ev else math.nan,
        "steps": max((r.get("step", 0) for r in rl), default=0),
    }


def run_one(row: str, seed: int, out: pathlib.Path) -> dict:
    """One training run; the inprocess row starts from the gateway row's warm start and
    pretrained critic (configs/harness.py `warm=`), so both rows' 'before' is one policy."""
    workdir = out / f"{row}_s{seed}"
    variant = VARIANT[row]
    if row != "gateway" and (out / f"gateway_s{seed}" / "warm_start").is_dir():
        variant += f"warm={out / f'gateway_s{seed}'},"
    cmd = [sys.executable, "-m", "experiments.train",
           f"--config=configs/harness.py:{variant}seed={seed}", f"--workdir={workdir}"]  # fmt: skip
    t0 = time.time()
    with open(out / f"{row}_s{seed}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S.value)
            rc = rc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"row": row, "seed": seed, "rc": rc, "wall_s": round(time.time() - t0, 1),
            "command": " ".join(cmd[1:]), **summarize(workdir)}  # fmt: skip


def _pct(x: float) -> str:
    return f"{100 * x:.1f}" if math.isfinite(x) else "n/a"


def table(runs: list[dict]) -> str:
    """Per row, greedy and sampled after - before, paired over seeds, tested as one family
    of two (Holm); the gateway row's is the demo's claim (results/harness_demo/), the
    in-process row is descriptive."""
    lines = [
        "| row | success | seeds | before (%) | after (%) | after - before, paired "
        "(pp ± SE [95% t]) | test (Holm over the row's two) | MDD (pp) | critic EV "
        "| DIS keep rate | RL steps | wall per run (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in ("gateway", "inprocess"):
        rs = [r for r in runs if r["row"] == row and r["rc"] == 0]  # failed runs: per seed only
        diffs, means = {}, {}
        for kind, b_key, a_key in (("greedy", "before", "after"),
                                   ("sampled", "sampled_before", "sampled_after")):  # fmt: skip
            before = {r["seed"]: r.get(b_key, math.nan) for r in rs}
            after = {r["seed"]: r.get(a_key, math.nan) for r in rs}
            if not rs or not all(map(math.isfinite, [*before.values(), *after.values()])):
                continue  # runs from before the sampled columns
            diffs[kind] = compare.paired_difference(after, before)
            means[kind] = (np.mean(list(before.values())), np.mean(list(after.values())))
        holm = compare.holm_family(diffs)
        for kind, d in diffs.items():
            lines.append(
                f"| {row} | {kind} | {len(rs)} | {_pct(means[kind][0])} | {_pct(means[kind][1])} "
                f"| {compare.fmt_difference(d)} | {compare.fmt_test(d, holm[kind])} "
                f"| {compare.fmt_mdd(d, len(diffs))} "
                f"| {np.nanmean([r['critic_ev'] for r in rs]):.3f} "
                f"| {np.nanmean([r['keep_rate'] for r in rs]):.3f} "
                f"| {max(r['steps'] for r in rs)} | {np.mean([r['wall_s'] for r in rs]):.0f} |"
            )
    per_seed = ["", "| row | seed | greedy before (%) | after (%) | sampled before (%) "
                "| after (%) | RL batches' reward (%) | value pretraining held-out EV "
                "| critic EV | keep rate | rc | wall (s) |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        per_seed.append(
            f"| {r['row']} | {r['seed']} | {_pct(r['before'])} | {_pct(r['after'])} "
            f"| {_pct(r.get('sampled_before', math.nan))} "
            f"| {_pct(r.get('sampled_after', math.nan))} "
            f"| {_pct(r.get('train_reward', math.nan))} | {r['vp_heldout_ev']:.3f} "
            f"| {r['critic_ev']:.3f} "
            f"| {r['keep_rate']:.3f} | {r['rc']} | {r['wall_s']} |"
        )
    return "\n".join(lines + per_seed) + "\n\n" + compare.MDD_NOTE


def main(argv):
    del argv
    if FROM_RUNS.value:  # the runs' workdirs beside the file, when there, are read again
        path = pathlib.Path(FROM_RUNS.value)
        runs = _records(path)
        for r in runs:
            workdir = path.parent / f"{r['row']}_s{r['seed']}"
            if (workdir / "metrics.jsonl").exists():
                r.update(summarize(workdir))
        print(table(runs))
        return
    out = pathlib.Path(OUT_DIR.value)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / "runs.jsonl"
    for seed in [int(s) for s in SEEDS.value]:
        for row in ROWS.value:
            rec = run_one(row, seed, out)
            rec["cpu"] = platform.processor() or platform.machine()
            with open(runs_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
    text = table(_records(runs_path))
    (out / "harness_demo.md").write_text(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
