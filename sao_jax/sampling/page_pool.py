"""The host side of the paged KV pool: its settings (`KVLayout`) and the page allocator.

The device side is sao_jax/models/paged_cache.py: per layer, P pages of Z positions
shared by all S slots, and a block table [S, N] (N = ceil(max_len / Z)) naming the page
of each slot's n-th block of positions. `PagePool` owns that table on the host: the
engine (sampling/engine.py) asks, before each device call, for the pages covering every
position the call writes or attends (`ensure`), and gives a slot's pages back when its
trajectory ends (`release`). Pages are taken lowest id first, so a run's table, like its
tokens, depends only on the schedule.

Sharded pools: the slots and the pages split alike over the `batch` mesh axes
(models/paged_cache.py), so slot s of shard d = s // (S / D) takes pages only from
[d P / D, (d + 1) P / D), the pages that live on its devices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sao_jax.models.paged_cache import PAGED_KERNELS

KV_LAYOUTS = ("dense", "paged")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """How an engine's KV cache is laid out (`sampling.kv_layout` and friends)."""

    kind: str = "dense"  # 'dense': S x max_len per layer; 'paged': a shared pool of pages
    page_size: int = 16  # Z: positions per page
    num_pages: int = 0  # P: pages per layer in the pool, all shards; 0 = S x ceil(L / Z)
    kernel: str = "auto"  # decode read: models/paged_kernels.py PAGED_KERNELS

    def __post_init__(self):
        if self.kind not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: {self.kind!r} is not one of {KV_LAYOUTS}")
        for name in ("page_size", "num_pages"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= (name == "page_size")):
                raise ValueError(f"{name}: must be an int >= {int(name == 'page_size')}, got {v!r}")
        if self.kernel not in PAGED_KERNELS:
            raise ValueError(f"paged_kernel: {self.kernel!r} is not one of {PAGED_KERNELS}")

    @property
    def paged(self) -> bool:
        return self.kind == "paged"

    def blocks(self, max_len: int) -> int:
        """N: blocks of a full-length slot, ceil(max_len / Z)."""
        return -(-max_len // self.page_size)

    def pool_pages(self, num_slots: int, max_len: int) -> int:
        """P: `num_pages`, or (0) as many as S full-length slots hold (never waits)."""
        return self.num_pages or num_slots * self.blocks(max_len)

    def check(self, num_slots: int, max_len: int, shards: int = 1) -> None:
        """Raises ValueError naming the field when the pool cannot serve S slots on `shards`
        shards: S and P must split evenly, and each shard must hold one full-length slot
        (otherwise a slot could wait for pages forever)."""
        if not self.paged:
            return
        pages, blocks = self.pool_pages(num_slots, max_len), self.blocks(max_len)
        if num_slots % shards:
            raise ValueError(f"num_slots: {num_slots} does not split over {shards} slot shards")
        if pages % shards:
            raise ValueError(f"num_pages: {pages} does not split over {shards} slot shards")
        if pages // shards < blocks:
            raise ValueError(
                f"num_pages: {pages} pages over {shards} shard(s) leave {pages // shards} per "
                f"shard, fewer than one full-length slot needs (ceil({max_len} / "
                f"{self.page_size}) = {blocks})"
            )


class PagePool:
    """Free pages per shard and each slot's block-table row (-1 = no page)."""

    def __init__(self, num_slots: int, max_len: int, layout: KVLayout, shards: int = 1):
        layout.check(num_slots, max_len, shards)
        self.page_size = layout.page_size
        self.num_pages = layout.pool_pages(num_slots, max_len)
        self.shards = shards
        self._per_shard = num_slots // shards
        self.table = np.full((num_slots, layout.blocks(max_len)), -1, np.int32)  # [S, N]
        per = self.num_pages // shards
        self._free = [list(range((d + 1) * per - 1, d * per - 1, -1)) for d in range(shards)]
        self._held = np.zeros(num_slots, np.int64)  # blocks of each slot with a page
        self.changes = 0  # bumped whenever the table changes (the engine re-sends it)
        self.peak = 0  # most pages in use at once

    def shard_of(self, s: int) -> int:
        return s // self._per_shard

    def held(self, s: int) -> int:
        return int(self._held[s])

    def free(self, shard: int) -> int:
        return len(self._free[shard])

    @property
    def in_use(self) -> int:
        return self.num_pages - sum(len(f) for f in self._free)

    def ensure(self, s: int, tokens: int) -> bool:
        """Gives slot s pages for positions [0, tokens); False (nothing taken) when its
        shard has too few free pages."""
        need = -(-tokens // self.page_size) - int(self._held[s])
        if need <= 0:
            return True
        free = self._free[self.shard_of(s)]
        if len(free) < need:
            return False
        held = int(self._held[s])
        for n in range(held, held + need):
            self.table[s, n] = free.pop()
        self._held[s] = held + need
        self.changes += 1
        self.peak = max(self.peak, self.in_use)
        return True

    def release(self, s: int) -> None:
        """Gives all of slot s's pages back to its shard."""
        held = int(self._held[s])
        if not held:
            return
        self._free[self.shard_of(s)].extend(self.table[s, :held][::-1].tolist())
        self.table[s] = -1
        self._held[s] = 0
        self.changes += 1
