"""The paged KV pool: pages shared by all slots, a block table per slot, admission control.

Against the dense cache (S x max_len per layer): the page reads equal the dense reads
bit for bit (gather) or to the kernel's precision (Pallas, interpret mode on CPU); the
engine's rollouts are the same (tokens, routing, versions; logp within 2e-6) with
refills, multi-turn observations, span buckets and the long lane, and with a pool so
small that slots wait for pages and get preempted; one trace per program as pages move.
The paged decode program lowers for TPU and CUDA from abstract shapes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.defaults import sampling_section
from sao_jax.models import paged_cache as pc
from sao_jax.models.attention import KVCache, cache_attention, cached_attention
from sao_jax.models.paged_kernels import lowering_for, resolve_kernel
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import ModelDef, init_params
from sao_jax.sampling.engine import EngineConfig
from sao_jax.sampling.generate import GenerateFns
from sao_jax.sampling.page_pool import KVLayout, PagePool
from sao_jax.sampling.rollouts import SyncRollouts
from sao_jax.sampling.sampler import AsyncSampler, configs_from_section
from sao_jax.schema import ConfigError
from tests.sampling_support import (
    MODEL,
    FakeTokenizer,
    TurnEnv,
    assert_same_rollouts,
    engine_rollouts,
    prompts,
)

L_MAX = 64


def test_page_pool_hands_out_and_takes_back_pages_per_shard():
    pool = PagePool(4, 32, KVLayout("paged", page_size=8, num_pages=12), shards=2)
    assert pool.table.shape == (4, 4) and (pool.table == -1).all()
    assert pool.ensure(0, 9) and pool.table[0, :2].tolist() == [0, 1]  # lowest ids first
    assert pool.ensure(2, 1) and pool.table[2, 0] == 6  # shard 1 owns pages 6..11
    assert pool.ensure(0, 16) and pool.held(0) == 2  # already covered: nothing taken
    assert pool.ensure(1, 32) and pool.free(0) == 0 and pool.in_use == 7
    assert not pool.ensure(0, 25)  # 2 more pages needed, none free in shard 0
    assert pool.held(0) == 2  # a refused request takes nothing
    changes = pool.changes
    pool.release(1)
    assert (pool.table[1] == -1).all() and pool.free(0) == 4 and pool.changes == changes + 1
    assert pool.ensure(0, 25) and pool.table[0].tolist() == [0, 1, 2, 3]
    assert pool.ensure(3, 8) and 6 <= pool.table[3, 0] < 12
    assert pool.peak == 7


def test_layout_settings_are_checked_naming_the_field():
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(kv_layout="ring")
    with pytest.raises(ValueError, match="num_pages.*full-length slot"):
        EngineConfig(max_len=64, kv_layout="paged", page_size=8, num_pages=7)
    with pytest.raises(ValueError, match="paged_kernel"):
        EngineConfig(kv_layout="paged", paged_kernel="flash")
    assert EngineConfig(num_slots=4, max_len=64, kv_layout="paged", page_size=8).layout == (
        KVLayout("paged", 8, 0, "auto")
    )
    assert KVLayout("paged", 8).pool_pages(4, 60) == 32
    section = sampling_section()
    section.update(kv_layout="paged", page_size=8, num_pages=16, paged_kernel="gather")
    engine, _ = configs_from_section(section)
    assert engine.layout == KVLayout("paged", 8, 16, "gather")
    section.num_pages = 3
    with pytest.raises(ConfigError, match="sampling.*num_pages"):
        configs_from_section(section)
    assert resolve_kernel("auto", "tpu") == "pallas_tpu"
    assert resolve_kernel("auto", "gpu") == "pallas_gpu"
    assert resolve_kernel("auto", "cpu") == "gather"


# ---- reads and writes against the dense cache -------------------------------------------


def paged_copy(k_bskh, v_bskh, page_size, num_pages, rng, layers=1, layer=0):
    """A paged cache holding the dense rows' positions in randomly placed pages (layer
    `layer` of a stack of `layers`), with its block table."""
    b, s, kv, h = k_bskh.shape
    n = s // page_size
    table = rng.permutation(num_pages)[: b * n].reshape(b, n).astype(np.int32)
    shape = (kv, layers, num_pages, page_size, h)
    kp, vp = (rng.normal(size=shape).astype(k_bskh.dtype) for _ in range(2))  # junk elsewhere
    for row in range(b):
        for j in range(n):
            blk = slice(j * page_size, (j + 1) * page_size)
            kp[:, layer, table[row, j]] = np.swapaxes(k_bskh[row, blk], 0, 1)
            vp[:, layer, table[row, j]] = np.swapaxes(v_bskh[row, blk], 0, 1)
    lay = None if layers == 1 else jnp.asarray(layer, jnp.int32)
    return pc.PagedKVCache(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), layer=lay)


def dense_rows(rng, dtype=np.float32, b=4, s=32, kv=2, h=16):
    return tuple(rng.normal(size=(b, s, kv, h)).astype(dtype) for _ in range(2))


@pytest.mark.parametrize("layers", [1, 3])
def test_gathered_pages_equal_the_dense_cache(layers):
    """Prefill chunks and decode queries, spans and a long lane, a stacked layer index:
    the gather reads exactly the dense slots, so attention outputs are bit-identical; a
    write lands where the dense cache puts it and drops positions without a page."""
    rng = np.random.default_rng(0)
    k, v = dense_rows(rng)
    q = jnp.asarray(rng.normal(size=(4, 3, 4, 16)), jnp.float32)
    pos = jnp.asarray([[0, 1, 2], [5, 6, 7], [20, 21, 22], [9, 10, 11]], jnp.int32)
    paged = paged_copy(k, v, 8, 20, rng, layers=layers, layer=layers - 1)
    dense = KVCache(jnp.asarray(k), jnp.asarray(v))
    none = Sharder()
    for read in (dict(), dict(span=24), dict(span=16, lane_rows_r=jnp.asarray([2]), lane_span=24)):
        want = cached_attention(q, pos, dense.replace(**read))
        kn, vn = (x[np.arange(4)[:, None], np.asarray(pos)] for x in (k, v))  # the same values
        got, _ = cache_attention(q, kn, vn, pos, paged.replace(**read), none)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    new = jnp.asarray(rng.normal(size=(4, 2, 2, 16)), jnp.float32)
    wpos = jnp.asarray([[3, 4], [31, 64], [8, 9], [64, 64]], jnp.int32)  # 64: inert, dropped
    written = pc.write_pages(paged, new, new, wpos)
    dense_w = np.asarray(dense.k_bskh).copy()
    for row, cols in enumerate(np.asarray(wpos)):
        for t, p in enumerate(cols):
            if p < 32:
                dense_w[row, p] = np.asarray(new[row, t])
    read = pc.gather_slots(written, written.k_klpzh, 32)
    np.testing.assert_array_equal(np.asarray(read), dense_w)
    other = [i for i in range(layers) if i != layers - 1]
    np.testing.assert_array_equal(written.k_klpzh[:, other], paged.k_klpzh[:, other])
    hole = paged.replace(block_table_sn=paged.block_table_sn.at[0, 0].set(-1))
    before = np.asarray(hole.k_klpzh)
    after = pc.write_pages(hole, new, new, jnp.asarray([[0, 1]] + [[64, 64]] * 3, jnp.int32))
    np.testing.assert_array_equal(np.asarray(after.k_klpzh), before)  # no page: dropped


# |kernel - dense| bounds, with the largest seen on these inputs (interpret mode, CPU,
# outputs up to 1.78). The TPU kernel reads K and V as bfloat16 whatever their dtype, so
# its float32 error is bfloat16 rounding of the inputs; the GPU kernel keeps the cache's
# dtype. A bfloat16 output near 1.78 is rounded to 2^-7 = 7.8e-3 (one ulp): 4 ulps allowed.
KERNEL_TOL = {
    ("pallas_tpu", "float32"): 2e-2,  # seen 5.1e-3 (K/V rounded to bfloat16)
    ("pallas_tpu", "bfloat16"): 3.2e-2,  # seen 7.8e-3 (1 ulp)
    ("pallas_gpu", "float32"): 1e-5,  # seen 3.9e-7
    ("pallas_gpu", "bfloat16"): 3.2e-2,  # seen 1.6e-2 (2 ulps)
}


@pytest.mark.parametrize("kernel,dtype", sorted(KERNEL_TOL))
def test_pallas_kernels_in_interpret_mode_equal_the_dense_cache(kernel, dtype):
    """JAX's paged-attention kernels (Pallas interpret mode on CPU) reading the pages in
    place give the dense cache's decode attention; rows at different lengths, a
    permuted page table, layer 1 of a stack of 2 (page ids offset into the stack)."""
    rng = np.random.default_rng(1)
    dt = jnp.dtype(dtype)
    k, v = dense_rows(rng, np.float32, b=3, h=128)
    k, v = np.asarray(k, dt), np.asarray(v, dt)
    q = jnp.asarray(rng.normal(size=(3, 1, 4, 128)), dt)
    pos = jnp.asarray([[4], [17], [31]], jnp.int32)
    want = cached_attention(q, pos, KVCache(jnp.asarray(k), jnp.asarray(v)))
    paged = paged_copy(k, v, 8, 16, rng, layers=2, layer=1).replace(kernel=kernel)
    kn, vn = (x[np.arange(3)[:, None], np.asarray(pos)] for x in (k, v))
    got, _ = jax.jit(lambda q, kn, vn, c: cache_attention(q, kn, vn, pos, c, Sharder()))(
        q, kn, vn, paged
    )
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err <= KERNEL_TOL[kernel, dtype], err
    assert got.dtype == dt


def test_pallas_kernel_per_device_on_a_mesh():
    """On 8 fake devices (slots and pages over data x expert, heads over tensor) each
    device runs the kernel on its own rows and pages (shard_map), page ids taken local."""
    mesh = build_mesh((2, 1, 2, 2))
    sharder = Sharder(mesh)
    rng = np.random.default_rng(2)
    b, z, per = 4, 8, 5  # 4 slot shards of 1 row; 5 pages each
    k, v = dense_rows(rng, b=b)
    table = np.stack([rng.permutation(per)[:4] + d * per for d in range(b)]).astype(np.int32)
    kp, vp = (np.zeros((2, 1, b * per, z, 16), np.float32) for _ in range(2))
    for row in range(b):
        for j in range(4):
            kp[:, 0, table[row, j]] = np.swapaxes(k[row, j * z : (j + 1) * z], 0, 1)
            vp[:, 0, table[row, j]] = np.swapaxes(v[row, j * z : (j + 1) * z], 0, 1)
    q = jnp.asarray(rng.normal(size=(b, 1, 4, 16)), jnp.float32)
    pos = jnp.asarray([[3], [30], [12], [25]], jnp.int32)
    want = cached_attention(q, pos, KVCache(jnp.asarray(k), jnp.asarray(v)))
    kn, vn = (x[np.arange(b)[:, None], np.asarray(pos)] for x in (k, v))
    for kernel, tol in (("gather", 0.0), ("pallas_gpu", 1e-5)):
        c = pc.PagedKVCache(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), kernel=kernel)
        got, c2 = jax.jit(lambda q, kn, vn, c: cache_attention(q, kn, vn, pos, c, sharder))(
            q, kn, vn, c
        )
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=0)
        assert c2.k_klpzh.sharding.is_equivalent_to(sharder.named(pc.PAGE_AXES, kp.shape), 5)


def test_paged_decode_lowers_for_tpu_and_cuda_from_shapes():
    """The engine's paged decode program, traced from abstract shapes (no params, no
    cache), lowers with the Mosaic (TPU) and Triton (CUDA) paged-attention kernels."""
    cfg = dataclasses.replace(MODEL, dtype="bfloat16", head_dim=128)
    mdef = ModelDef.of(lambda: Policy(cfg, rngs=nnx.Rngs(0)))
    for kernel, platform, call in (
        ("pallas_tpu", "tpu", "tpu_custom_call"),
        ("pallas_gpu", "cuda", "__gpu$xla.gpu.triton"),
    ):
        fns = GenerateFns(mdef, num_slots=4, max_len=64, layout=KVLayout("paged", 16, 16, kernel))
        with lowering_for(platform):
            traced = fns.trace_decode()
        assert call in traced.lower(lowering_platforms=(platform,)).as_text()


# ---- the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


@pytest.fixture(scope="module")
def stacked():
    cfg = dataclasses.replace(MODEL, scan_layers=True)
    return init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())


def rollouts(mdef, params, **kw):
    return engine_rollouts(mdef, params, steps_per_sync=3, **kw)


@pytest.fixture(scope="module")
def per_token_reference(model):
    """The dense cache's rollouts with per-token keys (any schedule gives these tokens)."""
    return rollouts(*model, per_token_keys=True)[0]


