"""KV-cache memory of a rollout engine, and the rollouts it keeps in flight, from shapes.

Per-token KV bytes b = layers x 2 (k, v) x K x H x compute bytes (Qwen3-30B-A3B: 48 x 2 x
4 x 128 x 2 B = 96 KiB). An engine of S slots holds
  dense   S x max_len x b            (every slot preallocated to max_len)
  paged   P x Z x b                  (P pages of Z positions, sampling/page_pool.py)
split over the devices its slots and pages shard over (`devices`). A dense cache caps S at
memory / (max_len x b); a paged pool caps the *live* tokens, so S is set by how many
positions S rollouts in flight hold at once, i.e. by the episode-length distribution.

Live tokens (`in_flight`). In steady state every slot runs episodes back to back, and an
episode's time in the slot grows with its length (one token per slot per decode step), so
the episode a slot holds at a random moment has a length-biased final length T (density
proportional to T f(T)) and has reached a uniform fraction of it; it holds
ceil((u T + steps_per_sync) / Z) pages (the engine's lookahead, sampling/engine.py). The
S slots are taken as independent. A pool whose slots split over D slot shards (the
mesh axes of the `batch` rule, models/paged_cache.py) is D separate pools of S / D
slots and P / D pages each, so the plan is per shard: fewer slots per pool multiplex
less. Monte Carlo (seeded) gives the pages one shard's slots hold at a quantile, and the
fraction of moments its P / D pages are short of them (then slots wait for pages:
admission control, never a drop). Time spent waiting for the
environment is not modelled (it weighs multi-turn episodes more); a plan, not a
measurement.

`EpisodeLengths`: log-normal final lengths with a given median and 99th percentile,
capped at max_len (longer episodes are truncated there). No measured distribution of
agentic episode lengths exists in this repository; the default (median 4k, p99 32k
tokens) is issue 26's "most agentic episodes far shorter than max_len".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from statistics import NormalDist

import numpy as np

from sao_jax.models.config import ModelConfig
from sao_jax.sampling.page_pool import KVLayout


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int | None = None) -> int:
    """b = L x 2 K H x itemsize: keys and values of one position in every layer, in the
    compute dtype unless `itemsize` is given."""
    itemsize = np.dtype(cfg.compute_dtype).itemsize if itemsize is None else itemsize
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize


@dataclasses.dataclass(frozen=True)
class EpisodeLengths:
    """Final episode lengths in tokens: log-normal (median, p99), capped at max_len."""

    median: float = 4096.0
    p99: float = 32768.0

    def __post_init__(self):
        if not 0 < self.median < self.p99:
            raise ValueError(f"episode lengths: need 0 < median < p99, got {self}")

    @property
    def sigma(self) -> float:
        """sigma of log T: log(p99 / median) / z_0.99."""
        return math.log(self.p99 / self.median) / NormalDist().inv_cdf(0.99)

    def sample(self, rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
        t = np.exp(rng.normal(math.log(self.median), self.sigma, n))
        return np.clip(np.round(t), 2, max_len)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The KV cache of one engine: its layout and sizes (from config.sampling)."""

    layout: str  # 'dense' | 'paged'
    slots: int  # S: rollouts in flight in this engine
    max_len: int
    page_size: int  # Z (dense: unused)
    pages: int  # P per layer (dense: 0)
    steps_per_sync: int
    token_bytes: int  # b
    devices: int  # devices the engine's cache splits over
    shards: int = 1  # slot shards (the rest of the split is over KV heads)

    @property
    def tokens(self) -> int:
        """Positions the cache holds (all layers)."""
        return self.pages * self.page_size if self.layout == "paged" else self.slots * self.max_len

    @property
    def device_bytes(self) -> float:
        return self.tokens * self.token_bytes / self.devices


