"""Demo-scale rollouts: sampler tokens/s by cache read policy, padding vs packing of updates.

    python -m experiments.bench.demo_rollouts --params=workdirs/demo/warm_start --update=256
    python -m experiments.bench.demo_rollouts --quick        # random-init policy, fewer rounds

On configs/sao.py (the README's demo: 32 slots, max_len 96, the calculator env, the
character tokenizer) with the given policy (a warm start written by the demo, or the
random init), side by side in one process:

1. Sampler throughput: the demo's engine runs rounds of --prompts prompts to completion,
   alternating the read policies (whole cache, as before span buckets; the default span
   buckets if they differ from it; spans 32/64, without and with a 4-slot long lane),
   same seed and prompts per round, so every policy generates the same tokens. tokens/s
   = generated action tokens / wall seconds, after one warm-up round per policy.
2. Batches: the trajectories of (1), the policy's own length distribution, are cut into
   update batches of rl.batch_size as the learner takes them; printed: the padding
   fraction of the model's input rows, padded [B, T] (T rounded up to
   train.length_bucket) vs packed into rows of each --pack-lengths; with --update=Lp,
   the update step's wall time padded vs packed into rows of Lp (medians of 3,
   interleaved, after the compiling call, whose time is printed too).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import numpy as np

from configs import sao
from sao_jax import checkpointing
from sao_jax import config as config_lib
from sao_jax.data.prompts import prompt_source
from sao_jax.envs.registry import env_factory
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.update import Learner
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.sampling.trajectory import pack_batch, pad_batch, padding_fraction
from sao_jax.text.tokenizer import load_tokenizer


def _policies(ecfg: EngineConfig) -> dict[str, EngineConfig]:
    base = {f: getattr(ecfg, f) for f in ecfg.__dataclass_fields__}
    whole = EngineConfig(**{**base, "span_buckets": (ecfg.max_len,), "lane_slots": 0})
    out = {"whole cache (before)": whole}
    if whole.spans != ecfg.spans or ecfg.lane_slots:
        out["default spans (after)"] = ecfg
    small = (32, 64)  # below the default's smallest bucket: what reading less buys here
    out["spans 32, 64"] = EngineConfig(**{**base, "span_buckets": small, "lane_slots": 0})
    out["spans 32, 64 + lane of 4"] = EngineConfig(
        **{**base, "span_buckets": small, "lane_slots": 4}
    )
    return out


def sampler_rates(mdef, params, tok, make_env, prompts, ecfg, rounds, per_round):
    """{policy: (tokens/s, tokens)} over `rounds` interleaved rounds; and all trajectories."""
    engines = {
        name: Engine.create(mdef, tok, make_env, cfg, seed=7)
        for name, cfg in _policies(ecfg).items()
    }
    tokens = dict.fromkeys(engines, 0)
    wall = dict.fromkeys(engines, 0.0)
    trajs = []
    for r in range(rounds + 1):  # round 0 compiles and warms up
        batch = [next(prompts) for _ in range(per_round)]
        for name, eng in engines.items():
            t = time.perf_counter()
            done, _ = eng.run(params, batch)
            dt = time.perf_counter() - t
            if r:
                tokens[name] += sum(x.num_actions for x in done)
                wall[name] += dt
                if name == "whole cache (before)":
                    trajs += done
    return {k: (tokens[k] / wall[k], tokens[k]) for k in engines}, trajs


def _pack(chunk, config, row_length):
    t = config.train
    return pack_batch(
        chunk,
        length_bucket=t.length_bucket,
        row_length=row_length,
        microbatches=config.rl.microbatches,
        rows_multiple=t.pack_rows_multiple,
    )[0]


def batch_padding(trajs, config, row_lengths):
    """{layout: [(padding fraction, model-input shape)]} over batches of rl.batch_size."""
    b, t = config.rl.batch_size, config.train
    out = {"padded": []} | {f"packed, rows of {lp or 'T'}": [] for lp in row_lengths}
    for i in range(0, len(trajs) - b + 1, b):
        chunk = trajs[i : i + b]
        padded = pad_batch(chunk, length_bucket=t.length_bucket)
        out["padded"].append((padding_fraction(padded["segment_ids"]), padded["tokens"].shape))
        for lp in row_lengths:
            packed = _pack(chunk, config, lp or None)
            out[f"packed, rows of {lp or 'T'}"].append(
                (padding_fraction(packed["packed_segment_ids"]), packed["packed_tokens"].shape)
            )
    return out


def update_times(config, models, trajs, row_length, repeats):
    """Median update-step seconds (and compile seconds) on padded vs packed batches."""
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, Sharder())
    b, t = config.rl.batch_size, config.train
    chunk = trajs[:b]
    batches = {
        "padded": pad_batch(chunk, length_bucket=t.length_bucket),
        f"packed, rows of {row_length or 'T'}": _pack(chunk, config, row_length or None),
    }
    state = {k: learner.new_state(models.policy, models.critic, seed=0) for k in batches}
    times = {k: [] for k in batches}
    for r in range(repeats + 1):
        for k, batch in batches.items():
            start = time.perf_counter()
            state[k], m = learner.update_step(state[k], batch, jax.random.key(r))
            jax.block_until_ready(m)
            times[k].append(time.perf_counter() - start)
    return {k: (statistics.median(v[1:]), v[0]) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="", help="warm-start policy dir (the demo's warm_start)")
    p.add_argument("--quick", action="store_true", help="2 rounds, no update timing")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per read policy")
    p.add_argument("--prompts", type=int, default=128, help="prompts per round")
    p.add_argument("--pack-lengths", default="0,128,192,256", help="packed row lengths; 0 = T")
    p.add_argument(
        "--update",
        type=int,
        default=-1,
        help="time the update step padded vs packed rows of this length (0 = T; -1 = skip)",
    )
    args = p.parse_args(argv)
    rounds = 2 if args.quick else args.rounds

    config = config_lib.validate(sao.get_config())
    sharder = Sharder()
    models = init_models(ModelConfig.from_config(config.model), sharder, config.seed)
    params = models.policy
    if args.params:
        pdef = models.policy_def
        with checkpointing.Checkpointer(args.params, keep=1, async_save=False) as c:
            params, _ = c.restore(
                checkpointing.abstract_like(pdef.shapes(), pdef.shardings(sharder))
            )
    tok = load_tokenizer(config.init.tokenizer)
    env = config.env
    make_env, _ = env_factory(env.name, env.params.to_dict())
    kw = dict(seed=config.seed, eval_fraction=env.eval_fraction, **env.prompts)
    prompts = iter(prompt_source(env.name, "train", **kw).to_iter_dataset())
    ecfg, _ = configs_from_section(config.sampling, config.seed)

    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(f"# jax {jax.__version__} backend={jax.default_backend()} devices={jax.device_count()}")
    print(
        f"# configs/sao.py: {ecfg.num_slots} slots, max_len {ecfg.max_len}, policy "
        f"{args.params or 'random init'}; {rounds} rounds x {args.prompts} prompts per policy"
    )
    rates, trajs = sampler_rates(
        models.policy_def, params, tok, make_env, prompts, ecfg, rounds, args.prompts
    )
    base = rates["whole cache (before)"][0]
    if "default spans (after)" not in rates:
        print(f"(default spans {ecfg.spans} read the whole cache at max_len {ecfg.max_len})")
    print("| read policy | tokens/s | tokens | vs whole cache |")
    print("|---|---|---|---|")
    for name, (rate, n) in rates.items():
        print(f"| {name} | {rate:.0f} | {n} | {rate / base:.2f}x |")
    lengths = np.array([t.length for t in trajs])
    print(
        f"trajectory tokens: n={len(lengths)} p50={np.median(lengths):.0f} "
        f"p90={np.percentile(lengths, 90):.0f} max={lengths.max()} mean={lengths.mean():.1f}"
    )
    row_lengths = [int(x) for x in args.pack_lengths.split(",")]
    print(f"| batch of {config.rl.batch_size} | padding fraction (mean) | model rows x length |")
    print("|---|---|---|")
    for k, v in batch_padding(trajs, config, row_lengths).items():
        shapes = ", ".join(f"{r}x{c}" for r, c in sorted({s for _, s in v}))
        print(f"| {k} | {np.mean([f for f, _ in v]):.3f} | {shapes} |")
    if args.update >= 0 and not args.quick:
        for k, (med, first) in update_times(config, models, trajs, args.update, 3).items():
            print(f"update step, {k}: {med:.2f} s median (first call, compile: {first:.1f} s)")


if __name__ == "__main__":
    main()
