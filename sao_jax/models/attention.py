"""Grouped-query attention with per-head q/k RMSNorm, RoPE and an optional KV cache.

One masking rule serves training, packed batches and cached decoding: query t attends
key s iff `key_pos[s] <= query_pos[t]` and both carry the same nonzero segment id. With
a cache, key s is cache slot s, which always holds position s of that row: a row's
tokens are written contiguously from position 0, so stale or padded entries sit at
positions beyond the query and are masked by causality alone.

Without a cache (training passes) the kernel is chosen by `impl` (attention_backends.py:
naive, blockwise, cudnn, splash, auto); `grouped_attention` below is the
naive form, the reference every other kernel is tested against, and it is itself tested
against `grouped_attention_literal`, the same formula in the input layout.

Decode cost proportional to context: a cache may carry a static `span`; attention then
reads only slots [0, span) (the caller guarantees every query that matters sits below
it), and an optional long lane (`lane_rows_r`, static `lane_span`) gives a few rows a
longer span, so one long row does not make every row pay (docs/sampling.md section 1).
A paged cache (models/paged_cache.py: pages shared by all slots, a block table per slot)
shows attention the same slots: its pages are gathered into the dense layout, or read in
place by a Pallas kernel for decode (models/paged_kernels.py); `cache_attention` picks.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models import attention_backends as backends
from sao_jax.models import paged_cache as paged
from sao_jax.models import paged_kernels
from sao_jax.models.layers import (
    RMSNorm,
    apply_rope,
    normal,
    param,
    rope_tables,
    token_einsum,
)
from sao_jax.models.paged_cache import PagedKVCache
from sao_jax.parallel.mesh import Sharder

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@flax.struct.dataclass
class KVCache:
    """One layer's cache, or (stacked) a run of layers'; slot s of row b holds the
    key/value of position s.

    Reads: every row attends slots [0, span) (None = all S); the rows `lane_rows_r`
    instead attend [0, lane_span) (no lane when None). Writes always reach the whole
    cache. The spans are static (part of the tree structure: one program per span).
    Stacked (`model.scan_layers`): k/v carry a leading layer axis [L, B, S, K, H], and
    `layer` (a traced int32 scalar) names the one layer an attention call reads and
    writes, in place (a scan carries the whole stack; no per-layer copy of it is made).
    """

    k_bskh: jax.Array  # [B, S, K, H]; stacked [L, B, S, K, H]
    v_bskh: jax.Array  # [B, S, K, H]; stacked [L, B, S, K, H]
    lane_rows_r: jax.Array | None = None  # [R] int32 distinct rows of the long lane
    layer: jax.Array | None = None  # stacked: the layer index into the leading axis
    span: int | None = flax.struct.field(pytree_node=False, default=None)
    lane_span: int | None = flax.struct.field(pytree_node=False, default=None)


def init_cache(
    batch: int, length: int, num_kv_heads: int, head_dim: int, dtype, layers: int | None = None
) -> KVCache:
    """Zeros [B, S, K, H]; with `layers` = L, one stacked cache [L, B, S, K, H]."""
    shape = (batch, length, num_kv_heads, head_dim)
    shape = shape if layers is None else (layers, *shape)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_cache(cache: KVCache, k_btkh, v_btkh, positions_bt) -> KVCache:
    """Writes new keys/values at their positions (out-of-range positions are dropped);
    stacked: into layer `cache.layer` of the stack only."""
    rows_b1 = jnp.arange(k_btkh.shape[0])[:, None]
    idx = (rows_b1, positions_bt) if cache.layer is None else (cache.layer, rows_b1, positions_bt)
    k = cache.k_bskh.at[idx].set(k_btkh.astype(cache.k_bskh.dtype), mode="drop")
    v = cache.v_bskh.at[idx].set(v_btkh.astype(cache.v_bskh.dtype), mode="drop")
    return cache.replace(k_bskh=k, v_bskh=v)


def _slots(cache: KVCache, x, span: int) -> jax.Array:
    """Slots [0, span) of the cache's k or v `x`: [B, span, K, H] (stacked: of `layer`)."""
    if cache.layer is None:
        return x[:, :span]
    b, _, kv, h = x.shape[1:]
    start = (cache.layer, 0, 0, 0, 0)
    return jax.lax.dynamic_slice(x, start, (1, b, span, kv, h))[0]


def attention_mask(q_pos_bt, k_pos_bs, q_seg_bt, k_seg_bs) -> jax.Array:
    """[B, T, S] boolean: causal by position, same nonzero segment."""
    causal = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
    same = (q_seg_bt[:, :, None] == k_seg_bs[:, None, :]) & (k_seg_bs[:, None, :] != 0)
    return causal & same


