"""Decode attention over a paged KV cache (models/paged_cache.py), by backend.

  gather      pure JAX: positions [0, span) of every slot gathered from its pages into a
              dense [S, span, K, H] buffer, then the dense cache's attention
              (models/attention.py `attend_slots`); any backend, and every prefill
  pallas_tpu  `jax.experimental.pallas.ops.tpu.paged_attention` (Mosaic): reads each
              row's pages in place, up to its own length; K and V are read as bfloat16
  pallas_gpu  `jax.experimental.pallas.ops.gpu.paged_attention` (Triton), the same
              contract, K and V in their own dtype
  auto        pallas_tpu on TPU, pallas_gpu on GPU, gather elsewhere

Off their backend the Pallas kernels run in Pallas interpret mode (slow: for tests);
under `lowering_for(platform)` they are traced as that platform runs them, so a program
can be lowered for 'tpu' or 'cuda' on a CPU host (`.trace(...).lower(lowering_platforms=
...)`, from abstract shapes). A
kernel reads, per row, only the pages covering positions [0, position + 1): the cost of
a decode step follows each slot's own context, where the gather reads the bucketed span
for every row (span buckets and the long lane, docs/sampling.md, are how the gather
keeps that small). The kernels take one query per row, so only decode calls use them.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

from sao_jax.models.paged_cache import PAGED_KERNELS, PagedKVCache, flat_pages, layer_page_ids

_PLATFORM = threading.local()  # `lowering_for`'s platform while it is active


@contextlib.contextmanager
def lowering_for(platform: str):
    """Traces the Pallas kernels natively for `platform` ('tpu' | 'cuda' | 'gpu') instead
    of in interpret mode, whatever this host's backend: for lowering only."""
    prev = getattr(_PLATFORM, "value", None)
    _PLATFORM.value = "gpu" if platform == "cuda" else platform
    try:
        yield
    finally:
        _PLATFORM.value = prev


def _backend() -> str:
    return getattr(_PLATFORM, "value", None) or jax.default_backend()


def resolve_kernel(name: str, backend: str | None = None) -> str:
    """The kernel `name` runs: 'auto' -> the backend's Pallas kernel, or 'gather'."""
    if name not in PAGED_KERNELS:
        raise ValueError(f"paged_kernel: {name!r} is not one of {PAGED_KERNELS}")
    if name != "auto":
        return name
    backend = backend or _backend()
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "gather")


def _largest_divisor(n: int, candidates) -> int:
    return next(c for c in candidates if n % c == 0)


def decode_attention(q_b1nh, positions_b1, cache: PagedKVCache, span: int) -> jax.Array:
    """Attention of one query per row (at its position) over the row's pages [0, pos + 1),
    with the Pallas kernel `cache.kernel`; rows whose position is >= `span` read nothing
    (their output, zeros, is unused). Returns [B, 1, N, H] in q's dtype."""
    z = cache.page_size
    blocks = -(-span // z)
    pos_b = positions_b1[:, 0]
    lengths_b = jnp.where(pos_b < span, pos_b + 1, 0).astype(jnp.int32)
    pages_bn = jnp.maximum(layer_page_ids(cache, cache.block_table_sn[:, :blocks]), 0)
    k_kpzh, v_kpzh = flat_pages(cache.k_klpzh), flat_pages(cache.v_klpzh)
    h = q_b1nh.shape[-1]
    q_bnh = q_b1nh[:, 0] * jnp.asarray(h**-0.5, q_b1nh.dtype)  # the kernels do not scale
    backend = _backend()
    if cache.kernel == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        def call():
            return paged_attention(
                q_bnh,
                k_kpzh,
                v_kpzh,
                lengths_b,
                pages_bn,
                pages_per_compute_block=_largest_divisor(blocks, (8, 4, 2, 1)),
            )

        if backend == "tpu":
            out_bnh = call()
        else:
            with pltpu.force_tpu_interpret_mode():
                out_bnh = call()
    elif cache.kernel == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu

        splits = _largest_divisor(blocks, (16, 8, 4, 2, 1))
        out_bnh = gpu.paged_attention(
            q_bnh,
            k_kpzh,
            v_kpzh,
            pages_bn,
            lengths_b,
            k_splits=splits,
            pages_per_compute_block=_largest_divisor(blocks // splits, (8, 4, 2, 1)),
            interpret=backend != "gpu",
        )
    else:
        raise ValueError(f"decode_attention: no kernel {cache.kernel!r} (gather reads densely)")
    return out_bnh[:, None].astype(q_b1nh.dtype)
