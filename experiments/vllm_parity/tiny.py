"""The tiny Qwen3-MoE of vLLM's parity checks, built with transformers (no downloads).

The shapes vLLM's CPU kernels take (hidden and MoE widths multiples of 32, head_dim 64;
docs/vllm.md), 4 experts top-2, a vocabulary of 512 (the harness tokenizer's ids fit), and
weights of std 0.2 (norms 1 +- 0.1), so that next-token laws are peaked (log-probs of a
few nats) and the MoE routing is not a coin toss. Used by tests/test_vllm_backend.py and
experiments/vllm_parity.
"""

from __future__ import annotations

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
)


def tiny_checkpoint(path: str, seed: int = 0) -> None:
    """Saves the tiny model (fp32 safetensors and config.json) under `path`."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    model.save_pretrained(path)
