r"""Is value learnable on the demo task? Per-level success of the warm start and a critic's
explained variance on rollouts it never trained on.

  python -m experiments.testbed_probe --config=configs/sao.py --seeds=0,1,2 \
      --workdir=workdirs/probe --vp_steps=150 --heldout=512

Per seed: the config's SFT warm start (reused from `<workdir>/seed=<n>/warm_start` when
there), then
1. held-out rollouts: `--heldout` prompts of the eval split, one sampled rollout each
   (T = 1) with the warm-start policy, plus greedy decoding of the same prompts: success
   per level (the prompt's `level` meta; one level for tasks without levels);
2. value pretraining on fresh rollouts: every step samples `rl.batch_size` new rollouts
   of training prompts (no reuse) and takes one `Learner.value_step` (Monte-Carlo
   targets, rl.lam_critic = 1);
3. every `--ev_every` steps, explained variance 1 - Var(R - V) / Var(R) over the action
   tokens of ALL held-out rollouts pooled (R = the outcome, gamma = lambda = 1);
4. reference predictors on the same held-out tokens: the mean (what a moving average
   knows: EV 0 by construction), the per-level mean (a prompt-level oracle, fitted on the
   held-out set itself, so an upper bound for prompt-only information) and the per-level
   x tool-errors-so-far mean (what the visible `e:` events add).
Writes `<workdir>/probe.json` and prints a table; mean and standard error over seeds.
"""

from __future__ import annotations

import collections
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from sao_jax import config as config_lib
from sao_jax.data.prompts import prompt_source
from sao_jax.rl import passes
from sao_jax.rollouts import SyncRollouts
from sao_jax.sampling.engine import Engine
from sao_jax.sampling.trajectory import pad_batch
from sao_jax.train import Run

CONFIG = flags.DEFINE_string("config", "configs/sao.py", "Config file[:variant].")
SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds (one warm start each).")
WORKDIR = flags.DEFINE_string("workdir", "workdirs/probe", "Warm starts and probe.json.")
VP_STEPS = flags.DEFINE_integer("vp_steps", 150, "Value-pretraining steps on fresh rollouts.")
EV_EVERY = flags.DEFINE_integer("ev_every", 30, "Held-out EV every this many steps.")
HELDOUT = flags.DEFINE_integer("heldout", 512, "Held-out prompts (one rollout each).")
SFT_STEPS = flags.DEFINE_integer("sft_steps", -1, "Override sft.steps (-1: the config's).")
ERROR_RATE = flags.DEFINE_float("error_rate", -1.0, "Override sft.error_rate (-1: config's).")
CRITIC_LR = flags.DEFINE_float("critic_lr", -1.0, "Override optim.critic.lr (-1: config's).")


def level(prompt_meta: dict) -> int:
    return int(prompt_meta.get("level", 0))


def ev(pred: np.ndarray, target: np.ndarray) -> float:
    """1 - Var(target - pred) / Var(target) over pooled tokens."""
    var = np.var(target)
    return float(1.0 - np.var(target - pred) / var) if var > 0 else float("nan")


def token_table(trajs, levels_of: dict[str, int]) -> dict[str, np.ndarray]:
    """Per action token: outcome R, the prompt's level, tool errors seen so far."""
    rows = collections.defaultdict(list)
    for t in trajs:
        idx = np.nonzero(t.action_mask)[0]
        # tool errors seen so far: observation turns answered with 'e:' before each token
        n_err = np.zeros(len(t.tokens), np.int32)
        turn_err = [bool(i.get("error")) for i in t.info.get("turn_infos", [])]
        if turn_err:
            turn_of = t.turn_ids
            errs_before = np.concatenate([[0], np.cumsum(turn_err)])
            n_err = errs_before[np.clip(turn_of, 0, len(turn_err))]
        rows["R"].append(np.full(len(idx), t.outcome))
        rows["level"].append(np.full(len(idx), levels_of.get(t.prompt_uid, 0)))
        rows["errors"].append(np.minimum(n_err[idx], 3))
    return {k: np.concatenate(v) for k, v in rows.items()}


def group_mean_ev(tab: dict[str, np.ndarray], keys: tuple[str, ...]) -> float:
    """EV of predicting R by its mean within groups of `keys` (fitted in-sample)."""
    key = np.zeros_like(tab["R"], dtype=np.int64)
    for k in keys:
        key = key * 16 + tab[k].astype(np.int64)
    pred = np.zeros_like(tab["R"], dtype=np.float64)
    for g in np.unique(key):
        sel = key == g
        pred[sel] = tab["R"][sel].mean()
    return ev(pred, tab["R"])


def critic_ev(run: Run, critic, trajs, batch_size: int) -> float:
    """Pooled held-out EV of the critic's values on every action token."""
    fn = jax.jit(lambda p, b: passes.critic_pass(run.models.critic_def.bind(p), b)["values"])
    preds, targets = [], []
    for i in range(0, len(trajs), batch_size):
        chunk = trajs[i : i + batch_size]
        batch = pad_batch(chunk, length=run.config.sampling.max_len, num_rows=batch_size)
        values = np.asarray(fn(critic, {k: jnp.asarray(v) for k, v in batch.items()}))
        for row, t in enumerate(chunk):
            m = batch["action_mask"][row]
            preds.append(values[row][m])
            targets.append(np.full(int(m.sum()), t.outcome))
    return ev(np.concatenate(preds), np.concatenate(targets))


