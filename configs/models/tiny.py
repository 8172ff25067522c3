"""The embedded default model: a small Qwen3-MoE-style decoder trained from scratch on CPU.

Mixes one dense layer with MoE layers so both code paths run in every demo and test.
"""

import ml_collections


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.vocab_size = 64  # the built-in character tokenizer fits
    c.hidden_size = 64
    c.num_hidden_layers = 3
    c.num_attention_heads = 4
    c.num_key_value_heads = 2
    c.head_dim = 16
    c.intermediate_size = 128  # dense layer width
    c.moe_intermediate_size = 64  # per-expert width
    c.num_experts = 8
    c.num_experts_per_tok = 2
    c.norm_topk_prob = True
    c.decoder_sparse_step = 1
    c.mlp_only_layers = (0,)  # layer 0 dense, layers 1-2 MoE
    c.rope_theta = 10000.0
    c.rms_norm_eps = 1e-6
    c.tie_word_embeddings = False
    c.router_aux_loss_coef = 0.001
    c.initializer_range = 0.02
    c.moe_impl = "auto"  # 'grouped' on CPU (measured fastest), 'ragged' on accelerators
    c.dtype = "float32"
    c.param_dtype = "float32"
    return c
