"""Jitted prefill and KV-cache decode over a fixed set of slots, and the token sampler.

The rollout engine keeps S slots, each holding one trajectory at its own position in a
cache of length L (slot s of a cache row holds position s, see models/attention.py).
Two compiled programs serve every prompt length and every schedule:

* `prefill`: writes a chunk [S, C] of known tokens (prompt, observation) into the cache.
  Rows with nothing to write are inert: their positions are >= L, so the cache scatter
  (mode='drop') writes nothing for them. C comes from a few buckets, so a new prompt
  length never compiles a new program.
* `decode`: feeds one token per slot ([S, 1], per-slot positions), samples the next one,
  and repeats `steps` times inside a `lax.scan`. Tokens sampled after a slot's turn has
  ended (overshoot) are discarded on the host; the cache entries they wrote sit at
  positions beyond the slot's length and are overwritten before anything attends them.

Both programs take a static read span (`choose_spans`): attention reads only cache slots
[0, span), the smallest span bucket that covers every row whose output is used, and
optionally a long lane of a few rows with a longer span. So a step costs in proportion
to the context the slots hold, not to L; one program is compiled per span (pair).

The cache is dense ([S, L, K, H] per layer) or a paged pool shared by the slots, read
through a block table the engine passes in (page_pool.py, models/paged_cache.py); the
programs run on a sharder's mesh, the slot axis over its data axes (`GenerateFns`).

Per generated token two log-probs are recorded:
  sampled_logp = log q(a), q = softmax(truncate(logits / temperature)) (what was sampled);
  rollout_logp = log_softmax(logits)[a], the untruncated temperature-1 distribution,
which is the function the trainer evaluates, so importance ratios built on it measure
only train/inference mismatch and staleness (docs/method.md section 9).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.attention import KVCache
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import policy_def
from sao_jax.models.paged_cache import PAGE_AXES, TABLE_AXES, PagedKVCache
from sao_jax.models.paged_kernels import resolve_kernel
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.page_pool import KVLayout


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding distribution; traced in the compiled step, so changing it never recompiles."""

    temperature: float = 1.0  # 0 = greedy (evaluation)
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest nucleus with mass >= top_p; 1 = off

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k: must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(temperature, top_k, top_p) as host scalars, float32 / int32 / float32.

        Host, not device, arrays: the jitted call copies them in with its other inputs,
        where `jnp.asarray` would run one small device program per scalar per call (a
        fixed cost of every decode step, docs/benchmarks.md "Decode cost by context")."""
        return (
            np.asarray(self.temperature, np.float32),
            np.asarray(self.top_k, np.int32),
            np.asarray(self.top_p, np.float32),
        )


class Sample(NamedTuple):
    tokens_s: jax.Array  # [S] int32 sampled tokens
    sampled_logp_s: jax.Array  # [S] log q(a) under the truncated, tempered distribution
    rollout_logp_s: jax.Array  # [S] log_softmax(raw logits)[a] (temperature 1, full vocab)


def truncation_mask(logits_sv: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[S, V] bool: tokens kept by top-k, then top-p on the top-k-renormalised distribution.

    In descending order of logit, token i (rank i) is kept iff i < k and the probability
    mass of the kept tokens ranked before it is < top_p (so the first token is always
    kept). Tokens tied with the last kept logit are kept too. `top_k <= 0` and
    `top_p >= 1` switch the respective cut off exactly (no float round-off at the tail).
    """
    v = logits_sv.shape[-1]
    sorted_sv = -jnp.sort(-logits_sv, axis=-1)  # descending
    rank_v = jnp.arange(v)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    keep_sv = rank_v[None, :] < k
    probs_sv = jax.nn.softmax(jnp.where(keep_sv, sorted_sv, -jnp.inf), axis=-1)
    mass_before_sv = jnp.cumsum(probs_sv, axis=-1) - probs_sv
    keep_sv = keep_sv & ((mass_before_sv < top_p) | (top_p >= 1.0))
    count_s1 = jnp.sum(keep_sv, axis=-1, keepdims=True)
    threshold_s1 = jnp.take_along_axis(sorted_sv, count_s1 - 1, axis=-1)
    return logits_sv >= threshold_s1


