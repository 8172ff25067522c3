"""Grouped expert matmul over tiles of each expert's group: only the useful work, dropless.

For backends whose `ragged_dot` is not a grouped GEMM (XLA:CPU runs every row against
every group), the routed SwiGLU experts run as plain matmuls over the (token, slot)
pairs sorted by expert, each expert's group cut into tiles of R rows:

  1. pairs m = n k + j (token n, slot j) are keyed by local expert (pairs of no local
     expert, and of masked tokens, get key E) and stably argsorted; sizes_e = the count
     per expert, starts_e their prefix sums;
  2. tile i of expert e holds pairs order[starts_e + i R + r] for i R + r < sizes_e
     (empty rows past the group's end);
  3. per tile, y = down(silu(x gate_e) * (x up_e)) as three `[R, D] x [D, F]` matmuls;
     each pair's row is written back and out_n = sum_j w_nj y_(n, j).

Group sizes are data and matmul shapes must be static, so the program is two
`lax.fori_loop`s: over the E local experts (each slices its weights once), and inside,
over ceil(sizes_e / R) tiles, a trip count that is TRACED. ONE compiled body whatever the
routing (no recompiles, no branch per bucket), never a dropped token, and the rows
multiplied are sum_e R ceil(sizes_e / R): the useful rows plus less than one tile per
expert, whatever the imbalance. R is a quarter of the balanced group N k / E rounded up
to 8 rows, so the padding is at most E R ~ 25% of the useful rows (~12% on average) for
any router, balanced or not. (An earlier form padded every expert to the largest group
and ran `[E, C, D] x [E, D, F]` batched einsums; at init routing, largest groups 2.4-3x
the balanced size, that multiplied 2.5-3.3x the useful rows, and it measured slower
even when balanced: docs/benchmarks.md, "MoE expert compute".)

The backward is a `custom_vjp` (a loop with a traced trip count has no autodiff
transpose) with residuals in the pair layout [N k, F]; it walks the same tiles,
accumulates each expert's weight gradients in the inner loop carry, writes them once per
expert, and moves rows with gathers and unique-index writes only, never a scatter-add.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

TILES_PER_BALANCED_GROUP = 4  # R = balanced group / 4: padding < E R = 25% of useful
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
    """Pairs sorted by expert: order, group sizes and starts, and the tiles of a group."""

    def __init__(self, key_m, num_local: int, rows: int):
        self.m, self.rows = key_m.shape[0], rows
        self.order_m = jnp.argsort(key_m, stable=True).astype(jnp.int32)
        sizes = jnp.bincount(key_m, length=num_local + 1)[:num_local].astype(jnp.int32)
        self.sizes_e, self.starts_e = sizes, jnp.cumsum(sizes) - sizes

    def tiles(self, e):
        """ceil(sizes_e / R): the traced trip count of expert e's tile loop."""
        return (self.sizes_e[e] + self.rows - 1) // self.rows

    def pairs_of_tile(self, e, i):
        """[R] pair index of each row of tile i of expert e (m = no pair: an empty row)."""
        c_r = i * self.rows + jnp.arange(self.rows, dtype=jnp.int32)
        src_r = jnp.minimum(self.starts_e[e] + c_r, self.m - 1)
        return jnp.where(c_r < self.sizes_e[e], self.order_m[src_r], self.m)


def _gather(a_mx, pair_r, fill=0):
    """[M, X] rows at pair_r -> [R, X] (empty rows = fill)."""
    return jnp.take(a_mx, pair_r, axis=0, mode="fill", fill_value=fill)


def _put(buf_mx, pair_r, val_rx):
    """buf[pair] = val for every filled row (pairs are unique; empty rows dropped)."""
    return buf_mx.at[pair_r].set(val_rx, mode="drop")


