"""The heads-major naive attention against its literal form: values and gradients.

`grouped_attention` moves q, k, v to heads-major layouts before its products (faster on
XLA:CPU); `grouped_attention_literal` is the same formula written in the input layout,
the slow reference here. They must agree to fp32 rounding with packed segments, padding,
GQA / MQA / MHA, the whole layer (q/k RMSNorm, RoPE), and cached decoding.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.attention import (
    NAIVE_IMPLS,
    Attention,
    KVCache,
    attention_mask,
    cached_attention,
    grouped_attention,
    grouped_attention_literal,
    init_cache,
    training_attention,
)
from sao_jax.parallel.mesh import Sharder

B, T, H = 2, 24, 8


@contextlib.contextmanager
def literal_naive():
    """The 'naive' impl computed by the literal form while functions are traced inside."""
    saved, NAIVE_IMPLS["naive"] = NAIVE_IMPLS["naive"], grouped_attention_literal
    try:
        yield
    finally:
        NAIVE_IMPLS["naive"] = saved


def _packed():
    """positions, segment ids [B, T]: row 0 three trajectories, row 1 two then padding."""
    runs = [(1, 7), (2, 11), (3, 6)], [(4, 15), (9, 5)]
    seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b, row in enumerate(runs):
        t = 0
        for sid, n in row:
            seg[b, t : t + n], pos[b, t : t + n] = sid, np.arange(n)
            t += n
    return jnp.asarray(pos), jnp.asarray(seg)


def _qkv(n, kv, seed=0):
    kq, kk, kvv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, n, H))
    k = jax.random.normal(kk, (B, T, kv, H))
    v = jax.random.normal(kvv, (B, T, kv, H))
    return q, k, v, jax.random.normal(kc, (B, T, n, H))


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (3, 3)])  # GQA, MQA, MHA
def test_heads_major_equals_literal_values_and_grads(heads):
    pos, seg = _packed()
    mask = attention_mask(pos, pos, seg, seg)
    q, k, v, ct = _qkv(*heads)

    def value_and_grads(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, mask) * ct)
        return jax.jit(fn)(q, k, v, mask), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    got, got_g = value_and_grads(grouped_attention)
    want, want_g = value_and_grads(grouped_attention_literal)
    # Every position, padding queries (all keys masked: the mean of the values) included.
    np.testing.assert_allclose(got, want, atol=2e-6)
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


def test_heads_major_bfloat16_close_to_literal():
    pos, seg = _packed()
    mask = attention_mask(pos, pos, seg, seg)
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in _qkv(4, 2))
    got = grouped_attention(q, k, v, mask)
    assert got.dtype == jnp.bfloat16
    want = grouped_attention_literal(q, k, v, mask)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-2)


def _layer(impl):
    return Attention(
        dim=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=H,
        rope_theta=10000.0,
        eps=1e-6,
        init_std=0.3,
        param_dtype=jnp.float32,
        sharder=Sharder(),
        rngs=nnx.Rngs(0),
        impl=impl,
    )


def test_layer_naive_equals_the_literal_form_with_qk_norm():
    """The whole layer through `training_attention`: values and param grads."""
    pos, seg = _packed()
    x = jax.random.normal(jax.random.key(5), (B, T, 32))

    def run(literal):
        graphdef, params = nnx.split(_layer("naive"))
        params["q_norm"]["scale"][...] = jnp.linspace(0.5, 1.5, H)
        params["k_norm"]["scale"][...] = jnp.linspace(1.5, 0.5, H)

        def loss(p):
            y, _ = nnx.merge(graphdef, p)(x, pos, seg)
            return jnp.sum(y**2)

        with literal_naive() if literal else contextlib.nullcontext():
            return jax.jit(jax.value_and_grad(loss))(params)

    (ln, gn), (ll, gl) = run(False), run(True)
    np.testing.assert_allclose(ln, ll, rtol=1e-5)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(gn), jax.tree_util.tree_leaves_with_path(gl)
    ):
        scale = float(jnp.max(jnp.abs(b)))  # grads reach ~100 here: fp32 rounding of that
        np.testing.assert_allclose(a, b, atol=1e-6 * scale, rtol=1e-4, err_msg=str(path))


def test_decode_with_cache_equals_literal_training_pass():
    """Prefill 10 tokens, then decode one at a time into the cache: each step's output
    equals the literal form's whole-sequence pass at that position."""
    t = 16
    x = jax.random.normal(jax.random.key(7), (B, t, 32))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    seg = jnp.ones((B, t), jnp.int32)
    layer = _layer("naive")
    with literal_naive():
        want, _ = layer(x, pos, seg)
    cache = init_cache(B, 20, 2, H, jnp.float32)
    got, cache = layer(x[:, :10], pos[:, :10], seg[:, :10], cache)
    outs = [got]
    for i in range(10, t):
        y, cache = layer(x[:, i : i + 1], pos[:, i : i + 1], seg[:, i : i + 1], cache)
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=2e-5)


def test_cached_attention_equals_literal_over_the_cache():
    """A cache read with a span and a long lane, against the literal form over all slots."""
    s = 24
    q, _, _, _ = _qkv(4, 2, seed=3)
    q = q[:, :3]
    kk, kv = jax.random.split(jax.random.key(4))
    k = jax.random.normal(kk, (B, s, 2, H))
    v = jax.random.normal(kv, (B, s, 2, H))
    pos = jnp.asarray([[4, 5, 6], [18, 19, 20]], jnp.int32)
    mask = jnp.arange(s)[None, None, :] <= pos[:, :, None]
    want = grouped_attention_literal(q, k, v, mask)
    cache = KVCache(k, v, lane_rows_r=jnp.asarray([1], jnp.int32), span=8, lane_span=s)
    np.testing.assert_allclose(cached_attention(q, pos, cache), want, atol=2e-6)


def test_training_attention_naive_equals_the_literal_form():
    pos, seg = _packed()
    q, k, v, _ = _qkv(4, 2)
    got = training_attention(q, k, v, pos, seg, impl="naive", block=512, sharder=Sharder())
    mask = attention_mask(pos, pos, seg, seg)
    np.testing.assert_allclose(got, grouped_attention_literal(q, k, v, mask), atol=2e-6)
