"""Dropless token dispatch: sort (token, slot) pairs by expert and run grouped matmuls.

Unsharded, every expert is local. On a mesh the experts are split over the `expert`
logical axis (expert parallelism) and their hidden width over `expert_mlp` (tensor
parallelism) inside a `shard_map`: each device all-gathers the tokens of its expert
group, computes the contributions of its own experts, and the partial outputs are summed
back with `psum_scatter` (tokens sharded there) or `psum`. Expert weights are never
gathered and no token is ever dropped.

The local expert compute is one of three exact, dropless implementations (`moe_impl`):
  ragged   `ragged_dot` grouped GEMMs over the rows sorted by expert (GPU/TPU);
  grouped  plain matmuls over tiles of each expert's group (sao_jax/models/moe/grouped.py);
  dense    every local expert on every token, combined with the routing weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sao_jax.models.moe.experts import grouped_swiglu
from sao_jax.models.moe.grouped import grouped_local_moe
from sao_jax.parallel import platform
from sao_jax.parallel.mesh import Sharder

IMPLS = ("ragged", "grouped", "dense")


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """'auto' -> 'grouped' on CPU, 'ragged' on accelerators (GPU, TPU, ...).

    Measured (docs/benchmarks.md, "MoE expert compute"): XLA's CPU `ragged_dot` runs every
    row against every group (~15x a plain matmul of the useful work) and `dense` computes
    E_local / k times the useful FLOPs, while `grouped` computes the useful rows plus under
    one tile of R = N k / (4 E) rows per expert (<= 1.25x) as plain matmuls. On TPU
    `ragged_dot` is a grouped matmul over the routed rows only; on GPU it is one where
    cuDNN/hipBLASLt grouped GEMMs cover the shapes, else XLA pads it to a batched dot (not
    measured here: docs/benchmarks.md says how to check). All three are exact and dropless.
    """
    if impl == "auto":
        return "grouped" if (backend or platform.backend()) == "cpu" else "ragged"
    if impl not in IMPLS:
        raise ValueError(f"moe impl: {impl!r} is not one of {('auto', *IMPLS)}")
    return impl


def dense_local_moe(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, offset):
    """As `local_moe`, computing every local expert on every token and combining with the
    routing weights (zero for experts a token did not choose or that are not local)."""
    dt = x_nd.dtype
    e_local = w_gate_edf.shape[0]
    local_nk = jnp.where(experts_nk >= 0, experts_nk - offset, -1)  # -1: masked token
    onehot_nke = jax.nn.one_hot(local_nk, e_local, dtype=jnp.float32)  # 0 if not local
    combine_ne = jnp.einsum("nke,nk->ne", onehot_nke, weights_nk.astype(jnp.float32))
    gate_nef = jnp.einsum("nd,edf->nef", x_nd, w_gate_edf.astype(dt))
    up_nef = jnp.einsum("nd,edf->nef", x_nd, w_up_edf.astype(dt))
    h_nef = jax.nn.silu(gate_nef) * up_nef * combine_ne[:, :, None].astype(dt)
    return jnp.einsum("nef,efd->nd", h_nef, w_down_efd.astype(dt))


def local_moe(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, expert_offset):
    """Sum over each token's k slots of weight * expert(x), for experts in
    [expert_offset, expert_offset + E_local); other slots contribute zero. Returns [N, D]."""
    k = experts_nk.shape[1]
    e_local = w_gate_edf.shape[0]
    expert_m = experts_nk.reshape(-1) - expert_offset  # [M = N * k]
    is_local_m = (experts_nk.reshape(-1) >= 0) & (expert_m >= 0) & (expert_m < e_local)
    key_m = jnp.where(is_local_m, expert_m, e_local)  # non-local slots sort to the end
    order_m = jnp.argsort(key_m, stable=True)
    token_m = order_m // k
    group_sizes_e = jnp.bincount(key_m, length=e_local + 1)[:e_local].astype(jnp.int32)
    y_md = grouped_swiglu(x_nd[token_m], group_sizes_e, w_gate_edf, w_up_edf, w_down_efd)
    w_m = jnp.where(is_local_m, weights_nk.reshape(-1), 0)[order_m]
    y_md = y_md.astype(jnp.float32) * w_m[:, None].astype(jnp.float32)
    return jnp.zeros(x_nd.shape, jnp.float32).at[token_m].add(y_md).astype(x_nd.dtype)


def _as_tuple(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def moe_dispatch(
    x_nd,
    experts_nk,
    weights_nk,
    w_gate_edf,
    w_up_edf,
    w_down_efd,
    sharder: Sharder,
    impl: str = "auto",
    token_mask_n: jax.Array | None = None,
) -> jax.Array:
    """Expert-parallel dropless MoE forward; equals `local_moe` with offset 0.

    `token_mask_n` (bool [N]): tokens that are False (padding) go to no expert and get a
    zero output; the expert work is then only that of the real tokens.
    """
    if token_mask_n is not None:  # expert -1 is local nowhere: every impl skips it
        experts_nk = jnp.where(token_mask_n[:, None], experts_nk, -1)
        weights_nk = jnp.where(token_mask_n[:, None], weights_nk, 0)
    compute = {
        "ragged": local_moe,
        "dense": dense_local_moe,
        "grouped": functools.partial(grouped_local_moe, num_experts=w_gate_edf.shape[0]),
    }[resolve_impl(impl)]
    if sharder.mesh is None:
        return compute(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd, 0)
    batch_axes = _as_tuple(sharder.spec(("batch",), x_nd.shape[:1])[0])
    exp_axes = sharder.mesh_axes("expert")
    mlp_axes = tuple(a for a in sharder.mesh_axes("expert_mlp") if a not in exp_axes)
    gather_axes = tuple(a for a in batch_axes if a in exp_axes + mlp_axes)
    reduce_axes = tuple(a for a in exp_axes + mlp_axes if a not in gather_axes)
    tok = P(batch_axes or None, None)
    up_spec = P(exp_axes or None, None, mlp_axes or None)
    down_spec = P(exp_axes or None, mlp_axes or None, None)

    def body(x, e, w, g, u, d):
        if gather_axes:
            x, e, w = (jax.lax.all_gather(a, gather_axes, axis=0, tiled=True) for a in (x, e, w))
        offset = jax.lax.axis_index(exp_axes) * g.shape[0] if exp_axes else 0
        y = compute(x, e, w, g, u, d, offset)
        if reduce_axes:
            y = jax.lax.psum(y, reduce_axes)
        if gather_axes:
            y = jax.lax.psum_scatter(y, gather_axes, scatter_dimension=0, tiled=True)
        return y

    return jax.shard_map(
        body,
        mesh=sharder.mesh,
        in_specs=(tok, tok, tok, up_spec, up_spec, down_spec),
        out_specs=tok,
    )(x_nd, experts_nk, weights_nk, w_gate_edf, w_up_edf, w_down_efd)
