"""Step-time cost of the BRACE critic target: the update step with rl.critic_target
'lambda' (default) and 'brace', side by side in one run (docs/method.md section 8).

    python -m experiments.bench.critic_target                  # configs/sao.py, 64 x 96
    python -m experiments.bench.critic_target --batch 16 --length 64 --rounds 5

Both learners are built from configs/sao.py (the embedded MoE, SAO's update: K = 2 critic
steps, DIS, frozen critic attention) with the same parameters and run on the same
synthetic multi-turn batch (sao_jax/rl/synthetic.py, versions lagging up to 8). 'brace'
adds what its targets need: one policy forward without gradient for the log ratio of the
current policy to the rollout engine, and the closed-form target in place of the lambda
returns. The machine may be shared, so the two steps are timed in INTERLEAVED rounds;
the table gives each one's median and range over rounds and the median of the per-round
ratios brace / lambda with its range, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax

from sao_jax import config as config_lib
from sao_jax.configs import sao
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner

TARGETS = ("lambda", "brace")


def learner_and_state(target: str, batch: int, seed: int):
    """(the Learner of configs/sao.py with `target`, {"state": its fresh TrainState})."""
    c = sao.get_config()
    c.rl.batch_size = batch
    c.rl.critic_target = target
    config = config_lib.validate(c)
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=seed)
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, Sharder())
    holder = {"state": learner.new_state(models.policy, models.critic, seed=seed)}
    return learner, holder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64, help="rows (configs/sao.py: 64)")
    p.add_argument("--length", type=int, default=96, help="tokens (sampling.max_len: 96)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    vocab = sao.get_config().model.vocab_size
    batch = jax.device_put(
        synthetic_batch(args.batch, args.length, vocab, seed=args.seed, version=8, max_lag=8)
    )
    key = jax.random.key(args.seed)
    steps, compile_s = {}, {}
    for target in TARGETS:
        learner, holder = learner_and_state(target, args.batch, args.seed)

        def step(learner=learner, holder=holder):
            holder["state"], metrics = learner.update_step(holder["state"], batch, key)
            jax.block_until_ready((holder["state"], metrics))

        t0 = time.perf_counter()
        step()
        compile_s[target] = time.perf_counter() - t0
        steps[target] = step
    times = {t: [] for t in TARGETS}
    for _ in range(args.rounds):
        for target in TARGETS:
            t0 = time.perf_counter()
            steps[target]()
            times[target].append(time.perf_counter() - t0)
    ratios = [b / a for a, b in zip(times["lambda"], times["brace"], strict=True)]
    print(f"update step, configs/sao.py model, batch {args.batch} x {args.length} tokens, ")
    print(f"{args.rounds} interleaved rounds on {jax.default_backend()} ({os.cpu_count()} cores)")
    print("| critic target | median step s | range s | first call (compile) s |")
    print("|---|---|---|---|")
    for target in TARGETS:
        xs = times[target]
        print(
            f"| {target} | {statistics.median(xs):.3f} | {min(xs):.3f}-{max(xs):.3f} "
            f"| {compile_s[target]:.1f} |"
        )
    print(
        f"brace / lambda: median {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    load1 = os.getloadavg()
    print(f"load average before {load0[0]:.1f}, after {load1[0]:.1f}")


if __name__ == "__main__":
    main()
