"""A paged KV cache: one pool of fixed-size pages shared by every slot, a block table per slot.

Layout of one cache (a layer's, or with `model.scan_layers` a stack's of L layers; L = 1
for a per-layer cache):

  k_klpzh, v_klpzh  [K, L, P, Z, H]  P pages of Z token positions per layer, key/value
                                      heads leading (the layout of JAX's paged-attention
                                      kernels, which take [K, pages, Z, H])
  block_table_sn    [S, N] int32      the page holding slot s's n-th block of Z positions
                                      (N = ceil(max_len / Z)); -1 = no page

Position p of slot s lives at offset p % Z of page block_table[s, p // Z] in every layer.
The host (sampling/page_pool.py) hands out and takes back pages as slots grow and finish,
so the pool is sized to the live tokens rather than S x max_len. A layer l's pages are
the indices [l P, (l + 1) P) of the [K, L P, Z, H] view of the pool: a kernel gets that
view whole and page ids offset by l P, so no layer's pool is ever copied out of the stack.

Sharded (`sampling/generate.py`): the slot axis and the page axis both take the `batch`
rule's mesh axes, so shard d of the slots holds shard d of the pages, and the host
gives the slots of shard d only pages of [d P_d, (d + 1) P_d) (P_d = P / shards). Writes
and reads then run per device (`per_device`): page id % P_d is the local page.

Reads see exactly what the dense cache (models/attention.py) would show: slot s's
positions [0, span) gathered into a dense [S, span, K, H] buffer, or read by a Pallas
kernel in place (models/paged_kernels.py). A position on no page (table -1) reads page 0
of the layer, whatever it holds; every such position lies beyond the query (the host
allocates every block a call writes or attends), so causality masks it, as it masks the
stale slots of a dense cache. Writes to a position without a page, or at positions >=
N Z (inert rows), are dropped.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sao_jax.parallel.mesh import Sharder

PAGED_KERNELS = ("auto", "gather", "pallas_tpu", "pallas_gpu")  # models/paged_kernels.py


@flax.struct.dataclass
class PagedKVCache:
    """A pool of pages (see the module docstring); the read fields mirror `KVCache`'s.

    `block_table_sn` is set for the duration of one program (the engine passes it in);
    `layer` (stacked) names the layer an attention call reads and writes. `span` bounds
    the positions read ([0, span), static); `lane_rows_r` read [0, lane_span) instead.
    `kernel` picks the decode read (models/paged_kernels.py; prefill always gathers).
    """

    k_klpzh: jax.Array  # [K, L, P, Z, H]
    v_klpzh: jax.Array  # [K, L, P, Z, H]
    block_table_sn: jax.Array | None = None  # [S, N] int32 page ids, -1 = none
    lane_rows_r: jax.Array | None = None  # [R] int32 rows of the long lane
    layer: jax.Array | None = None  # stacked: the layer index (None: layer 0 of L = 1)
    span: int | None = flax.struct.field(pytree_node=False, default=None)
    lane_span: int | None = flax.struct.field(pytree_node=False, default=None)
    kernel: str = flax.struct.field(pytree_node=False, default="gather")

    @property
    def page_size(self) -> int:
        return self.k_klpzh.shape[-2]

    @property
    def pages_per_layer(self) -> int:
        return self.k_klpzh.shape[2]


PAGE_AXES = ("act_kv_heads", "layers", "batch", None, None)  # logical names of k/v pages
TABLE_AXES = ("batch", None)  # of the block table [S, N]


def init_paged_cache(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, layers: int = 1
) -> PagedKVCache:
    """Zeros [K, L, P, Z, H] (L = 1 for one layer's cache)."""
    shape = (num_kv_heads, layers, num_pages, page_size, head_dim)
    return PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def flat_pages(x_klpzh) -> jax.Array:
    """[K, L, P, Z, H] -> [K, L P, Z, H] (contiguous: no copy)."""
    kv, layers, pages, z, h = x_klpzh.shape
    return x_klpzh.reshape(kv, layers * pages, z, h)


def layer_page_ids(cache: PagedKVCache, table_sn: jax.Array) -> jax.Array:
    """Page ids into the [K, L P, Z, H] view for this cache's layer (-1 stays -1)."""
    pages = cache.pages_per_layer
    base = 0 if cache.layer is None else cache.layer * pages
    return jnp.where(table_sn >= 0, table_sn % pages + base, -1)


def write_pages(cache: PagedKVCache, k_btkh, v_btkh, positions_bt) -> PagedKVCache:
    """Writes new keys/values at their positions; positions without a page are dropped."""
    z = cache.page_size
    table_sn = cache.block_table_sn
    n = table_sn.shape[1]
    block_bt = positions_bt // z
    inside_bt = (positions_bt >= 0) & (block_bt < n)
    ids_bt = jnp.take_along_axis(
        layer_page_ids(cache, table_sn), jnp.clip(block_bt, 0, n - 1), axis=1
    )
    k_flat, v_flat = flat_pages(cache.k_klpzh), flat_pages(cache.v_klpzh)
    ids_bt = jnp.where(inside_bt & (ids_bt >= 0), ids_bt, k_flat.shape[1])  # out of range: drop
    off_bt = positions_bt % z

    def put(flat, x_btkh):  # flat[:, id, off] = x: [B, T] index dims, then [K, H]
        return flat.at[:, ids_bt, off_bt].set(
            jnp.moveaxis(x_btkh, 2, 0).astype(flat.dtype), mode="drop"
        )

    shape = cache.k_klpzh.shape
    return cache.replace(
        k_klpzh=put(k_flat, k_btkh).reshape(shape), v_klpzh=put(v_flat, v_btkh).reshape(shape)
    )


def gather_slots(cache: PagedKVCache, x_klpzh, span: int, rows_r=None) -> jax.Array:
    """Positions [0, span) of every slot (or of `rows_r`) as a dense [B, span, K, H]."""
    z = cache.page_size
    blocks = -(-span // z)
    table = cache.block_table_sn if rows_r is None else cache.block_table_sn[rows_r]
    ids_bn = jnp.maximum(layer_page_ids(cache, table[:, :blocks]), 0)  # none -> page 0
    x_kbnzh = flat_pages(x_klpzh)[:, ids_bn]
    b, k, h = ids_bn.shape[0], x_kbnzh.shape[0], x_kbnzh.shape[-1]
    x_bskh = jnp.transpose(x_kbnzh, (1, 2, 3, 0, 4)).reshape(b, blocks * z, k, h)
    return x_bskh[:, :span]


def specs(sharder: Sharder, cache: PagedKVCache) -> tuple[P, P, P, P]:
    """shard_map specs of (queries / new keys [B, T, heads, H], positions [B, T], block
    table [S, N], pages [K, L, P, Z, H]) on the sharder's mesh: rows and pages over the
    `batch` axes, heads over `act_kv_heads`' (when they divide the key/value heads)."""
    pages = sharder.spec(PAGE_AXES, cache.k_klpzh.shape)
    rows = sharder.spec(TABLE_AXES, cache.block_table_sn.shape)
    if pages[2] != rows[0]:
        raise ValueError(
            f"paged KV cache: pages split over {pages[2]} but slots over {rows[0]}; "
            "sampling.num_pages and sampling.num_slots must both divide by the batch shards"
        )
    act = P(rows[0], None, pages[0], None)
    return act, P(rows[0], None), rows, pages


def per_device(fn, sharder: Sharder, q_btnh, k_btkh, v_btkh, positions_bt, cache: PagedKVCache):
    """`fn(q, k, v, positions, cache) -> (out [B, T, N, H], cache)` on each device's rows,
    heads and pages (`shard_map`; a plain call unsharded). `fn` sees its local pages and
    its rows of the block table; page ids are taken modulo the local page count."""
    if sharder.mesh is None:
        return fn(q_btnh, k_btkh, v_btkh, positions_bt, cache)
    act, tok, rows, pages = specs(sharder, cache)
    lane = cache.lane_span if cache.lane_rows_r is not None else None
    span = max(cache.span or 0, lane or 0) or None  # no long lane per device: widest span
    layer = jnp.zeros((), jnp.int32) if cache.layer is None else cache.layer
    stacked = cache.layer is not None

    def local(q, k, v, pos, table, kp, vp, layer):
        c = PagedKVCache(kp, vp, table, None, layer if stacked else None, span, None, cache.kernel)
        out, c = fn(q, k, v, pos, c)
        return out, c.k_klpzh, c.v_klpzh

    out, kp, vp = jax.shard_map(
        local,
        mesh=sharder.mesh,
        in_specs=(act, act, act, tok, rows, pages, pages, P()),
        out_specs=(act, pages, pages),
        check_vma=False,
    )(
        q_btnh,
        k_btkh,
        v_btkh,
        positions_bt,
        cache.block_table_sn,
        cache.k_klpzh,
        cache.v_klpzh,
        layer,
    )
    return out, cache.replace(k_klpzh=kp, v_klpzh=vp)
