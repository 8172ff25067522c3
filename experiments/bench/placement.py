"""Placement benchmark: colocated vs disaggregated sampler pool, the throughput model and its
check here, then the model applied to the 30B recipe (docs/scaling.md, "Sampler pool").

    python -m experiments.bench.placement            # 3-6 minutes on 2 busy cores
    python -m experiments.bench.placement --plan     # the 30B table only (a second)

Here: 2 fake CPU devices, each single-threaded (XLA_FLAGS below, set before jax starts),
so each device is about one core: two small "chips". Colocated: the sampler and the
trainer share both (slots and batch split over the two); disaggregated: the pool is
device 1, the trainer device 0. The run is `configs/sao.py:smoke` (random init, no SFT or
value pretraining), B = 8 trajectories per update, the real update step (GAE + critic),
the real weight sync (sao_jax/parallel/reshard.py, landing double-buffered).

Measured, side by side in one process:
  1. decode step cost by (slots, context) on one device;
  2. per placement: rollout cost per trajectory (the async sampler alone, fixed params, on
     that placement's sampler devices), update cost (batch assembly + the update step, on
     its trainer devices), weight-sync cost;
  3. the prediction of sao_jax/plan/throughput.py per placement (`CONCURRENCY` below: on
     this CPU the sampler and the learner share the cores), then the loop itself
     (async rollouts, update, weight sync; as sao_jax/train.py runs it), twice per
     placement, interleaved; the model's error per placement.
Then the 30B table (`--plan` alone prints just that): a plan from shapes and published
hardware figures, not a measurement.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=2"
    + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import pathlib
import statistics
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import train
from sao_jax.config import load_config
from sao_jax.models.config import ModelConfig
from sao_jax.plan import throughput as tp
from sao_jax.sampling.generate import GenerateFns, SamplingParams

B = 8  # trajectories per update
# Two single-threaded devices on 2 shared cores: the sampler thread's host work (the
# engine's Python) and both placements' device programs contend for the same cores, so
# the sampler and the learner gain nothing from running at once (concurrency 1, for both
# placements). A probe that ran update steps beside a free-running sampler measured
# 1.0-1.4, but the coupled loop ran no faster than the serial sum: its predictions with the
# probe's value were 24-52% too high. On chips, concurrency is 2 for a pool of its own.
CONCURRENCY = 1.0
RUN = {  # configs/sao.py:smoke, shrunk to the loop itself
    "init.kind": "random",
    "sft.steps": 0,
    "value_pretrain.steps": 0,
    "rl.batch_size": B,
    "sampling.num_slots": 8,
    "sampling.queue_size": 16,
    "sampling.max_len": 96,
    "sampling.prefill_buckets": (32,),
    "sampling.span_buckets": (96,),
    "train.length_bucket": 96,  # one padded shape: one update program
}
PLACEMENTS = {
    "colocated": {"mesh.shape": (2, 1, 1, 1)},
    "disaggregated": {
        "mesh.shape": (1, 1, 1, 1),
        "sampling.placement": "disaggregated",
        "sampling.pool_devices": 1,
    },
}


def make_config(placement: str, rollouts: str):
    config = load_config(f"{pathlib.Path(__file__).parents[2]}/configs/sao.py:smoke")
    for name, value in {**RUN, **PLACEMENTS[placement], "train.rollouts": rollouts}.items():
        *path, leaf = name.split(".")
        node = config
        for part in path:
            node = node[part]
        node[leaf] = value
    return config


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() (its result blocked on), after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def decode_table(run, slots=(4, 8, 16), contexts=(16, 64), repeats=20) -> dict:
    """Median ms of one decode step by (slots, context) on the pool's device."""
    params = run.sampler_params(run.models.policy)
    key, sampling = jax.random.key(0), SamplingParams()
    out = {}
    for s in slots:
        fns = GenerateFns(run.sampler_def, num_slots=s, max_len=RUN["sampling.max_len"])
        tokens = np.ones(s, np.int32)
        for ctx in contexts:
            positions = np.full(s, ctx, np.int32)
            with run.placement.pool_context():
                cache = [fns.init_cache(params)]

                def step(fns=fns, cache=cache, tokens=tokens, positions=positions):
                    cache[0], o = fns.decode(params, cache[0], tokens, positions, key, sampling)
                    return o.tokens_ns

                out[(s, ctx)] = 1e3 * _timed(step, repeats)
    return out


