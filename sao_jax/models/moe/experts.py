"""Expert weights and the grouped SwiGLU computation over tokens sorted by expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.layers import normal, param


def grouped_swiglu(x_md, group_sizes_e, w_gate_edf, w_up_edf, w_down_efd) -> jax.Array:
    """Rows of `x_md` are sorted by expert: the first group_sizes[0] rows go to expert 0,
    and so on. Rows past sum(group_sizes) belong to no local expert and come out zero.

    Returns [M, D] = down_e(silu(x @ gate_e) * (x @ up_e)) for each row's expert e.
    """
    dt = x_md.dtype
    gate_mf = jax.lax.ragged_dot(x_md, w_gate_edf.astype(dt), group_sizes_e)
    up_mf = jax.lax.ragged_dot(x_md, w_up_edf.astype(dt), group_sizes_e)
    h_mf = jax.nn.silu(gate_mf) * up_mf
    return jax.lax.ragged_dot(h_mf, w_down_efd.astype(dt), group_sizes_e)


class Experts(nnx.Module):
    """E SwiGLU experts stored as stacked tensors: gate/up [E, D, F], down [E, F, D]."""

    def __init__(self, num_experts: int, dim: int, hidden: int, *, init_std, param_dtype, rngs):
        init = normal(init_std)
        up_axes = ("expert", "embed", "expert_mlp")
        self.gate_proj = param(rngs, init, (num_experts, dim, hidden), up_axes, param_dtype)
        self.up_proj = param(rngs, init, (num_experts, dim, hidden), up_axes, param_dtype)
        self.down_proj = param(
            rngs, init, (num_experts, hidden, dim), ("expert", "expert_mlp", "embed"), param_dtype
        )

    def weights(self):
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]


def reference_moe(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd) -> jax.Array:
    """Slow dense reference: every expert on every token, combined with one-hot weights."""
    dt = x_nd.dtype
    gate = jnp.einsum("nd,edf->nef", x_nd, w_gate_edf.astype(dt))
    up = jnp.einsum("nd,edf->nef", x_nd, w_up_edf.astype(dt))
    y_ned = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, w_down_efd.astype(dt))
    combine_ne = jnp.einsum(
        "nke,nk->ne",
        jax.nn.one_hot(experts_nk, w_gate_edf.shape[0], dtype=dt),
        weights_nk.astype(dt),
    )
    return jnp.einsum("ned,ne->nd", y_ned, combine_ne)
