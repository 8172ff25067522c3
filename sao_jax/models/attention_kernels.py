"""Blockwise (flash-style) training attention in pure JAX, with its own O(T) backward.

Same masking rule as `attention.grouped_attention` + `attention.attention_mask` (the naive
reference): query t attends key s iff `k_pos[s] <= q_pos[t]` and both carry the same
nonzero segment id. The score matrix is never formed: queries and keys are cut into
blocks of `block` positions, and for each query block an online softmax runs over the
key blocks (Milakov & Gimelshein 2018; Dao et al. 2022, FlashAttention):

    m_new = max(m, rowmax(S_ij))             running max of the scores
    l     = l exp(m - m_new) + rowsum(exp(S_ij - m_new))
    acc   = acc exp(m - m_new) + exp(S_ij - m_new) V_j
    out   = acc / l,   lse = m + log(l)      (rows with no visible key: out = 0)

A key block is skipped (no FLOPs) when no row of the device's batch can see it: every
key position of the block lies after every query position of the query block (causal
structure), or the nonzero segment-id ranges of the two blocks do not overlap (packed
rows). Both tests are conservative, so skipping never changes a result, whatever the
positions and segment ids are.

The backward is a custom VJP (FlashAttention-2's): it keeps only q, k, v, out and the
per-row log-sum-exp, recomputes each visible block's probabilities P = exp(S - lse),
and accumulates
    dV_j += P^T dO_i,  dS = P * (dO_i V_j^T - rowsum(dO_i * O_i)),
    dQ_i += dS K_j / sqrt(H),  dK_j += dS^T Q_i / sqrt(H),
so training memory is O(T) per layer instead of the O(T^2) scores autodiff would keep.

Shapes: B batch, T query length, S key length (= T here), N query heads, K key/value
heads, G = N / K query heads per key/value head, H head width; blocks: I query blocks of
bq rows, J key blocks of bk rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BIG = jnp.iinfo(jnp.int32).max


def _pad_to(x: jax.Array, length: int, axis: int = 1, value=0) -> jax.Array:
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x: jax.Array, block: int, axis: int = 1) -> jax.Array:
    """Cuts `axis` (length T) into blocks, block index leading (for dynamic indexing):
    [B, T, ...] -> [T / block, B, block, ...] for axis 1."""
    t = x.shape[axis]
    x = x.reshape(*x.shape[:axis], t // block, block, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _block_ranges(pos_nbc, seg_nbc):
    """Per block and row: (min, max) position and (min, max) nonzero segment id of its real
    tokens; an all-padding block gets empty ranges (min > max)."""
    real = seg_nbc != 0
    pmin = jnp.min(jnp.where(real, pos_nbc, _BIG), axis=-1)
    pmax = jnp.max(jnp.where(real, pos_nbc, -_BIG), axis=-1)
    smin = jnp.min(jnp.where(real, seg_nbc, _BIG), axis=-1)
    smax = jnp.max(jnp.where(real, seg_nbc, -_BIG), axis=-1)
    return pmin, pmax, smin, smax  # each [n, B]


def visible_blocks(q_pos_bt, k_pos_bs, q_seg_bt, k_seg_bs, block_q: int, block_k: int):
    """[I, J] bool: True unless no query of block i in any row can see a key of block j.

    Causal: the earliest key position of block j must be <= the latest query position of
    block i. Segments: the nonzero segment-id ranges of the two blocks must overlap
    (equal ids imply overlapping ranges, so the test only ever keeps extra blocks).
    """
    qpmin, qpmax, qsmin, qsmax = _block_ranges(
        _blocks(q_pos_bt, block_q), _blocks(q_seg_bt, block_q)
    )
    kpmin, kpmax, ksmin, ksmax = _block_ranges(
        _blocks(k_pos_bs, block_k), _blocks(k_seg_bs, block_k)
    )
    del qpmin, kpmax
    causal_ijb = kpmin[None, :, :] <= qpmax[:, None, :]
    overlap_ijb = (ksmin[None, :, :] <= qsmax[:, None, :]) & (
        ksmax[None, :, :] >= qsmin[:, None, :]
    )
    return jnp.any(causal_ijb & overlap_ijb, axis=-1)


def _block_mask(qpos_bq, kpos_bk, qseg_bq, kseg_bk) -> jax.Array:
    """[B, bq, bk] bool: the reference rule inside one (query block, key block) pair."""
    causal = kpos_bk[:, None, :] <= qpos_bq[:, :, None]
    same = (qseg_bq[:, :, None] == kseg_bk[:, None, :]) & (kseg_bk[:, None, :] != 0)
    return causal & same


def _scores(q_bkgqh, k_bksh, mask_bqs, scale):
    """[B, K, G, bq, bk] float32 scaled scores, -inf where masked (heads-major operands:
    the batch dims b, k lead, which XLA:CPU runs several times faster)."""
    s = jnp.einsum("bkgqh,bksh->bkgqs", q_bkgqh, k_bksh, preferred_element_type=jnp.float32)
    return jnp.where(mask_bqs[:, None, None], s * scale, -jnp.inf)


def _forward(q, k, v, qpos, kpos, qseg, kseg, visible_ij):
    """Blocked heads-major inputs (q [I, B, K, G, bq, H], k, v [J, B, K, bk, H]) ->
    (out [I, B, K, G, bq, H] in q's dtype, lse [I, B, K, G, bq] f32)."""
    n_k = k.shape[0]
    h = q.shape[-1]
    scale = h**-0.5
    dt = q.dtype
    # Tie the masks' inputs to q: under an outer differentiated loop (the layer scan),
    # JAX would otherwise hoist the mask computation, which depends on positions and
    # segment ids alone, out of that loop and precompute every block pair's mask
    # ([I, J, B, K, G, bq, bk]: the O(T^2) array this kernel exists to avoid).
    q, qpos, kpos, qseg, kseg, visible_ij = jax.lax.optimization_barrier(
        (q, qpos, kpos, qseg, kseg, visible_ij)
    )

    def one_query_block(i):
        q_i = q[i]  # [B, K, G, bq, H]
        b, kh, g, bq, _ = q_i.shape
        m0 = jnp.full((b, kh, g, bq), -jnp.inf, jnp.float32)
        l0 = jnp.zeros((b, kh, g, bq), jnp.float32)
        acc0 = jnp.zeros((b, kh, g, bq, h), jnp.float32)

        def visit(j, carry):
            m, lsum, acc = carry
            mask = _block_mask(qpos[i], kpos[j], qseg[i], kseg[j])
            s = _scores(q_i, k[j], mask, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet
            p = jnp.exp(s - shift[..., None])  # 0 where masked
            corr = jnp.exp(m - shift)  # 0 while m is -inf
            pv = jnp.einsum(
                "bkgqs,bksh->bkgqh", p.astype(dt), v[j], preferred_element_type=jnp.float32
            )
            return m_new, lsum * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        def body(j, carry):
            return jax.lax.cond(visible_ij[i, j], visit, lambda _, c: c, j, carry)

        m, lsum, acc = jax.lax.fori_loop(0, n_k, body, (m0, l0, acc0))
        seen = lsum > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, lsum, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, lsum, 1.0)), 0.0)
        return out.astype(dt), lse  # out [B, K, G, bq, H]

    return jax.lax.map(one_query_block, jnp.arange(q.shape[0]))


