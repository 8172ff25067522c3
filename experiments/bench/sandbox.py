"""Benchmark of the Python sandbox: latency, throughput, and a round of env calls.

    python -m experiments.bench.sandbox            # 200 serial runs per mode
    python -m experiments.bench.sandbox --quick    # 40

For each isolation mode this machine has ("bwrap", and the weak "rlimits"), side by side
in one run: `print(1)` run `--runs` times one after another (runs/s, p50 and p99
latency), then the same number through a pool of `--workers` threads (runs/s). Then one
"round" of the engine: `--slots` sandbox calls (a small program each), serially as the
sampler used to make them, and through `sampling.env_calls.EnvCalls` (what the engine
does now), in wall seconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import time

import numpy as np

from sao_jax.envs import sandbox
from sao_jax.sampling.env_calls import EnvCalls

PROGRAM = "import math\nprint(sum(math.factorial(i) % 7 for i in range(200)))\n"


def _latencies(mode: str, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        r = sandbox.run_python("print(1)", isolation=mode, allow_weak=True, audit_hook=False)
        out.append(time.perf_counter() - t0)
        assert r.ok, r
    return out


def _pool_rate(mode: str, runs: int, workers: int) -> float:
    def one(_):
        assert sandbox.run_python("print(1)", isolation=mode, allow_weak=True, audit_hook=False).ok

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(runs)))
    return runs / (time.perf_counter() - t0)


def _round(mode: str, slots: int, workers: int) -> tuple[float, float]:
    run = lambda: sandbox.run_python(PROGRAM, isolation=mode, allow_weak=True, audit_hook=False)
    t0 = time.perf_counter()
    for _ in range(slots):
        assert run().ok
    serial = time.perf_counter() - t0
    calls = EnvCalls(workers, timeout_s=60.0)
    t0 = time.perf_counter()
    pending = [calls.submit(run) for _ in range(slots)]
    calls.wait(pending)
    assert all(c.error is None and c.result.ok for c in pending)
    return serial, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--slots", type=int, default=32)
    args = p.parse_args()
    runs = args.runs or (40 if args.quick else 200)
    setup = sandbox.probe_setup()
    modes = [m for m in (sandbox.BWRAP, sandbox.RLIMITS) if m != sandbox.BWRAP or setup.bwrap]
    load = os.getloadavg()[0]
    print(f"# {platform.machine()}, {os.cpu_count()} CPU cores, load average {load:.1f}")
    print(f"# interpreter {setup.python}, sandbox uid {setup.uid}; {runs} runs per figure")
    if setup.isolation != sandbox.BWRAP:
        print(f"# bwrap unavailable: {setup.note}")
    print(
        "| mode | serial runs/s | p50 ms | p99 ms | pool runs/s | round serial s | round pool s |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        _latencies(mode, 3)  # warm the page cache
        lat = np.array(_latencies(mode, runs))
        rate = _pool_rate(mode, runs, args.workers)
        serial, pooled = _round(mode, args.slots, args.workers)
        print(
            f"| {mode} | {runs / lat.sum():.1f} | {1e3 * np.percentile(lat, 50):.0f} | "
            f"{1e3 * np.percentile(lat, 99):.0f} | {rate:.1f} ({args.workers} threads) | "
            f"{serial:.2f} ({args.slots} calls) | {pooled:.2f} |"
        )
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
