"""Chunked LM-head log-probs and entropies equal the unchunked ones, gradients included."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.logprobs import chunked_logp_entropy, logp_entropy_from_logits
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, init_params
from sao_jax.rl import passes

CFG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
)


@pytest.mark.parametrize("chunk", [0, 5, 8, 64])  # 5 leaves a padded last chunk of T = 37
def test_chunked_equals_unchunked(chunk):
    kh, kw, ky, kc = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(kh, (3, 37, 16))
    w = jax.random.normal(kw, (16, 50)) * 0.5
    y = jax.random.randint(ky, (3, 37), 0, 50)
    c_logp, c_ent = jax.random.normal(kc, (2, 3, 37))
    head = lambda w: lambda h: jnp.einsum("btd,dv->btv", h, w)

    def loss(fn, h, w):
        logp, ent = fn(h, w)
        return jnp.sum(logp * c_logp + ent * c_ent), (logp, ent)

    ref = lambda h, w: logp_entropy_from_logits(head(w)(h), y)
    got = lambda h, w: chunked_logp_entropy(head(w), h, y, chunk)
    (_, want), want_g = jax.value_and_grad(lambda *a: loss(ref, *a), (0, 1), has_aux=True)(h, w)
    (_, have), have_g = jax.value_and_grad(lambda *a: loss(got, *a), (0, 1), has_aux=True)(h, w)
    for a, b in zip(have + have_g, want + want_g):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_policy_pass_chunked_equals_full_logits(tie):
    """policy_pass (chunked LM head) == token_logp_entropy of the full [B, T, V] logits."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tie, logits_chunk=4)
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    assert isinstance(mdef, ModelDef)
    b, t = 2, 11
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, cfg.vocab_size)
    batch = dict(
        tokens=tokens,
        positions=jnp.broadcast_to(jnp.arange(t), (b, t)),
        segment_ids=jnp.ones((b, t), jnp.int32),
    )
    weights = jax.random.normal(jax.random.key(3), (2, b, t))

    def loss(p, chunked):
        model = mdef.bind(p)
        if chunked:
            out = passes.policy_pass(model, batch, replay=False)
            logp, ent = out["logp"], out["entropy"]
        else:
            logits = model(batch["tokens"], batch["positions"], batch["segment_ids"]).out
            logp, ent = passes.token_logp_entropy(logits, batch["tokens"])
        return jnp.sum(logp * weights[0] + ent * weights[1]), (logp, ent)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, want), want_g = grad(params, False)
    (_, have), have_g = grad(params, True)
    for a, b_ in zip(have, want):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-5)
    for (path, a), (_, b_) in zip(
        jax.tree_util.tree_leaves_with_path(have_g), jax.tree_util.tree_leaves_with_path(want_g)
    ):
        np.testing.assert_allclose(a, b_, atol=1e-5, rtol=1e-4, err_msg=str(path))