class Bench:
    """One placement's Run, its unit costs and its measured loop."""

    def __init__(self, placement: str, workdir: pathlib.Path):
        self.placement = placement
        self.run = train.Run(make_config(placement, "async"), workdir)
        self.state = self.run.warm_start()

    def _source(self, rollouts: str):
        """(run, a new rollouts source of kind `rollouts`) on this placement's devices."""
        config = self.run.config
        config.unlock()
        config.train.rollouts = rollouts
        config.lock()
        return self.run, self.run.rollouts()

    def producing(self):
        """A started async source with fixed params whose trajectories a thread takes as
        they come (so the queue never pushes back), and a stop callable."""
        run, source = self._source("async")
        source.publish(run.sampler_params(self.state.policy), 0, synced=True)
        source.start()
        done = threading.Event()

        def drain():
            while not done.is_set():
                with contextlib.suppress(TimeoutError, RuntimeError):  # RuntimeError: stopped
                    source.take(1, 1.0)

        worker = threading.Thread(target=drain, daemon=True)
        worker.start()
        generated = lambda: source.stats()["generated"]
        while generated() < 2 * B:  # compiled, in its stride
            time.sleep(0.05)

        def stop():
            done.set()
            source.stop()
            worker.join(30)

        return generated, stop

    def rollout_s(self, trajectories: int = 4 * B) -> float:
        """Seconds per trajectory of the async sampler alone (the loop's producer), fixed
        params, on this placement's sampler devices: its production rate, drained."""
        generated, stop = self.producing()
        try:
            g0, t0 = generated(), time.perf_counter()
            while generated() < g0 + trajectories:
                time.sleep(0.01)
            return (time.perf_counter() - t0) / (generated() - g0)
        finally:
            stop()

    def trajectories(self):
        run, source = self._source("sync")
        source.publish(run.sampler_params(self.state.policy), 0, synced=True)
        return source.take(B, 600)

    def fresh_state(self):
        """A copy of the initial state (the update step donates its input)."""
        return jax.tree.map(jnp.copy, self.state)

    def learner_step(self, state, trajs):
        """What the learner does per update besides taking: the batch, the update step."""
        return self.run.learner.update_step(
            state, self.run._batch(trajs), self.run._key(int(state.updates))
        )

    def update_s(self, trajs, repeats: int = 5) -> float:
        """Seconds per update as the loop pays them: batch assembly + the update step."""
        state = [self.fresh_state()]

        def step():
            state[0], m = self.learner_step(state[0], trajs)
            return m

        return _timed(step, repeats)

    def sync_s(self, repeats: int = 10) -> float:
        return _timed(lambda: self.run.sampler_params(self.state.policy), repeats)

    def loop(self, steps: int, warmup: int = 2) -> float:
        """Trajectories/s of the RL loop's skeleton (take, update, weight sync), async."""
        run, source = self._source("async")
        state = self.fresh_state()
        source.publish(run.sampler_params(state.policy), int(state.step), synced=True)
        source.start()
        try:
            for i in range(warmup + steps):
                if i == warmup:
                    t = time.perf_counter()
                trajs = source.take(B, 600)
                state, _ = run.learner.update_step(
                    state, run._batch(trajs), run._key(int(state.updates))
                )
                source.publish(run.sampler_params(state.policy), int(state.step), synced=True)
            jax.block_until_ready(state)
            return steps * B / (time.perf_counter() - t)
        finally:
            source.stop()


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime unavailable"