def pool_plan(cfg: ModelConfig, sampling: Mapping, devices: int, shards: int = 1) -> PoolPlan:
    """The engine cache that `sampling` (config.sampling's fields) describes, on `devices`
    with its slots in `shards` slot shards; ValueError naming the field when the slots or
    pages do not split (sampling/page_pool.py KVLayout.check)."""
    layout = sampling.get("kv_layout", "dense")
    slots, max_len = int(sampling["num_slots"]), int(sampling["max_len"])
    page = int(sampling.get("page_size", 16))
    pages = int(sampling.get("num_pages", 0)) or slots * -(-max_len // page)
    if devices % shards:
        raise ValueError(f"pool shards: {shards} slot shards do not divide {devices} devices")
    KVLayout(layout, page, pages).check(slots, max_len, shards)
    return PoolPlan(
        layout=layout,
        slots=slots,
        max_len=max_len,
        page_size=page,
        pages=pages if layout == "paged" else 0,
        steps_per_sync=int(sampling.get("steps_per_sync", 1)),
        token_bytes=kv_bytes_per_token(cfg),
        devices=devices,
        shards=shards,
    )


@dataclasses.dataclass(frozen=True)
class InFlight:
    """Pages held by an engine's S rollouts in flight (paged) at an episode distribution."""

    mean_length: float  # E[T] of a finished episode (capped)
    mean_live: float  # mean positions one rollout in flight holds (page-rounded)
    quantile: float
    pages_q: int  # pages one shard's S / D rollouts hold at that quantile of moments
    short: float  # fraction of moments a shard's P / D pages are fewer than they hold


def in_flight(
    pool: PoolPlan,
    lengths: EpisodeLengths,
    *,
    quantile: float = 0.999,
    trials: int = 4000,
    draws: int = 200_000,
    seed: int = 0,
) -> InFlight:
    """Monte Carlo of the module docstring's live-token model (seeded, host only)."""
    rng = np.random.default_rng(seed)
    t = lengths.sample(rng, draws, pool.max_len)
    slots = pool.slots // pool.shards
    pick = rng.choice(draws, size=(trials, slots), p=t / t.sum())  # length-biased
    live = np.ceil(rng.uniform(size=pick.shape) * t[pick])
    need = np.minimum(live + pool.steps_per_sync, pool.max_len)
    pages = np.ceil(need / pool.page_size).sum(axis=1)
    return InFlight(
        mean_length=float(t.mean()),
        mean_live=float(pages.mean() * pool.page_size / slots),
        quantile=quantile,
        pages_q=int(np.ceil(np.quantile(pages, quantile))),
        short=float(np.mean(pages > pool.pages // pool.shards)) if pool.layout == "paged" else 0.0,
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:9.2f}"


def pool_plan_lines(pool: PoolPlan, lengths: EpisodeLengths, engines: int) -> list[str]:
    """The engine's cache and the rollouts in flight, as lines under memory_plan's table."""
    kib = pool.token_bytes / 1024
    lines = [
        "",
        f"rollout pool: {engines} engine(s) x {pool.slots} slots = {engines * pool.slots} "
        f"rollouts in flight, max_len {pool.max_len}, {kib:g} KiB of KV per token, each "
        f"engine's cache split over {pool.devices} device(s), {pool.shards} slot shard(s)",
    ]
    if pool.layout == "dense":
        lines.append(
            f"KV cache dense: {pool.slots} slots x {pool.max_len} positions = "
            f"{_gib(pool.tokens * pool.token_bytes).strip()} GiB per engine, "
            f"{_gib(pool.device_bytes).strip()} GiB per device"
        )
        return lines
    f = in_flight(pool, lengths)
    lines += [
        f"KV pool paged: {pool.pages} pages x {pool.page_size} positions = {pool.tokens} "
        f"positions, {_gib(pool.tokens * pool.token_bytes).strip()} GiB per engine, "
        f"{_gib(pool.device_bytes).strip()} GiB per device",
        f"episode lengths (assumed): log-normal, median {lengths.median:g}, p99 "
        f"{lengths.p99:g} tokens, capped at {pool.max_len}: mean {f.mean_length:.0f}; a "
        f"rollout in flight holds {f.mean_live:.0f} positions on average (length-biased, "
        "page-rounded)",
        f"pages the {pool.slots // pool.shards} rollouts of a slot shard hold: {f.pages_q} "
        f"at the {f.quantile:.1%} quantile of moments, of its {pool.pages // pool.shards}; "
        f"it is short of them (slots wait for pages) {f.short:.2%} of the time",
        f"the dense cache would need {_gib(pool.slots * pool.max_len * pool.token_bytes).strip()}"
        f" GiB per engine for these {pool.slots} slots "
        f"({pool.slots * pool.max_len / pool.tokens:.1f}x the pool)",
    ]
    return lines
