"""Softmax top-k router (Qwen3-MoE) with optional routing replay and load-balancing loss.

The router returns the experts it chose for every token, so that a rollout can record
them and a training pass can force the same choice (`forced_experts_nk`): routing replay.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.layers import normal, param


class Routing(NamedTuple):
    experts_nk: jax.Array  # [N, k] int32 chosen experts per token
    weights_nk: jax.Array  # [N, k] combine weights (compute dtype)
    probs_ne: jax.Array  # [N, E] float32 softmax over all experts


def route(
    logits_ne: jax.Array,
    top_k: int,
    *,
    norm_topk: bool,
    forced_experts_nk: jax.Array | None = None,
) -> Routing:
    """probs = softmax(logits); experts = top-k of probs (or the forced ones);
    weights = probs at those experts, renormalised to sum to one when `norm_topk`."""
    probs_ne = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
    if forced_experts_nk is None:
        weights_nk, experts_nk = jax.lax.top_k(probs_ne, top_k)
    else:
        experts_nk = forced_experts_nk.astype(jnp.int32)
        weights_nk = jnp.take_along_axis(probs_ne, experts_nk, axis=-1)
    if norm_topk:
        weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
    return Routing(experts_nk.astype(jnp.int32), weights_nk, probs_ne)


def load_balancing_loss(routing: Routing, num_experts: int, token_mask_n=None) -> jax.Array:
    """Switch/Mixtral auxiliary loss: E * sum_e f_e * P_e over valid tokens.

    f_e is the fraction of (token, slot) assignments sent to expert e, averaged per slot as
    Hugging Face does; P_e is the mean router probability of expert e.
    """
    n = routing.experts_nk.shape[0]
    w_n = jnp.ones((n,), jnp.float32) if token_mask_n is None else token_mask_n.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(w_n), 1.0)
    onehot_nke = jax.nn.one_hot(routing.experts_nk, num_experts, dtype=jnp.float32)
    frac_ke = jnp.einsum("nke,n->ke", onehot_nke, w_n) / denom
    prob_e = jnp.einsum("ne,n->e", routing.probs_ne, w_n) / denom
    return num_experts * jnp.sum(frac_ke * prob_e[None, :])


class Router(nnx.Module):
    """Linear gate [D, E]; its logits feed `route`."""

    def __init__(self, dim: int, num_experts: int, *, init_std: float, param_dtype, rngs):
        self.kernel = param(
            rngs, normal(init_std), (dim, num_experts), ("embed", "router_experts"), param_dtype
        )

    def __call__(self, x_nd: jax.Array) -> jax.Array:
        return jnp.einsum("nd,de->ne", x_nd, self.kernel[...].astype(x_nd.dtype))
