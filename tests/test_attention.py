"""Training attention kernels against the naive reference: values and gradients.

The naive form (`grouped_attention` + `attention_mask`) materialises the scores; the
blockwise kernel and the cuDNN call (through XLA here) must give the same outputs on every
query that sees a key, and the same gradients, with packed segments, padding and GQA.
Pallas splash (interpret mode, its TPU lowering): tests/test_pallas_interpret.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import attention_backends as backends
from sao_jax.models.attention import (
    Attention,
    training_attention,
)
from sao_jax.models.attention_kernels import blockwise_attention, visible_blocks
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.schema import ConfigError
from tests.attention_support import B, H, K, N, T, layout_of, naive, qkv, value_and_grads


def _assert_same(fn, layout, atol=2e-5, **kw):
    pos, seg = layout_of(layout)
    q, k, v, ct = qkv(**kw)
    want, want_g = value_and_grads(naive, q, k, v, pos, seg, ct)
    got, got_g = value_and_grads(fn, q, k, v, pos, seg, ct)
    real = (seg != 0)[:, :, None, None]
    np.testing.assert_allclose(jnp.where(real, got, 0), jnp.where(real, want, 0), atol=atol)
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, atol=atol, err_msg=f"d{name}")


@pytest.mark.parametrize("layout", ["padded", "packed", "unordered"])
@pytest.mark.parametrize("block", [8, 16])  # 16 does not divide T = 40: padded blocks
def test_blockwise_equals_naive(layout, block):
    fn = lambda q, k, v, p, s: blockwise_attention(q, k, v, p, p, s, s, block=block)
    _assert_same(jax.jit(fn), layout)


def test_blockwise_padding_query_gets_zero():
    pos, seg = layout_of("padded")
    q, k, v, _ = qkv()
    out = blockwise_attention(q, k, v, pos, pos, seg, seg, block=8)
    np.testing.assert_array_equal(out[0, T - 5 :], 0.0)


def test_masked_blocks_are_skipped():
    """Causal and segment structure both remove blocks (the skip fires, and exactly)."""
    t, blk = 64, 8
    pos = jnp.broadcast_to(jnp.arange(t), (1, t))
    one = jnp.ones((1, t), jnp.int32)
    vis = np.asarray(visible_blocks(pos, pos, one, one, blk, blk))
    np.testing.assert_array_equal(vis, np.tril(np.ones((8, 8), bool)))  # causal: 36 of 64
    # Two packed trajectories of 32 tokens: query blocks of the second skip the first's keys.
    seg = jnp.asarray([[1] * 32 + [2] * 32])
    pos2 = jnp.asarray([list(range(32)) * 2])
    vis = np.asarray(visible_blocks(pos2, pos2, seg, seg, blk, blk))
    want = np.zeros((8, 8), bool)
    want[:4, :4] = want[4:, 4:] = np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(vis, want)  # 20 of 64 blocks computed


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
def test_attention_layer_equals_naive_with_qk_norm(impl):
    """The whole layer (projections, q/k RMSNorm, RoPE, GQA): values and parameter grads,
    with the kernel a config selects (splash: Pallas interpret mode on CPU)."""
    pos, seg = layout_of("packed")
    x = jax.random.normal(jax.random.key(5), (B, T, 32))

    def make(impl):
        return Attention(
            dim=32,
            num_heads=N,
            num_kv_heads=K,
            head_dim=H,
            rope_theta=10000.0,
            eps=1e-6,
            init_std=0.3,
            param_dtype=jnp.float32,
            sharder=Sharder(),
            rngs=nnx.Rngs(0),
            impl=impl,
            block=8,
        )

    def run(impl):
        graphdef, params = nnx.split(make(impl))
        # Give the q/k norms non-trivial scales so their gradients are exercised.
        params["q_norm"]["scale"][...] = jnp.linspace(0.5, 1.5, H)
        params["k_norm"]["scale"][...] = jnp.linspace(1.5, 0.5, H)
        real = (seg != 0)[:, :, None]

        def loss(p):
            y, _ = nnx.merge(graphdef, p)(x, pos, seg)
            return jnp.sum(jnp.where(real, y, 0.0) ** 2)

        return jax.jit(jax.value_and_grad(loss))(params)

    (lb, gb), (ln, gn) = run(impl), run("naive")
    np.testing.assert_allclose(lb, ln, rtol=1e-5)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(gb), jax.tree_util.tree_leaves_with_path(gn)
    ):
        # Gradients reach |g| ~ 1e2 here: an element near 0 carries float32 rounding of
        # that size (4e-5 on one AMD EPYC box), so the absolute tolerance follows the scale.
        atol = 2e-5 + 1e-6 * float(np.max(np.abs(b)))
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-4, err_msg=str(path))


@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (1, 2, 2, 2), (1, 1, 1, 8)])
def test_blockwise_sharded_equals_unsharded(shape):
    """Under shard_map on 8 fake devices (rows and heads split, or heads replicated)."""
    pos, seg = layout_of("packed")
    q, k, v, ct = qkv()
    ct = ct * (seg != 0)[:, :, None, None]

    def run(sharder):
        def loss(q, k, v):
            out = training_attention(q, k, v, pos, seg, impl="blockwise", block=8, sharder=sharder)
            return jnp.sum(out * ct)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    want, got = run(Sharder()), run(Sharder(build_mesh(shape)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-5)


def test_dispatch_picks_backend_kernels():
    r = backends.resolve_impl
    assert r("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert r("auto", jnp.float32, "gpu") == "blockwise"  # cuDNN has no fp32 flash kernel
    assert r("auto", jnp.bfloat16, "tpu") == "splash"
    assert r("auto", jnp.float32, "cpu", length=1024, block=512) == "blockwise"
    assert r("auto", jnp.float32, "gpu", length=512, block=512) == "naive"  # one block
    # CPU: small blocks (measured fastest), naive only when T fits one of them.
    assert backends.resolve("auto", jnp.float32, "cpu", length=96, block=512) == ("blockwise", 32)
    assert backends.resolve("auto", jnp.float32, "cpu", length=96, block=16) == ("blockwise", 16)
    assert backends.resolve("auto", jnp.float32, "cpu", length=32, block=512) == ("naive", 32)
    assert backends.resolve("blockwise", jnp.float32, "cpu", block=512) == ("blockwise", 512)
    assert backends.resolve("auto", jnp.bfloat16, "tpu", block=512) == ("splash", 512)
    assert r("auto", jnp.bfloat16, "tpu", length=64, block=512) == "splash"
    assert r("naive", jnp.float32, "tpu") == "naive"
    with pytest.raises(ConfigError, match="model.attention_impl"):
        r("flash3", jnp.float32, "cpu")
    q, k, v, _ = qkv()
    pos, seg = layout_of("padded")
    with pytest.raises(ConfigError, match="'cudnn' needs model.dtype bfloat16"):
        backends.cudnn_attention(q, k, v, pos, seg, block=8)


def test_layout_predicates():
    assert bool(backends.prefix_rows(*layout_of("padded")))
    assert not bool(backends.prefix_rows(*layout_of("packed")))
    assert bool(backends.ordered_segments(*layout_of("packed")))
    assert not bool(backends.ordered_segments(*layout_of("unordered")))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cudnn_call_equals_naive(layout):
    """The cuDNN call's arguments (causal, row lengths, GQA) run through XLA on CPU; a
    packed batch takes the blockwise fallback. Same values and gradients as naive."""
    fn = lambda q, k, v, p, s: backends.cudnn_attention(
        q, k, v, p, s, block=8, implementation="xla"
    )
    _assert_same(jax.jit(fn), layout)