def _causal_over_slots(q_pos_bt, span: int) -> jax.Array:
    """[B, T, span] mask of a cache read: slot s holds position s, visible iff s <= q_pos."""
    return jnp.arange(span, dtype=q_pos_bt.dtype)[None, None, :] <= q_pos_bt[:, :, None]


def attend_slots(q_btnh, positions_bt, read, span: int, lane_rows_r=None, lane_span=None):
    """Attention of the queries over cache slots [0, span) (long lane: [0, lane_span)).

    `read(span, rows)` returns (k, v) [B or R, span, K, H] of slots [0, span) of every row
    (rows None) or of rows `rows`: a slice of a dense cache or a gather of pages. Equals
    attention over all slots for every query at a position < its row's span: the slots
    beyond are masked by causality, so they only add exact zeros.
    """
    k_bskh, v_bskh = read(span, None)
    out_btnh = grouped_attention(q_btnh, k_bskh, v_bskh, _causal_over_slots(positions_bt, span))
    if lane_rows_r is None:
        return out_btnh
    k_rskh, v_rskh = read(lane_span, lane_rows_r)
    pos_rt = positions_bt[lane_rows_r]
    out_rtnh = grouped_attention(
        q_btnh[lane_rows_r], k_rskh, v_rskh, _causal_over_slots(pos_rt, lane_span)
    )
    return out_btnh.at[lane_rows_r].set(out_rtnh)


def cached_attention(q_btnh, positions_bt, cache: KVCache) -> jax.Array:
    """Attention of the queries over a dense cache's first `span` slots (long lane:
    `lane_span`); see `attend_slots`."""
    s = cache.k_bskh.shape[-3]
    span = s if cache.span is None else min(cache.span, s)
    lane = s if cache.lane_span is None else min(cache.lane_span, s)

    def read(n, rows):
        k, v = _slots(cache, cache.k_bskh, n), _slots(cache, cache.v_bskh, n)
        return (k, v) if rows is None else (k[rows], v[rows])

    return attend_slots(q_btnh, positions_bt, read, span, cache.lane_rows_r, lane)


def paged_attention(q_btnh, k_btkh, v_btkh, positions_bt, cache: PagedKVCache, sharder):
    """Writes the new keys/values into their pages and attends (per device on a mesh):
    one query per row through the Pallas kernel `cache.kernel`, otherwise the gather of
    each row's pages into slots [0, span) (models/paged_cache.py, paged_kernels.py)."""
    length = cache.block_table_sn.shape[1] * cache.page_size

    def local(q, k, v, pos, c: PagedKVCache):
        c = paged.write_pages(c, k, v, pos)
        span = length if c.span is None else min(c.span, length)
        if q.shape[1] == 1 and c.kernel != "gather":
            lane = c.lane_span if c.lane_rows_r is not None else None
            return paged_kernels.decode_attention(q, pos, c, max(span, lane or 0)), c
        lane = length if c.lane_span is None else min(c.lane_span, length)

        def read(n, rows):
            return paged.gather_slots(c, c.k_klpzh, n, rows), paged.gather_slots(
                c, c.v_klpzh, n, rows
            )

        return attend_slots(q, pos, read, span, c.lane_rows_r, lane), c

    return paged.per_device(local, sharder, q_btnh, k_btkh, v_btkh, positions_bt, cache)


def cache_attention(q_btnh, k_btkh, v_btkh, positions_bt, cache, sharder):
    """(attention output, updated cache) of one cached call, dense or paged cache."""
    if isinstance(cache, PagedKVCache):
        return paged_attention(q_btnh, k_btkh, v_btkh, positions_bt, cache, sharder)
    cache = write_cache(cache, k_btkh, v_btkh, positions_bt)
    return cached_attention(q_btnh, positions_bt, cache), cache


