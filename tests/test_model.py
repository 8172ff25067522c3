"""Policy and critic: shapes, MoE dispatch against a dense reference, and sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models import layers
from sao_jax.models.config import ModelConfig
from sao_jax.models.moe.dispatch import dense_local_moe, local_moe, moe_dispatch
from sao_jax.models.moe.experts import reference_moe
from sao_jax.models.moe.router import route
from sao_jax.models.transformer import Critic, Policy, critic_params_from_policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import ModelDef, check_params, init_params
from sao_jax.schema import ConfigError
from tests.closeness import assert_pass_close

CFG = ModelConfig(
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=(0,),
)
MESHES = [(2, 2, 2, 1), (1, 1, 8, 1), (1, 2, 2, 2), (2, 1, 2, 2)]


def _tokens(b=8, t=10, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def _forward(ctor, sharder, tokens):
    mdef, params = init_params(ctor(sharder), sharder)
    return jax.jit(lambda p, x: mdef.bind(p)(x))(params, tokens), params


def _policy(sharder):
    return lambda: Policy(CFG, sharder=sharder, rngs=nnx.Rngs(0))


def _critic(sharder):
    return lambda: Critic(CFG, sharder=sharder, rngs=nnx.Rngs(0))


def test_shapes_and_routing_record():
    out, params = _forward(_policy, Sharder(), _tokens())
    assert out.out.shape == (8, 10, CFG.vocab_size) and out.out.dtype == jnp.float32
    assert out.experts_btlk.shape == (8, 10, 2, 2)  # two MoE layers, top-2
    assert out.cache is None
    assert np.isfinite(float(out.aux_loss)) and float(out.aux_loss) > 0
    assert (
        "mlp" in params["trunk"]["layers"][0]
        and "experts" not in params["trunk"]["layers"][0]["mlp"]
    )


def test_dispatch_matches_dense_reference():
    key = jax.random.key(3)
    kx, kr, kg, ku, kd = jax.random.split(key, 5)
    n, d, f, e, k = 24, 16, 8, 8, 3
    x = jax.random.normal(kx, (n, d))
    routing = route(jax.random.normal(kr, (n, e)), k, norm_topk=False)
    w = [jax.random.normal(kk, s) for kk, s in ((kg, (e, d, f)), (ku, (e, d, f)), (kd, (e, f, d)))]
    want = reference_moe(x, routing.experts_nk, routing.weights_nk, *w)
    # Unscaled N(0, 1) weights: outputs of order 100 summed from terms of order 10, so an
    # output near 0 carries rounding of the terms' size; the bound is relative to the
    # array's scale (tests/closeness.py), not to each element.
    for fn in (local_moe, dense_local_moe):
        got = fn(x, routing.experts_nk, routing.weights_nk, *w, 0)
        assert_pass_close(got, want, err_msg=fn.__name__)
    # Expert-parallel dispatch on 8 fake devices equals the local computation. Data x
    # tensor without fsdp (2, 1, 2, 2) shards tokens and experts as (1, 2, 2, 2) does, only
    # without the weights' fsdp split: inside tests/test_value_pretrain.py's sharded critic.
    for shape in MESHES[:3]:
        sharder = Sharder(build_mesh(shape))
        for impl in ("ragged", "dense"):
            sharded = jax.jit(lambda *a, s=sharder, i=impl: moe_dispatch(*a, s, i))(
                x, routing.experts_nk, routing.weights_nk, *w
            )
            assert_pass_close(sharded, want, err_msg=impl)


def test_router_topk_and_replay():
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    r = route(logits, 2, norm_topk=True)
    np.testing.assert_array_equal(r.experts_nk, [[1, 2], [0, 3]])
    np.testing.assert_allclose(jnp.sum(r.weights_nk, -1), 1.0, rtol=1e-6)
    forced = jnp.array([[3, 0], [1, 2]])
    rf = route(logits, 2, norm_topk=False, forced_experts_nk=forced)
    np.testing.assert_array_equal(rf.experts_nk, forced)
    np.testing.assert_allclose(rf.weights_nk, jnp.take_along_axis(rf.probs_ne, forced, -1))


def test_forced_routing_reproduces_logits():
    tokens = _tokens()
    mdef, params = init_params(_policy(Sharder()), Sharder())
    fwd = jax.jit(lambda p, x, f=None: mdef.bind(p)(x, forced_experts_btlk=f))
    free = fwd(params, tokens)
    replay = fwd(params, tokens, free.experts_btlk)
    np.testing.assert_allclose(replay.out, free.out, atol=1e-6)
    np.testing.assert_array_equal(replay.experts_btlk, free.experts_btlk)


@pytest.mark.parametrize(
    "ctor,meshes", [(_policy, MESHES[1:3]), (_critic, MESHES[2:3])], ids=["policy", "critic"]
)
def test_sharded_equals_unsharded(ctor, meshes):
    """The policy on expert-only (1, 1, 8, 1) and fsdp x expert x tensor (1, 2, 2, 2); the
    critic (the same trunk, a value head instead of the LM head) on the latter. Data x fsdp
    x expert (2, 2, 2, 1): tests/test_stacked_layers.py test_sharded_equals_unsharded_stacked
    (a stacked trunk: forward and gradients, one pass) and the MoE dispatch above."""
    tokens = _tokens()
    ref, _ = _forward(ctor, Sharder(), tokens)
    for shape in meshes:
        sharder = Sharder(build_mesh(shape))
        out, params = _forward(ctor, sharder, tokens)
        assert float(jnp.max(jnp.abs(out.out - ref.out))) <= 1e-5, shape
        ep = params["trunk"]["layers"][1]["mlp"]["experts"]["gate_proj"].sharding.spec
        assert ep[0] == "expert"


def test_packed_segments_match_separate_rows():
    mdef, params = init_params(_policy(Sharder()), Sharder())
    fwd = jax.jit(lambda p, x, pos, seg: mdef.bind(p)(x, pos, seg).out)
    a, b = _tokens(1, 5, 7), _tokens(1, 4, 8)
    packed = jnp.concatenate([a, b, jnp.zeros((1, 1), a.dtype)], axis=1)
    pos = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    seg = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0]])
    out = fwd(params, packed, pos, seg)
    ones = lambda x: jnp.ones_like(x)
    ar = lambda x: jnp.arange(x.shape[1])[None]
    np.testing.assert_allclose(out[:, :5], fwd(params, a, ar(a), ones(a)), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:9], fwd(params, b, ar(b), ones(b)), atol=1e-5)


def test_critic_from_policy_and_value_head_zero():
    _, pparams = init_params(_policy(Sharder()), Sharder())
    cdef, cparams = init_params(_critic(Sharder()), Sharder())
    cparams = critic_params_from_policy(pparams, cparams)
    check_params(cparams, cdef, "critic")
    values = jax.jit(lambda p, x: cdef.bind(p)(x).out)(cparams, _tokens())  # one program
    assert values.shape == (8, 10)
    np.testing.assert_array_equal(values, 0.0)  # zero-initialised head
    np.testing.assert_array_equal(
        cparams["trunk"]["embed"]["embedding"], pparams["trunk"]["embed"]["embedding"]
    )


def test_attention_parameters_addressable_as_group():
    axes = ModelDef.of(_critic(Sharder())).axes()
    attn = axes["trunk"]["layers"][1]["attn"]
    assert set(attn) == {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}


def test_bad_mesh_and_divisibility_errors():
    with pytest.raises(ConfigError, match="mesh.shape"):
        build_mesh((3, -1, 1, 1))
    with pytest.raises(ConfigError, match="needs 16 devices"):
        build_mesh((2, 2, 2, 2))
    sharder = Sharder(build_mesh((1, 1, 1, 8)))  # kv_heads=2 not divisible by tensor=8
    with pytest.raises(ConfigError, match=r"parameter trunk\.layers\.0\.attn\.k_proj"):
        ModelDef.of(_policy(sharder)).shardings(sharder)


def test_bad_model_config_names_field():
    with pytest.raises(ConfigError, match="model.num_key_value_heads"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="model.nonsense"):
        ModelConfig.from_config({"nonsense": 1})
    with pytest.raises(ConfigError, match="unsupported architecture"):
        ModelConfig.from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_check_params_names_tensor():
    mdef, params = init_params(_policy(Sharder()), Sharder())
    bad = jax.tree.map(lambda x: x, params)
    bad["trunk"]["final_norm"]["scale"] = jnp.ones((3,))
    with pytest.raises(ConfigError, match=r"trunk\.final_norm\.scale"):
        check_params(bad, mdef)
    del bad["lm_head"]
    with pytest.raises(ConfigError, match="missing parameter lm_head"):
        check_params(bad, mdef)


@pytest.mark.parametrize(
    "spec, x_shape, w_shape",
    [
        ("btd,df->btf", (3, 5, 8), (8, 6)),
        ("btd,dnh->btnh", (3, 5, 8), (8, 4, 2)),
        ("btnh,nhd->btd", (3, 5, 4, 2), (4, 2, 8)),
        ("btd,vd->btv", (3, 5, 8), (7, 8)),
        ("btd,d->bt", (3, 5, 8), (8,)),
    ],
)
def test_token_einsum_equals_einsum(spec, x_shape, w_shape):
    """One merged token dim: the same values and gradients as the two-token-dim einsum."""
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    ct = jax.random.normal(kc, jnp.einsum(spec, x, w).shape)

    def value_and_grads(einsum):
        loss = lambda x, w: jnp.sum(einsum(spec, x, w) * ct)
        return einsum(spec, x, w), jax.grad(loss, argnums=(0, 1))(x, w)

    (got, got_g), (want, want_g) = value_and_grads(layers.token_einsum), value_and_grads(jnp.einsum)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, wg in zip(got_g, want_g):
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-5)


def test_token_einsum_rejects_non_token_products():
    x = jnp.ones((2, 3, 4))
    with pytest.raises(ValueError, match="not a per-token product"):
        layers.token_einsum("btd,bd->bt", x, jnp.ones((2, 4)))  # w has a token dim
    with pytest.raises(ValueError, match="not a per-token product"):
        layers.token_einsum("btd,df->tbf", x, jnp.ones((4, 5)))  # tokens reordered


def test_next_key_is_flax_streams_key():
    """`layers.next_key` draws flax's keys (so every seed initialises as before), eagerly
    and while a module is built under eval_shape (where it avoids flax's slow update)."""
    ours, flax_rngs = nnx.Rngs(3), nnx.Rngs(3)
    for _ in range(3):
        a, b = layers.next_key(ours.params), flax_rngs.params()
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
    assert int(ours.params.count[...]) == int(flax_rngs.params.count[...]) == 3

    def draws(next_of):
        rngs = nnx.Rngs(7)
        return jnp.stack([jax.random.key_data(next_of(rngs)) for _ in range(4)])

    traced = jax.jit(lambda: draws(lambda r: layers.next_key(r.params)))()
    np.testing.assert_array_equal(traced, draws(lambda r: r.params()))