def _backward(q, k, v, qpos, kpos, qseg, kseg, visible_ij, out, lse, dout):
    """Blocked FlashAttention-2 backward -> (dq, dk, dv) blocked like q, k, v."""
    n_q, n_k = q.shape[0], k.shape[0]
    scale = q.shape[-1] ** -0.5
    dt = q.dtype
    q, qpos, kpos, qseg, kseg, visible_ij = jax.lax.optimization_barrier(
        (q, qpos, kpos, qseg, kseg, visible_ij)
    )  # as in _forward: no loop-invariant mask hoisting
    # D_i = rowsum(dO * O): [I, B, K, G, bq]
    delta = jnp.einsum("ibkgqh,ibkgqh->ibkgq", dout.astype(jnp.float32), out.astype(jnp.float32))
    dq0 = jnp.zeros(q.shape, jnp.float32)

    def one_key_block(dq, j):
        k_j, v_j = k[j], v[j]  # [B, K, bk, H]
        # dK_j, dV_j accumulate transposed, [B, K, H, bk]: XLA:CPU runs the products
        # contracting over (g, q) ~3x faster with q / dO as the left operand (measured).
        b, kh, bk, h = k_j.shape
        dk0 = jnp.zeros((b, kh, h, bk), jnp.float32)
        dv0 = jnp.zeros((b, kh, h, bk), jnp.float32)

        def visit(i, carry):
            dq, dk, dv = carry
            q_i, do_i = q[i], dout[i]
            mask = _block_mask(qpos[i], kpos[j], qseg[i], kseg[j])
            s = _scores(q_i, k_j, mask, scale)
            p = jnp.exp(s - lse[i][..., None])  # [B, K, G, bq, bk], 0 where masked
            dv = dv + jnp.einsum(
                "bkgqh,bkgqs->bkhs", do_i, p.astype(dt), preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta[i][..., None]) * scale).astype(dt)
            dq_i = jnp.einsum("bkgqs,bksh->bkgqh", ds, k_j, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgqh,bkgqs->bkhs", q_i, ds, preferred_element_type=jnp.float32)
            return dq.at[i].add(dq_i), dk, dv

        def body(i, carry):
            return jax.lax.cond(visible_ij[i, j], visit, lambda _, c: c, i, carry)

        dq, dk, dv = jax.lax.fori_loop(0, n_q, body, (dq, dk0, dv0))
        dk_bksh, dv_bksh = jnp.swapaxes(dk, 2, 3), jnp.swapaxes(dv, 2, 3)
        return dq, (dk_bksh.astype(k.dtype), dv_bksh.astype(v.dtype))

    dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, jnp.arange(n_k))
    return dq.astype(q.dtype), dk, dv


