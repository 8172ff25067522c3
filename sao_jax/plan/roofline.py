"""What bounds a step: bytes a decode step must read against HBM bandwidth, useful FLOPs
against peak FLOP/s (published figures: sao_jax/plan/hardware.py).

Decode (one token per slot per step, S slots, each reading a context of C cached tokens)
is memory-bound: a step reads at least

  weights  every matmul weight a token touches once per step, whatever S: attention
           q/k/v/o, routers, dense MLPs, norms and the LM head (D V), the S embedding rows,
           and per MoE layer the experts the S tokens route to, E (1 - (1 - k/E)^S) of E
           in expectation when routing is uniform (`expected_experts_touched`): all of
           them at S >= 64 for Qwen3-30B-A3B's k = 8 of E = 128;
  KV       S x C x L x 2 K H bytes of keys and values,

so tokens/s <= S x HBM bandwidth / (weight bytes + KV bytes) (`decode_tokens_per_s_bound`).
Activations, logits and the sampler's sort over the vocabulary are not counted: the
bound is optimistic, a measured fraction of it says how far a decode step is from it.

MFU = useful FLOPs per second / peak dense bf16 FLOP/s, with the useful FLOPs of
sao_jax/plan/flops.py (not what a backend executes, e.g. XLA's padded ragged_dot).
"""

from __future__ import annotations

from sao_jax.models.config import ModelConfig
from sao_jax.plan.flops import param_counts
from sao_jax.plan.kv_pool import kv_bytes_per_token


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """E (1 - (1 - k/E)^n): distinct experts that n tokens route to in one MoE layer, in
    expectation, when each token takes k of the E experts uniformly (P(a given expert is
    not among one token's k) = 1 - k / E)."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def decode_step_bytes(
    cfg: ModelConfig, slots: int, context: int, *, weight_bytes: int = 2, kv_bytes: int = 2
) -> dict[str, float]:
    """{'weights', 'kv', 'total'}: bytes one decode step reads at least (module docstring),
    for `slots` tokens each attending `context` cached positions; weights and cache in
    `weight_bytes` / `kv_bytes` per element (bf16: 2)."""
    counts = param_counts(cfg, "policy")
    d, v = cfg.hidden_size, cfg.vocab_size
    head = d * v  # the LM head (the embedding table too, when tied)
    embedding_rows = 0 if cfg.tie_word_embeddings else min(slots, v) * d
    dense = sum(n for k, n in counts.items() if k not in ("experts", "embedding + lm_head"))
    per_expert = 3 * d * cfg.moe_intermediate_size
    touched = expected_experts_touched(cfg.num_experts, cfg.num_experts_per_tok, slots)
    experts = len(cfg.moe_layers) * touched * per_expert
    weights = (dense + head + embedding_rows + experts) * weight_bytes
    kv = slots * context * kv_bytes_per_token(cfg, kv_bytes)
    return {"weights": float(weights), "kv": float(kv), "total": float(weights + kv)}


def decode_tokens_per_s_bound(step_bytes: float, slots: int, hbm_bytes_per_s: float) -> float:
    """Tokens/s an HBM of `hbm_bytes_per_s` allows when each step of `slots` tokens reads
    `step_bytes`."""
    return slots * hbm_bytes_per_s / step_bytes


def mfu(useful_flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOP utilisation: useful FLOPs / (seconds x peak FLOP/s)."""
    return useful_flops / (seconds * peak_flops)
