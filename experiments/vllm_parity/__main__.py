"""Why a few of vLLM's log-probs sit far from the learner's: MoE routing flips, proven.

    make vllm-env                                       # once (docs/vllm.md)
    python -m experiments.vllm_parity                   # 32 prompts x 64 tokens
    python -m experiments.vllm_parity --prompts 64 --tokens 64 --seed 1

tests/test_vllm_backend.py's parity test finds |delta logp| (vLLM bf16 against the
learner's fp32 recomputation on the same bf16-rounded weights) of a few 1e-2 nats on most
tokens and a tail of ~0.5% off by 0.25-1.5 nats. The claim checked here: the tail is the
MoE top-k choice flipping between the two passes (bf16 rounding moves a router's logits
across a near tie), not attention or the expert kernels. How:

1. vLLM's side (experiments/vllm_parity/engine_side.py, in the vLLM env): the tiny
   Qwen3-MoE of experiments/vllm_parity/tiny.py samples --tokens tokens at temperature 1
   after each of --prompts random --prompt_len-id prompts, one request at a time, and
   records the experts it routed every position to (its routers' capture callback).
2. The learner (this process): the same tokens recomputed in fp32 on the bf16-rounded
   weights twice: routing itself (what DIS compares in a run) and REPLAYING vLLM's experts
   (the model's `forced_experts_btlk`, rl.routing_replay's path); and the positions where
   its own top-k set differs from vLLM's (a flip) in any MoE layer.

If flips cause the tail, the replayed pass has no tail (its max |delta| is of the bf16
noise's size) and the tail's tokens follow a flip (at the position that predicts them or
earlier: attention carries a flip's effect forward). Prints the table of docs/vllm.md
("Parity: where the tail comes from"); exit 2 on bad arguments or a failed engine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments.vllm_parity.tiny import TINY, tiny_checkpoint
from sao_jax.models import hf
from sao_jax.sampling.backend_vllm import server_env
from sao_jax.sampling.vllm_config import VllmConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
ENGINE_SIDE = pathlib.Path(__file__).with_name("engine_side.py")
TAIL = 0.25  # nats: tests/test_vllm_backend.py's PARITY_P99, the tail's threshold
DIS_BAND = (0.7, 6.0)  # rl.losses.dis's kept ratio band (docs/method.md, section 2)


def flipped_positions(own_tlk: np.ndarray, engine_tlk: np.ndarray) -> np.ndarray:
    """[T] bool: the positions where any MoE layer's chosen expert SET differs between
    two routings [T, L, k] (the order within the top-k does not matter)."""
    return np.any(np.sort(own_tlk, axis=-1) != np.sort(engine_tlk, axis=-1), axis=(1, 2))


def flip_before(flips_t: np.ndarray, prompt_len: int) -> np.ndarray:
    """[N] bool for the N = T - prompt_len + 1 sampled tokens: token j (at position
    prompt_len + j) follows a flip at a position <= prompt_len + j - 1 (the one whose
    logits predict it, or an earlier one, through attention)."""
    seen = np.logical_or.accumulate(flips_t)  # [T]
    return seen[prompt_len - 1 :]


def summary(delta: np.ndarray) -> dict[str, float]:
    """|delta logp| median, p99, max, the tokens over TAIL, and DIS's keep rate."""
    ratio = np.exp(delta)  # exp(learner - engine): DIS's r_t
    keep = np.mean((ratio > DIS_BAND[0]) & (ratio < DIS_BAND[1]))
    a = np.abs(delta)
    return dict(
        median=float(np.median(a)),
        p99=float(np.quantile(a, 0.99)),
        max=float(a.max()),
        tail=int(np.sum(a > TAIL)),
        keep=float(keep),
    )


