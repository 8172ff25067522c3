"""Benchmark of observation-skipping GAE: lax.scan vs associative_scan vs NumPy vs PyTorch.

    python -m experiments.bench.gae            # B=64, T in {4096, 32768, 131072}
    python -m experiments.bench.gae --quick    # B=64, T in {1024, 4096}

Batches of B rows, about half of the tokens observations, laid out in turns. Each JAX
version is compiled and warmed up first; the figure is the median of `--repeats` runs.
The NumPy reference and the PyTorch loop (the way PyTorch RL frameworks write GAE: a
reverse Python loop over t on [B] tensors) are timed on a prefix of at most
`--loop-max-t` tokens and scaled linearly to T (the output says when). The achieved
bytes/s of the best version is set against a streaming copy of the same number of bytes
(x + 1 on a float32 array, read + write) measured in the same run.
"""

from __future__ import annotations

import argparse
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


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_one(b: int, t: int, args, rng) -> list[tuple[str, float, str]]:
    r, v, m = turn_batch(rng, b, t)
    rj, vj, mj = jnp.asarray(r), jnp.asarray(v), jnp.asarray(m)
    rows = []
    for impl in gae.GAE_IMPLS:
        fn = lambda impl=impl: jax.block_until_ready(
            gae.skip_observation_gae(rj, vj, mj, gamma=1.0, lam=0.95, impl=impl)
        )
        fn()  # compile and warm up
        rows.append((f"jax {impl}", median_seconds(fn, args.repeats), ""))
    t_loop = min(t, args.loop_max_t)
    scale = t / t_loop
    note = f"timed on T={t_loop}, scaled x{scale:g}" if scale > 1 else ""
    rp, vp, mp = r[:, :t_loop], v[:, :t_loop], m[:, :t_loop]
    sec = median_seconds(lambda: numpy_loop(rp, vp, mp, 1.0, 0.95), args.loop_repeats)
    rows.append(("numpy loop", sec * scale, note))
    try:
        import torch

        torch.set_num_threads(1)  # per-step [B] ops: threads only add overhead
        rt, vt, mt = torch.from_numpy(rp), torch.from_numpy(vp), torch.from_numpy(mp)
        torch_loop(rt, vt, mt, 1.0, 0.95)
        sec = median_seconds(lambda: torch_loop(rt, vt, mt, 1.0, 0.95), args.loop_repeats)
        rows.append(("torch loop (CPU)", sec * scale, note))
    except ImportError:
        rows.append(("torch loop (CPU)", float("nan"), "torch not installed"))
    # A streaming copy moving the same bytes: x + 1 reads and writes 4 bytes per element.
    x = jnp.zeros((b * t * BYTES_PER_TOKEN // 8,), jnp.float32)
    copy = jax.jit(lambda y: y + 1.0)
    jax.block_until_ready(copy(x))
    rows.append(("copy (same bytes)", median_seconds(lambda: copy(x).block_until_ready(), 5), ""))
    # Check the versions agree before printing their times.
    want = numpy_loop(r[:, : min(t, 4096)], v[:, : min(t, 4096)], m[:, : min(t, 4096)], 1.0, 0.95)
    for impl in gae.GAE_IMPLS:
        got = gae.skip_observation_gae(
            rj[:, :4096], vj[:, :4096], mj[:, :4096], gamma=1.0, lam=0.95, impl=impl
        )
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-3)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small T for a fast check")
    p.add_argument("--batch", type=int, default=64, help="rows B")
    p.add_argument("--lengths", type=int, nargs="*", help="override the T values")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per JAX version")
    p.add_argument("--loop-repeats", type=int, default=3, help="timed runs per Python loop")
    p.add_argument("--loop-max-t", type=int, default=8192, help="longest T timed for loops")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lengths = args.lengths or ([1024, 4096] if args.quick else [4096, 32768, 131072])
    rng = np.random.default_rng(args.seed)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); {platform.processor()}")
    print(f"default_gae_impl({jax.default_backend()!r}) = {gae.default_gae_impl()!r}")
    for t in lengths:
        b = args.batch
        rows = bench_one(b, t, args, rng)
        gae_rows = [row for row in rows if not row[0].startswith("copy")]
        best = min(gae_rows, key=lambda row: row[1])
        print(f"\nB={b} T={t} ({b * t / 1e6:.2f} M tokens, ~half observations)")
        print(f"  {'version':<20} {'median ms':>12} {'M tok/s':>10} {'x best':>8}  note")
        for name, sec, note in rows:
            print(
                f"  {name:<20} {sec * 1e3:12.2f} {b * t / sec / 1e6:10.1f} "
                f"{sec / best[1]:8.1f}  {note}"
            )
        copy_sec = rows[-1][1]
        gbytes = b * t * BYTES_PER_TOKEN / 1e9
        print(
            f"  best: {best[0]}: {gbytes / best[1]:.2f} GB/s of {BYTES_PER_TOKEN} B/token vs "
            f"copy {gbytes / copy_sec:.2f} GB/s ({copy_sec / best[1]:.1%} of copy bandwidth)"
        )


if __name__ == "__main__":
    main()
