"""Decode cost proportional to context: span buckets and the long lane reproduce rollouts.

The engine reads only cache slots [0, span) (plus a long lane for the longest slots).
Against the whole-cache read (`span_buckets=(max_len,)`, what every step did before),
the same seed must give the same tokens, routing records and versions, and rollout
log-probs equal up to float32 reduction order, through refills, observation chunks,
top-k/top-p sampling and several decode steps per sync; and the spans must actually be
smaller than the cache (the mechanism fires) with one trace per program.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.defaults import sampling_section
from sao_jax.models.attention import KVCache, cached_attention
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.engine import EngineConfig
from sao_jax.sampling.generate import Spans, choose_spans, span_buckets
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.schema import ConfigError
from tests.sampling_support import MODEL, assert_same_rollouts, engine_rollouts

L_MAX = 64


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


def test_span_buckets_and_choice():
    assert span_buckets(96) == (96,)  # the demo's cache: nothing to gain below 128
    assert span_buckets(4096) == (128, 256, 512, 1024, 2048, 4096)
    assert span_buckets(300, smallest=64) == (64, 128, 256, 300)
    b = (8, 16, 32, 64)
    assert choose_spans([3, 9, 0, 5], b) == Spans(16)
    s = choose_spans([3, 40, 0, 5], b, lane_slots=1)
    assert (s.span, s.lane_span, s.lane_rows_r.tolist()) == (8, 64, [1])
    s = choose_spans([30, 40, 0, 5], b, lane_slots=2)
    assert (s.span, s.lane_span, sorted(s.lane_rows_r.tolist())) == (8, 64, [0, 1])
    assert choose_spans([60, 40, 0, 5], b, lane_slots=1) == Spans(64)  # the rest need 64 too
    with pytest.raises(ValueError, match="lane_slots"):
        EngineConfig(num_slots=4, lane_slots=4)
    with pytest.raises(ValueError, match="span_buckets"):
        EngineConfig(span_buckets=(32, 16))
    assert EngineConfig(max_len=96).spans == (96,)
    assert EngineConfig(max_len=1024).spans == (128, 256, 512, 1024)
    assert EngineConfig(max_len=96, span_buckets=(16, 200)).spans == (16, 96)
    section = sampling_section()
    section.update(max_len=96, span_buckets=[16, 32], lane_slots=1)
    engine, _ = configs_from_section(section)
    assert engine.spans == (16, 32, 96) and engine.lane_slots == 1
    section.lane_slots = 9
    with pytest.raises(ConfigError, match="sampling.*lane_slots"):
        configs_from_section(section)


def test_cached_attention_over_spans_equals_whole_cache():
    rng = np.random.default_rng(0)
    b, s, kv, g, h = 4, 32, 2, 2, 8
    k, v = (jnp.asarray(rng.normal(size=(b, s, kv, h)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(b, 3, kv * g, h)), jnp.float32)
    pos = jnp.asarray([[0, 1, 2], [5, 6, 7], [20, 21, 22], [9, 10, 11]], jnp.int32)
    full = cached_attention(q, pos, KVCache(k, v))
    lane = KVCache(k, v, lane_rows_r=jnp.asarray([2], jnp.int32), span=12, lane_span=24)
    np.testing.assert_allclose(cached_attention(q, pos, lane), full, atol=1e-6)
    short = np.asarray(cached_attention(q, pos, KVCache(k, v, span=12)))  # row 2 needs 23
    full = np.asarray(full)
    np.testing.assert_allclose(short[[0, 1, 3]], full[[0, 1, 3]], atol=1e-6)
    assert not np.allclose(short[2], full[2])


@pytest.mark.parametrize("steps", [1, 3])
def test_spans_and_lane_reproduce_whole_cache_rollouts(model, steps):
    mdef, params = model
    ref, _ = engine_rollouts(mdef, params, steps_per_sync=steps, span_buckets=(L_MAX,))
    got, eng = engine_rollouts(
        mdef, params, steps_per_sync=steps, span_buckets=(8, 16, 32), lane_slots=1
    )
    # Same terms, different float32 summation split: equal to rounding (2e-6).
    assert_same_rollouts(ref, got)
    progs = eng.fns.programs
    decode = {p for p in progs if p[0] == "decode"}
    assert any(p[1] < L_MAX for p in decode), "some decode step read less than the cache"
    assert any(p[2] is not None for p in decode), "the long lane was used"
    assert any(p[0] == "prefill" and p[2] < L_MAX for p in progs)
    assert eng.fns.traces["decode"] == len(decode), "one trace per (span, lane) program"
    assert eng.fns.traces["prefill"] == len(progs) - len(decode)
