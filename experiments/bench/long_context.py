"""Long-context update step on CPU: temporaries and step time, naive vs blockwise attention,
remat off vs on, at several trajectory lengths; and compile time, 4 vs 48 layers.

    python -m experiments.bench.long_context            # T = 1k, 2k, 4k, 16k
    python -m experiments.bench.long_context --quick    # T = 256, 512, 1024

The model is the `larger` one of experiments/bench/update_step.py (D = 256, 4 layers,
16 experts, V = 1024), one row per update (B = 1), SAO's default step (configs/base.py:
K = 2 critic steps, DIS, frozen critic attention), layers under `lax.scan`
(`model.scan_layers`, the long-context setting). For each length and variant the
jitted `Learner.update_step` is compiled from shapes (sao_jax/plan/step_memory.py)
and XLA's memory analysis gives its temporaries per device; variants whose arguments +
temporaries fit under --run-limit-gib, at lengths up to --run-max-length, are then run
(the others are compiled only, with step_memory.FAST_COMPILE: same memory figures, about
half the compile time, marked "(fast)"): the median wall time of --repeats
calls after one warm-up call (one call, no warm-up, at lengths above --warmup-max).
Temporaries do not depend on the machine's load; wall times do, so compare ratios taken
in the same run. The compile-time section compiles the step for 4 and 48 layers with
`model.scan_layers` on and off (process CPU seconds of lower + compile).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax

from configs import base
from experiments.bench.update_step import LARGER
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, init_models, policy_def
from sao_jax.parallel.mesh import Sharder
from sao_jax.plan.step_memory import StepBytes, compile_update_step
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner

VARIANTS = (("naive", "none"), ("naive", "full"), ("blockwise", "none"), ("blockwise", "full"))


def learner_for(model: dict, rows: int):
    c = base.get_config()
    c.model.update(LARGER)
    c.model.update(model)
    c.rl.batch_size = rows
    c = config_lib.validate(c)
    cfg = ModelConfig.from_config(c.model)
    sharder = Sharder()
    return (
        c,
        cfg,
        Learner(c.rl, c.optim, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder),
    )


def compile_timed(learner, cfg, rows, length, fast=False):
    start = time.process_time()
    compiled = compile_update_step(learner, cfg, rows, length, fast=fast)
    return compiled, time.process_time() - start


def run_timed(compiled, cfg, learner, rows, length, repeats, warmup) -> float:
    """Median wall seconds of `repeats` update steps (after one warm-up call if asked)."""
    models = init_models(cfg, learner.sharder, seed=0)
    state = learner.new_state(models.policy, models.critic, seed=0)
    batch = jax.device_put(synthetic_batch(rows, length, cfg.vocab_size, seed=0))
    key = jax.random.key(0)
    if warmup:
        state, _ = compiled(state, batch, key)
        jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = compiled(state, batch, key)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_section(args) -> None:
    print("\n## update step, B = 1 row: temporaries (MiB) and step time\n")
    print("| T | attention | remat | temp MiB | args MiB | compile CPU s | step s | step / best |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    temp_bf: dict[int, int] = {}
    for length in args.lengths:
        rows = []
        for impl, remat in args.variants:
            model = dict(attention_impl=impl, remat=remat, scan_layers=True)
            _, cfg, learner = learner_for(model, 1)
            run = length <= args.run_max_length  # else memory figures only: fast compile
            compiled, compile_s = compile_timed(learner, cfg, 1, length, fast=not run)
            mem = StepBytes.of(compiled)
            if (impl, remat) == ("blockwise", "full"):
                temp_bf[length] = mem.temp
            seconds = None
            if run and (mem.temp + mem.argument) / 2**30 <= args.run_limit_gib:
                warm = length <= args.warmup_max
                reps = args.repeats if warm else 1
                seconds = run_timed(compiled, cfg, learner, 1, length, reps, warm)
            rows.append(
                (impl, remat, mem, f"{compile_s:.1f}" + ("" if run else " (fast)"), seconds)
            )
            del compiled
        best = min((r[4] for r in rows if r[4] is not None), default=None)
        for impl, remat, mem, compile_s, seconds in rows:
            why = "memory" if length <= args.run_max_length else "time"
            step = f"{seconds:.2f}" if seconds is not None else f"not run ({why})"
            ratio = f"{seconds / best:.2f}" if seconds is not None else "-"
            print(
                f"| {length} | {impl} | {remat} | {mem.temp / 2**20:,.1f} | "
                f"{mem.argument / 2**20:,.1f} | {compile_s} | {step} | {ratio} |",
                flush=True,
            )
    ref = 2048 if 2048 in temp_bf else min(temp_bf)
    for length in sorted(temp_bf):
        if length > ref:
            per_token = (temp_bf[length] - temp_bf[ref]) / (length - ref) / 1024
            print(
                f"\nblockwise + remat full: temp({length}) / temp({ref}) = "
                f"{temp_bf[length] / temp_bf[ref]:.2f} (T ratio {length / ref:.0f}); "
                f"{per_token:.1f} KiB per added token"
            )


def compile_section(args) -> None:
    print(f"\n## compile time of the update step (T = {args.compile_length}, B = 1)\n")
    print("| layers | scan_layers | lower + compile, CPU s | HLO text, MB |")
    print("|---:|---|---:|---:|")
    for layers in (4, 48):
        for scan in (True, False):
            _, cfg, learner = learner_for(dict(num_hidden_layers=layers, scan_layers=scan), 1)
            compiled, seconds = compile_timed(learner, cfg, 1, args.compile_length)
            size = len(compiled.as_text()) / 1e6
            print(f"| {layers} | {scan} | {seconds:.1f} | {size:.1f} |", flush=True)
            del compiled


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T = 256, 512, 1024; fewer repeats")
    p.add_argument("--lengths", type=int, nargs="*", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-max", type=int, default=4096, help="longest T with a warm-up call")
    p.add_argument("--run-limit-gib", type=float, default=3.0, help="skip runs above this")
    p.add_argument("--run-max-length", type=int, default=1 << 20, help="compile only above")
    p.add_argument("--compile-length", type=int, default=256)
    p.add_argument("--skip", nargs="*", default=[], choices=("memory", "compile"))
    p.add_argument(
        "--variants", nargs="*", default=None, help="attention:remat, e.g. blockwise:full"
    )
    args = p.parse_args(argv)
    args.variants = [tuple(v.split(":")) for v in args.variants] if args.variants else VARIANTS
    if args.lengths is None:
        args.lengths = [256, 512, 1024] if args.quick else [1024, 2048, 4096, 16384]
    if args.quick:
        args.repeats = min(args.repeats, 2)
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.machine()}")
    print(f"# jax {jax.__version__} on {dev.platform}, {jax.device_count()} device(s)")
    print(f"# model: {LARGER}")
    if "memory" not in args.skip:
        memory_section(args)
    if "compile" not in args.skip:
        compile_section(args)


if __name__ == "__main__":
    main()
