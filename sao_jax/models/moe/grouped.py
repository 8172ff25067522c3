"""Grouped expert matmul with a data-dependent capacity: only the useful work, dropless.

For backends whose `ragged_dot` is not a grouped GEMM (XLA:CPU runs every row against
every group), the routed SwiGLU experts run as batched einsums `[E, C, D] x [E, D, F]`
over the (token, slot) pairs sorted by expert, each expert's group padded to a common
capacity C:

  1. pairs m = n k + j (token n, slot j) are keyed by local expert (pairs of no local
     expert, and of masked tokens, get key E) and stably argsorted; sizes_e = the count
     per expert, starts_e their prefix sums, rank_m = the pair's place in its group;
  2. slot (e, c) holds pair order[starts_e + c] when c < sizes_e, nothing otherwise;
  3. y = down(silu(x gate) * (x up)) batched over E; each pair reads its slot back and
     out_n = sum_j w_nj y_(n, j).

Dropless needs C >= the largest group, which is data; einsum shapes must be static. So
the capacity is cut into TILES of a static height R (a quarter of the balanced group
size N k / E, rounded up to 8 rows) and the program runs ceil(max_e sizes_e / R) tiles
in a `lax.fori_loop` whose trip count is that traced number: tile i computes slots
[i R, (i + 1) R) of every expert as one `[E, R, D] x [E, D, F]` einsum. In effect the
capacity is the largest group rounded up to R: ONE compiled loop body whatever the
routing (no recompiles, no branch per bucket), never a dropped token, and the work is
E x that capacity: 1.0-1.3x the useful rows for a balanced router, up to E / k x (the
`dense` cost) when one expert takes everything.

The backward is a `custom_vjp` (a loop with a traced trip count has no autodiff
transpose) with static residuals in the pair layout [N k, F]; it walks the same tiles,
accumulates the weight gradients in the loop carry and moves rows with gathers and
unique-index writes only, never a scatter-add.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

TILES_PER_BALANCED_GROUP = 4  # R = balanced group / 4: capacity rounds up by <= 25%
_ROW_MULTIPLE = 8


def tile_rows(tokens: int, top_k: int, num_experts: int) -> int:
    """R: rows per expert per tile for `tokens` tokens routed top-`top_k` over
    `num_experts` experts in all (the balanced group N k / E over 4, rounded up to 8)."""
    balanced = tokens * top_k / num_experts
    rows = _ROW_MULTIPLE * math.ceil(balanced / TILES_PER_BALANCED_GROUP / _ROW_MULTIPLE)
    return max(_ROW_MULTIPLE, min(rows, _ROW_MULTIPLE * math.ceil(tokens / _ROW_MULTIPLE)))


def dedupe_slots(experts_nk, weights_nk, valid_nk):
    """Merges a token's repeated expert into its first slot (weights summed), so every
    expert sees a token at most once: (valid_nk, weights_nk). Top-k never repeats an
    expert; forced (replayed) routing might, and the sum is what `dense` computes."""
    k = experts_nk.shape[1]
    same_nkk = (experts_nk[:, :, None] == experts_nk[:, None, :]) & valid_nk[:, None, :]
    earlier_kk = jnp.tril(jnp.ones((k, k), bool), -1)  # [i, j]: j < i
    first_nk = valid_nk & ~jnp.any(same_nkk & earlier_kk[None], axis=2)
    merged_nk = jnp.einsum("nij,nj->ni", same_nkk.astype(weights_nk.dtype), weights_nk)
    return first_nk, jnp.where(first_nk, merged_nk, 0)


class _Groups:
    """Pairs sorted by expert: order, group sizes and starts, and each pair's rank."""

    def __init__(self, key_m, num_local: int, rows: int):
        m = key_m.shape[0]
        self.key_m, self.rows = key_m, rows
        self.order_m = jnp.argsort(key_m, stable=True).astype(jnp.int32)
        sizes = jnp.bincount(key_m, length=num_local + 1)[:num_local].astype(jnp.int32)
        self.sizes_e, self.starts_e = sizes, jnp.cumsum(sizes) - sizes
        self.tiles = (jnp.max(sizes) + rows - 1) // rows  # traced trip count
        self.m = m

    def pairs_of_tile(self, i):
        """[E, R] pair index of each slot of tile i (m = no pair: an empty slot)."""
        c_r = i * self.rows + jnp.arange(self.rows, dtype=jnp.int32)
        filled_er = c_r[None, :] < self.sizes_e[:, None]
        src_er = jnp.minimum(self.starts_e[:, None] + c_r[None, :], self.m - 1)
        return jnp.where(filled_er, self.order_m[src_er], self.m)


