r"""Is value learnable on the demo task? Per-level success of the warm start, and how much
of the return's variance simple predictors explain on held-out rollouts (the oracle EVs).

  python -m experiments.testbed_probe --config=configs/sao.py --seeds=0 \
      --workdir=workdirs/probe --heldout=512

Per seed: the config's SFT warm start (reused from `<workdir>/seed=<n>/warm_start` when
there; a run's own `<run workdir>/warm_start` can be linked there), then
1. held-out rollouts: `--heldout` prompts of the eval split, one sampled rollout each
   (T = 1) with the warm-start policy, plus greedy decoding of the same prompts: success
   per level (the prompt's `level` meta; one level for tasks without levels);
2. reference predictors of the outcome R (gamma = lambda = 1) on the sampled rollouts'
   action tokens, each the mean of R within groups fitted on the same rollouts (so an
   upper bound for what that information gives a critic): the mean (what a moving average
   knows: EV 0), the level (prompt-level oracle), level x tool errors seen so far (the
   visible `e:` events), and that x whether the episode opened with an answer (a guess,
   visible from its first token on). EV = 1 - Var(R - V) / Var(R) over action tokens.
The learned critic's held-out EV is value pretraining's own log (sao_jax/run/value_pretrain.py).
Writes `<workdir>/probe.json` and prints a table.
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
from sao_jax.run.streams import stream_seed
from sao_jax.sampling.engine import Engine
from sao_jax.train import Run

CONFIG = flags.DEFINE_string("config", "configs/sao.py", "Config file[:variant].")
SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds (one warm start each).")
WORKDIR = flags.DEFINE_string("workdir", "workdirs/probe", "Warm starts and probe.json.")
HELDOUT = flags.DEFINE_integer("heldout", 512, "Held-out prompts (one rollout each).")
SFT_STEPS = flags.DEFINE_integer("sft_steps", -1, "Override sft.steps (-1: the config's).")
ERROR_RATE = flags.DEFINE_float("error_rate", -1.0, "Override sft.error_rate (-1: config's).")


def level(prompt_meta: dict) -> int:
    return int(prompt_meta.get("level", 0))


def ev(pred: np.ndarray, target: np.ndarray) -> float:
    """1 - Var(target - pred) / Var(target) over pooled tokens."""
    var = np.var(target)
    return float(1.0 - np.var(target - pred) / var) if var > 0 else float("nan")


def token_table(trajs, levels_of: dict[str, int], answer_id: int) -> dict[str, np.ndarray]:
    """Per action token: outcome R, the prompt's level, tool errors seen so far, and
    whether the episode opened with an answer (`answer_id`: the token of 'a')."""
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
        # opened with an answer (no call): seen from the first action token's successor on
        first = t.tokens[idx[0]] if idx.size else -1
        guess = np.zeros(len(idx), np.int32)
        if idx.size and first == answer_id:
            guess[1:] = 1
        rows["guess"].append(guess)
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
    # a copy of the sampler params (the state may be donated elsewhere)
    params = jax.tree.map(jnp.copy, run.sampler_params(state.policy))
    out = {"seed": seed, "sft_s": t_sft}
    t0 = time.time()
    for name, temp in (("sampled", 1.0), ("greedy", 0.0)):
        cfg = run.engine_cfg.__class__(**{**run.engine_cfg.__dict__, "temperature": temp})
        key_seed = stream_seed(seed, "testbed_probe")
        engine = Engine.create(run.sampler_def, run.tokenizer, run.env_factory, cfg, seed=key_seed)
        trajs, _ = engine.run(params, held_prompts)
        out[f"{name}_per_level"] = per_level(trajs, levels_of)
        out[f"{name}_success"] = float(np.mean([bool(t.info.get("success")) for t in trajs]))
        if name == "sampled":
            held = trajs
    out["heldout_rollout_s"] = time.time() - t0
    tab = token_table(held, levels_of, run.tokenizer.encode("a")[0])
    out["ref_ev_level"] = group_mean_ev(tab, ("level",))
    out["ref_ev_level_errors"] = group_mean_ev(tab, ("level", "errors"))
    out["ref_ev_level_errors_guess"] = group_mean_ev(tab, ("level", "errors", "guess"))
    logging.info("seed %d warm start: %s", seed, json.dumps(out))
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
        ref = [r[k] for k in ("ref_ev_level", "ref_ev_level_errors", "ref_ev_level_errors_guess")]
        print(
            f"   reference EV: per level {ref[0]:.3f}, x errors so far {ref[1]:.3f}, "
            f"x opened with an answer {ref[2]:.3f}"
        )
        print(f"   seconds: sft {r['sft_s']:.0f}, held-out rollouts {r['heldout_rollout_s']:.0f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