@jax.custom_vjp
def _flash(q, k, v, qpos, kpos, qseg, kseg, visible_ij):
    return _forward(q, k, v, qpos, kpos, qseg, kseg, visible_ij)[0]


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, visible_ij):
    out, lse = _forward(q, k, v, qpos, kpos, qseg, kseg, visible_ij)
    return out, (q, k, v, qpos, kpos, qseg, kseg, visible_ij, out, lse)


def _flash_bwd(res, dout):
    q, k, v, qpos, kpos, qseg, kseg, visible_ij, out, lse = res
    dq, dk, dv = _backward(q, k, v, qpos, kpos, qseg, kseg, visible_ij, out, lse, dout)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def block_size(length: int, block: int) -> int:
    """The block actually used: `block`, or the whole (8-rounded) length when shorter."""
    return min(block, -(-length // 8) * 8)


def blockwise_attention(
    q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, q_seg_bt, k_seg_bs, *, block: int = 512
) -> jax.Array:
    """softmax(q k^T / sqrt(H) + mask) v without the [T, S] scores; equals the naive form
    on every query that sees at least one key (one that sees none gets 0, where the naive
    form returns the mean of all values). GQA: N query heads share K key/value heads.

    Lengths are padded to a multiple of the block with segment 0 (invisible).
    """
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    bq, bk = block_size(t, block), block_size(s, block)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    g = n // kh
    # Heads-major, so every per-block product has its batch dims (b, k) leading.
    q_bkgth = jnp.transpose(_pad_to(q_btnh, tp).reshape(b, tp, kh, g, h), (0, 2, 3, 1, 4))
    k_bksh = jnp.transpose(_pad_to(k_bskh, sp), (0, 2, 1, 3))
    v_bksh = jnp.transpose(_pad_to(v_bskh, sp), (0, 2, 1, 3))
    qpos, kpos = _pad_to(q_pos_bt, tp), _pad_to(k_pos_bs, sp)
    qseg, kseg = _pad_to(q_seg_bt, tp), _pad_to(k_seg_bs, sp)
    visible_ij = visible_blocks(qpos, kpos, qseg, kseg, bq, bk)
    out_ibkgqh = _flash(
        _blocks(q_bkgth, bq, axis=3),
        _blocks(k_bksh, bk, axis=2),
        _blocks(v_bksh, bk, axis=2),
        _blocks(qpos, bq),
        _blocks(kpos, bk),
        _blocks(qseg, bq),
        _blocks(kseg, bk),
        visible_ij,
    )
    out_btkgh = jnp.transpose(out_ibkgqh, (1, 0, 4, 2, 3, 5)).reshape(b, tp, kh, g, h)
    return out_btkgh.reshape(b, tp, n, h)[:, :t]
