"""The tiled grouped expert matmul: values and gradients against `dense`,
`ragged` and the slow reference, balanced to one-expert routings, padding masks, expert
parallelism, no retraces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.moe import grouped
from sao_jax.models.moe.dispatch import moe_dispatch, resolve_impl
from sao_jax.models.moe.experts import reference_moe
from sao_jax.models.moe.router import route
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import init_params

N, D, F, E, K = 48, 16, 8, 8, 2
MESHES = [(2, 2, 2, 1), (1, 1, 8, 1), (1, 2, 2, 2), (2, 1, 2, 2)]


def _inputs(seed=0, skew=0.0):
    kx, kr, kg, ku, kd = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(kx, (N, D))
    logits = jax.random.normal(kr, (N, E)).at[:, 0].add(skew)  # skew: expert 0 overfull
    w = [
        jax.random.normal(kk, s) / np.sqrt(s[1])
        for kk, s in ((kg, (E, D, F)), (ku, (E, D, F)), (kd, (E, F, D)))
    ]
    return x, logits, w


def _loss(impl, sharder, forced, mask, x, logits, *w):
    """A scalar of the MoE output whose gradient reaches x, the router and the experts."""
    r = route(logits, K, norm_topk=False, forced_experts_nk=forced)
    if impl == "reference":
        keep = jnp.ones((N,), bool) if mask is None else mask
        w_nk = jnp.where(keep[:, None], r.weights_nk, 0.0)
        y = reference_moe(x, r.experts_nk, w_nk, *w)
    else:
        y = moe_dispatch(x, r.experts_nk, r.weights_nk, *w, sharder, impl, mask)
    return jnp.sum(jnp.tanh(y) * jnp.linspace(-1.0, 2.0, D)), y


def _value_and_grads(impl, sharder, x, logits, w, forced=None, mask=None):
    fn = jax.value_and_grad(
        lambda *a: _loss(impl, sharder, forced, mask, *a), argnums=(0, 1, 2, 3, 4), has_aux=True
    )
    return jax.jit(fn)(x, logits, *w)


def _assert_tree_close(got, want, what):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=what)


def _tiles(experts_nk):
    """Tiles the grouped path runs for this routing (sum_e ceil(group_e / R)), and R."""
    sizes = np.bincount(np.asarray(experts_nk).reshape(-1), minlength=E)
    rows = grouped.tile_rows(N, K, E)
    return int(np.sum(-(-sizes // rows))), rows


BALANCED = jnp.stack([jnp.arange(N) % E, (jnp.arange(N) + 1) % E], axis=1)  # N k / E each


@pytest.mark.parametrize(
    "skew, forced",
    [(0.0, BALANCED), (1.5, None), (100.0, None)],
    ids=["balanced", "skewed", "one_expert"],
)
def test_values_and_gradients_equal_dense_ragged_reference(skew, forced):
    x, logits, w = _inputs(skew=skew)
    experts = route(logits, K, norm_topk=False, forced_experts_nk=forced).experts_nk
    tiles, rows = _tiles(experts)
    assert N * K <= tiles * rows < N * K + E * rows  # under one tile of padding per expert
    if forced is not None:
        assert tiles == E * 2  # groups of 12, tiles of 8
    else:
        assert np.bincount(np.asarray(experts).reshape(-1)).max() > N * K // E + rows  # skewed
    want = _value_and_grads("reference", Sharder(), x, logits, w, forced)
    for impl in ("grouped", "dense", "ragged"):
        got = _value_and_grads(impl, Sharder(), x, logits, w, forced)
        _assert_tree_close(got, want, impl)


def test_padding_tokens_go_to_no_expert():
    x, logits, w = _inputs(seed=3, skew=0.5)
    mask = jnp.arange(N) % 3 != 0  # a third of the tokens are padding
    want = _value_and_grads("reference", Sharder(), x, logits, w, mask=mask)
    for impl in ("grouped", "dense", "ragged"):
        (loss, y), grads = _value_and_grads(impl, Sharder(), x, logits, w, mask=mask)
        _assert_tree_close(((loss, y), grads), want, impl)
        assert np.all(np.asarray(y)[~np.asarray(mask)] == 0)
        assert np.all(np.asarray(grads[0])[~np.asarray(mask)] == 0)  # no gradient to pads


def test_repeated_forced_experts_are_merged_not_dropped():
    x, logits, w = _inputs(seed=1)
    forced = jnp.stack([jnp.arange(N) % E, jnp.arange(N) % E], axis=1)  # both slots alike
    want = _value_and_grads("reference", Sharder(), x, logits, w, forced)
    got = _value_and_grads("grouped", Sharder(), x, logits, w, forced)
    _assert_tree_close(got, want, "repeated experts")


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_expert_parallel_equals_unsharded(shape):
    # dense and ragged under expert parallelism: tests/test_model.py (same meshes).
    x, logits, w = _inputs(seed=2, skew=1.0)
    want = _value_and_grads("reference", Sharder(), x, logits, w)
    got = _value_and_grads("grouped", Sharder(build_mesh(shape)), x, logits, w)
    _assert_tree_close(got, want, f"grouped on {shape}")


def test_tile_height():
    for n, k, e in ((48, 2, 8), (2048, 2, 16), (7, 3, 4), (8192, 8, 128)):
        rows = grouped.tile_rows(n, k, e)
        assert rows % 8 == 0 and rows >= n * k / e / grouped.TILES_PER_BALANCED_GROUP
        assert rows < n * k / e / grouped.TILES_PER_BALANCED_GROUP + 8 or rows == 8


def test_one_compile_whatever_the_routing():
    x, _, w = _inputs()
    traces = []

    @jax.jit
    def fn(x, experts, weights, *w):
        traces.append(1)
        return grouped.grouped_local_moe(x, experts, weights, *w, 0)

    for skew in (0.0, 1.5, 100.0):
        r = route(_inputs(skew=skew)[1], K, norm_topk=False)
        fn(x, r.experts_nk, r.weights_nk, *w)
    assert len(traces) == 1


def test_padding_overhead_report():
    r = route(_inputs(skew=100.0)[1], K, norm_topk=False)
    report = grouped.padding_overhead(r.experts_nk, E)
    tiles, rows = _tiles(r.experts_nk)
    assert report["tiles"] == tiles and report["rows"] == rows == 8
    assert report["executed_over_useful"] == tiles * rows / (N * K)
    assert report["largest_over_balanced"] == pytest.approx(E / K)  # expert 0 takes all N
    half = grouped.padding_overhead(BALANCED, E, token_mask_n=jnp.arange(N) < N // 2)
    assert half["largest_over_balanced"] == 1.0  # N / 2 tokens, k = 2, spread evenly
    assert half["tiles"] == E and half["executed_over_useful"] == 8 / 6  # groups of 6


def test_auto_resolves_by_backend_and_rejects_unknown():
    assert resolve_impl("auto", "cpu") == "grouped"
    assert resolve_impl("auto", "gpu") == resolve_impl("auto", "tpu") == "ragged"
    assert resolve_impl("dense") == "dense"
    with pytest.raises(ValueError, match="moe impl"):
        resolve_impl("capacity")


def test_policy_logits_and_gradients_match_dense():
    cfg = dict(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=8,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,),
    )  # fmt: skip
    tokens = jax.random.randint(jax.random.key(5), (4, 12), 0, 32)
    out = {}
    for impl in ("grouped", "dense"):
        model_cfg = ModelConfig(**cfg, moe_impl=impl)
        mdef, params = init_params(lambda c=model_cfg: Policy(c, rngs=nnx.Rngs(0)), Sharder())
        loss = lambda p, mdef=mdef: jnp.mean(jnp.square(mdef.bind(p)(tokens).out))
        out[impl] = jax.jit(jax.value_and_grad(loss))(params)
    _assert_tree_close(out["grouped"], out["dense"], "policy")
