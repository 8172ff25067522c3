"""Training attention side by side: the naive form before / after heads-major, and blockwise.

    python -m experiments.bench.attention_layout                      # both models, 7 rounds
    python -m experiments.bench.attention_layout --blocks 128 64 --rounds 15

At the attention shapes of the update-step bench's two models (experiments/bench/
update_step.py: tiny B x T = 64 x 128, N/K/H = 4/2/16; larger 4 x 512, 8/4/32), one packed
batch (two trajectories per row, 5 padding tokens), fp32, each kernel jitted alone:

  naive_literal  `grouped_attention_literal`: products `btkgh,bskh->bkgts` in the input
                 layout (batch dims b, k not leading): the naive form before heads-major
  naive          `grouped_attention`: q, k, v moved to heads-major first
  blockwise:BLK  the blockwise kernel at query/key block BLK (skips the causally masked
                 blocks; BLK >= T is one block, the same work as naive)

Forward and forward + backward (d(sum(out * ct)) / d(q, k, v)) are timed in INTERLEAVED
rounds (the machine may be shared); per round each kernel's time is divided into
naive_literal's, and the median and range of those ratios are printed with the load
average. Values and gradients are checked against naive_literal on the real queries.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.attention import attention_mask, grouped_attention, grouped_attention_literal
from sao_jax.models.attention_kernels import blockwise_attention

# name: (B, T, N, K, H, blockwise blocks tried by default)
SHAPES = {"tiny": (64, 128, 4, 2, 16, (128, 32)), "larger": (4, 512, 8, 4, 32, (512, 128))}


def packed_batch(b: int, t: int):
    """positions, segment ids [B, T]: trajectories of T/3 and the rest - 5, then padding."""
    cut = t // 3
    idx = np.arange(t)
    pos = np.where(idx < cut, idx, idx - cut)
    seg = np.where(idx < cut, 1, 2)
    seg[t - 5 :] = 0
    return (jnp.asarray(np.broadcast_to(x, (b, t)), jnp.int32) for x in (pos, seg))


def kernels(pos, seg, blocks) -> dict:
    def naive(fn):
        return lambda q, k, v: fn(q, k, v, attention_mask(pos, pos, seg, seg))

    out = {"naive_literal": naive(grouped_attention_literal), "naive": naive(grouped_attention)}
    for blk in blocks:
        out[f"blockwise:{blk}"] = lambda q, k, v, blk=blk: blockwise_attention(
            q, k, v, pos, pos, seg, seg, block=blk
        )
    return out


def seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _med(xs, fmt) -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def bench_shape(name: str, b, t, n, kv, h, blocks, rounds: int) -> None:
    kq, kk, kvv, kc = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (b, t, n, h))
    k = jax.random.normal(kk, (b, t, kv, h))
    v = jax.random.normal(kvv, (b, t, kv, h))
    pos, seg = packed_batch(b, t)
    real = (seg != 0)[:, :, None, None]
    ct = jax.random.normal(kc, (b, t, n, h)) * real
    progs = {}
    for kname, fn in kernels(pos, seg, blocks).items():
        loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v) * ct)
        progs[kname] = (jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1, 2))))
    ref_out, ref_grads = (f(q, k, v) for f in progs["naive_literal"])
    load0 = os.getloadavg()[0]
    print(f"\n## {name}: B x T = {b} x {t}, N/K/H = {n}/{kv}/{h}, fp32")
    for kname, (fwd, grad) in progs.items():
        err = float(jnp.max(jnp.abs(jnp.where(real, fwd(q, k, v) - ref_out, 0.0))))
        gerr = max(float(jnp.max(jnp.abs(a - w))) for a, w in zip(grad(q, k, v), ref_grads))
        print(f"{kname:14s} max |out - literal| {err:.1e}, max |grad - literal| {gerr:.1e}")
    times = {kname: ([], []) for kname in progs}
    for _ in range(rounds):
        for kname, (fwd, grad) in progs.items():
            times[kname][0].append(seconds(fwd, q, k, v))
            times[kname][1].append(seconds(grad, q, k, v))
    print(f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; speedups per round vs literal")
    print("| kernel | fwd (median ms) | fwd speedup | fwd+bwd (median ms) | fwd+bwd speedup |")
    print("|---|---|---|---|---|")
    base_f, base_b = times["naive_literal"]
    for kname, (tf, tb) in times.items():
        rf = [x / y for x, y in zip(base_f, tf)]
        rb = [x / y for x, y in zip(base_b, tb)]
        print(
            f"| {kname} | {statistics.median(tf) * 1e3:.1f} | {_med(rf, '{:.2f}x')} | "
            f"{statistics.median(tb) * 1e3:.1f} | {_med(rb, '{:.2f}x')} |"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--blocks", nargs="*", type=int, default=None, help="blockwise blocks")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    args = p.parse_args(argv)
    if args.rounds < 1 or any(blk < 8 for blk in args.blocks or ()):
        p.error("--rounds must be >= 1 and every --blocks entry >= 8")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(f"# jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
    for name in args.models:
        b, t, n, kv, h, blocks = SHAPES[name]
        bench_shape(name, b, t, n, kv, h, args.blocks or blocks, args.rounds)


if __name__ == "__main__":
    main()
