"""Prefill over the writing slots only (`GenerateFns.prefill_rows`, `Engine.row_prefill`):
the engine the gateway drives (sao_jax/sampling/backend_native.py) admits a few prompts
while the other slots decode, and each admission then costs its own rows, not all S.

Checked against the [S, C] prefill the in-process sampler runs: the rows written hold the
same keys and values and the other rows are untouched (a stacked dense cache, gathered
on its slot axis behind the layer axis, and a paged pool, written through the block
table's rows), and an engine with `row_prefill` (dense cache) yields the same rollouts
(tokens, routing, versions exactly; log-probs within float32 summation order) on the
multi-turn env, whose observations are prefilled while other slots decode. The gateway
tests (tests/test_serve_backend.py: log-probs equal a teacher-forced pass) run the
path through NativeBackend."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.engine import Engine, EngineConfig, generate_fns, row_groups
from sao_jax.sampling.generate import GenerateFns, Spans, inert_rows
from sao_jax.sampling.page_pool import KVLayout
from tests.sampling_support import (
    MODEL,
    FakeTokenizer,
    TurnEnv,
    assert_same_rollouts,
    prompts,
)

S, L = 4, 64


def test_row_groups_are_the_binary_digits_of_the_count():
    assert row_groups([]) == []
    assert row_groups([5]) == [[5]]
    assert row_groups([0, 2, 3, 7, 9, 11, 12]) == [[0, 2, 3, 7], [9, 11], [12]]
    for n in range(1, 34):
        rows = list(range(100, 100 + n))
        groups = row_groups(rows)
        sizes = [len(g) for g in groups]
        assert [r for g in groups for r in g] == rows
        assert sizes == sorted(set(sizes), reverse=True)  # distinct, largest first
        assert all(k & (k - 1) == 0 for k in sizes) and len(sizes) == bin(n).count("1")


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


def _chunk(rows, width, start):
    """Tokens and positions [S, C]: rows `rows` write `width` tokens from `start`."""
    tokens, positions = inert_rows(S, width, L)
    rng = np.random.default_rng(len(rows))
    for s in rows:
        tokens[s] = rng.integers(4, MODEL.vocab_size, width)
        positions[s] = np.arange(start, start + width)
    return tokens, positions


def _leaves(cache):
    return [np.asarray(x) for x in jax.tree.leaves(cache)]


@pytest.mark.parametrize("variant", ["stacked", "paged"])
def test_prefill_rows_writes_what_the_full_prefill_writes(variant):
    cfg = dataclasses.replace(MODEL, scan_layers=variant == "stacked")
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    layout = KVLayout("paged", page_size=8) if variant == "paged" else None
    fns = GenerateFns(mdef, num_slots=S, max_len=L, record_routing=True, layout=layout)
    table = np.arange(S * L // 8, dtype=np.int32).reshape(S, L // 8) if layout else None
    # every slot holds 8 tokens; then slots 1 and 3 take 8 more
    full, _ = fns.prefill(params, fns.init_cache(), *_chunk(range(S), 8, 0), block_table=table)
    before = _leaves(full)
    tokens, positions = _chunk([1, 3], 8, 8)
    ref_cache, ref_experts = fns.prefill(
        params, jax.tree.map(lambda x: x.copy(), full), tokens, positions, block_table=table
    )
    rows = np.array([1, 3])
    got_cache, got_experts = fns.prefill_rows(
        params, full, rows, tokens[rows], positions[rows], block_table=table
    )
    assert fns.traces["prefill_rows"] == 1
    np.testing.assert_allclose(np.asarray(got_experts), np.asarray(ref_experts)[rows])
    for ref, got, old in zip(_leaves(ref_cache), _leaves(got_cache), before, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-6, rtol=1e-6)
        if variant != "paged":  # untouched rows stay bit for bit (paged: their pages)
            axis = ref.ndim - 4
            untouched = np.take(got, [0, 2], axis=axis)
            np.testing.assert_array_equal(untouched, np.take(old, [0, 2], axis=axis))
    with pytest.raises(ValueError, match="spans.span"):
        fns.prefill_rows(params, got_cache, rows, tokens[rows], positions[rows], Spans(0),
                         block_table=table)  # fmt: skip


def test_engine_with_row_prefill_makes_the_same_rollouts(model):
    """Two engines on one GenerateFns (one compilation of the shared programs)."""
    mdef, params = model
    cfg = EngineConfig(num_slots=S, max_len=L, max_turn_tokens=10, steps_per_sync=3,
                       record_routing=True, top_k=20, top_p=0.9,
                       prefill_buckets=(16, L))  # fewer programs to compile  # fmt: skip
    fns = generate_fns(mdef, cfg)
    out = {}
    for row_prefill in (False, True):
        eng = Engine(fns, FakeTokenizer(), TurnEnv, cfg, seed=3)
        eng.row_prefill = row_prefill
        trajs, drops = eng.run(params, prompts(9, seed=1, turns=3), version=2)
        assert not drops
        out[row_prefill] = sorted(trajs, key=lambda t: t.prompt_uid)
    assert fns.traces["prefill_rows"] >= 1  # observations came while others decoded
    assert_same_rollouts(out[False], out[True])