def measure(steps: int) -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; load before: {uptime()}")
    print(f"# jax {jax.__version__}, {jax.device_count()} single-threaded CPU devices; B={B}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        benches = {p: Bench(p, pathlib.Path(tmp) / p) for p in PLACEMENTS}
        table = decode_table(benches["disaggregated"].run)
        print("decode step (ms) by slots x context, one device (the pool's), medians:")
        contexts = sorted({c for _, c in table})
        print("| slots | " + " | ".join(f"context {c}" for c in contexts) + " |")
        print("|---|" + "---|" * len(contexts))
        for s in sorted({s for s, _ in table}):
            print(f"| {s} | " + " | ".join(f"{table[(s, c)]:.2f}" for c in contexts) + " |")
        costs = {}
        for name, bench in benches.items():
            trajs = bench.trajectories()
            costs[name] = dict(
                roll=bench.rollout_s(), update=bench.update_s(trajs), sync=bench.sync_s()
            )
            costs[name]["trajs"] = trajs
        print(f"unit costs (s; B={B}; update = batch assembly + update step):")
        print("| placement | rollout per trajectory | update | weight sync |")
        print("|---|---|---|---|")
        for name, k in costs.items():
            print(f"| {name} | {k['roll']:.4f} | {k['update']:.4f} | {k['sync']:.4f} |")
        predicted = {  # this CPU: concurrency 1 for both (CONCURRENCY), the CPU copies the sync
            name: tp.pipeline_rate(name, B, k["roll"], k["update"], k["sync"],
                                   concurrency=CONCURRENCY, sync_exposed=1.0)
            for name, k in costs.items()
        }  # fmt: skip
        measured = {p: [] for p in PLACEMENTS}
        for _ in range(2):  # interleaved: A B A B
            for name, bench in benches.items():
                measured[name].append(bench.loop(steps))
    print(f"loop: {steps} updates after 2 of warm-up, twice per placement, interleaved")
    print("| placement | predicted traj/s | measured traj/s (runs) | model error |")
    print("|---|---|---|---|")
    for name in PLACEMENTS:
        m = statistics.mean(measured[name])
        err = (predicted[name] - m) / m
        runs = ", ".join(f"{x:.2f}" for x in measured[name])
        print(f"| {name} | {predicted[name]:.2f} | {m:.2f} ({runs}) | {err:+.0%} |")
    ratio_p = predicted["disaggregated"] / predicted["colocated"]
    ratio_m = statistics.mean(measured["disaggregated"]) / statistics.mean(measured["colocated"])
    print(f"disaggregated / colocated: predicted {ratio_p:.2f}x, measured {ratio_m:.2f}x")
    print(f"# wall {time.perf_counter() - t0:.0f} s; load after: {uptime()}")


GiB = 2**30
# The 30B recipe (configs/qwen3_30b_a3b_sao.py): 128 trajectories per update, K = 2, packed
# 32k rows. Episode lengths: log-normal, median 4096 tokens, p99 32768 (sigma = ln 8 /
# 2.326): mean 6.1k tokens, of which 1.5k prompt + observations (prefilled) and 4.6k
# generated; a decoding slot holds E[n^2] / (2 E[n]) = 6.8k live KV tokens on average.
# Trainer memory per chip from docs/scaling.md's plans (state at the plan's chip count;
# the 32k update step's temporaries).
# At most 1024 rollouts in flight (8 batches: the staleness a trajectory can see stays
# within a few updates; the pool's plan needs >= 512).
WORKLOADS = {
    "tpu-v5p": tp.Workload(128, 4600, 1500, 6800, 32768, 2, 12.87 * GiB, 64, 52.6 * GiB,
                           max_in_flight=1024),
    "h200": tp.Workload(128, 4600, 1500, 6800, 32768, 2, 41.87 * GiB, 16, 67.0 * GiB,
                        max_in_flight=1024),
}  # fmt: skip
# (hardware, chips, [(layout, pool chips, chips per sampler replica)]). "every host": each
# host splits its own chips (sampling.pool_devices per process: what runs across processes
# today); "pool hosts": whole hosts form the pool (a pool slice: Pathways, or a
# cross-process transfer jax 0.10 does not offer on CPU/GPU; docs/scaling.md).
PLANS = (
    ("tpu-v5p", 64, [("colocated", 0, 4), ("every host 1:3", 16, 1), ("every host 2:2", 32, 2),
                     ("pool hosts", 16, 4), ("pool hosts", 24, 4), ("pool hosts", 32, 4)]),
    ("h200", 128, [("colocated", 0, 8), ("every host 2:6", 32, 2), ("every host 4:4", 64, 4),
                   ("every host 6:2", 96, 2), ("pool hosts", 32, 8), ("pool hosts", 64, 8),
                   ("pool hosts", 96, 8)]),
)  # fmt: skip


def plan_30b() -> None:
    from configs.models import qwen3_30b_a3b

    cfg = ModelConfig.from_config(qwen3_30b_a3b.get_config())
    print("30B plan (shapes + published figures; decode at 70% of HBM bandwidth, update and")
    print("prefill at 40% MFU; paged KV; at most 1024 rollouts in flight; sync overlapped):")
    columns = ("hardware", "layout", "rollout:train chips", "chips per replica",
               "rollouts in flight", "decode step (ms)", "rollouts of one batch (s)",
               "update (s)", "weight sync (s)", "predicted traj/s", "speedup over colocated",
               "same, decode at 20% of HBM bw")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, chips, rows in PLANS:
        hw, work = tp.HARDWARE[name], WORKLOADS[name]
        _, _, base_replica = rows[0]
        base = tp.split_rate(cfg, hw, work, chips, 0, base_replica)
        slow_base = tp.split_rate(cfg, hw, work, chips, 0, base_replica, bw_efficiency=0.2)
        for layout, pool, replica in rows:
            r = tp.split_rate(cfg, hw, work, chips, pool, replica)
            split = "-" if pool == 0 else f"{pool}:{chips - pool}"
            head = f"| {chips} x {hw.name} | {layout} | {split} | {replica} |"
            if r is None:
                print(f"{head} does not fit | | | | | | | |")
                continue
            slow = tp.split_rate(cfg, hw, work, chips, pool, replica, bw_efficiency=0.2)
            speedup, slow_speedup = r["rate"] / base["rate"], slow["rate"] / slow_base["rate"]
            print(f"{head} {r['slots']} | {r['step_ms']:.1f} | {r['roll_s']:.1f} | "
                  f"{r['update_s']:.1f} | {r['sync_s']:.2f} | {r['rate']:.2f} | "
                  f"{speedup:.2f}x | {slow_speedup:.2f}x |")  # fmt: skip
    for name, *_ in PLANS:
        print(f"# {tp.HARDWARE[name].name}: {tp.HARDWARE[name].source}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", action="store_true", help="the 30B table only")
    p.add_argument("--steps", type=int, default=12, help="measured updates per loop run")
    args = p.parse_args(argv)
    if not args.plan:
        measure(args.steps)
    plan_30b()


if __name__ == "__main__":
    main()