def grouped_attention(q_btnh, k_bskh, v_bskh, mask_bts) -> jax.Array:
    """softmax(q k^T / sqrt(H) + mask) v with N = K G query heads sharing K key/value heads.

    Heads-major: q moves to [B, K, G*T, H] and k, v to [B, K, S, H] before the products, so
    both contract with their batch dims (b, k) leading, and the output moves back once.
    Equals `grouped_attention_literal` up to float summation order; on XLA:CPU it is
    1.3-1.8x faster forward and forward + backward (docs/benchmarks.md).
    """
    b, t, n, h = q_btnh.shape
    s, kv = k_bskh.shape[1], k_bskh.shape[2]
    g = n // kv
    dt = q_btnh.dtype
    q_bkxh = jnp.transpose(q_btnh.reshape(b, t, kv, g, h), (0, 2, 3, 1, 4)).reshape(b, kv, g * t, h)
    k_bksh = jnp.transpose(k_bskh.astype(dt), (0, 2, 1, 3))
    v_bksh = jnp.transpose(v_bskh.astype(dt), (0, 2, 1, 3))
    logits_bkxs = jnp.einsum("bkxh,bksh->bkxs", q_bkxh, k_bksh)
    logits_bkgts = logits_bkxs.reshape(b, kv, g, t, s).astype(jnp.float32) * (h**-0.5)
    logits_bkgts = jnp.where(mask_bts[:, None, None], logits_bkgts, _MASKED)
    probs_bkxs = jax.nn.softmax(logits_bkgts, axis=-1).astype(dt).reshape(b, kv, g * t, s)
    out_bkgth = jnp.einsum("bkxs,bksh->bkxh", probs_bkxs, v_bksh).reshape(b, kv, g, t, h)
    return jnp.transpose(out_bkgth, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def grouped_attention_literal(q_btnh, k_bskh, v_bskh, mask_bts) -> jax.Array:
    """`grouped_attention` written literally, in the input layout: the slow reference of the
    tests (and the attention layout before heads-major, timed by the benches). Its
    products' batch dims (b, k) are not leading, which XLA:CPU runs ~4x slower per FLOP."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, kv, n // kv, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh.astype(q_btnh.dtype))
    logits = logits.astype(jnp.float32) * (h**-0.5)
    logits = jnp.where(mask_bts[:, None, None], logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1).astype(q_btnh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh.astype(q_btnh.dtype))
    return out.reshape(b, t, n, h)


def training_attention(
    q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt, *, impl: str, block: int, sharder
) -> jax.Array:
    """Self-attention of a whole sequence (no cache) with the kernel `impl` names."""
    impl, block = backends.resolve(impl, q_btnh.dtype, length=q_btnh.shape[1], block=block)
    if impl in NAIVE_IMPLS:
        mask = attention_mask(positions_bt, positions_bt, segment_ids_bt, segment_ids_bt)
        return NAIVE_IMPLS[impl](q_btnh, k_btkh, v_btkh, mask)
    kernel = backends.kernel_for(impl, block)
    return backends.per_device(
        kernel, sharder, q_btnh, k_btkh, v_btkh, positions_bt, segment_ids_bt
    )


# The materialised-score impls by name (attention_backends.py lists every impl).
NAIVE_IMPLS = {"naive": grouped_attention}


class Attention(nnx.Module):
    """Qwen3 attention: q/k/v projections, per-head q/k RMSNorm, RoPE, GQA, output proj.

    All of its parameters live under this module (`...attn.*`), so a critic can freeze
    attention as one group by path.
    """

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        eps: float,
        init_std: float,
        param_dtype,
        sharder: Sharder,
        rngs: nnx.Rngs,
        impl: str = "naive",
        block: int = 512,
    ):
        self.head_dim = head_dim
        self.impl = impl  # training kernel (attention_backends.IMPLS)
        self.block = block  # its query/key block length
        self.rope_theta = rope_theta
        self.sharder = sharder
        init = normal(init_std)
        self.q_proj = param(
            rngs, init, (dim, num_heads, head_dim), ("embed", "q_heads", "head_dim"), param_dtype
        )
        self.k_proj = param(
            rngs,
            init,
            (dim, num_kv_heads, head_dim),
            ("embed", "kv_heads", "head_dim"),
            param_dtype,
        )
        self.v_proj = param(
            rngs,
            init,
            (dim, num_kv_heads, head_dim),
            ("embed", "kv_heads", "head_dim"),
            param_dtype,
        )
        self.o_proj = param(
            rngs, init, (num_heads, head_dim, dim), ("q_heads", "head_dim", "embed"), param_dtype
        )
        self.q_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype, rngs=rngs)
        self.k_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype, rngs=rngs)

    def __call__(
        self,
        x_btd: jax.Array,
        positions_bt: jax.Array,
        segment_ids_bt: jax.Array,
        cache: KVCache | PagedKVCache | None = None,
    ) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
        dt = x_btd.dtype
        c = self.sharder.constrain
        q = token_einsum("btd,dnh->btnh", x_btd, self.q_proj[...].astype(dt))
        k = token_einsum("btd,dkh->btkh", x_btd, self.k_proj[...].astype(dt))
        v = token_einsum("btd,dkh->btkh", x_btd, self.v_proj[...].astype(dt))
        q = c(self.q_norm(q), ("batch", "length", "act_heads", None))
        k = c(self.k_norm(k), ("batch", "length", "act_kv_heads", None))
        v = c(v, ("batch", "length", "act_kv_heads", None))
        cos, sin = rope_tables(positions_bt, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is None:
            out = training_attention(
                q,
                k,
                v,
                positions_bt,
                segment_ids_bt,
                impl=self.impl,
                block=self.block,
                sharder=self.sharder,
            )
        else:
            out, cache = cache_attention(q, k, v, positions_bt, cache, self.sharder)
        out = c(out, ("batch", "length", "act_heads", None))
        y = token_einsum("btnh,nhd->btd", out, self.o_proj[...].astype(dt))
        return y, cache