def _token_rows(x_nd, pair_r, k: int):
    """x rows of the tokens of the pairs in the tile (pair m is token m // k)."""
    return _gather(x_nd, jnp.where(pair_r < x_nd.shape[0] * k, pair_r // k, x_nd.shape[0]))


def _expert_weights(e, dtype, *w_edf):
    """Expert e's slice of each weight, in the compute dtype."""
    return tuple(jax.lax.dynamic_index_in_dim(w, e, keepdims=False).astype(dtype) for w in w_edf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, rows):
    return _grouped_fwd(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, rows)[0]


def _grouped_fwd(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, rows):
    n, d = x_nd.shape
    m = key_m.shape[0]
    k, f, dt = m // n, w_gate_edf.shape[-1], x_nd.dtype
    g = _Groups(key_m, w_gate_edf.shape[0], rows)

    def expert(e, bufs):
        w_gate_df, w_up_df, w_down_fd = _expert_weights(e, dt, w_gate_edf, w_up_edf, w_down_efd)

        def tile(i, bufs):
            y_md, gate_mf, up_mf = bufs
            pair_r = g.pairs_of_tile(e, i)
            x_rd = _token_rows(x_nd, pair_r, k)
            gate_rf, up_rf = x_rd @ w_gate_df, x_rd @ w_up_df
            y_rd = (jax.nn.silu(gate_rf) * up_rf) @ w_down_fd
            put = functools.partial(_put, pair_r=pair_r)
            return put(y_md, val_rx=y_rd), put(gate_mf, val_rx=gate_rf), put(up_mf, val_rx=up_rf)

        return jax.lax.fori_loop(0, g.tiles(e), tile, bufs)

    zeros = lambda width: _vary_like(jnp.zeros((m, width), dt), x_nd)  # unrouted pairs: 0
    init = (zeros(d), zeros(f), zeros(f))
    y_md, gate_mf, up_mf = jax.lax.fori_loop(0, w_gate_edf.shape[0], expert, init)
    out_nd = _combine(y_md, w_m, n, k, dt)
    res = (x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, y_md, gate_mf, up_mf)
    return out_nd, res


def _combine(y_md, w_m, n: int, k: int, dtype):
    """out_n = sum_j w_(n,j) y_(n,j), accumulated in float32."""
    y_mkd = y_md.astype(jnp.float32).reshape(n, k, -1) * w_m.reshape(n, k, 1).astype(jnp.float32)
    return jnp.sum(y_mkd, axis=1).astype(dtype)


def _outer(a_rx, b_ry):
    """sum_r a_rx b_ry -> [X, Y] in float32 (weight-gradient accumulation)."""
    return jnp.einsum("rx,ry->xy", a_rx, b_ry, preferred_element_type=jnp.float32)


def _grouped_bwd(rows, res, dout_nd):
    x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, y_md, gate_mf, up_mf = res
    n, d = x_nd.shape
    m = key_m.shape[0]
    k, dt, f32 = m // n, x_nd.dtype, jnp.float32
    g = _Groups(key_m, w_gate_edf.shape[0], rows)
    dout_md = jnp.broadcast_to(dout_nd.astype(f32)[:, None, :], (n, k, d)).reshape(m, d)
    # d out / d w_m = <dout_n, y_m>; d out / d y_m = w_m dout_n.
    dw_m = jnp.sum(dout_md * y_md.astype(f32), axis=-1).astype(w_m.dtype)
    dy_md = (dout_md * w_m[:, None].astype(f32)).astype(dt)

    def expert(e, carry):
        dx_md, d_gate_edf, d_up_edf, d_down_efd = carry
        w_gate_df, w_up_df, w_down_fd = _expert_weights(e, dt, w_gate_edf, w_up_edf, w_down_efd)

        def tile(i, inner):
            dx_md, d_gate_df, d_up_df, d_down_fd = inner
            pair_r = g.pairs_of_tile(e, i)
            x_rd, dy_rd = _token_rows(x_nd, pair_r, k), _gather(dy_md, pair_r)
            gate_rf, up_rf = _gather(gate_mf, pair_r).astype(f32), _gather(up_mf, pair_r)
            sig_rf = jax.nn.sigmoid(gate_rf)
            silu_rf = (gate_rf * sig_rf).astype(dt)
            dh_rf = dy_rd @ w_down_fd.T
            dsilu_rf = (sig_rf * (1 + gate_rf * (1 - sig_rf))).astype(dt)
            dgate_rf, dup_rf = dh_rf * up_rf * dsilu_rf, dh_rf * silu_rf
            dx_rd = dgate_rf @ w_gate_df.T + dup_rf @ w_up_df.T
            return (
                _put(dx_md, pair_r, dx_rd),
                d_gate_df + _outer(x_rd, dgate_rf),
                d_up_df + _outer(x_rd, dup_rf),
                d_down_fd + _outer(silu_rf * up_rf, dy_rd),
            )

        zeros = lambda w: _vary_like(jnp.zeros(w.shape, f32), x_nd)
        init = (dx_md, zeros(w_gate_df), zeros(w_up_df), zeros(w_down_fd))
        dx_md, d_gate_df, d_up_df, d_down_fd = jax.lax.fori_loop(0, g.tiles(e), tile, init)
        put = lambda buf, val: jax.lax.dynamic_update_index_in_dim(buf, val, e, 0)
        return (
            dx_md,
            put(d_gate_edf, d_gate_df),
            put(d_up_edf, d_up_df),
            put(d_down_efd, d_down_fd),
        )

    zeros = lambda shape, dtype: _vary_like(jnp.zeros(shape, dtype), x_nd)
    init = (
        zeros(dy_md.shape, dt),
        *(zeros(w.shape, f32) for w in (w_gate_edf, w_up_edf, w_down_efd)),
    )
    dx_md, d_gate, d_up, d_down = jax.lax.fori_loop(0, w_gate_edf.shape[0], expert, init)
    dx_nd = jnp.sum(dx_md.astype(f32).reshape(n, k, d), axis=1).astype(dt)
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
    negative ids, contribute zero), as matmuls over tiles of each expert's group. `num_experts` is
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
    """What the grouped path computes for this routing (host side, one device): the tile
    height R, the tiles run (sum_e ceil(sizes_e / R)), the largest group over the balanced
    size of the routed (unmasked) pairs, and the rows multiplied (tiles x R) over the useful
    rows."""
    experts_nk = np.asarray(experts_nk)
    n, k = experts_nk.shape
    if token_mask_n is not None:
        experts_nk = np.where(np.asarray(token_mask_n)[:, None], experts_nk, -1)
    flat = experts_nk.reshape(-1)
    sizes = np.bincount(flat[flat >= 0], minlength=num_experts)[:num_experts]
    useful = max(int(sizes.sum()), 1)
    rows = tile_rows(n, k, num_experts)
    tiles = int(np.sum(-(-sizes // rows)))
    return dict(
        rows=float(rows),
        tiles=float(tiles),
        largest_over_balanced=float(sizes.max()) * num_experts / useful,
        executed_over_useful=tiles * rows / useful,
    )