def _bf16_rounded(params):
    """The weights vLLM holds (its dtype=bfloat16), in fp32 for the reference."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), params)


def _learner(mdef, params, ids: list[int], forced_tlk: np.ndarray | None):
    """(log_softmax(logits[t - 1])[ids[t]] for t >= 1 [T - 1], the experts chosen [T, L, k])
    of one sequence, fp32; `forced_tlk`: replay these experts at every position."""
    tokens = jnp.asarray([ids], jnp.int32)
    forced = None if forced_tlk is None else jnp.asarray(forced_tlk[None], jnp.int32)
    out = mdef.bind(params)(tokens, forced_experts_btlk=forced)
    logp = jax.nn.log_softmax(out.out[0].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp[:-1], tokens[0, 1:, None], axis=-1)[:, 0]
    return np.asarray(picked), np.asarray(out.experts_btlk[0])


def _engine(args, model_dir: str, prompts: list[list[int]], work: str) -> list[dict]:
    """Runs engine_side.py in the vLLM env; its records (engine_side.py's docstring)."""
    path, out = os.path.join(work, "prompts.json"), os.path.join(work, "engine.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    cmd = [
        args.vllm_python,
        str(ENGINE_SIDE),
        f"--model={model_dir}",
        f"--prompts={path}",
        f"--max_tokens={args.tokens}",
        f"--seed={args.seed}",
        f"--out={out}",
    ]
    log = os.path.join(work, "vllm.log")
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env(VllmConfig()))
    if done.returncode != 0:
        tail = pathlib.Path(log).read_text().strip().splitlines()[-1:]
        sys.exit(f"vllm_parity: the engine side exited {done.returncode}: {tail}; log: {log}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm_python", default=str(REPO / ".vllm-venv/bin/python"))
    parser.add_argument("--work_dir", default="", help="keep the checkpoint, records, log")
    args = parser.parse_args(argv)
    for name in ("prompts", "prompt_len", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.prompt_len + args.tokens > TINY["max_position_embeddings"]:
        parser.error(f"--prompt_len + --tokens must be <= {TINY['max_position_embeddings']}")
    if not os.access(args.vllm_python, os.X_OK):
        parser.error(f"--vllm_python {args.vllm_python} missing: run `make vllm-env`")
    work = args.work_dir or tempfile.mkdtemp(prefix="vllm_parity_")
    model_dir = os.path.join(work, "tiny")
    tiny_checkpoint(model_dir)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(1, TINY["vocab_size"], size=(args.prompts, args.prompt_len))
    records = _engine(args, model_dir, prompts.tolist(), work)
    _, mdef, params = hf.load_hf_policy(model_dir)
    params = _bf16_rounded(params)
    own_d, replay_d, after, flip_rates = [], [], [], []
    for rec in records:
        ids = rec["prompt"] + rec["token_ids"]
        engine_tlk = np.asarray(rec["experts"])  # [T - 1, L, k]: the last token not fed
        got = np.asarray(rec["logp"])
        own_logp, own_tlk = _learner(mdef, params, ids, None)
        forced = np.concatenate([engine_tlk, own_tlk[-1:]])  # the last position: no token
        replay_logp, _ = _learner(mdef, params, ids, forced)
        n = len(rec["prompt"])
        own_d.append(own_logp[n - 1 :] - got)
        replay_d.append(replay_logp[n - 1 :] - got)
        flips = flipped_positions(own_tlk[:-1], engine_tlk)
        flip_rates.append(flips)
        after.append(flip_before(flips, n)[: len(got)])
    own, replay = np.concatenate(own_d), np.concatenate(replay_d)
    after_n, flips_all = np.concatenate(after), np.concatenate(flip_rates)
    tail = np.abs(own) > TAIL
    rows = [("learner routes itself (a run's DIS)", summary(own)),
            ("learner replays vLLM's experts", summary(replay))]  # fmt: skip
    print(
        f"{len(records)} requests x {args.tokens} tokens at temperature 1 (seed {args.seed}); "
        f"tiny Qwen3-MoE, {TINY['num_experts']} experts top-{TINY['num_experts_per_tok']}, "
        f"{TINY['num_hidden_layers']} MoE layers; vLLM bf16, learner fp32 on the same "
        f"bf16-rounded weights\n"
    )
    print("| learner pass | tokens | |delta| median | p99 | max | tokens > 0.25 | DIS keep |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in rows:
        print(f"| {name} | {own.size} | {s['median']:.4f} | {s['p99']:.4f} | {s['max']:.4f} "
              f"| {s['tail']} | {s['keep']:.4f} |")  # fmt: skip
    print(
        f"\nrouting flips (any layer's expert set differs): {int(flips_all.sum())} of "
        f"{flips_all.size} positions ({flips_all.mean():.2%}); sampled tokens after a flip: "
        f"{int(after_n.sum())} of {after_n.size}"
    )
    print(
        f"tail tokens (|delta| > {TAIL} routing itself) after a flip: "
        f"{int(np.sum(tail & after_n))} of {int(tail.sum())}; "
        f"max |delta| among tokens with no flip before them: "
        f"{np.abs(own[~after_n]).max() if (~after_n).any() else float('nan'):.4f}"
    )


if __name__ == "__main__":
    main()
