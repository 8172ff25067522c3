"""Scanned prefill/decode of the stacked layout (`model.scan_layers=True`) against per layer.

With stacked parameters the KV cache is stacked per run too (one KVCache of [L_run, B, S,
K, H] per stack) and the cache path scans each stack. From one seed, prefill and several
decode steps must give the per-layer layout's greedy tokens, routing records (also with
forced experts: routing replay) and cache contents, logits within float32 tolerance;
whole engine rollouts (refills, observation chunks, top-k/top-p sampling, span buckets
and the long lane) must match; and the lowered decode step must not grow with depth.
The model mixes a dense layer and MoE layers, so a stack of one layer is covered.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.attention import KVCache
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models, policy_def
from sao_jax.models.layer_stack import layer_runs
from sao_jax.parallel.mesh import Sharder
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.generate import GenerateFns, SamplingParams
from tests.sampling_support import FakeTokenizer, TurnEnv, prompts

# Dense layer 0, then a run of two MoE layers: two stacks, [1, ...] and [2, ...] (three
# layers: the per-layer programs unroll them, so their compile time grows with the depth).
MODEL = dict(
    vocab_size=32, hidden_size=32, num_hidden_layers=3, head_dim=8, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
    num_experts_per_tok=2, mlp_only_layers=(0,),
)  # fmt: skip
CFG = ModelConfig(**MODEL)
STACKED = dataclasses.replace(CFG, scan_layers=True)
S, L_MAX = 4, 24


@functools.cache
def _models(cfg):
    return init_models(cfg, Sharder(), seed=0)


def _per_layer_cache(cfg, cache) -> list[KVCache]:
    """A stacked cache (one KVCache per stack) as one KVCache per layer."""
    out = []
    for c, (a, b) in zip(cache, layer_runs(cfg), strict=True):
        assert c.k_bskh.shape[0] == b - a
        out += [KVCache(c.k_bskh[j], c.v_bskh[j]) for j in range(b - a)]
    return out


def test_cache_layout():
    per_c, st_c = (
        GenerateFns(_models(c).policy_def, num_slots=S, max_len=L_MAX).init_cache(_models(c).policy)
        for c in (CFG, STACKED)
    )
    assert [c.k_bskh.shape for c in per_c] == [(S, L_MAX, 2, 8)] * 3  # one per layer
    assert [c.k_bskh.shape for c in st_c] == [(1, S, L_MAX, 2, 8), (2, S, L_MAX, 2, 8)]


@functools.cache
def _rollout(cfg, replay: bool = False):
    """Prefill 5 tokens, then 2 x 3 greedy decode steps over the whole cache; `replay`:
    prefill with forced experts (the per-layer run's, shifted). Span buckets and the long
    lane: test_engine_rollouts_equal_per_layer."""
    m = _models(cfg)
    fns = GenerateFns(
        m.policy_def, num_slots=S, max_len=L_MAX, steps=3, record_routing=True, return_logits=True
    )
    forced = None
    if replay:
        forced = (_rollout(CFG)[0].experts_btlk + 1) % CFG.num_experts  # still distinct
    tokens = jax.random.randint(jax.random.key(3), (S, 5), 0, CFG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(5), (S, 5))
    prefill = jax.jit(
        lambda p, c, f: m.policy_def.bind(p)(
            tokens, positions, jnp.ones_like(tokens), cache=c, forced_experts_btlk=f
        )
    )
    out = prefill(m.policy, fns.init_cache(m.policy), forced)
    cache, decoded = out.cache, []
    last, pos = out.out[:, -1].argmax(-1), positions[:, -1] + 1
    for i in range(2):
        cache, dec = fns.decode(
            m.policy, cache, last, pos, jax.random.key(i), SamplingParams(0.0), None
        )
        decoded.append(dec)
        last, pos = dec.tokens_ns[-1], pos + 3
    return out, decoded, cache


def test_prefill_and_decode_equal_per_layer():
    want_out, want, want_cache = _rollout(CFG)
    got_out, got, got_cache = _rollout(STACKED)
    np.testing.assert_allclose(got_out.out, want_out.out, atol=1e-5)  # prefill logits
    np.testing.assert_array_equal(got_out.experts_btlk, want_out.experts_btlk)
    assert want_out.experts_btlk.shape == (S, 5, 2, 2)  # every MoE layer recorded
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.tokens_ns, w.tokens_ns)
        np.testing.assert_array_equal(g.experts_nslk, w.experts_nslk)
        np.testing.assert_allclose(g.logits_nsv, w.logits_nsv, atol=1e-5)
        np.testing.assert_allclose(g.rollout_logp_ns, w.rollout_logp_ns, atol=1e-5)
    assert len(set(np.asarray(want[0].tokens_ns).ravel().tolist())) > 1  # not one token
    assert len(got_cache) == 2 and got_cache[1].lane_rows_r is None and got_cache[1].span is None
    for g, w in zip(_per_layer_cache(STACKED, got_cache), want_cache, strict=True):
        np.testing.assert_allclose(g.k_bskh, w.k_bskh, atol=1e-5)
        np.testing.assert_allclose(g.v_bskh, w.v_bskh, atol=1e-5)
    assert np.abs(np.asarray(want_cache[2].k_bskh[:, :11])).min() > 0  # 11 positions written


def test_forced_experts_through_the_cache_path():
    """Routing replay during prefill: the forced experts are used and recorded, per layer and
    stacked alike, and they change the output (the mechanism fires)."""
    free = _rollout(CFG)[0]
    want, got = _rollout(CFG, replay=True)[0], _rollout(STACKED, replay=True)[0]
    forced = (free.experts_btlk + 1) % CFG.num_experts
    np.testing.assert_array_equal(want.experts_btlk, forced)
    np.testing.assert_array_equal(got.experts_btlk, forced)
    np.testing.assert_allclose(got.out, want.out, atol=1e-5)
    assert not np.allclose(want.out, free.out, atol=1e-3)


def _engine_run(cfg):
    m = _models(cfg)
    ecfg = EngineConfig(
        num_slots=S, max_len=64, max_turn_tokens=10, record_routing=True, top_k=20, top_p=0.9,
        steps_per_sync=3, span_buckets=(8, 32), lane_slots=1,
    )  # fmt: skip
    eng = Engine.create(m.policy_def, FakeTokenizer(), TurnEnv, ecfg, seed=3)
    trajs, drops = eng.run(m.policy, prompts(6, seed=1, turns=3), version=2)
    assert not drops and len(trajs) == 6
    return sorted(trajs, key=lambda t: t.prompt_uid), eng


def test_engine_rollouts_equal_per_layer():
    """Continuous batching, observation appends, spans and the long lane, both layouts."""
    (ref, _), (got, eng) = _engine_run(CFG), _engine_run(STACKED)
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.action_mask, a.action_mask)
        np.testing.assert_array_equal(b.experts, a.experts)
        np.testing.assert_allclose(b.rollout_logp, a.rollout_logp, atol=1e-5, rtol=0)
        np.testing.assert_allclose(b.sampled_logp, a.sampled_logp, atol=1e-5, rtol=0)
        assert b.terminated == a.terminated and b.outcome == a.outcome
    assert any(p[0] == "decode" and p[2] is not None for p in eng.fns.programs), "lane used"


def _decode_ops(layers: int) -> int:
    """Stablehlo ops of the lowered decode step (stacked layout, from shapes only)."""
    cfg = dataclasses.replace(STACKED, num_hidden_layers=layers)
    mdef = policy_def(cfg, Sharder())
    fns = GenerateFns(mdef, num_slots=S, max_len=L_MAX, steps=2, record_routing=True)
    params = mdef.shapes()
    cache = jax.eval_shape(lambda: mdef.bind(params).trunk.init_cache(S, L_MAX))
    i32 = jax.ShapeDtypeStruct((S,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (params, cache, i32, i32, key, *SamplingParams().arrays(), None)
    text = fns._decode.lower(*args, span=16, lane_span=None).as_text()
    return sum(1 for line in text.splitlines() if " = " in line and "stablehlo." in line)


def test_decode_program_does_not_grow_with_depth():
    assert _decode_ops(3) == _decode_ops(7)
