"""Rollout backends side by side: the native JAX engine vs vLLM's CPU build, same weights.

    make vllm-env                                       # once (docs/vllm.md)
    python -m experiments.bench.backends                # 8 / 32 / 128 rollouts, 3 rounds
    python -m experiments.bench.backends --levels 8 32 --rounds 2 --tokens 32 --syncs 3

One policy, configs/sao.py:vllm's tiny MoE (the shapes vLLM's CPU kernels take) at its
init seed (--config: another run config's policy, an `init.kind='hf'` one's checkpoint;
only the default has run), is served by both backends of
sao_jax/sampling/backend_factory.py (`build_backend`): 'native' (NativeBackend, one per
level with `num_slots` = the level) and 'vllm' (one server, `max_num_seqs` = the largest
level, 1 OpenMP thread as the run uses it). A trajectory is one request: a
--prompt_len-id prompt (random ids of the run's vocabulary, the same for both) continued
by exactly --tokens tokens at temperature 1 (no eos: the tokenizer's eos is withheld, so
every request decodes the same length and a token counts the same in both). At each
level, C requests are submitted at once and the round lasts until the last one finishes:

  trajectories/s  C / the round's seconds
  decode tokens/s the round's sampled tokens / its seconds (prefill included, as a run
                  pays it)

Every (level, backend) runs one untimed round first (the native engine compiles its
prefill and decode programs; vLLM warms its kernels). Rounds are ALTERNATED (the machine
may be shared): round r runs every level on both backends, the backend that goes first
switching every round, so a pair ran seconds apart under the same load; printed per
level: the median of each backend and vllm / native per round and their median.

Then seconds per weight sync, no request in flight: the native backend's `publish` (a
params store swap), vLLM's in place (`weight_sync='inplace'`: staging in /dev/shm and the
server's load, its own share in brackets) --syncs times, and by restart
(`weight_sync='restart'`: export + a new server) twice, on a server of its own started
after the first one stopped (never two servers at once). Each sync publishes other
weights (params x (1 + 0.01 k)), so nothing is skipped as unchanged.

Not a timed test: the rows and the command are in docs/vllm.md and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time

import jax
import numpy as np

from sao_jax import config as config_lib
from sao_jax.parallel.mesh import Sharder
from sao_jax.run.inputs import build_models, resolved_config
from sao_jax.sampling.backend import GenRequest
from sao_jax.sampling.backend_factory import build_backend
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.sampling.vllm_config import vllm_config
from sao_jax.text.tokenizer import load_tokenizer

BACKENDS = ("native", "vllm")


class NoEos:
    """The run's tokenizer with its eos withheld: every request decodes its full budget."""

    eos_id = None

    def __init__(self, tokenizer):
        self._tok = tokenizer

    def __getattr__(self, name):
        return getattr(self._tok, name)


def round_order(r: int) -> tuple[str, ...]:
    """The backends' order in round r: native first in even rounds, vLLM in odd ones."""
    return BACKENDS if r % 2 == 0 else BACKENDS[::-1]


def one_round(backend, prompts_ct: np.ndarray, tokens: int) -> tuple[float, int]:
    """(seconds, sampled tokens) of C requests submitted at once, until the last ends."""
    t0 = time.perf_counter()
    handles = [backend.submit(GenRequest(tuple(int(i) for i in p), tokens)) for p in prompts_ct]
    n = sum(len(h.future.result(timeout=1800).token_ids) for h in handles)
    return time.perf_counter() - t0, n


def paired_ratios(rows: dict[str, list[tuple[float, int]]]) -> list[float]:
    """vllm / native decode tokens/s, round by round (the rounds were paired)."""
    rate = {k: [n / dt for dt, n in v] for k, v in rows.items()}
    return [v / n for n, v in zip(rate["native"], rate["vllm"], strict=True)]


