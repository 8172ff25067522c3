"""Qwen3-30B-A3B: the published dims (30.5 B parameters, 3.3 B active per token).

Matches the Hub's Qwen/Qwen3-30B-A3B config.json; a checkpoint loads with
`sao_jax.models.hf.load_hf_policy(path, param_dtype=..., dtype=...)`, which reads the
dims from config.json itself. This section is for planning and for runs that start
from such a checkpoint:

    python -m experiments.memory_plan --config=configs/models/qwen3_30b_a3b.py \\
        --mesh=data=1,fsdp=8,expert=8,tensor=1 --devices=64

param_dtype is float32 on purpose: RL updates at lr 1e-6 are ~1e-6 in absolute size,
far below bfloat16's resolution (2^-8 relative, ~1e-4 at weight scale 0.02), so bf16
master weights would round most updates away. Matmuls still run in bfloat16 (dtype).
"""

import ml_collections


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.vocab_size = 151936  # Qwen3 tokenizer vocabulary (padded)
    c.hidden_size = 2048
    c.num_hidden_layers = 48
    c.num_attention_heads = 32
    c.num_key_value_heads = 4  # GQA: 8 query heads per kv head
    c.head_dim = 128  # != hidden_size / heads (64)
    c.intermediate_size = 6144  # dense MLP width (unused: every layer is MoE)
    c.moe_intermediate_size = 768  # per-expert width
    c.num_experts = 128
    c.num_experts_per_tok = 8
    c.norm_topk_prob = True
    c.decoder_sparse_step = 1  # every layer sparse
    c.mlp_only_layers = ()
    c.rope_theta = 1_000_000.0
    c.rms_norm_eps = 1e-6
    c.tie_word_embeddings = False
    c.router_aux_loss_coef = 0.001
    c.initializer_range = 0.02
    c.moe_impl = "auto"  # grouped GEMM (ragged_dot) on GPU/TPU
    c.dtype = "bfloat16"  # activations / matmuls
    c.param_dtype = "float32"  # master weights (see the module docstring)
    return c