def sample_tokens(
    key: jax.Array,
    logits_sv: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> Sample:
    """a ~ q = softmax(mask(logits / T)) per row; greedy argmax when T == 0.

    `key`: one key for all rows, or [S] keys, one per row. `temperature`, `top_k`,
    `top_p`: scalars, or [S] values, one per row (a serving backend's requests).
    sampled_logp = log q(a) (0 under greedy: a point mass); rollout_logp =
    log_softmax(logits)[a] whatever the sampling settings.
    """
    logits_sv = logits_sv.astype(jnp.float32)
    per_row = jnp.ndim(temperature) > 0
    if per_row:  # [S] -> [S, 1], against the [S, V] logits
        temperature, top_k, top_p = temperature[:, None], top_k[:, None], top_p[:, None]
    greedy = temperature <= 0
    scaled_sv = logits_sv / jnp.where(greedy, 1.0, temperature)
    keep_sv = truncation_mask(scaled_sv, top_k, top_p)
    masked_sv = jnp.where(keep_sv, scaled_sv, -jnp.inf)
    if key.ndim:  # a key per row
        sampled_s = jax.vmap(jax.random.categorical)(key, masked_sv)
    else:
        sampled_s = jax.random.categorical(key, masked_sv, axis=-1)
    greedy_s = greedy[:, 0] if per_row else greedy
    tokens_s = jnp.where(greedy_s, jnp.argmax(logits_sv, axis=-1), sampled_s).astype(jnp.int32)
    logq_sv = jax.nn.log_softmax(masked_sv, axis=-1)
    sampled_logp_s = jnp.take_along_axis(logq_sv, tokens_s[:, None], axis=-1)[:, 0]
    sampled_logp_s = jnp.where(greedy_s, 0.0, sampled_logp_s)
    logp_sv = jax.nn.log_softmax(logits_sv, axis=-1)
    rollout_logp_s = jnp.take_along_axis(logp_sv, tokens_s[:, None], axis=-1)[:, 0]
    return Sample(tokens_s, sampled_logp_s, rollout_logp_s)


class DecodeOut(NamedTuple):
    """Outputs of `steps` decode steps, step-major."""

    tokens_ns: jax.Array  # [n, S] sampled tokens
    sampled_logp_ns: jax.Array  # [n, S]
    rollout_logp_ns: jax.Array  # [n, S]
    experts_nslk: jax.Array | None  # [n, S, L_moe, k] routing of the token FED at step i
    logits_nsv: jax.Array | None  # [n, S, V] raw logits (only with return_logits)


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n, or the largest bucket (the chunk is then split)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def default_buckets(max_len: int, smallest: int = 8) -> tuple[int, ...]:
    """Powers of two from `smallest` up to the first one >= max_len."""
    out, b = [], smallest
    while True:
        out.append(b)
        if b >= max_len:
            return tuple(out)
        b *= 2


class GenerateFns:
    """The compiled prefill/decode programs for S slots and cache length L.

    Pure functions of (params, cache, ...); the cache is donated. Stateless apart from a
    trace counter, so several engines (sampler workers) can share one instance and one
    compilation. `traces[name]` counts how often each program was traced.

    Sharding: the programs run on `sharder`'s mesh (default: the one the model def was
    built with; another one rebuilds the policy def for it). The slot axis of the cache,
    the decode batch and the prefill chunk takes the `batch` rule (the mesh's data axes),
    key/value heads `act_kv_heads` (tensor), experts their own rules, all from the one
    rules table (parallel/mesh.py), so the slot count grows with the pool's devices.

    `layout` (page_pool.KVLayout): 'dense' keeps [S, L, K, H] per layer; 'paged' a pool
    of pages shared by all slots (models/paged_cache.py), addressed through the block
    table each call takes. `per_token_keys`: each sampled token's key is
    fold_in(fold_in(key, serial), position), serial = the trajectory's number in the
    engine, so a token's draw does not depend on which slot, batch or step it ran in.
    """

    def __init__(
        self,
        mdef: ModelDef,
        *,
        num_slots: int,
        max_len: int,
        steps: int = 1,
        record_routing: bool = False,
        return_logits: bool = False,
        sharder: Sharder | None = None,
        layout: KVLayout | None = None,
        per_token_keys: bool = False,
    ):
        for name, v in (("num_slots", num_slots), ("max_len", max_len), ("steps", steps)):
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name}: must be a positive int, got {v!r}")
        model = nnx.merge(mdef.graphdef, mdef.abstract)
        self.model_cfg: ModelConfig = model.cfg
        if sharder is not None and sharder != model.sharder:
            mdef = policy_def(self.model_cfg, sharder)  # constraints on the pool's mesh
        self.mdef = mdef
        self.sharder: Sharder = sharder or model.sharder
        self.num_slots = num_slots
        self.max_len = max_len
        self.steps = steps
        self.record_routing = record_routing
        self.return_logits = return_logits
        self.per_token_keys = per_token_keys
        layout = layout or KVLayout()  # dense
        self.layout = dataclasses.replace(layout, kernel=resolve_kernel(layout.kernel))
        self.shards = slot_shards(self.sharder, num_slots, self.layout.blocks(max_len))
        self.layout.check(num_slots, max_len, self.shards)
        self.traces: collections.Counter[str] = collections.Counter()
        self.programs: set[tuple] = set()  # (name, span, lane_span, ...) of every trace
        static = ("span", "lane_span")
        self._prefill = jax.jit(self._prefill_impl, donate_argnums=(1,), static_argnames=static)
        self._prefill_rows = jax.jit(
            self._prefill_rows_impl, donate_argnums=(1,), static_argnames=static
        )
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,), static_argnames=static)
        self._init = jax.jit(self._init_impl)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(L_moe, k) of a per-token routing record, or None for a dense model."""
        c = self.model_cfg
        return (len(c.moe_layers), c.num_experts_per_tok) if c.moe_layers else None

    def _empty(self):
        trunk = nnx.merge(self.mdef.graphdef, self.mdef.abstract).trunk
        if self.layout.paged:
            return trunk.init_paged_cache(
                self.layout.pool_pages(self.num_slots, self.max_len), self.layout.page_size
            )
        return trunk.init_cache(self.num_slots, self.max_len)

    def _init_impl(self):
        return self._placed(self._empty())

    def init_cache(self, params: Params = None):
        """An empty cache, placed on the mesh: dense, a KVCache [S, L, K, H] per layer
        (stacked layout: per stack, [L_run, S, L, K, H]); paged, a PagedKVCache
        [K, L_run, P, Z, H] per layer or stack. `params` is not read (kept for callers)."""
        del params
        return self._init()

    def abstract_cache(self):
        """The cache as ShapeDtypeStructs (with shardings on a mesh): for lowering the
        programs from shapes (jax.eval_shape, `.trace(...).lower(...)`)."""
        return jax.eval_shape(self._init_impl)

    def trace_decode(self, span: int | None = None):
        """The decode program traced from abstract shapes (nothing allocated, no params):
        `.lower(lowering_platforms=('tpu',))` lowers it for another backend (Pallas
        kernels: under `models.paged_kernels.lowering_for(platform)`)."""
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        f32 = jax.ShapeDtypeStruct((), jnp.float32)
        s = self.num_slots
        table = i32(s, self.layout.blocks(self.max_len)) if self.layout.paged else None
        return self._decode.trace(
            self.mdef.shapes(),
            self.abstract_cache(),
            i32(s),
            i32(s),
            jax.eval_shape(lambda: jax.random.key(0)),
            f32,
            jax.ShapeDtypeStruct((), jnp.int32),
            f32,
            None,
            table,
            i32(s) if self.per_token_keys else None,
            span=span or self.max_len,
            lane_span=None,
        )

    def _placed(self, cache):
        """Each cache leaf constrained to its sharding (identity unsharded)."""
        sharder = self.sharder

        def place(c):
            if isinstance(c, PagedKVCache):
                names = PAGE_AXES
                return c.replace(
                    k_klpzh=sharder.constrain(c.k_klpzh, names),
                    v_klpzh=sharder.constrain(c.v_klpzh, names),
                )
            names = ("batch", "cache_length", "act_kv_heads", None)
            if c.k_bskh.ndim == 5:
                names = ("layers", *names)
            return c.replace(
                k_bskh=sharder.constrain(c.k_bskh, names), v_bskh=sharder.constrain(c.v_bskh, names)
            )

        return jax.tree.map(place, cache, is_leaf=_is_cache)

    def _reading(self, cache, lane_rows_r, span, lane_span, table_sn):
        """Caches that read [0, span) (lane rows: [0, lane_span)); per layer or stacked;
        paged ones through `table_sn`."""

        def read(c):
            c = c.replace(lane_rows_r=lane_rows_r, span=span, lane_span=lane_span)
            if isinstance(c, PagedKVCache):
                c = c.replace(block_table_sn=table_sn, kernel=self.layout.kernel)
            return c

        return jax.tree.map(read, cache, is_leaf=_is_cache)

    def _plain(self, cache):
        def plain(c):
            c = c.replace(lane_rows_r=None, span=None, lane_span=None)
            if isinstance(c, PagedKVCache):
                c = c.replace(block_table_sn=None, kernel="gather")
            return c

        return self._placed(jax.tree.map(plain, cache, is_leaf=_is_cache))

    def _prefill_impl(
        self, params, cache, tokens_sc, positions_sc, lane_rows_r, table_sn=None, *, span, lane_span
    ):
        self.traces["prefill"] += 1
        self.programs.add(("prefill", tokens_sc.shape[1], span, lane_span))
        return self._prefill_body(
            params, cache, tokens_sc, positions_sc, lane_rows_r, table_sn, span, lane_span
        )

    def _prefill_rows_impl(
        self, params, cache, rows_r, tokens_rc, positions_rc, lane_rows_r, table_sn=None, *,
        span, lane_span,
    ):  # fmt: skip
        """The prefill of slots `rows_r` [R] only: a dense cache's rows are gathered
        ([R, L, K, H] per layer), written and scattered back; a paged pool is written
        through the block table's rows `rows_r`. Each row's arithmetic is the full
        prefill's on a batch of R rows."""
        self.traces["prefill_rows"] += 1
        self.programs.add(("prefill_rows", *tokens_rc.shape, span, lane_span))
        if self.layout.paged:
            return self._prefill_body(params, cache, tokens_rc, positions_rc, lane_rows_r,
                                      table_sn[rows_r], span, lane_span)  # fmt: skip

        def take(c):
            axis = c.k_bskh.ndim - 4  # stacked: [L_run, S, ...]
            return c.replace(k_bskh=jnp.take(c.k_bskh, rows_r, axis=axis),
                             v_bskh=jnp.take(c.v_bskh, rows_r, axis=axis))  # fmt: skip

        def put(c, part):
            idx = (slice(None),) * (c.k_bskh.ndim - 4) + (rows_r,)
            return c.replace(k_bskh=c.k_bskh.at[idx].set(part.k_bskh),
                             v_bskh=c.v_bskh.at[idx].set(part.v_bskh))  # fmt: skip

        part = jax.tree.map(take, cache, is_leaf=_is_cache)
        part, experts = self._prefill_body(
            params, part, tokens_rc, positions_rc, lane_rows_r, None, span, lane_span
        )
        return self._placed(jax.tree.map(put, cache, part, is_leaf=_is_cache)), experts

    def _prefill_body(
        self, params, cache, tokens_sc, positions_sc, lane_rows_r, table_sn, span, lane_span
    ):
        model = self.mdef.bind(params)
        segments_sc = (positions_sc < self.max_len).astype(jnp.int32)
        cache = self._reading(cache, lane_rows_r, span, lane_span, table_sn)
        out = model(tokens_sc, positions_sc, segments_sc, cache=cache)
        experts = out.experts_btlk if self.record_routing else None
        return self._plain(out.cache), experts

    def _decode_impl(
        self,
        params,
        cache,
        tokens_s,
        positions_s,
        key,
        temperature,
        top_k,
        top_p,
        lane_rows_r,
        table_sn=None,
        serial_s=None,
        *,
        span,
        lane_span,
    ):
        self.traces["decode"] += 1
        self.programs.add(("decode", span, lane_span))
        model = self.mdef.bind(params)
        if self.per_token_keys:  # [S] keys, one per trajectory; folded with the position
            row_keys_s = jax.vmap(jax.random.fold_in, (None, 0))(key, serial_s)

        def one_step(carry, key_i):
            cache, tokens_s, positions_s = carry
            segments_s = (positions_s < self.max_len).astype(jnp.int32)
            cache = self._reading(cache, lane_rows_r, span, lane_span, table_sn)
            out = model(tokens_s[:, None], positions_s[:, None], segments_s[:, None], cache=cache)
            logits_sv = out.out[:, 0]  # [S, V]
            if self.per_token_keys:  # the key of the token sampled for position p + 1
                key_i = jax.vmap(jax.random.fold_in)(row_keys_s, positions_s + 1)
            sample = sample_tokens(key_i, logits_sv, temperature, top_k, top_p)
            experts = None
            if self.record_routing and out.experts_btlk is not None:
                experts = out.experts_btlk[:, 0]  # [S, L_moe, k]
            ys = (*sample, experts, logits_sv if self.return_logits else None)
            return (self._plain(out.cache), sample.tokens_s, positions_s + 1), ys

        keys = jax.random.split(key, self.steps)
        (cache, _, _), ys = jax.lax.scan(one_step, (cache, tokens_s, positions_s), keys)
        return cache, DecodeOut(*ys)

    def _spans(self, spans: Spans | None) -> dict:
        """Keyword arguments of a program call; None = read the whole cache."""
        if spans is None:
            return dict(lane_rows_r=None, span=self.max_len, lane_span=None)
        for name, v in (("span", spans.span), ("lane_span", spans.lane_span)):
            if v is not None and not (isinstance(v, int) and 0 < v <= self.max_len):
                raise ValueError(f"spans.{name}: must be an int in [1, {self.max_len}], got {v!r}")
        rows = spans.lane_rows_r
        if (rows is None) != (spans.lane_span is None):
            raise ValueError("spans: lane_rows_r and lane_span go together")
        rows = None if rows is None else np.array(rows, np.int32)  # host: see `_rows`
        return dict(lane_rows_r=rows, span=spans.span, lane_span=spans.lane_span)

    def _rows(self, x, dtype=jnp.int32):
        """A host array [S, ...] as a program input: on a mesh, placed with its slot axis
        split like the cache's; unsharded, a host copy the jitted call copies in (a traced
        one, under a caller's jit or export, keeps the shardings the caller gave it).

        Never `jnp.asarray`: that runs a small device program per array per call, which
        was most of a short-context decode step's fixed cost outside the model."""
        if isinstance(x, jax.core.Tracer):
            return x.astype(dtype)
        x = np.array(x, dtype)  # a copy: the host may change its array while a call runs
        sharding = self.sharder.named(("batch",) + (None,) * (x.ndim - 1), x.shape)
        return x if sharding is None else jax.device_put(x, sharding)

    def block_table(self, table_sn):
        """The block table [S, N] as a program argument (None for a dense cache)."""
        if not self.layout.paged:
            return None
        if table_sn is None:
            raise ValueError("block_table: a paged cache needs the engine's block table")
        if isinstance(table_sn, jax.Array):
            return table_sn
        return jax.device_put(self._rows(table_sn))  # on the devices: the engine keeps it

    def prefill(self, params, cache, tokens_sc, positions_sc, spans=None, *, block_table=None):
        """Writes tokens [S, C] at positions [S, C] (>= L: not written). Returns the new
        cache and, with record_routing, the experts [S, C, L_moe, k] of every token.

        `spans` bounds the cache read (`choose_spans`); rows whose position + 1 exceeds
        their span get wrong outputs, fine only for rows the caller ignores. A paged
        cache takes the block table [S, N] (`block_table`)."""
        return self._prefill(
            params,
            cache,
            self._rows(tokens_sc),
            self._rows(positions_sc),
            table_sn=self.block_table(block_table),
            **self._spans(spans),
        )

    def prefill_rows(self, params, cache, rows_r, tokens_rc, positions_rc, spans=None, *,
                     block_table=None):  # fmt: skip
        """`prefill` of the slots `rows_r` [R] (distinct) only: tokens [R, C] at positions
        [R, C]; `spans` (`lane_rows_r` indexing the R rows) bounds their read. Costs R
        rows, not S: for the slots that take new tokens while the others decode. The
        slot axis must not be split over devices (`shards` == 1). Returns the new cache
        and, with record_routing, the experts [R, C, L_moe, k]."""
        if self.shards != 1:
            raise ValueError(f"prefill_rows: the slot axis is split {self.shards} ways")
        return self._prefill_rows(
            params,
            cache,
            self._rows(rows_r),
            self._rows(tokens_rc),
            self._rows(positions_rc),
            table_sn=self.block_table(block_table),
            **self._spans(spans),
        )

    def decode(
        self,
        params,
        cache,
        tokens_s,
        positions_s,
        key,
        sampling: SamplingParams,
        spans=None,
        *,
        block_table=None,
        serial_s=None,
    ):
        """Feeds tokens [S] at positions [S] and samples `steps` tokens per slot.

        Step i feeds the token sampled at step i - 1 (the given one at step 0) at
        position positions_s + i; `spans` must cover positions_s + steps for every row
        whose samples are used. With `per_token_keys`, `serial_s` [S] numbers each row's
        trajectory and `key` is the engine's fixed key. Returns (cache, DecodeOut).
        """
        if not self.per_token_keys:
            serial_s = None  # not read by the program: nothing to copy in
        elif serial_s is None:
            serial_s = np.zeros(self.num_slots, np.int32)
        return self._decode(
            params,
            cache,
            self._rows(tokens_s),
            self._rows(positions_s),
            key,
            *sampling.arrays(),
            table_sn=self.block_table(block_table),
            serial_s=None if serial_s is None else self._rows(serial_s),
            **self._spans(spans),
        )


