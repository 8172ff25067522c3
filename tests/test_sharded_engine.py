"""The engine on a mesh: slots over the data axes, KV heads over tensor, experts over expert.

On 8 fake CPU devices (data=2, expert=2, tensor=2) the engine's programs run on the pool's
sharder: the cache's slot axis (dense rows, or the paged pool's pages with them) splits
over data x expert (4 slot shards), its key/value heads over tensor, and the MoE layers
dispatch over the expert axis. The rollouts equal the unsharded engine's: tokens,
routing records and versions identical, log-probs within float32 rounding (the tensor
split reorders the sums of the output projection).
"""

import dataclasses

import jax
import pytest
from flax import nnx

from sao_jax.models.factory import policy_def
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.engine import EngineConfig, generate_fns
from tests.sampling_support import MODEL, assert_same_rollouts, engine_rollouts

CFG = dataclasses.replace(MODEL, num_attention_heads=4, num_key_value_heads=2)  # K splits 2
SLOTS, L_MAX = 8, 64


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(CFG, rngs=nnx.Rngs(0)), Sharder())


@pytest.fixture(scope="module")
def pool():
    return Sharder(build_mesh((2, 1, 2, 2)))  # (data, fsdp, expert, tensor)


def run(mdef, params, sharder, **kw):
    if sharder is not None:
        params = jax.device_put(params, policy_def(CFG, sharder).shardings(sharder))
    return engine_rollouts(
        mdef, params, num_prompts=21, sharder=sharder, num_slots=SLOTS, steps_per_sync=3, **kw
    )


def cache_specs(eng, field):
    leaf = getattr(eng._cache[1], field)
    return leaf.sharding, leaf.ndim


def test_sharded_engine_equals_unsharded(model, pool):
    """Dense cache, per-call sampling keys: the same schedule on 1 and on 8 devices."""
    ref, _ = run(*model, None)
    got, eng = run(*model, pool)
    assert_same_rollouts(ref, got, atol=1e-5)
    sharding, ndim = cache_specs(eng, "k_bskh")  # [S, L, K, H]
    want = pool.named(("batch", None, "act_kv_heads", None), (SLOTS, L_MAX, 2, 16))
    assert sharding.is_equivalent_to(want, ndim)
    assert sharding.shard_shape((SLOTS, L_MAX, 2, 16)) == (2, L_MAX, 1, 16)  # 2 slots, 1 head
    assert eng.fns.shards == 4


def test_sharded_paged_pool_equals_unsharded(model, pool):
    """Paged pool of 32 pages, 8 per slot shard (one full-length slot each): each shard's
    slots wait and preempt within their own pages; with per-token keys the rollouts are
    the unsharded dense cache's."""
    ref, _ = run(*model, None, per_token_keys=True)
    got, eng = run(*model, pool, per_token_keys=True, kv_layout="paged", page_size=8,
                   num_pages=32)  # fmt: skip
    assert_same_rollouts(ref, got, atol=1e-5)
    assert eng.stats()["admission_waits"] > 0
    sharding, ndim = cache_specs(eng, "k_klpzh")  # [K, L, P, Z, H]
    assert sharding.is_equivalent_to(
        pool.named(("act_kv_heads", None, "batch", None, None), (2, 1, 32, 8, 16)), ndim
    )
    assert sharding.shard_shape((2, 1, 32, 8, 16)) == (1, 1, 8, 8, 16)  # 8 pages, 1 head
    table = eng.pool.table
    for s in range(SLOTS):  # every page of a slot lies in its own shard's range
        pages = table[s][table[s] >= 0]
        assert ((pages // 8) == s // 2).all()


def test_pool_that_cannot_split_is_refused(model, pool):
    # 6 pages per slot shard, fewer than the 8 of one full-length slot
    cfg = EngineConfig(num_slots=SLOTS, max_len=L_MAX, kv_layout="paged", page_size=8, num_pages=24)
    with pytest.raises(ValueError, match="num_pages: 24 pages over 4 shard"):
        generate_fns(model[0], cfg, pool)