def _gather(a_mx, pair_er, fill=0):
    """[M, X] rows at pair_er -> [E, R, X] (empty slots = fill)."""
    return jnp.take(a_mx, pair_er, axis=0, mode="fill", fill_value=fill)


def _put(buf_mx, pair_er, val_erx):
    """buf[pair] = val for every filled slot (pairs are unique; empty slots dropped)."""
    return buf_mx.at[pair_er.reshape(-1)].set(val_erx.reshape(-1, val_erx.shape[-1]), mode="drop")


def _token_rows(x_nd, pair_er, k: int):
    """x rows of the tokens of the pairs in the slots (pair m is token m // k)."""
    return _gather(x_nd, jnp.where(pair_er < x_nd.shape[0] * k, pair_er // k, x_nd.shape[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, rows):
    return _grouped_fwd(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, rows)[0]


def _grouped_fwd(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, rows):
    n, d = x_nd.shape
    m = key_m.shape[0]
    k, f, dt = m // n, w_gate_edf.shape[-1], x_nd.dtype
    g = _Groups(key_m, w_gate_edf.shape[0], rows)

    def tile(i, bufs):
        y_md, gate_mf, up_mf = bufs
        pair_er = g.pairs_of_tile(i)
        x_erd = _token_rows(x_nd, pair_er, k)
        gate_erf = jnp.einsum("erd,edf->erf", x_erd, w_gate_edf.astype(dt))
        up_erf = jnp.einsum("erd,edf->erf", x_erd, w_up_edf.astype(dt))
        h_erf = jax.nn.silu(gate_erf) * up_erf
        y_erd = jnp.einsum("erf,efd->erd", h_erf, w_down_efd.astype(dt))
        put = functools.partial(_put, pair_er=pair_er)
        return put(y_md, val_erx=y_erd), put(gate_mf, val_erx=gate_erf), put(up_mf, val_erx=up_erf)

    zeros = lambda width: _vary_like(jnp.zeros((m, width), dt), x_nd)  # unrouted pairs: 0
    y_md, gate_mf, up_mf = jax.lax.fori_loop(0, g.tiles, tile, (zeros(d), zeros(f), zeros(f)))
    out_nd = _combine(y_md, w_m, n, k, dt)
    res = (x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, y_md, gate_mf, up_mf)
    return out_nd, res


def _combine(y_md, w_m, n: int, k: int, dtype):
    """out_n = sum_j w_(n,j) y_(n,j), accumulated in float32."""
    y_mkd = y_md.astype(jnp.float32).reshape(n, k, -1) * w_m.reshape(n, k, 1).astype(jnp.float32)
    return jnp.sum(y_mkd, axis=1).astype(dtype)


def _grouped_bwd(rows, res, dout_nd):
    x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, y_md, gate_mf, up_mf = res
    n, d = x_nd.shape
    m = key_m.shape[0]
    k, dt = m // n, x_nd.dtype
    g = _Groups(key_m, w_gate_edf.shape[0], rows)
    dout_mkd = jnp.broadcast_to(dout_nd.astype(jnp.float32)[:, None, :], (n, k, d))
    dout_md = dout_mkd.reshape(m, d)
    # d out / d w_m = <dout_n, y_m>; d out / d y_m = w_m dout_n.
    dw_m = jnp.sum(dout_md * y_md.astype(jnp.float32), axis=-1).astype(w_m.dtype)
    dy_md = (dout_md * w_m[:, None].astype(jnp.float32)).astype(dt)
    wg, wu, wd = (w.astype(dt) for w in (w_gate_edf, w_up_edf, w_down_efd))

    def tile(i, carry):
        dx_md, d_gate, d_up, d_down = carry
        pair_er = g.pairs_of_tile(i)
        x_erd, dy_erd = _token_rows(x_nd, pair_er, k), _gather(dy_md, pair_er)
        gate_erf, up_erf = _gather(gate_mf, pair_er), _gather(up_mf, pair_er)
        sig_erf = jax.nn.sigmoid(gate_erf.astype(jnp.float32))
        silu_erf = (gate_erf.astype(jnp.float32) * sig_erf).astype(dt)
        d_down = d_down + jnp.einsum("erf,erd->efd", silu_erf * up_erf, dy_erd)
        dh_erf = jnp.einsum("erd,efd->erf", dy_erd, wd)
        dsilu_erf = sig_erf * (1 + gate_erf.astype(jnp.float32) * (1 - sig_erf))
        dgate_erf = (dh_erf * up_erf * dsilu_erf.astype(dt)).astype(dt)
        dup_erf = dh_erf * silu_erf
        d_gate = d_gate + jnp.einsum("erd,erf->edf", x_erd, dgate_erf)
        d_up = d_up + jnp.einsum("erd,erf->edf", x_erd, dup_erf)
        dx_erd = jnp.einsum("erf,edf->erd", dgate_erf, wg) + jnp.einsum("erf,edf->erd", dup_erf, wu)
        return _put(dx_md, pair_er, dx_erd), d_gate, d_up, d_down

    zeros = lambda a: _vary_like(jnp.zeros(a.shape, a.dtype), x_nd)
    init = (zeros(dy_md), zeros(wg), zeros(wu), zeros(wd))
    dx_md, d_gate, d_up, d_down = jax.lax.fori_loop(0, g.tiles, tile, init)
    dx_nd = jnp.sum(dx_md.astype(jnp.float32).reshape(n, k, d), axis=1).astype(dt)
    return (
        dx_nd,
        jnp.zeros(key_m.shape, jax.dtypes.float0),
        dw_m,
        d_gate.astype(w_gate_edf.dtype),
        d_up.astype(w_up_edf.dtype),
        d_down.astype(w_down_efd.dtype),
    )


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_local_moe(
    x_nd,
    experts_nk,
    weights_nk,
    w_gate_edf,
    w_up_edf,
    w_down_efd,
    expert_offset,
    *,
    num_experts: int | None = None,
) -> jax.Array:
    """As `dispatch.local_moe` (experts in [offset, offset + E_local) only; others, and
    negative ids, contribute zero), as capacity-tiled batched einsums. `num_experts` is
    the model's E over all devices (default E_local): it sets the balanced group size."""
    n, k = experts_nk.shape
    e_local = w_gate_edf.shape[0]
    expert_nk = experts_nk - expert_offset
    local_nk = (experts_nk >= 0) & (expert_nk >= 0) & (expert_nk < e_local)
    keep_nk, w_nk = dedupe_slots(expert_nk, weights_nk, local_nk)
    key_m = jnp.where(keep_nk, expert_nk, e_local).reshape(-1).astype(jnp.int32)
    rows = tile_rows(n, k, num_experts or e_local)
    args = _same_varying_axes(x_nd, key_m, w_nk.reshape(-1), w_gate_edf, w_up_edf, w_down_efd)
    return _grouped(*args, rows)


def _varying(a) -> frozenset:
    """The mesh axes `a` varies over inside `shard_map` (empty outside)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary_like(a, ref):
    """`a` marked as varying over the mesh axes `ref` varies over (loop carries)."""
    missing = tuple(sorted(_varying(ref) - _varying(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a


def _same_varying_axes(*arrays):
    """Inside `shard_map`, marks every input as varying over the union of the mesh axes
    any of them varies over, so that the custom backward's cotangents (e.g. dx, partial
    over the `expert_mlp` shards) have their inputs' types; autodiff then sums them over
    those axes where the forward broadcast them (outside this function)."""
    vma = frozenset().union(*(_varying(a) for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(vma - _varying(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def padding_overhead(experts_nk, num_experts: int, token_mask_n=None) -> dict[str, float]:
    """What the grouped path computes for this routing (host side, one device): the
    capacity (largest group rounded up to the tile height), the largest group over the
    balanced size of the routed (unmasked) pairs, and rows executed E C over useful rows."""
    experts_nk = jnp.asarray(experts_nk)
    n, k = experts_nk.shape
    if token_mask_n is not None:
        experts_nk = jnp.where(jnp.asarray(token_mask_n)[:, None], experts_nk, -1)
    flat = experts_nk.reshape(-1)
    sizes = jnp.bincount(jnp.where(flat >= 0, flat, num_experts), length=num_experts + 1)
    useful = int(jnp.sum(sizes[:num_experts]))
    largest = int(jnp.max(sizes[:num_experts]))
    rows = tile_rows(n, k, num_experts)
    cap = rows * math.ceil(largest / rows)
    return dict(
        capacity=float(cap),
        largest_over_balanced=largest * num_experts / max(useful, 1),
        executed_over_useful=num_experts * cap / max(useful, 1),
    )