def _is_cache(x) -> bool:
    return isinstance(x, (KVCache, PagedKVCache))


def slot_shards(sharder: Sharder, num_slots: int, blocks: int) -> int:
    """How many ways the slot axis splits on the sharder's mesh (1 unsharded)."""
    if sharder.mesh is None:
        return 1
    axes = sharder.spec(TABLE_AXES, (num_slots, blocks))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(sharder.mesh.shape[a] for a in axes)


def span_buckets(max_len: int, smallest: int = 128) -> tuple[int, ...]:
    """Powers of two from `smallest` below max_len, then max_len (the full cache).

    Below ~128 slots the cache read is small next to the weights every step reads, so a
    smaller span saves nothing measurable and only adds programs to compile."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return (*out, max_len)


class Spans(NamedTuple):
    """Static read spans of one prefill/decode call (see models/attention.py)."""

    span: int  # every row reads cache slots [0, span)
    lane_rows_r: np.ndarray | None = None  # [R] rows that read [0, lane_span) instead
    lane_span: int | None = None


def choose_spans(need_s, buckets: tuple[int, ...], lane_slots: int = 0) -> Spans:
    """The cheapest spans covering `need_s` (per row: cache slots its queries must see,
    i.e. its largest used query position + 1; 0 for a row whose output is discarded).

    Without a lane: span = smallest bucket >= max(need). With `lane_slots` = R > 0, the R
    rows of largest need form the long lane (span of the largest need) and the rest read
    the bucket of the (R+1)-th largest need, when that is smaller; cost ~ S * span +
    R * lane_span instead of S * lane_span.
    """
    need_s = np.asarray(need_s)
    order = np.argsort(-need_s, kind="stable")
    longest = bucket_length(int(need_s[order[0]]), buckets)
    if 0 < lane_slots < len(need_s):
        rest = bucket_length(int(need_s[order[lane_slots]]), buckets)
        if rest < longest:
            rows_r = np.sort(order[:lane_slots]).astype(np.int32)
            return Spans(rest, rows_r, longest)
    return Spans(longest)


def inert_rows(num_slots: int, width: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Host buffers for a prefill chunk with every row inert (token 0 at position L)."""
    tokens_sc = np.zeros((num_slots, width), np.int32)
    positions_sc = np.full((num_slots, width), max_len, np.int32)
    return tokens_sc, positions_sc
