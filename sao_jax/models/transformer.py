"""The Qwen3-MoE-style decoder: a shared trunk, a policy (LM head) and a critic (value head).

Policy = trunk + LM head (tied to the embedding or not). Critic = the same trunk + a scalar
value per token; `Critic.from_policy` copies a policy's trunk. Attention parameters sit
under `trunk.layers.<i>.attn` (or `trunk.stacks.<r>.attn`, stacked [L_run, ...], with
`model.scan_layers`: layer_stack.py), so the critic can freeze them by path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.attention import Attention, KVCache, init_cache
from sao_jax.models.config import ModelConfig
from sao_jax.models.layer_stack import apply_layers, layer_runs, stack_modules
from sao_jax.models.layers import DenseMLP, Embed, RMSNorm, normal, param, token_einsum, zeros
from sao_jax.models.moe.block import MoEBlock
from sao_jax.models.paged_cache import PagedKVCache, init_paged_cache
from sao_jax.parallel.mesh import Sharder


class ModelOutput(NamedTuple):
    out: jax.Array  # policy: logits [B, T, V] float32; critic: values [B, T] float32
    experts_btlk: jax.Array | None  # chosen experts per MoE layer [B, T, L_moe, k] int32
    aux_loss: jax.Array  # load-balancing loss (already scaled by router_aux_loss_coef)
    cache: tuple[KVCache, ...] | None  # updated KV cache (per layer, or per stack) if given


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); mlp is MoE or dense."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, sharder: Sharder, rngs: nnx.Rngs):
        d, pd, std, eps = cfg.hidden_size, cfg.weight_dtype, cfg.initializer_range, cfg.rms_norm_eps
        self.input_norm = RMSNorm(d, eps=eps, param_dtype=pd, rngs=rngs)
        self.attn = Attention(
            dim=d,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            rope_theta=cfg.rope_theta,
            eps=eps,
            init_std=std,
            param_dtype=pd,
            sharder=sharder,
            rngs=rngs,
            impl=cfg.attention_impl,
            block=cfg.attention_block,
        )
        self.post_attn_norm = RMSNorm(d, eps=eps, param_dtype=pd, rngs=rngs)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        if self.is_moe:
            self.mlp = MoEBlock(
                dim=d,
                hidden=cfg.moe_intermediate_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                norm_topk=cfg.norm_topk_prob,
                impl=cfg.moe_impl,
                init_std=std,
                param_dtype=pd,
                sharder=sharder,
                rngs=rngs,
            )
        else:
            self.mlp = DenseMLP(
                d, cfg.intermediate_size, init_std=std, param_dtype=pd, sharder=sharder, rngs=rngs
            )

    def __call__(self, x_btd, positions_bt, segment_ids_bt, cache, forced_experts_btk):
        h, cache = self.attn(self.input_norm(x_btd), positions_bt, segment_ids_bt, cache)
        x_btd = x_btd + h
        routing = None
        if self.is_moe:
            h, routing = self.mlp(
                self.post_attn_norm(x_btd), forced_experts_btk, token_mask_bt=segment_ids_bt != 0
            )
        else:
            h = self.mlp(self.post_attn_norm(x_btd))
        return x_btd + h, cache, routing


class Trunk(nnx.Module):
    """Embedding, decoder layers and final norm; returns the last hidden states."""

    def __init__(self, cfg: ModelConfig, *, sharder: Sharder, rngs: nnx.Rngs):
        self.cfg = cfg
        self.sharder = sharder
        self.embed = Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            init_std=cfg.initializer_range,
            param_dtype=cfg.weight_dtype,
            rngs=rngs,
        )
        layers = [
            DecoderLayer(cfg, i, sharder=sharder, rngs=rngs) for i in range(cfg.num_hidden_layers)
        ]
        if cfg.scan_layers:  # one module per run of same-kind layers, params [L_run, ...]
            self.stacks = nnx.List([stack_modules(layers[a:b]) for a, b in layer_runs(cfg)])
        else:
            self.layers = nnx.List(layers)
        self.final_norm = RMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.weight_dtype, rngs=rngs
        )

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        segment_ids_bt: jax.Array | None = None,
        *,
        cache: tuple[KVCache, ...] | None = None,
        forced_experts_btlk: jax.Array | None = None,
    ):
        cfg = self.cfg
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        x = self.sharder.constrain(
            self.embed(tokens_bt, cfg.compute_dtype), ("batch", "length", "act_embed")
        )
        x, experts_btlk, aux_l, cache = apply_layers(
            list(self.stacks if cfg.scan_layers else self.layers),
            x,
            positions_bt,
            segment_ids_bt,
            forced_experts_btlk,
            num_experts=cfg.num_experts,
            remat=cfg.remat,
            stacked=cfg.scan_layers,
            sharder=self.sharder,
            cache=cache,
        )
        hidden = self.final_norm(x)
        aux_loss = cfg.router_aux_loss_coef * (jnp.mean(aux_l) if aux_l is not None else 0.0)
        return hidden, experts_btlk, jnp.asarray(aux_loss, jnp.float32), cache

    def init_cache(self, batch: int, length: int) -> tuple[KVCache, ...]:
        """Zeros: one KVCache [B, S, K, H] per layer, or (`scan_layers`) one per stack,
        [L_run, B, S, K, H]."""
        cfg = self.cfg
        kw = dict(num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
        if cfg.scan_layers:
            sizes = [b - a for a, b in layer_runs(cfg)]
        else:
            sizes = [None] * cfg.num_hidden_layers
        return tuple(
            init_cache(batch, length, dtype=cfg.compute_dtype, layers=n, **kw) for n in sizes
        )

    def init_paged_cache(self, num_pages: int, page_size: int) -> tuple[PagedKVCache, ...]:
        """Zeros: one pool of `num_pages` pages of `page_size` positions per layer, laid out
        [K, 1, P, Z, H] per layer or (`scan_layers`) [K, L_run, P, Z, H] per stack
        (models/paged_cache.py)."""
        cfg = self.cfg
        kw = dict(num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
        runs = layer_runs(cfg) if cfg.scan_layers else [(0, 1)] * cfg.num_hidden_layers
        return tuple(
            init_paged_cache(num_pages, page_size, dtype=cfg.compute_dtype, layers=b - a, **kw)
            for a, b in runs
        )


class Policy(nnx.Module):
    """Trunk + LM head: next-token logits [B, T, V] in float32."""

    def __init__(self, cfg: ModelConfig, *, sharder: Sharder | None = None, rngs: nnx.Rngs):
        sharder = sharder or Sharder()
        self.cfg = cfg
        self.sharder = sharder
        self.trunk = Trunk(cfg, sharder=sharder, rngs=rngs)
        self.lm_head = nnx.data(None)
        if not cfg.tie_word_embeddings:
            self.lm_head = param(
                rngs,
                normal(cfg.initializer_range),
                (cfg.hidden_size, cfg.vocab_size),
                ("embed", "vocab"),
                cfg.weight_dtype,
            )

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, **kw) -> ModelOutput:
        hidden, experts, aux, cache = self.trunk(tokens_bt, positions_bt, segment_ids_bt, **kw)
        return ModelOutput(self.head_logits(hidden), experts, aux, cache)

    def hidden_states(self, tokens_bt, positions_bt=None, segment_ids_bt=None, **kw):
        """As `__call__` with `out` = the final hidden states [B, T, D] (compute dtype), for
        passes that apply the LM head in chunks (sao_jax/models/logprobs.py)."""
        return ModelOutput(*self.trunk(tokens_bt, positions_bt, segment_ids_bt, **kw))

    def head_logits(self, hidden_btd: jax.Array) -> jax.Array:
        """LM head: hidden states [B, T, D] -> logits [B, T, V] float32."""
        if self.lm_head is None:
            logits = self.trunk.embed.attend(hidden_btd)
        else:
            w_dv = self.lm_head[...].astype(hidden_btd.dtype)
            logits = token_einsum("btd,dv->btv", hidden_btd, w_dv)
        return self.sharder.constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))


class Critic(nnx.Module):
    """Trunk + scalar value head: V [B, T] in float32.

    The value head starts at zero (weights and bias), so V = 0 before value pretraining
    instead of an arbitrary scale that blows up the first critic loss.
    """

    def __init__(self, cfg: ModelConfig, *, sharder: Sharder | None = None, rngs: nnx.Rngs):
        sharder = sharder or Sharder()
        self.cfg = cfg
        self.sharder = sharder
        self.trunk = Trunk(cfg, sharder=sharder, rngs=rngs)
        self.value_head = param(rngs, zeros, (cfg.hidden_size,), ("embed",), jnp.float32)
        self.value_bias = param(rngs, zeros, (), (), jnp.float32)

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, **kw) -> ModelOutput:
        hidden, experts, aux, cache = self.trunk(tokens_bt, positions_bt, segment_ids_bt, **kw)
        values = token_einsum("btd,d->bt", hidden.astype(jnp.float32), self.value_head[...])
        return ModelOutput(values + self.value_bias[...], experts, aux, cache)


def critic_params_from_policy(policy_params: dict, critic_params: dict) -> dict:
    """Critic params whose trunk is a copy of the policy's (value head kept as given)."""
    out = dict(critic_params)
    out["trunk"] = jax.tree.map(jnp.copy, policy_params["trunk"])
    return out
