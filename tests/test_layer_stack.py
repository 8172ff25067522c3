"""Decoder layers under scan (stacked layout) and remat: same values and gradients as the
plain layer loop, routing replay kept, and the compiled program does not grow with the
number of layers."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.layer_stack import runs, stack_params
from sao_jax.models.transformer import Critic, Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import ModelDef, init_params
from sao_jax.schema import ConfigError

# Dense layer 0, then two MoE layers, then a dense one: three runs (four layers: the
# per-layer programs unroll them, so their compile time grows with the depth).
CFG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=(0, 3),
    attention_block=8,
)


def test_runs_split_by_kind():
    assert runs([False, True, True, True, False]) == [(0, 1), (1, 4), (4, 5)]
    assert runs([True] * 48) == [(0, 48)]
    assert runs([]) == []


def _batch(b=4, t=12):
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, CFG.vocab_size)
    seg = jnp.ones((b, t), jnp.int32).at[1, 9:].set(0)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return tokens, pos, seg


def _loss_and_grads(cfg, params, model_cls=Policy):
    mdef = ModelDef.of(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    tokens, pos, seg = _batch()

    def loss(p):
        out = mdef.bind(p)(tokens, pos, seg)
        real = (seg != 0)[..., None] if out.out.ndim == 3 else seg != 0
        loss = jnp.sum(jnp.where(real, out.out, 0.0) ** 2) + out.aux_loss
        return loss, (out.experts_btlk, out.out)

    (value, (experts, out)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return (value, experts), grads, out


@functools.cache
def _reference(model_cls):
    """The layer loop without remat (computed once per model class): (params, ((loss,
    experts), grads), forward output), the output from the same program as the gradients."""
    _, params = init_params(lambda: model_cls(REF_CFG, rngs=nnx.Rngs(0)), Sharder())
    (value, experts), grads, out = _loss_and_grads(REF_CFG, params, model_cls)
    return params, ((value, experts), grads), out


REF_CFG = dataclasses.replace(CFG, scan_layers=False, remat="none")


@pytest.mark.parametrize(
    "model_cls,scan,remat",
    [
        (Policy, True, "full"),
        (Policy, True, "dots"),
        (Policy, False, "dots"),
        (Critic, True, "none"),
    ],
    ids=["policy-scan-full", "policy-scan-dots", "policy-loop-dots", "critic-scan-none"],
)
def test_scan_and_remat_equal_layer_loop(model_cls, scan, remat):
    params, ((want, want_e), want_g), _ = _reference(model_cls)
    cfg = dataclasses.replace(CFG, scan_layers=scan, remat=remat)
    (got, got_e), got_g, _ = _loss_and_grads(
        cfg, stack_params(CFG, params) if scan else params, model_cls
    )
    if scan:  # gradients of the stacked params, mapped back to one subtree per layer
        got_g = stack_params(CFG, got_g, to_stacked=False)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(got_e, want_e)  # routing of every MoE layer, in order
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(got_g), jax.tree_util.tree_leaves_with_path(want_g)
    ):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=str(path))


@pytest.mark.parametrize("scan", [True], ids=["stacked"])
def test_replay_under_scan_and_sharded(scan):
    """Forced experts reach the right layer of the scanned run; 8 devices == 1. The layer
    loop's forced experts: tests/test_stacked_decode.py test_forced_experts_through_the_
    cache_path (shifted experts used, recorded, output changed), tests/test_model.py and
    test_packing's grpo-replay-ppo; its sharded MoE dispatch is the scanned one's."""
    cfg = dataclasses.replace(CFG, scan_layers=scan)
    _, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    tokens, pos, seg = _batch()

    def fwd(sharder):
        mdef = ModelDef.of(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(0)))
        return jax.jit(lambda p, f: mdef.bind(p)(tokens, pos, seg, forced_experts_btlk=f))

    # The free routing: the layer loop's (either layout's, test_scan_and_remat_equal_layer_loop).
    _, ((_, free_experts), _), free_out = _reference(Policy)
    # Force every token to other experts (each id + 1, mod E: the set changes, not only its
    # order, which the gate weights ignore), so a layer mix-up would show.
    forced = (free_experts + 1) % CFG.num_experts
    want = fwd(Sharder())(params, forced)
    np.testing.assert_array_equal(want.experts_btlk, forced)
    assert float(jnp.max(jnp.abs(want.out - free_out))) > 1e-3  # the replay changed the output
    sharder = Sharder(build_mesh((2, 2, 2, 1)))
    _, sparams = init_params(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(0)), sharder)
    got = fwd(sharder)(sparams, forced)
    np.testing.assert_array_equal(got.experts_btlk, forced)
    np.testing.assert_allclose(got.out, want.out, atol=1e-5)


def _dots(layers: int, scan: bool) -> int:
    """dot_general ops in the lowered (forward + backward) program of an all-MoE model."""
    cfg = dataclasses.replace(
        CFG, num_hidden_layers=layers, mlp_only_layers=(), scan_layers=scan, remat="full"
    )
    mdef = ModelDef.of(lambda: Policy(cfg, rngs=nnx.Rngs(0)))
    tokens, pos, seg = _batch()
    loss = lambda p: jnp.sum(mdef.bind(p)(tokens, pos, seg).out)
    return jax.jit(jax.grad(loss)).lower(mdef.shapes()).as_text().count("dot_general")


def test_scan_compiles_one_layer_body():
    assert _dots(2, scan=True) == _dots(6, scan=True)  # one body, whatever L
    assert _dots(3, scan=False) > _dots(2, scan=False)  # the loop unrolls (one more layer)


def test_bad_remat_names_field():
    with pytest.raises(ConfigError, match="model.remat"):
        ModelConfig(remat="everything")
    with pytest.raises(ConfigError, match="model.attention_impl"):
        ModelConfig(attention_impl="flash")
