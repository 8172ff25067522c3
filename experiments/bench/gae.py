"""Benchmark of observation-skipping GAE: the JAX forms vs NumPy and PyTorch loops, and copy.

    python -m experiments.bench.gae            # B=64, T in {4096, 32768, 131072}
    python -m experiments.bench.gae --quick    # B=64, T in {1024, 4096}

Batches of B rows, about half of the tokens observations, laid out in turns. Versions:
the three JAX forms of sao_jax/rl/gae.py (`scan`, `associative`, `chunked`), a NumPy
reverse loop and a PyTorch CPU loop written the way PyTorch RL frameworks write GAE (a
reverse Python loop over t on [B] tensors), and a streaming copy of the same bytes
(x + 1 on a float32 array, read + write: the memory-bandwidth yardstick).

The machine may be shared: every figure comes from INTERLEAVED rounds (each round runs
every version once, in turn), so that load swings hit all versions alike; the table
shows the median and the minimum over rounds, and each ratio is the median of the
per-round ratios, with its range. The load average is printed before and after. The
loops run on a prefix of at most `--loop-max-t` tokens and are scaled linearly to T (the
output says when). Before any timing, every JAX form is checked against the NumPy loop.
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

from sao_jax.rl import gae

BYTES_PER_TOKEN = 4 + 4 + 1 + 4 + 4  # read rewards, values, mask; write advantages, returns


def turn_batch(rng: np.random.Generator, b: int, t: int, mean_span: int = 64):
    """(rewards, values, mask): alternating action/observation spans, ~half observations."""
    mask = np.zeros((b, t), bool)
    for row in range(b):
        pos = int(rng.integers(1, mean_span))  # the prompt
        while pos < t:
            n_act = int(rng.integers(1, 2 * mean_span))
            mask[row, pos : pos + n_act] = True
            pos += n_act + int(rng.integers(1, 2 * mean_span))
    rewards = np.where(mask & (rng.random((b, t)) < 0.01), 1.0, 0.0).astype(np.float32)
    values = rng.normal(size=(b, t)).astype(np.float32)
    return rewards, values, mask


def numpy_loop(r, v, m, gamma, lam):
    """Masked-carry GAE as a reverse Python loop over t on [B] NumPy arrays."""
    b, t = r.shape
    g, next_v, parked = np.zeros(b, r.dtype), np.zeros(b, r.dtype), np.zeros(b, r.dtype)
    adv = np.zeros_like(r)
    for i in range(t - 1, -1, -1):
        m_b = m[:, i]
        g_new = r[:, i] + parked + gamma * next_v - v[:, i] + gamma * lam * g
        adv[:, i] = np.where(m_b, g_new, 0.0)
        g = np.where(m_b, g_new, g)
        next_v = np.where(m_b, v[:, i], next_v)
        parked = np.where(m_b, 0.0, parked + r[:, i])
    return adv, np.where(m, adv + v, 0.0)


def torch_loop(r, v, m, gamma, lam):
    """PyTorch-framework style: reverse loop over t, per-step [B] tensors, stack at the end."""
    import torch

    b, _ = r.shape
    g, next_v, parked = torch.zeros(b), torch.zeros(b), torch.zeros(b)
    reversed_adv = []
    for i in reversed(range(r.shape[1])):
        m_b = m[:, i]
        g_new = r[:, i] + parked + gamma * next_v - v[:, i] + gamma * lam * g
        reversed_adv.append(torch.where(m_b, g_new, 0.0))
        g = torch.where(m_b, g_new, g)
        next_v = torch.where(m_b, v[:, i], next_v)
        parked = torch.where(m_b, 0.0, parked + r[:, i])
    adv = torch.stack(reversed_adv[::-1], dim=1)
    return adv, torch.where(m, adv + v, 0.0)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def versions(b: int, t: int, args, rng):
    """name -> (zero-argument callable, scale, note): what each round times."""
    r, v, m = turn_batch(rng, b, t)
    rj, vj, mj = jnp.asarray(r), jnp.asarray(v), jnp.asarray(m)
    out = {}
    for impl in gae.GAE_IMPLS:
        fn = lambda impl=impl: jax.block_until_ready(
            gae.skip_observation_gae(rj, vj, mj, gamma=1.0, lam=0.95, impl=impl)
        )
        fn()  # compile and warm up
        out[f"jax {impl}"] = (fn, 1.0, "")
    t_loop = min(t, args.loop_max_t)
    scale = t / t_loop
    note = f"timed on T={t_loop}, x{scale:g}" if scale > 1 else ""
    rp, vp, mp = r[:, :t_loop], v[:, :t_loop], m[:, :t_loop]
    out["numpy loop"] = (lambda: numpy_loop(rp, vp, mp, 1.0, 0.95), scale, note)
    try:
        import torch

        torch.set_num_threads(1)  # per-step [B] ops: threads only add overhead
        rt, vt, mt = torch.from_numpy(rp), torch.from_numpy(vp), torch.from_numpy(mp)
        torch_loop(rt, vt, mt, 1.0, 0.95)
        out["torch loop (CPU)"] = (lambda: torch_loop(rt, vt, mt, 1.0, 0.95), scale, note)
    except ImportError:
        print("# torch not installed: no PyTorch loop")
    # A streaming copy moving the same bytes: x + 1 reads and writes 4 bytes per element.
    x = jnp.zeros((b * t * BYTES_PER_TOKEN // 8,), jnp.float32)
    copy = jax.jit(lambda y: y + 1.0)
    jax.block_until_ready(copy(x))
    out["copy (same bytes)"] = (lambda: copy(x).block_until_ready(), 1.0, "")
    # Check the JAX forms against the NumPy loop before timing them.
    n = min(t, 4096)
    want = numpy_loop(r[:, :n], v[:, :n], m[:, :n], 1.0, 0.95)
    for impl in gae.GAE_IMPLS:
        got = gae.skip_observation_gae(
            rj[:, :n], vj[:, :n], mj[:, :n], gamma=1.0, lam=0.95, impl=impl
        )
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-3, err_msg=impl)
    return out


def bench_one(b: int, t: int, args, rng) -> dict[str, list[float]]:
    """Seconds per round of every version (loops scaled to T), interleaved."""
    vs = versions(b, t, args, rng)
    times: dict[str, list[float]] = {name: [] for name in vs}
    for _ in range(args.rounds):
        for name, (fn, scale, _) in vs.items():
            is_loop = name.endswith(("loop", "(CPU)"))
            if is_loop and len(times[name]) >= args.loop_rounds:
                continue
            times[name].append(seconds(fn) * scale)
    return times, {name: note for name, (_, _, note) in vs.items()}


def ratio(times, num: str, den: str) -> tuple[float, float, float]:
    """Median, min and max over rounds of times[num] / times[den] (paired by round)."""
    pairs = [a / b for a, b in zip(times[num], times[den])]
    return statistics.median(pairs), min(pairs), max(pairs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small T for a fast check")
    p.add_argument("--batch", type=int, default=64, help="rows B")
    p.add_argument("--lengths", type=int, nargs="*", help="override the T values")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (JAX, copy)")
    p.add_argument("--loop-rounds", type=int, default=3, help="rounds that also run the loops")
    p.add_argument("--loop-max-t", type=int, default=32768, help="longest T timed for loops")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lengths = args.lengths or ([1024, 4096] if args.quick else [4096, 32768, 131072])
    rng = np.random.default_rng(args.seed)
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(f"# jax {jax.__version__} on {dev.platform} ({dev.device_kind}); {os.cpu_count()} CPUs")
    print(f"# default_gae_impl({jax.default_backend()!r}) = {gae.default_gae_impl()!r}")
    for t in lengths:
        b = args.batch
        load0 = os.getloadavg()[0]
        times, notes = bench_one(b, t, args, rng)
        load1 = os.getloadavg()[0]
        jax_names = [n for n in times if n.startswith("jax")]
        best = min(jax_names, key=lambda n: statistics.median(times[n]))
        print(
            f"\nB={b} T={t} ({b * t / 1e6:.2f} M tokens, ~half observations); "
            f"load average {load0:.1f} -> {load1:.1f}"
        )
        head = f"{'median ms':>10} {'min ms':>9} {'M tok/s':>8} {'x best':>7}"
        print(f"  {'version':<20} {head}  note")
        for name, ts in times.items():
            med = statistics.median(ts)
            x_best = ratio(times, name, best)[0]
            print(
                f"  {name:<20} {med * 1e3:10.2f} {min(ts) * 1e3:9.2f} {b * t / med / 1e6:8.1f} "
                f"{x_best:7.1f}  {notes[name]}"
            )
        gbytes = b * t * BYTES_PER_TOKEN / 1e9
        copy_med = statistics.median(times["copy (same bytes)"])
        frac = ratio(times, "copy (same bytes)", best)
        print(
            f"  best: {best}: {gbytes / statistics.median(times[best]):.2f} GB/s of "
            f"{BYTES_PER_TOKEN} B/token vs copy {gbytes / copy_med:.2f} GB/s: "
            f"{frac[0]:.1%} of copy bandwidth (per-round range {frac[1]:.1%}-{frac[2]:.1%})"
        )
        for loop in ("torch loop (CPU)", "numpy loop"):
            if loop in times:
                rt = ratio(times, loop, best)
                print(f"  {loop} / {best}: {rt[0]:.0f}x (per-round range {rt[1]:.0f}-{rt[2]:.0f}x)")


if __name__ == "__main__":
    main()
