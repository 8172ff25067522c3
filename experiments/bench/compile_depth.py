"""Compile time of the update step against depth: 4 vs 48 scanned layers.

    python -m experiments.bench.compile_depth                      # layers 4 and 48
    python -m experiments.bench.compile_depth --layers 4 16 48 --scan false

The model is the `larger` one of experiments/bench/update_step.py narrowed so that only
the program's structure matters (D = 64, MoE width 32, T = 64, B = 1), with SAO's default
step (configs/base.py). For each depth it lowers and compiles `Learner.update_step` from
shapes and prints the process CPU seconds of each, the lowered op count, the
`dot_general` count, the TrainState leaves and the operands of the largest while loop.
It uses only interfaces that predate stacked layers, so the same script measures an
older checkout too: `PYTHONPATH=<checkout> python <this file>` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import platform
import re
import time

import jax

from configs import base
from experiments.bench.update_step import LARGER
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel.mesh import Sharder
from sao_jax.plan.step_memory import abstract_batch
from sao_jax.rl.update import Learner

NARROW = dict(hidden_size=64, moe_intermediate_size=32)
_WHILE = re.compile(r"stablehlo\.while\((.*?)\)\s*:")


def largest_while(text: str) -> int:
    """Operands of the widest `stablehlo.while` in lowered StableHLO text."""
    return max((m.group(1).count("%iterArg") for m in _WHILE.finditer(text)), default=0)


def measure(layers: int, scan: bool, length: int) -> dict:
    """Lower + compile the update step of a `layers`-deep narrowed model (CPU seconds)."""
    c = base.get_config()
    c.model.update(LARGER, **NARROW, num_hidden_layers=layers, scan_layers=scan)
    c.rl.batch_size = 1
    c = config_lib.validate(c)
    cfg = ModelConfig.from_config(c.model)
    sharder = Sharder()
    learner = Learner(c.rl, c.optim, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder)
    batch = abstract_batch(1, length, cfg, None, routing=learner.rl.routing_replay)
    key = jax.eval_shape(lambda: jax.random.key(0))
    t0 = time.process_time()
    lowered = learner.update_step.lower(learner.abstract_state, batch, key)
    t1 = time.process_time()
    text = lowered.as_text()
    t2 = time.process_time()
    lowered.compile()
    t3 = time.process_time()
    return dict(
        lower_s=t1 - t0,
        compile_s=t3 - t2,
        ops=sum(1 for line in text.splitlines() if " = " in line and "stablehlo." in line),
        dots=text.count("dot_general"),
        leaves=len(jax.tree.leaves(learner.abstract_state)),
        while_operands=largest_while(text),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="*", default=[4, 48])
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--scan", choices=("true", "false"), default="true")
    p.add_argument("--label", default="", help="a column naming the checkout measured")
    args = p.parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.machine()}")
    print(f"# model: {dict(LARGER, **NARROW)}, T = {args.length}, B = 1")
    print("| code | layers | scan | lower, CPU s | compile, CPU s | ops | dot_general | "
          "TrainState leaves | widest while operands |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for layers in args.layers:
        m = measure(layers, args.scan == "true", args.length)
        print(
            f"| {args.label} | {layers} | {args.scan} | {m['lower_s']:.1f} | "
            f"{m['compile_s']:.1f} | {m['ops']:,} | {m['dots']} | {m['leaves']} | "
            f"{m['while_operands']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
