"""Benchmark of the rollout pipeline: async single rollouts vs a synchronous group batch.

    python -m experiments.bench.pipeline            # 64 learner steps per mode
    python -m experiments.bench.pipeline --quick    # 24 steps per mode, about a minute

Episode lengths are heavy-tailed: each episode's number of model turns is drawn from a
Pareto law (alpha = --alpha, capped at --max-turns), every turn is exactly
--turn-tokens tokens (the per-turn budget; no stop string, no EOS), and each observation
is 3 tokens. The learner takes a batch of B = 8 trajectories per step and "updates" for
--update-ms (a sleep: the learner sits on another device, so it leaves the host CPU to
the sampler), then publishes the params as the next version. Side by side in one run:

(a) async: `AsyncSampler`, one worker, 8 continuous slots: a finished trajectory's slot
    takes the next prompt at once; the learner takes any 8 finished trajectories.
(b) sync group-of-8: 8 rollouts of one prompt start together in 8 slots; the batch is
    ready when the slowest finishes; then the learner updates; no overlap.

Every prefill/decode program the engine can pick is compiled before anything is timed
(`compile_programs`), so neither mode pays a compile inside its timed window.

Printed: trajectories/s and learner idle fraction (time waiting for data / wall time)
of each, their ratio, the staleness histogram of (a), and the decode cost per step
(cache length --cache-len, every slot at position 64, or at 2048, or all at 64 but one at
2048), interleaved in one loop, for three read policies: the whole cache (what every step
paid before span buckets), span buckets (the smallest power of two covering the longest
slot), and span buckets with a one-row long lane (docs/sampling.md section 1). Last, the
padding fraction of the learner's model inputs for (a)'s batches: padded rows [8, T] (T =
the longest rounded up to 32) vs the same trajectories packed first-fit decreasing into
rows of T (`pack_batch`, docs/sampling.md section 3).
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time

import jax
import numpy as np
from flax import nnx
from sao_jax.configs.models import tiny

from sao_jax.envs.base import Prompt, StepResult
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.generate import (
    GenerateFns,
    SamplingParams,
    Spans,
    choose_spans,
    inert_rows,
    span_buckets,
)
from sao_jax.sampling.sampler import AsyncSampler, SamplerConfig
from sao_jax.sampling.trajectory import pack_rows, round_up

GROUP = 8  # batch size of both modes, and the group size of (b)


class BenchTokenizer:
    """Lowercase letters and digits; no EOS, so turns end only at the token budget."""

    chars = "abcdefghijklmnopqrstuvwxyz0123456789<>"
    pad_id, bos_id, eos_id, unk_id = 0, 1, None, 2
    vocab_size = 3 + len(chars)

    def encode(self, text):
        return [3 + self.chars.index(c) if c in self.chars else self.unk_id for c in text]

    def decode(self, ids):
        return "".join(self.chars[i - 3] for i in ids if 3 <= i < self.vocab_size)


class ParetoTurnsEnv:
    """Each episode lasts ceil(Pareto(alpha, x_m=1)) model turns, capped at max_turns."""

    stop_strings = ()

    def __init__(self, alpha: float, max_turns: int, seed: int):
        self.alpha, self.max_turns = alpha, max_turns
        self.rng = np.random.default_rng(seed)

    def reset(self, prompt):
        self.turns = min(int(np.ceil(self.rng.pareto(self.alpha) + 1)), self.max_turns)
        self.t = 0
        return prompt.text

    def step(self, action_text):
        self.t += 1
        done = self.t >= self.turns
        return StepResult("" if done else "<o>", 1.0 if done else 0.0, done)


def compile_programs(fns, params, ecfg) -> float:
    """Compiles every program the engine can pick (each decode span; each prefill width
    with each span that can hold it) before anything is timed; returns the seconds.

    They compile lazily, on first use: without this, whichever mode runs first pays the
    compiles of the longer spans inside its timed window (a heavy-tailed episode reaches
    a new span bucket mid-run), which is how async single rollouts once measured slower
    than the synchronous group (docs/benchmarks.md, "Pipeline")."""
    t = time.perf_counter()
    cache = fns.init_cache(params)
    s, key = fns.num_slots, jax.random.key(0)
    for span in ecfg.spans:
        spans = Spans(span)
        for width in ecfg.buckets:
            if width <= span:
                tokens, positions = inert_rows(s, width, fns.max_len)
                cache, _ = fns.prefill(params, cache, tokens, positions, spans)
        cache, _ = fns.decode(params, cache, np.zeros(s, np.int32), np.zeros(s, np.int32),
                                key, SamplingParams(), spans)  # fmt: skip
    jax.block_until_ready(cache)
    return time.perf_counter() - t


def run_async(mdef, params, env_factory, ecfg, steps, update_s, fns):
    prompts = (Prompt(f"q{i}", f"q{i % 97}") for i in itertools.count())
    sampler = AsyncSampler(
        mdef,
        BenchTokenizer(),
        env_factory,
        prompts,
        engine=ecfg,
        config=SamplerConfig(num_workers=1, queue_size=2 * GROUP),
        fns=fns,
    )
    lengths, idle = [], 0.0
    with sampler:
        sampler.publish(params, 0)
        sampler.take(GROUP, timeout=600)  # warm-up: compiled, pipeline filled
        t0 = time.perf_counter()
        for v in range(1, steps + 1):
            w = time.perf_counter()
            trajs = sampler.take(GROUP, timeout=600)
            idle += time.perf_counter() - w
            lengths += [t.length for t in trajs]
            time.sleep(update_s)
            sampler.publish(params, v)
        wall = time.perf_counter() - t0
        stats = sampler.stats()
    return dict(traj_s=steps * GROUP / wall, idle=idle / wall, wall=wall, lengths=lengths), stats


def run_sync(mdef, params, env_factory, ecfg, steps, update_s, fns):
    engine = Engine(fns, BenchTokenizer(), env_factory, ecfg, seed=1)
    group = lambda i: [Prompt(f"g{i}.{j}", f"q{i % 97}") for j in range(GROUP)]
    engine.run(params, group(-1))  # warm-up
    lengths, idle = [], 0.0
    t0 = time.perf_counter()
    for i in range(steps):
        w = time.perf_counter()
        trajs, _ = engine.run(params, group(i), version=i)  # waits for the slowest
        idle += time.perf_counter() - w
        lengths += [t.length for t in trajs]
        time.sleep(update_s)
    wall = time.perf_counter() - t0
    return dict(traj_s=steps * GROUP / wall, idle=idle / wall, wall=wall, lengths=lengths)


def decode_cost(mdef, params, cache_len, repeats):
    """Median seconds of one decode step per (read policy, slot positions), interleaved."""
    fns = GenerateFns(mdef, num_slots=GROUP, max_len=cache_len)
    cache = fns.init_cache(params)
    tokens = np.full(GROUP, 5, np.int32)
    sampling = SamplingParams()
    buckets = span_buckets(cache_len)
    policies = {
        "whole cache": lambda need: None,
        "span buckets": lambda need: choose_spans(need, buckets),
        "spans + long lane": lambda need: choose_spans(need, buckets, lane_slots=1),
    }
    layouts = {
        "pos 64": np.full(GROUP, 64, np.int32),
        "pos 2048": np.full(GROUP, 2048, np.int32),
        "7 x 64 + 1 x 2048": np.array([2048] + [64] * (GROUP - 1), np.int32),
    }
    times = {(p, lay): [] for p in policies for lay in layouts}
    key = jax.random.key(0)
    for _ in range(repeats + 1):  # the first round compiles and warms up
        for (pol, lay), ts in times.items():
            positions = layouts[lay]
            spans = policies[pol](positions + 1)
            t = time.perf_counter()
            cache, out = fns.decode(params, cache, tokens, positions, key, sampling, spans)
            out.tokens_ns.block_until_ready()
            ts.append(time.perf_counter() - t)
    return {k: statistics.median(ts[1:]) for k, ts in times.items()}, list(layouts)


def padding_fractions(lengths, batch=GROUP, bucket=32):
    """Mean padding fraction of padded vs packed model rows over consecutive batches."""
    padded, packed = [], []
    for i in range(0, len(lengths) - batch + 1, batch):
        ls = lengths[i : i + batch]
        t = round_up(max(ls), bucket)
        padded.append(1 - sum(ls) / (len(ls) * t))
        packed.append(1 - sum(ls) / (len(pack_rows(ls, t)) * t))
    return float(np.mean(padded)), float(np.mean(packed))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps (a minute or two)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per mode")
    p.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index of turns")
    p.add_argument("--max-turns", type=int, default=24)
    p.add_argument("--turn-tokens", type=int, default=8)
    p.add_argument("--update-ms", type=float, default=100.0, help="fake learner step cost")
    p.add_argument("--cache-len", type=int, default=4096, help="for the decode-cost figure")
    args = p.parse_args(argv)
    steps = args.steps or (24 if args.quick else 64)

    cfg = ModelConfig.from_config(tiny.get_config())
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    max_len = 8 + args.max_turns * (args.turn_tokens + 3) + 1
    max_len = 1 << (max_len - 1).bit_length()
    ecfg = EngineConfig(num_slots=GROUP, max_len=max_len, max_turn_tokens=args.turn_tokens)
    fns = GenerateFns(mdef, num_slots=GROUP, max_len=max_len)
    seeds = itertools.count()
    env_factory = lambda: ParetoTurnsEnv(args.alpha, args.max_turns, next(seeds))
    update_s = args.update_ms / 1000

    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(f"# jax {jax.__version__} backend={jax.default_backend()} devices={jax.device_count()}")
    print(
        f"# tiny MoE policy, B={GROUP}, slots={GROUP}, L={max_len}, steps={steps}, "
        f"turns~min(Pareto({args.alpha}), {args.max_turns}) x {args.turn_tokens} tokens, "
        f"update={args.update_ms:.0f} ms"
    )
    compile_s = compile_programs(fns, params, ecfg)
    print(f"# compiled {len(fns.programs)} prefill/decode programs first: {compile_s:.1f} s")
    a, stats = run_async(mdef, params, env_factory, ecfg, steps, update_s, fns)
    b = run_sync(mdef, params, env_factory, ecfg, steps, update_s, fns)
    lengths = np.array(a["lengths"] + b["lengths"])
    print(
        f"trajectory tokens: p50={np.percentile(lengths, 50):.0f} "
        f"p90={np.percentile(lengths, 90):.0f} max={lengths.max()} mean={lengths.mean():.1f}"
    )
    print("| mode | traj/s | learner idle | wall (s) |")
    print("|---|---|---|---|")
    for name, r in (("(a) async single, continuous slots", a), ("(b) sync group-of-8", b)):
        print(f"| {name} | {r['traj_s']:.2f} | {r['idle']:.0%} | {r['wall']:.1f} |")
    print(f"throughput ratio (a)/(b): {a['traj_s'] / b['traj_s']:.2f}x")
    print(f"staleness of taken trajectories (versions behind: count): {stats['staleness']}")
    print(f"dropped: {stats['dropped'] or 'none'}")
    pad, packed = padding_fractions(a["lengths"])
    print(f"padding of (a)'s update batches: padded rows {pad:.1%}, packed rows {packed:.1%}")
    cost, layouts = decode_cost(mdef, params, args.cache_len, repeats=10 if args.quick else 30)
    print(f"decode step (ms), {GROUP} slots, cache {args.cache_len}, medians, interleaved:")
    print("| read policy | " + " | ".join(layouts) + " | pos 64 / pos 2048 |")
    print("|---|" + "---|" * (len(layouts) + 1))
    for pol in dict.fromkeys(p for p, _ in cost):
        ms = [cost[(pol, lay)] * 1e3 for lay in layouts]
        ratio = cost[(pol, "pos 64")] / cost[(pol, "pos 2048")]
        print(f"| {pol} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ratio:.2f} |")


if __name__ == "__main__":
    main()
