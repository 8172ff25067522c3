"""The sparse MoE block: router -> dropless expert dispatch."""

from __future__ import annotations

import jax
from flax import nnx

from sao_jax.models.moe.dispatch import moe_dispatch
from sao_jax.models.moe.experts import Experts
from sao_jax.models.moe.router import Router, Routing, route
from sao_jax.parallel.mesh import Sharder


class MoEBlock(nnx.Module):
    """Qwen3-MoE sparse block. Returns the output and the routing (for replay and aux loss)."""

    def __init__(
        self,
        *,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool,
        impl: str,
        init_std: float,
        param_dtype,
        sharder: Sharder,
        rngs: nnx.Rngs,
    ):
        self.top_k = top_k
        self.norm_topk = norm_topk
        self.impl = impl
        self.sharder = sharder
        self.gate = Router(dim, num_experts, init_std=init_std, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(
            num_experts, dim, hidden, init_std=init_std, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(
        self,
        x_btd: jax.Array,
        forced_experts_btk: jax.Array | None = None,
        *,
        token_mask_bt: jax.Array | None = None,
    ) -> tuple[jax.Array, Routing]:
        """`token_mask_bt` (bool, e.g. segment_ids != 0): padding tokens are routed (the
        routing is recorded as before) but computed by no expert; their output is 0."""
        b, t, d = x_btd.shape
        x_nd = x_btd.reshape(b * t, d)
        forced = None if forced_experts_btk is None else forced_experts_btk.reshape(b * t, -1)
        routing = route(
            self.gate(x_nd), self.top_k, norm_topk=self.norm_topk, forced_experts_nk=forced
        )
        y_nd = moe_dispatch(
            x_nd,
            routing.experts_nk,
            routing.weights_nk.astype(x_nd.dtype),
            *self.experts.weights(),
            self.sharder,
            self.impl,
            None if token_mask_bt is None else token_mask_bt.reshape(b * t),
        )
        return y_nd.reshape(b, t, d), routing
