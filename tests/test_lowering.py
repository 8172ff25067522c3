"""The 30B recipe's programs lowered for TPU and for GPU on this CPU (no device of either).

Each program is built from configs/qwen3_30b_a3b_sao.py at its published sizes (48
layers in one scanned stack, D 2048, 128 experts, the 151,936-token vocabulary) on an
abstract mesh of the recipe's shape, traced for the platform (`platform.target`: the
kernels 'auto' picks there) and lowered by `jax.export.export(..., platforms=[...])`:

  program        platform  mesh                               checked in the module
  update step    tpu       64 chips, data 1 fsdp 8 expert 8   64 devices; Mosaic kernels
                                                               (splash fwd, dq, dkv); ragged_dot
  update step    cuda      16 GPUs, fsdp 16 (the launch       16 devices; ragged_dot; no
                           command's gpus=16)                  Mosaic call (blockwise attention)
  prefill        tpu, cuda one host's sampler: 4 chips / 8    ragged_dot; the recipe's slots,
  decode                   GPUs ('local'), slots over it      32k cache, 8 steps per call
  weight sync    tpu, cuda trainer mesh -> hosts x local      bf16 outputs on the pool mesh
                 (8, 16)   (the host-local sampler layout)

The update step is the recipe's (policy + critic, K = 2 critic steps, frozen-attention
critic, remat 'full', scanned layers, 1024-token chunked log-probs, DIS, the recipe's
microbatches) for 128 rows of 4096 tokens: the recipe's length bucket, the shortest update
shape it compiles (the kernels' blocks do not change with T). On GPU its attention is the
blockwise kernel: 'auto' picks cuDNN there, which jax cannot trace without the CUDA
backend (test_cudnn_attention_for_cuda_is_called_as_the_recipe_needs checks the call).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import qwen3_30b_a3b_sao as recipe
from sao_jax.models import attention_backends as backends
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel import platform
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.reshard import first_divisible_spec, host_split_shardings, reshard_program
from sao_jax.plan.memory import abstract_mesh
from sao_jax.plan.step_memory import abstract_batch
from sao_jax.rl.update import Learner
from sao_jax.sampling.generate import GenerateFns, SamplingParams, Spans
from sao_jax.schema import ConfigDict

UPDATE_LENGTH = 4096
PREFILL_CHUNK = 512
TARGETS = [("tpu", 0), ("cuda", 8), ("cuda", 16)]  # (platform, gpus variant; 0 = TPU mesh)
# The update step on gpus=16 only: gpus=8 differs in the fsdp size and the microbatch count
# (16 vs 8), both free parameters of the same program; tracing one costs ~6 s.
UPDATE_TARGETS = [("tpu", 0), ("cuda", 16)]
HOST = {"tpu": 4, "cuda": 8}  # devices per host: TPU v5p hosts hold 4 chips, GPU hosts 8


@functools.cache
def _recipe(platform_name: str, gpus: int):
    """(run config, model config, abstract-mesh sharder) of a recipe variant."""
    c = recipe.get_config(f"gpus={gpus}" if gpus else None)
    cfg = ModelConfig.from_config(c.model)
    if platform_name == "cuda":  # cuDNN cannot be traced here: see the module docstring
        cfg = dataclasses.replace(cfg, attention_impl="blockwise")
    c.model = ConfigDict(dataclasses.asdict(cfg))
    mesh = abstract_mesh(dict(zip(c.mesh.axes, c.mesh.shape)))
    return c, cfg, Sharder(mesh, tuple(map(tuple, c.mesh.rules)))


def _with(shapes, shardings):
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def _mlir(exported) -> str:
    return exported.mlir_module()


def test_recipe_is_what_the_lowering_claims():
    c = recipe.get_config()
    assert (c.rl.k_critic, c.optim.critic.freeze_attention) == (2, True)
    assert (c.model.remat, c.model.scan_layers, c.model.logits_chunk) == ("full", True, 1024)
    assert (c.model.attention_impl, c.model.moe_impl) == ("auto", "auto")
    assert c.train.length_bucket == UPDATE_LENGTH
    assert c.model.num_hidden_layers == 48


@pytest.mark.parametrize("platform_name, gpus", UPDATE_TARGETS)
def test_update_step_lowers(platform_name, gpus):
    c, cfg, sharder = _recipe(platform_name, gpus)
    pdef, cdef = policy_def(cfg, sharder), critic_def(cfg, sharder)
    shapes = Learner(c.rl, c.optim, pdef, cdef, sharder)  # abstract state and shardings only
    state = _with(shapes.abstract_state, shapes.state_shardings)
    batch_sh = NamedSharding(sharder.mesh, sharder.spec(("batch",)))
    batch = abstract_batch(c.rl.batch_size, UPDATE_LENGTH, cfg, batch_sh)
    key = jax.eval_shape(lambda: jax.random.key(0))
    build = lambda: Learner(c.rl, c.optim, pdef, cdef, sharder).update_step
    exported = platform.lower("update step", platform_name, build, state, batch, key)
    text = _mlir(exported)
    assert exported.nr_devices == sharder.mesh.size == (gpus or 64)
    assert "ragged_dot" in text  # the experts as grouped GEMMs ('auto' off CPU)
    if platform_name == "tpu":  # splash forward, dq and dkv kernels (the body is scanned)
        assert text.count("tpu_custom_call") >= 3
    else:
        assert "tpu_custom_call" not in text  # no TPU trace was reused for this platform


def _sampler_args(platform_name: str, fns: GenerateFns, mdef):
    """Abstract bf16 params split as `distributed.host_local` splits them over one host's
    devices, and a KV cache and token rows with the slots over those devices."""
    n = HOST[platform_name]
    mesh = abstract_mesh({"local": n})
    params = _with(
        mdef.shapes(),
        jax.tree.map(
            lambda s: NamedSharding(mesh, first_divisible_spec(s.shape, "local", n)),
            mdef.shapes(),
        ),
    )
    cache = jax.eval_shape(fns.init_cache, params)
    cache = _with(cache, jax.tree.map(lambda _: NamedSharding(mesh, P(None, "local")), cache))
    return mesh, params, cache


@pytest.mark.parametrize("platform_name", ["tpu", "cuda"])
def test_prefill_and_decode_lower(platform_name):
    c, cfg, _ = _recipe(platform_name, 0 if platform_name == "tpu" else 8)
    cfg = dataclasses.replace(cfg, param_dtype="bfloat16")  # the sampler's copy
    mdef = policy_def(cfg, Sharder())  # samplers run a model without global-mesh constraints
    s, length, steps = c.sampling.num_slots, c.sampling.max_len, c.sampling.steps_per_sync
    assert (length, steps) == (32768, 8)

    def fns():  # a fresh GenerateFns per program: its jits trace for the target
        return GenerateFns(mdef, num_slots=s, max_len=length, steps=steps)

    def prefill():
        f = fns()
        return jax.jit(lambda p, c, t, q: f.prefill(p, c, t, q, Spans(length)))

    def decode():
        f = fns()
        return jax.jit(
            lambda p, c, t, q, k: f.decode(p, c, t, q, k, SamplingParams(), Spans(length))
        )

    mesh, params, cache = _sampler_args(platform_name, fns(), mdef)
    rows = NamedSharding(mesh, P("local"))
    chunk = jax.ShapeDtypeStruct((s, PREFILL_CHUNK), jnp.int32, sharding=rows)
    one = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=rows)
    key = jax.eval_shape(lambda: jax.random.key(0))
    lowered = (
        platform.lower("prefill", platform_name, prefill, params, cache, chunk, chunk),
        platform.lower("decode", platform_name, decode, params, cache, one, one, key),
    )
    for exported in lowered:
        assert exported.nr_devices == HOST[platform_name]
        assert "ragged_dot" in _mlir(exported)


@pytest.mark.parametrize("platform_name, gpus", TARGETS)
def test_weight_sync_lowers(platform_name, gpus):
    """Trainer shardings -> the host-local sampler layout on a (hosts, local) mesh of the
    same devices, cast to bf16: one program (`reshard.reshard_program`)."""
    _, cfg, sharder = _recipe(platform_name, gpus)
    pdef = policy_def(cfg, sharder)
    params = _with(pdef.shapes(), pdef.shardings(sharder))
    n = sharder.mesh.size
    pool = abstract_mesh({"hosts": n // HOST[platform_name], "local": HOST[platform_name]})
    targets = host_split_shardings(pdef.shapes(), pool, "local")
    build = lambda: reshard_program(targets, jnp.bfloat16)
    exported = platform.lower("weight sync", platform_name, build, params)
    assert exported.nr_devices == n
    assert {a.dtype for a in exported.out_avals} == {jnp.dtype(jnp.bfloat16)}
    text = _mlir(exported)
    assert f'"hosts"={n // HOST[platform_name]}, "local"={HOST[platform_name]}' in text


def test_cudnn_attention_for_cuda_is_called_as_the_recipe_needs(monkeypatch):
    """cuDNN flash attention as the GPU update step calls it (bf16, GQA, row lengths).

    The recipe's 'auto' picks cuDNN on GPU at its block; `jax.nn.dot_product_attention(
    implementation='cudnn')` checks the installed cuDNN while tracing, so on a host without
    CUDA (CI) the lowering fails with a LoweringError naming the program, the platform and
    cuDNN. The call's arguments are read through a spy that traces the same call through
    XLA: the whole program (the cuDNN branch and the blockwise fallback) lowers for CUDA."""
    cfg = ModelConfig.from_config(recipe.get_config("gpus=8").model)
    got = backends.resolve(cfg.attention_impl, cfg.dtype, "gpu", length=UPDATE_LENGTH,
                           block=cfg.attention_block)  # fmt: skip
    assert got == ("cudnn", 512)
    b, n, kh, h = 2, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = jax.ShapeDtypeStruct((b, UPDATE_LENGTH, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, UPDATE_LENGTH, kh, h), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((b, UPDATE_LENGTH), jnp.int32)
    build = lambda: jax.jit(functools.partial(backends.cudnn_attention, block=got[1]))
    try:
        exported = platform.lower("cuDNN attention", "cuda", build, q, kv, kv, pos, pos)
    except platform.LoweringError as e:  # no CUDA here
        assert str(e).startswith("cuDNN attention for cuda: ") and "cuDNN" in str(e), e
    else:  # a host with CUDA and cuDNN
        assert "cudnn" in _mlir(exported)

    calls, real = [], jax.nn.dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape, k.shape, v.shape, q.dtype, kw))
        return real(q, k, v, **{**kw, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    exported = platform.lower("cuDNN attention", "cuda", build, q, kv, kv, pos, pos)
    ((qs, ks, vs, dtype, kw),) = calls
    assert (qs, ks, vs, dtype) == (q.shape, kv.shape, kv.shape, jnp.bfloat16)  # GQA: 32 / 4
    assert kw["implementation"] == "cudnn" and kw["is_causal"] is True
    for name in ("query_seq_lengths", "key_value_seq_lengths"):  # one length per row
        assert (kw[name].shape, kw[name].dtype) == ((b,), jnp.int32), name
    assert exported.out_avals[0].shape == q.shape
    assert exported.out_avals[0].dtype == jnp.bfloat16
    assert "stablehlo.case" in _mlir(exported)  # the layout check picks cuDNN or blockwise