def per_level(trajs, levels_of) -> dict[int, tuple[float, int]]:
    out = collections.defaultdict(list)
    for t in trajs:
        out[levels_of.get(t.prompt_uid, 0)].append(bool(t.info.get("success", False)))
    return {k: (float(np.mean(v)), len(v)) for k, v in sorted(out.items())}


def probe_seed(seed: int) -> dict:
    config = config_lib.load_config(
        f"{CONFIG.value},seed={seed}" if ":" in CONFIG.value else f"{CONFIG.value}:seed={seed}"
    )
    if SFT_STEPS.value >= 0:
        config.sft.steps = SFT_STEPS.value
    if ERROR_RATE.value >= 0:
        config.sft.error_rate = ERROR_RATE.value
    if CRITIC_LR.value > 0:
        config.optim.critic.lr = CRITIC_LR.value
    config.train.progress = False
    workdir = pathlib.Path(WORKDIR.value) / f"seed={seed}"
    ws = workdir / "warm_start"
    if ws.is_dir():
        config.init.kind, config.init.params_path = "params", str(ws)
    config = config_lib.validate(config)
    t0 = time.time()
    run = Run(config, workdir)
    state = run.warm_start()
    t_sft = time.time() - t0
    env = config.env
    kw = dict(seed=seed, eval_fraction=env.eval_fraction, **env.prompts)
    held_prompts = list(prompt_source(env.name, "eval", size=HELDOUT.value, **kw))
    levels_of = {p.uid: level(p.meta) for p in held_prompts}
    # a copy: value_step donates the state, the samplers keep using these params
    params = jax.tree.map(jnp.copy, run.sampler_params(state.policy))
    out = {"seed": seed, "sft_s": t_sft}
    t0 = time.time()
    for name, temp in (("sampled", 1.0), ("greedy", 0.0)):
        cfg = run.engine_cfg.__class__(**{**run.engine_cfg.__dict__, "temperature": temp})
        engine = Engine.create(run.sampler_def, run.tokenizer, run.env_factory, cfg, seed=seed + 11)
        trajs, _ = engine.run(params, held_prompts)
        out[f"{name}_per_level"] = per_level(trajs, levels_of)
        out[f"{name}_success"] = float(np.mean([t.info.get("success", False) for t in trajs]))
        if name == "sampled":
            held = trajs
    out["heldout_rollout_s"] = time.time() - t0
    tab = token_table(held, levels_of)
    out["ref_ev_level"] = group_mean_ev(tab, ("level",))
    out["ref_ev_level_errors"] = group_mean_ev(tab, ("level", "errors"))
    logging.info("seed %d warm start: %s", seed, json.dumps(out))
    source = SyncRollouts(
        run.sampler_def, run.tokenizer, run.env_factory, run.prompts, run.engine_cfg, seed=seed + 3
    )
    source.publish(params, 0)
    b = config.rl.batch_size
    curve = [(0, critic_ev(run, state.critic, held, b))]
    t0 = time.time()
    for step in range(1, VP_STEPS.value + 1):
        batch = run._batch(source.take(b))
        state, _ = run.learner.value_step(state, batch, run._key(state))
        if step % EV_EVERY.value == 0 or step == VP_STEPS.value:
            curve.append((step, critic_ev(run, state.critic, held, b)))
            logging.info("seed %d step %d held-out EV %.3f", seed, step, curve[-1][1])
    out["vp_s"] = time.time() - t0
    out["ev_curve"] = curve
    return out


def main(argv):
    del argv
    results = [probe_seed(int(s)) for s in SEEDS.value]
    path = pathlib.Path(WORKDIR.value) / "probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    for r in results:
        lv = " ".join(
            f"L{k}={100 * v[0]:.0f}%(n={v[1]})" for k, v in r["sampled_per_level"].items()
        )
        gl = " ".join(f"L{k}={100 * v[0]:.0f}%" for k, v in r["greedy_per_level"].items())
        print(f"seed {r['seed']}: sampled {100 * r['sampled_success']:.1f}% [{lv}]")
        print(f"   greedy {100 * r['greedy_success']:.1f}% [{gl}]")
        ref = r["ref_ev_level"], r["ref_ev_level_errors"]
        print(f"   reference EV: per level {ref[0]:.3f}, per level x errors so far {ref[1]:.3f}")
        print("   critic EV " + " ".join(f"@{s}={e:.3f}" for s, e in r["ev_curve"]))
        sft_s, roll_s, vp_s = r["sft_s"], r["heldout_rollout_s"], r["vp_s"]
        print(f"   seconds: sft {sft_s:.0f}, held-out rollouts {roll_s:.0f}, vp {vp_s:.0f}")
    finals = np.array([r["ev_curve"][-1][1] for r in results])
    se = finals.std(ddof=1) / np.sqrt(len(finals)) if len(finals) > 1 else float("nan")
    print(f"final held-out EV: {finals.mean():.3f} +- {se:.3f} (SE, {len(finals)} seeds)")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
