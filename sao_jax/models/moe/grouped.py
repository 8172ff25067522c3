"""Capacity-bucketed grouped expert matmul: only the useful work, dropless, jittable.

For backends whose `ragged_dot` is not a grouped GEMM (XLA:CPU runs every row against
every group), this computes the routed SwiGLU experts as ONE batched einsum per weight,
`[E, C, D] x [E, D, F]`, over the (token, slot) pairs sorted by expert and each expert's
group padded to a capacity C:

  1. pairs m = n k + j (token n, slot j) are keyed by local expert (others: key E) and
     stably argsorted; group_sizes_e = the count per expert, starts_e its prefix sum;
  2. slot (e, c) of the padded [E, C] layout holds pair order[starts_e + c] when
     c < group_sizes_e, nothing otherwise; pair m sits at slot (e_m, rank_m);
  3. y = down(silu(x gate) * (x up)) batched over E; each pair reads its slot back and
     y_n = sum_j w_nj y_(n, j).

C must be static, yet dropless means C >= max_e group_sizes_e, which is data. The
capacity is therefore chosen INSIDE the program from a small static ladder with
`lax.switch`: C_i = round_up(r_i * N k / E, 8) for r in `CAPACITY_RATIOS` (below N),
then C = N, which always fits because a token's (deduplicated) experts are distinct, so
no expert gets more than N pairs. Every branch is compiled once, in the same program:
no recompiles whatever the routing, and only the chosen branch runs. The top rung C = N
costs what the dense path costs, so the worst case is never worse than `dense`; a
balanced router lands on the first rungs (1.25x-1.5x the useful work).

The backward is a `custom_vjp` whose residuals have static shapes (the pair layout
[N k, F]): autodiff through `lax.switch` would keep zero-filled residuals of EVERY
branch. It switches on the same rung, recomputes nothing but the SwiGLU's elementwise
part, and moves data with gathers only (each pair's slot and each slot's pair are known
both ways), never a scatter-add.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Capacity rungs as multiples of the balanced group size N k / E, each rounded up to a
# multiple of 8 rows; rungs at or above N are dropped (C = N always closes the ladder).
CAPACITY_RATIOS = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0)
_ROW_MULTIPLE = 8


def capacity_ladder(tokens: int, top_k: int, num_experts: int) -> tuple[int, ...]:
    """Static capacities C_0 < C_1 < ... < N for `tokens` tokens routed top-`top_k` over
    `num_experts` experts in all: round_up(r N k / E, 8) for r in CAPACITY_RATIOS, below N,
    then N itself (the dropless bound)."""
    balanced = tokens * top_k / num_experts
    caps = {_ROW_MULTIPLE * math.ceil(r * balanced / _ROW_MULTIPLE) for r in CAPACITY_RATIOS}
    return (*sorted(c for c in caps if c < tokens), tokens)


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


class _Layout:
    """Index maps between pairs m (= n k + j) and slots s (= e C + c) for one capacity."""

    def __init__(self, order_m, sizes_e, starts_e, key_m, rank_m, capacity: int):
        e = sizes_e.shape[0]
        m = order_m.shape[0]
        c_c = jnp.arange(capacity, dtype=jnp.int32)
        filled_ec = c_c[None, :] < sizes_e[:, None]
        src_ec = jnp.minimum(starts_e[:, None] + c_c[None, :], m - 1)
        self.pair_s = jnp.where(filled_ec, order_m[src_ec], m).reshape(-1)  # m: empty slot
        self.valid_m = key_m < e
        self.slot_m = jnp.where(self.valid_m, key_m * capacity + rank_m, 0)
        self.shape = (e, capacity)

    def to_slots(self, a_md, fill=0):
        """[M, X] pair layout -> [E, C, X] slot layout (empty slots = fill)."""
        out = jnp.take(a_md, self.pair_s, axis=0, mode="fill", fill_value=fill)
        return out.reshape(*self.shape, a_md.shape[-1])

    def to_pairs(self, a_ecx):
        """[E, C, X] slot layout -> [M, X] pair layout (pairs of no local expert = 0)."""
        a_sx = a_ecx.reshape(-1, a_ecx.shape[-1])
        return jnp.where(self.valid_m[:, None], a_sx[self.slot_m], 0)


def _sort_pairs(key_m, num_local: int):
    order_m = jnp.argsort(key_m, stable=True).astype(jnp.int32)
    sizes_e = jnp.bincount(key_m, length=num_local + 1)[:num_local].astype(jnp.int32)
    starts_e = jnp.cumsum(sizes_e) - sizes_e
    inv_m = jnp.zeros_like(order_m).at[order_m].set(jnp.arange(order_m.shape[0], dtype=jnp.int32))
    rank_m = inv_m - starts_e[jnp.minimum(key_m, num_local - 1)]
    return order_m, sizes_e, starts_e, rank_m


def _swiglu_slots(x_ecd, w_gate_edf, w_up_edf, w_down_efd):
    dt = x_ecd.dtype
    gate_ecf = jnp.einsum("ecd,edf->ecf", x_ecd, w_gate_edf.astype(dt))
    up_ecf = jnp.einsum("ecd,edf->ecf", x_ecd, w_up_edf.astype(dt))
    y_ecd = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate_ecf) * up_ecf, w_down_efd.astype(dt))
    return y_ecd, gate_ecf, up_ecf


def _pairs_of_tokens(x_nd, k: int):
    """[N, D] -> [N k, D]: row m = n k + j is token n."""
    n, d = x_nd.shape
    return jnp.broadcast_to(x_nd[:, None, :], (n, k, d)).reshape(n * k, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, caps):
    return _grouped_fwd(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, caps)[0]


def _grouped_fwd(x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, caps):
    n = x_nd.shape[0]
    k = key_m.shape[0] // n
    e_local = w_gate_edf.shape[0]
    order_m, sizes_e, starts_e, rank_m = _sort_pairs(key_m, e_local)
    rung = jnp.sum(jnp.max(sizes_e) > jnp.asarray(caps[:-1], jnp.int32)).astype(jnp.int32)
    x_md = _pairs_of_tokens(x_nd, k)

    def branch(capacity):
        def run():
            lay = _Layout(order_m, sizes_e, starts_e, key_m, rank_m, capacity)
            y_ecd, gate_ecf, up_ecf = _swiglu_slots(
                lay.to_slots(x_md), w_gate_edf, w_up_edf, w_down_efd
            )
            return lay.to_pairs(y_ecd), lay.to_pairs(gate_ecf), lay.to_pairs(up_ecf)

        return run

    y_md, gate_mf, up_mf = jax.lax.switch(rung, [branch(c) for c in caps])
    out_nd = _combine(y_md, w_m, n, k, x_nd.dtype)
    res = (x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, order_m, sizes_e, starts_e)
    return out_nd, (*res, rank_m, rung, y_md, gate_mf, up_mf)


def _combine(y_md, w_m, n: int, k: int, dtype):
    """out_n = sum_j w_(n,j) y_(n,j), accumulated in float32."""
    y_mkd = y_md.astype(jnp.float32).reshape(n, k, -1) * w_m.reshape(n, k, 1).astype(jnp.float32)
    return jnp.sum(y_mkd, axis=1).astype(dtype)


def _grouped_bwd(caps, res, dout_nd):
    x_nd, key_m, w_m, w_gate_edf, w_up_edf, w_down_efd, order_m, sizes_e, starts_e = res[:9]
    rank_m, rung, y_md, gate_mf, up_mf = res[9:]
    n, dt = x_nd.shape[0], x_nd.dtype
    k = key_m.shape[0] // n
    dout_md = _pairs_of_tokens(dout_nd.astype(jnp.float32), k)
    # d out / d w_m = <dout_n, y_m>; d out / d y_m = w_m dout_n.
    dw_m = jnp.sum(dout_md * y_md.astype(jnp.float32), axis=-1).astype(w_m.dtype)
    dy_md = (dout_md * w_m[:, None].astype(jnp.float32)).astype(dt)
    x_md = _pairs_of_tokens(x_nd, k)

    def branch(capacity):
        def run():
            lay = _Layout(order_m, sizes_e, starts_e, key_m, rank_m, capacity)
            x_ecd, dy_ecd = lay.to_slots(x_md), lay.to_slots(dy_md)
            gate_ecf, up_ecf = lay.to_slots(gate_mf), lay.to_slots(up_mf)
            sig_ecf = jax.nn.sigmoid(gate_ecf.astype(jnp.float32))
            silu_ecf = (gate_ecf.astype(jnp.float32) * sig_ecf).astype(dt)
            h_ecf = silu_ecf * up_ecf
            d_down = jnp.einsum("ecf,ecd->efd", h_ecf, dy_ecd)
            dh_ecf = jnp.einsum("ecd,efd->ecf", dy_ecd, w_down_efd.astype(dt))
            dsilu_ecf = sig_ecf * (1 + gate_ecf.astype(jnp.float32) * (1 - sig_ecf))
            dgate_ecf = (dh_ecf * up_ecf * dsilu_ecf.astype(dt)).astype(dt)
            dup_ecf = dh_ecf * silu_ecf
            d_gate = jnp.einsum("ecd,ecf->edf", x_ecd, dgate_ecf)
            d_up = jnp.einsum("ecd,ecf->edf", x_ecd, dup_ecf)
            dx_ecd = jnp.einsum("ecf,edf->ecd", dgate_ecf, w_gate_edf.astype(dt))
            dx_ecd = dx_ecd + jnp.einsum("ecf,edf->ecd", dup_ecf, w_up_edf.astype(dt))
            return lay.to_pairs(dx_ecd), d_gate, d_up, d_down

        return run

    dx_md, d_gate, d_up, d_down = jax.lax.switch(rung, [branch(c) for c in caps])
    dx_nd = jnp.sum(dx_md.astype(jnp.float32).reshape(n, k, -1), axis=1).astype(dt)
    d_key = jnp.zeros(key_m.shape, jax.dtypes.float0)
    return (
        dx_nd,
        d_key,
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
    """As `dispatch.local_moe` (experts in [offset, offset + E_local) only), computed as
    one batched einsum per weight over capacity-padded groups. `num_experts` is the
    model's E over all devices (default E_local), which sets the balanced group size."""
    n, k = experts_nk.shape
    e_local = w_gate_edf.shape[0]
    expert_nk = experts_nk - expert_offset
    local_nk = (expert_nk >= 0) & (expert_nk < e_local)
    keep_nk, w_nk = dedupe_slots(expert_nk, weights_nk, local_nk)
    key_m = jnp.where(keep_nk, expert_nk, e_local).reshape(-1).astype(jnp.int32)
    caps = capacity_ladder(n, k, num_experts or e_local)
    args = _same_varying_axes(x_nd, key_m, w_nk.reshape(-1), w_gate_edf, w_up_edf, w_down_efd)
    return _grouped(*args, caps)


def _varying(a) -> frozenset:
    """The mesh axes `a` varies over inside `shard_map` (empty outside)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


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


def padding_overhead(experts_nk, num_experts: int) -> dict[str, float]:
    """The chosen rung's capacity against the routing (host-side report): rows computed
    E C over useful rows N k, and the largest group over the balanced size N k / E."""
    n, k = experts_nk.shape
    sizes = jnp.bincount(experts_nk.reshape(-1), length=num_experts)
    largest = int(jnp.max(sizes))
    caps = capacity_ladder(n, k, num_experts)
    cap = next(c for c in caps if c >= largest)
    return dict(
        capacity=float(cap),
        largest_over_balanced=largest * num_experts / (n * k),
        executed_over_useful=num_experts * cap / (n * k),
    )
