"""Padding overhead of the grouped MoE path on the demo's routing distribution.

    python -m experiments.bench.moe_padding                   # fresh init and after SFT
    python -m experiments.bench.moe_padding --sft-steps 0     # fresh init only

Real demo tokens: demonstrations of the demo's task (configs/sao.py: the calculator
arithmetic env, tokenised as the rollout engine lays out episodes, padded to the demo's
rollout length) in batches of the demo's RL batch size, routed by the demo's policy
(configs/models/tiny.py), (a) freshly initialised and (b) after the demo's SFT warm start
(`--sft-steps`, default the demo's 500). For every MoE layer and batch: the largest
expert group over the balanced size (real tokens x k / E), the tiles the grouped path runs
(sao_jax/models/moe/grouped.py: each expert's group in tiles of R rows), and the rows it
multiplies over the useful rows, R x tiles / (real tokens x k) (1.00 = no padding). Padding
positions are routed but computed by no expert (MoEBlock's token mask); the `dense` path
multiplies E / k x the rows of EVERY position, padding included.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from configs import sao
from sao_jax import config as config_lib
from sao_jax.data.prompts import prompt_iterator
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.models.moe import grouped
from sao_jax.parallel.mesh import Sharder
from sao_jax.run.sft import SFTTrainer, demo_batches
from sao_jax.text.tokenizer import load_tokenizer


def demo_token_batches(config, seed: int, count: int, batch_size: int, length: int):
    """`count` [B, T] batches of demonstration tokens of the demo's env."""
    prompts = prompt_iterator(
        config.env.name,
        "train",
        seed=seed,
        eval_fraction=config.env.eval_fraction,
        **config.env.prompts,
    )
    batches = demo_batches(
        config.env.name,
        prompts,
        load_tokenizer(config.init.tokenizer),
        batch_size=batch_size,
        length=length,
        error_rate=config.sft.error_rate,
        seed=seed,
    )
    return [next(batches) for _ in range(count)]


def routing_report(models, batches) -> list[list[dict[str, float]]]:
    """Per batch, per MoE layer: grouped.padding_overhead of the policy's routing."""
    fwd = jax.jit(lambda p, tok, pos, seg: models.policy_def.bind(p)(tok, pos, seg).experts_btlk)
    out = []
    for batch in batches:
        experts = np.asarray(
            fwd(models.policy, batch["tokens"], batch["positions"], batch["segment_ids"])
        )
        k, e = experts.shape[-1], models.cfg.num_experts
        real = (batch["segment_ids"] != 0).reshape(-1)
        out.append(
            [
                grouped.padding_overhead(experts[:, :, i].reshape(-1, k), e, token_mask_n=real)
                for i in range(experts.shape[2])
            ]
        )
    return out


def print_report(title: str, cfg: ModelConfig, report, tokens: int, real_fraction) -> None:
    rows = grouped.tile_rows(tokens, cfg.num_experts_per_tok, cfg.num_experts)
    print(f"\n## {title}: N = {tokens} tokens per batch, tiles of {rows} rows per expert")
    print(
        "| MoE layer | largest / balanced (mean, max) | tiles (min-max) | rows executed / useful |"
    )
    print("|---|---|---|---|")
    for i, layer in enumerate(cfg.moe_layers):
        per = [batch[i] for batch in report]
        big = [o["largest_over_balanced"] for o in per]
        tiles = [int(o["tiles"]) for o in per]
        ex = [o["executed_over_useful"] for o in per]
        print(
            f"| {layer} | {statistics.mean(big):.2f}, {max(big):.2f} | {min(tiles)}-{max(tiles)} | "
            f"{statistics.mean(ex):.2f} (max {max(ex):.2f}) |"
        )
    all_ex = [o["executed_over_useful"] for batch in report for o in batch]
    dense = cfg.num_experts / cfg.num_experts_per_tok / statistics.mean(real_fraction)
    print(
        f"overall: the grouped path multiplies {statistics.mean(all_ex):.2f}x the useful expert "
        f"rows (padding overhead {statistics.mean(all_ex) - 1:.0%}); dense: {dense:.2f}x "
        f"(E / k over the real-token fraction {statistics.mean(real_fraction):.0%})"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps (demo: 500)")
    p.add_argument("--batches", type=int, default=8, help="demo batches routed")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = config_lib.validate(sao.get_config())
    cfg = ModelConfig.from_config(config.model)
    b, t = config.rl.batch_size, config.sampling.max_len
    steps = config.sft.steps if args.sft_steps is None else args.sft_steps
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; demo: configs/sao.py, env {config.env.name}")
    print(f"# batches of B x T = {b} x {t} demonstration tokens (padded), {args.batches} batches")
    batches = demo_token_batches(config, args.seed + 1000, args.batches, b, t)
    models = init_models(cfg, Sharder(), seed=config.seed)
    real = [float(np.mean(batch["segment_ids"] != 0)) for batch in batches]
    print_report("freshly initialised policy", cfg, routing_report(models, batches), b * t, real)
    if steps > 0:
        trainer = SFTTrainer(models.policy_def, config.sft.optim, Sharder())
        sft = demo_token_batches(
            config, config.seed, steps, config.sft.batch_size, config.sft.length
        )
        start = time.perf_counter()
        policy = trainer.run(models.policy, iter(sft), steps)
        print(f"\n# SFT warm start: {steps} steps in {time.perf_counter() - start:.0f} s")
        trained = models._replace(policy=policy)
        report = routing_report(trained, batches)
        print_report(f"after {steps} SFT steps", cfg, report, b * t, real)


if __name__ == "__main__":
    main()
