"""The platform query and the kernels each platform picks (sao_jax/parallel/platform.py).

'auto' resolves by backend: cuDNN flash (bf16) on GPU, Pallas splash compiled on TPU,
blockwise on CPU (attention_backends.resolve); `ragged_dot` on accelerators and the tiled
grouped matmuls on CPU (moe.dispatch.resolve_impl); GAE's associative form off CPU. Both
ways to ask are tested: the running backend (`jax.default_backend`, monkeypatched) and a
lowering target (`platform.target`), down to the primitives a traced model contains.
"""

import jax
import jax.numpy as jnp
import pytest

from sao_jax.models import attention_backends as backends
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import policy_def
from sao_jax.models.moe import dispatch
from sao_jax.parallel import platform
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl import gae

# One MoE layer, head_dim 32 and T = 256: splash-sized blocks of 128.
CFG = ModelConfig(
    vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, moe_intermediate_size=16, num_experts=4,
    num_experts_per_tok=2, attention_block=128,
)  # fmt: skip
TOKENS = jax.ShapeDtypeStruct((1, 256), jnp.int32)


def _primitives(cfg: ModelConfig) -> set[str]:
    """Primitive names in the traced training forward of a policy (a fresh function per
    call, so no earlier trace is reused)."""
    pdef = policy_def(cfg, Sharder())

    def forward(params, tokens):
        return pdef.bind(params)(tokens).out

    text = str(jax.make_jaxpr(forward)(pdef.shapes(), TOKENS))
    return {p for p in ("ragged_dot_general", "pallas_call") if p in text}


def test_target_sets_and_restores_the_backend():
    here = jax.default_backend()
    assert platform.backend() == here
    with platform.target("tpu") as b:
        assert b == platform.backend() == "tpu"
        with platform.target("cuda"):
            assert platform.backend() == "gpu"
        assert platform.backend() == "tpu"
    assert platform.backend() == here
    with pytest.raises(ValueError, match="platform: 'metal'"), platform.target("metal"):
        pass


@pytest.mark.parametrize(
    "backend, attention, moe, gae_impl",
    [("gpu", "cudnn", "ragged", "associative"), ("tpu", "splash", "ragged", "associative"),
     ("cpu", "blockwise", "grouped", "chunked")],
)  # fmt: skip
def test_auto_follows_the_running_backend(monkeypatch, backend, attention, moe, gae_impl):
    """Nothing passes a backend: each resolver asks the platform query."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert backends.resolve_impl("auto", jnp.bfloat16, length=4096) == attention
    assert dispatch.resolve_impl("auto") == moe
    assert gae.default_gae_impl() == gae_impl


def test_traced_model_takes_each_platforms_kernels(monkeypatch):
    """Under a lowering target the model's own trace holds that platform's kernels."""
    with platform.target("cpu"):
        assert _primitives(CFG) == set()  # blockwise attention, grouped matmuls
    with platform.target("tpu"):
        assert _primitives(CFG) == {"ragged_dot_general", "pallas_call"}  # splash, ragged
    # GPU in bf16: the cuDNN call (which cannot be traced without CUDA) is what runs.
    calls = []

    def cudnn_spy(q, k, v, pos, seg, *, block):
        calls.append(q.dtype)
        return backends.blockwise_attention(q, k, v, pos, pos, seg, seg, block=block)

    monkeypatch.setattr(backends, "cudnn_attention", cudnn_spy)
    with platform.target("cuda"):
        bf16 = ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
        assert _primitives(bf16) == {"ragged_dot_general"}
        assert calls == [jnp.bfloat16]
        assert _primitives(CFG) == {"ragged_dot_general"}  # float32: blockwise, no cuDNN
        assert calls == [jnp.bfloat16]


def test_splash_compiles_only_for_tpu(monkeypatch):
    """The splash kernel is built for Mosaic under a TPU target, in interpret mode else."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    seen = []
    real = sk.make_splash_mqa

    def spy(*args, interpret, **kw):
        seen.append(interpret)
        return real(*args, interpret=interpret, **kw)

    monkeypatch.setattr(sk, "make_splash_mqa", spy)
    splash = ModelConfig(**{**CFG.__dict__, "attention_impl": "splash"})
    for target in ("cpu", "tpu"):
        with platform.target(target):
            _primitives(splash)
    assert seen == [True, False]


def test_lowering_error_names_program_and_platform():
    x = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    with pytest.raises(platform.LoweringError, match=r"^my program for tpu: TypeError"):
        platform.lower("my program", "tpu", lambda: jax.jit(lambda x: x.reshape(5)), x)