def assert_one_trace_per_program(eng):
    progs = eng.fns.programs
    decode = {p for p in progs if p[0] == "decode"}
    assert eng.fns.traces["decode"] == len(decode)
    assert eng.fns.traces["prefill"] == len(progs) - len(decode)


def test_paged_pool_reproduces_dense_rollouts(model):
    """A pool as large as the dense cache never waits: the same schedule, the same
    rollouts as the dense cache, with the default per-call sampling keys, span buckets
    and a long lane (gathered from the pages)."""
    spans = dict(span_buckets=(32,), lane_slots=1)
    ref, _ = rollouts(*model, **spans)
    got, eng = rollouts(*model, kv_layout="paged", page_size=8, **spans)
    assert_same_rollouts(ref, got)
    stats = eng.stats()
    assert stats["admission_waits"] == 0 and stats["pages_in_use"] == 0  # all given back
    assert 0 < stats["pages_peak"] <= 4 * L_MAX // 8
    decode = {p for p in eng.fns.programs if p[0] == "decode"}
    assert any(p[2] is not None for p in decode) and any(p[1] < L_MAX for p in decode)
    assert_one_trace_per_program(eng)


@pytest.mark.parametrize("layout", ["per_layer", "stacked"])
def test_full_pool_waits_and_preempts_without_changing_rollouts(
    model, stacked, per_token_reference, layout
):
    """Ten pages of 8 positions for 4 slots of up to 64: slots wait for pages and young
    slots are preempted (their cache recomputed later), nothing is dropped, and with
    per-token keys every token, routing record and log-prob (2e-6) is the dense cache's
    (per-layer dense cache; the stacked layout's equals it, tests/test_stacked_decode.py)."""
    mdef, params = model if layout == "per_layer" else stacked
    got, eng = rollouts(
        mdef, params, per_token_keys=True, kv_layout="paged", page_size=8, num_pages=10
    )
    assert_same_rollouts(per_token_reference, got)
    stats = eng.stats()
    assert stats["admission_waits"] > 0 and stats["preemptions"] > 0, stats
    assert stats["pages_peak"] == 10 and stats["pages_in_use"] == 0
    assert_one_trace_per_program(eng)


class Listed:
    """A list of prompts as the checkpointable iterator the rollout sources read."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return self.items[self.i - 1]

    def get_state(self):
        return self.i

    def set_state(self, i):
        self.i = i


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rollout_sources_report_admission_counters(model, mode):
    """The async sampler's workers and the sync rollouts' takes run paged engines; their
    stats (hence the sampler/* metrics) carry the admission counters, summed."""
    mdef, params = model
    engine = EngineConfig(num_slots=4, max_len=L_MAX, max_turn_tokens=8, steps_per_sync=3,
                          kv_layout="paged", page_size=8, num_pages=10)  # fmt: skip
    args = (mdef, FakeTokenizer(), TurnEnv, Listed(prompts(12, seed=1, turns=3)))
    if mode == "async":
        source = AsyncSampler(*args, engine=engine).start()
    else:
        source = SyncRollouts(*args, engine)
    try:
        source.publish(params, 0)
        assert len(source.take(6, timeout=300)) == 6
        assert len(source.take(6, timeout=300)) == 6
        stats = source.stats()
    finally:
        source.stop()
    assert stats["admission_waits"] > 0 and stats["pages_peak"] == 10, stats
    assert "preemptions" in stats