def scaled(params, k: int):
    """Other weights for the k-th sync (x (1 + 0.01 k)), so no sync is of the same ones;
    computed before a sync is timed."""
    return jax.block_until_ready(jax.tree.map(lambda x: x * (1 + 0.01 * k), params))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/sao.py:vllm")
    p.add_argument("--levels", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="sampled tokens per request")
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--syncs", type=int, default=5, help="in-place syncs timed (restart: 2)")
    args = p.parse_args()

    config = resolved_config(config_lib.load_config(args.config))  # an hf run: its checkpoint
    tok = NoEos(load_tokenizer(config.init.tokenizer))
    models = build_models(config, Sharder(), tok)
    mdef, params, vocab = models.policy_def, models.policy, models.cfg.vocab_size
    n_params = sum(x.size for x in jax.tree.leaves(params))
    max_len = args.prompt_len + args.tokens
    engine_cfg, _ = configs_from_section(config.sampling, config.seed)
    engine_cfg = dataclasses.replace(engine_cfg, max_len=max_len, max_turn_tokens=args.tokens)
    vcfg = dataclasses.replace(vllm_config(config.sampling.vllm), max_num_seqs=max(args.levels))
    rng = np.random.default_rng(0)
    prompts = {c: rng.integers(3, vocab, (c, args.prompt_len)) for c in args.levels}
    print(f"{args.config}: {n_params / 1e6:.3f}M parameters, vocab {vocab}, "
          f"{args.prompt_len} + {args.tokens} tokens per request, levels {args.levels}, "
          f"{args.rounds} rounds; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, vLLM {vcfg.omp_threads} OpenMP thread(s)")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        common = dict(mdef=mdef, params=params, tokenizer=tok, seed=config.seed, workdir=tmp)
        t = time.perf_counter()
        vllm = build_backend("vllm", engine_cfg=engine_cfg, vllm=vcfg, **common)
        start_s = time.perf_counter() - t
        native = {
            c: build_backend(
                "native", engine_cfg=dataclasses.replace(engine_cfg, num_slots=c), **common
            )
            for c in args.levels
        }
        print(f"vLLM server start {start_s:.1f} s; warm-up rounds (untimed) ...", flush=True)
        rows = {c: {b: [] for b in BACKENDS} for c in args.levels}
        try:
            for c in args.levels:
                one_round(native[c], prompts[c], args.tokens)
                one_round(vllm, prompts[c], args.tokens)
            for r in range(args.rounds):
                for c in args.levels:
                    for b in round_order(r):
                        backend = native[c] if b == "native" else vllm
                        rows[c][b].append(one_round(backend, prompts[c], args.tokens))
                print(f"  round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.1f}",
                      flush=True)  # fmt: skip
            sync = {"native": [], "vllm in place": [], "vllm restart": []}
            for k in range(1, args.syncs + 1):
                new = scaled(params, k)
                t = time.perf_counter()
                native[args.levels[0]].publish(new, k)
                sync["native"].append(time.perf_counter() - t)
                vllm.publish(new, k)
            sync["vllm in place"] = list(vllm.publish_s)
            server_s = [s.get("seconds", float("nan")) for s in vllm.syncs]
        finally:
            vllm.close()
            for b in native.values():
                b.close()
        restart = build_backend(
            "vllm", engine_cfg=engine_cfg, vllm=dataclasses.replace(vcfg, weight_sync="restart"),
            **common,
        )  # fmt: skip
        try:
            for k in (1, 2):
                restart.publish(scaled(params, k), k)  # the export is timed (a sync's part)
            sync["vllm restart"] = list(restart.publish_s)
        finally:
            restart.close()

    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (a shared box: ratios, not rates)")
    print(f"{'level':>5} {'backend':8} {'traj/s':>8} {'tokens/s':>9}  per-round vllm/native")
    for c in args.levels:
        for b in BACKENDS:
            traj = statistics.median(c / dt for dt, _ in rows[c][b])
            toks = statistics.median(n / dt for dt, n in rows[c][b])
            print(f"{c:5d} {b:8} {traj:8.2f} {toks:9.1f}", end="")
            if b == "vllm":
                ratios = paired_ratios(rows[c])
                per = ", ".join(f"{x:.2f}" for x in ratios)
                print(f"  {per}; median {statistics.median(ratios):.2f}", end="")
            print()
    print("\nseconds per weight sync (no request in flight)")
    for name, s in sync.items():
        extra = ""
        if name == "vllm in place":
            extra = " (in the server: " + ", ".join(f"{x:.3f}" for x in server_s) + ")"
        print(f"  {name:14s} " + ", ".join(f"{x:.3f}" for x in s) + extra)


if __name__ == "__main__":  # vLLM's engine is started with spawn elsewhere; keep the guard
    main()
