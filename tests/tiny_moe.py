"""A tiny Hugging Face Qwen3-MoE for the weight-export tests: dense and sparse layers
(every second layer MoE) and tied embeddings, saved with transformers from a fixed seed."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=2,
    tie_word_embeddings=True,
)


def save_tiny_moe(path: str) -> str:
    """Writes the tiny model (seed 0) to `path` and returns it."""
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).save_pretrained(path)
    return path
