"""Training-attention backends chosen by `model.attention_impl`, and their per-device wrapper.

  naive      softmax over the materialised [B, K, G, T, S] scores, heads-major (attention.py;
             the reference of the other kernels and the decode path)
  blockwise  pure-JAX flash attention with an O(T) custom VJP (attention_kernels.py)
  cudnn      `jax.nn.dot_product_attention(implementation='cudnn')`: cuDNN's fused flash
             attention on NVIDIA GPUs (bfloat16 / float16)
  splash     Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`)
             on TPUs; elsewhere it runs in Pallas interpret mode (slow; for tests)
  auto       cudnn on GPU with a 16-bit dtype, splash on TPU (blocks of
             model.attention_block); on CPU blockwise in blocks of
             min(model.attention_block, CPU_BLOCK = 32), naive while T fits one block

The fused kernels see a simpler mask than the reference rule (attention.py): cuDNN gets
causal-by-index plus per-row lengths, splash causal-by-index plus segment ids. Each call
checks at run time that the batch has that structure (cuDNN: one segment per row, as a
prefix, positions counting up by one; splash: segment ids never decrease along the row
and positions increase inside a segment) and otherwise runs the blockwise kernel, so the
result never depends on which kernel ran (`lax.cond`: both branches are compiled).

On a mesh every kernel runs under `shard_map` (Pallas kernels and the blockwise loops do
not partition themselves): each device attends its own rows and heads (batch over the
`batch` rule's axes, heads over `act_kv_heads`'s when they divide the key/value heads).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sao_jax.models.attention_kernels import blockwise_attention
from sao_jax.models.config import ATTENTION_IMPLS
from sao_jax.parallel import platform
from sao_jax.parallel.mesh import Sharder
from sao_jax.schema import ConfigError

IMPLS = ATTENTION_IMPLS
_SPLASH_MIN_BLOCK = 128  # TPU lane width: splash blocks are multiples of it

Kernel = Callable[..., jax.Array]  # (q_btnh, k_bskh, v_bskh, pos_bt, seg_bt) -> [B, T, N, H]


# XLA:CPU runs the blockwise kernel fastest with small blocks: 32 was the fastest block
# measured at the demo's update step (T = 96), the tiny bench (4 x 512) and the larger
# bench model (4 x 512), ahead of 64, 128 and the naive form (docs/benchmarks.md).
CPU_BLOCK = 32


def resolve(impl: str, dtype, backend: str | None = None, *, length=None, block=512):
    """(kernel, block) that `impl` runs. 'auto' -> the backend's fused kernel: cuDNN on GPU
    in 16 bits, splash on TPU, at `block`; on CPU (or GPU fp32) 'blockwise' at
    min(block, CPU_BLOCK) on CPU, or 'naive' when the whole sequence fits in that one
    block. Any other name runs as named, at `block`. Unknown names are an error."""
    if impl not in IMPLS:
        raise ConfigError(f"config field model.attention_impl: {impl!r} is not one of {IMPLS}")
    if impl != "auto":
        return impl, block
    backend = backend or platform.backend()
    if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn", block
    if backend == "tpu":
        return "splash", block
    if backend == "cpu":
        block = min(block, CPU_BLOCK)
    if length is not None and length <= block:
        return "naive", block
    return "blockwise", block


def resolve_impl(impl: str, dtype, backend: str | None = None, *, length=None, block=512):
    """The kernel name of `resolve`."""
    return resolve(impl, dtype, backend, length=length, block=block)[0]


def prefix_rows(positions_bt, segment_ids_bt) -> jax.Array:
    """Scalar bool: every row is one segment from position 0 on (then padding), with
    positions counting up by one, so causal-by-index plus row lengths is the whole mask."""
    t = segment_ids_bt.shape[1]
    real_bt = segment_ids_bt != 0
    length_b1 = jnp.sum(real_bt, axis=1, keepdims=True)
    idx_1t = jnp.arange(t)[None, :]
    prefix = jnp.all(real_bt == (idx_1t < length_b1))
    one_id = jnp.all(jnp.where(real_bt, segment_ids_bt == segment_ids_bt[:, :1], True))
    counting = jnp.all(jnp.where(real_bt, positions_bt - positions_bt[:, :1] == idx_1t, True))
    return prefix & one_id & counting


def ordered_segments(positions_bt, segment_ids_bt) -> jax.Array:
    """Scalar bool: nonzero segment ids never decrease along a row and positions increase
    inside each segment, so causal-by-index plus equal segment ids is the whole mask."""
    real_bt = segment_ids_bt != 0
    # The last real id seen so far (0 before the first): ids must never drop below it.
    last_bt = jax.lax.cummax(jnp.where(real_bt, segment_ids_bt, 0), axis=1)
    sorted_ids = jnp.all(jnp.where(real_bt, segment_ids_bt == last_bt, True))
    same = (segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]) & real_bt[:, 1:]
    rising = jnp.all(jnp.where(same, positions_bt[:, 1:] > positions_bt[:, :-1], True))
    return sorted_ids & rising


def cudnn_attention(q, k, v, pos, seg, *, block: int, implementation: str = "cudnn"):
    """cuDNN flash attention (causal, per-row lengths); blockwise for any other layout.

    `implementation='xla'` runs the same call through XLA (how CPU tests check the
    argument mapping; XLA materialises the scores).
    """
    if implementation == "cudnn" and jnp.dtype(q.dtype) not in (jnp.bfloat16, jnp.float16):
        raise ConfigError(
            f"config field model.attention_impl: 'cudnn' needs model.dtype bfloat16 or "
            f"float16, got {jnp.dtype(q.dtype).name} (use 'blockwise' or 'auto')"
        )
    lengths_b = jnp.sum(seg != 0, axis=1).astype(jnp.int32)

    def fused(q, k, v):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            query_seq_lengths=lengths_b,
            key_value_seq_lengths=lengths_b,
            implementation=implementation,
        )

    def fallback(q, k, v):
        return blockwise_attention(q, k, v, pos, pos, seg, seg, block=block)

    return jax.lax.cond(prefix_rows(pos, seg), fused, fallback, q, k, v)


def splash_attention(q, k, v, pos, seg, *, block: int, interpret: bool | None = None):
    """Pallas splash attention (causal + segment ids, GQA as MQA per key/value head);
    blockwise for rows whose segments are not ordered. Lengths pad to the block size."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    if interpret is None:
        interpret = platform.backend() != "tpu"
    bs = max(_SPLASH_MIN_BLOCK, min(block, -(-t // _SPLASH_MIN_BLOCK) * _SPLASH_MIN_BLOCK))
    bs -= bs % _SPLASH_MIN_BLOCK
    tp = -(-t // bs) * bs
    sizes = sk.BlockSizes(
        block_q=bs,
        block_kv=bs,
        block_kv_compute=bs,
        block_q_dkv=bs,
        block_kv_dkv=bs,
        block_kv_dkv_compute=bs,
        block_q_dq=bs,
        block_kv_dq=bs,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((tp, tp)) for _ in range(g)])
    kernel = sk.make_splash_mqa(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))

    def fused(q, k, v):
        scale = jnp.asarray(h**-0.5, q.dtype)
        q_bkgth = jnp.transpose(pad(q).reshape(b, tp, kh, g, h) * scale, (0, 2, 3, 1, 4))
        k_bkth = jnp.transpose(pad(k), (0, 2, 1, 3))
        v_bkth = jnp.transpose(pad(v), (0, 2, 1, 3))
        seg_bt = pad(seg)

        def one(q_gth, k_th, v_th, s_t):  # one row, one key/value head
            return kernel(q_gth, k_th, v_th, segment_ids=sk.SegmentIds(q=s_t, kv=s_t))

        per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
        out_bkgth = jax.vmap(per_head)(q_bkgth, k_bkth, v_bkth, seg_bt)
        return jnp.transpose(out_bkgth, (0, 3, 1, 2, 4)).reshape(b, tp, n, h)[:, :t]

    def fallback(q, k, v):
        return blockwise_attention(q, k, v, pos, pos, seg, seg, block=block)

    return jax.lax.cond(ordered_segments(pos, seg), fused, fallback, q, k, v)


def kernel_for(impl: str, block: int) -> Kernel:
    """The per-device kernel of a resolved (non-naive) implementation."""
    if impl == "blockwise":
        return lambda q, k, v, pos, seg: blockwise_attention(
            q, k, v, pos, pos, seg, seg, block=block
        )
    if impl == "cudnn":
        return lambda q, k, v, pos, seg: cudnn_attention(q, k, v, pos, seg, block=block)
    if impl == "splash":
        return lambda q, k, v, pos, seg: splash_attention(q, k, v, pos, seg, block=block)
    raise ValueError(f"no per-device kernel for attention impl {impl!r}")


def per_device(kernel: Kernel, sharder: Sharder, q, k, v, pos, seg) -> jax.Array:
    """Runs `kernel` on each device's rows and heads (`shard_map`); plain call unsharded."""
    if sharder.mesh is None:
        return kernel(q, k, v, pos, seg)
    kv_spec = sharder.spec(("batch", "length", "act_kv_heads", None), k.shape)
    batch, heads = kv_spec[0], kv_spec[2]
    act = P(batch, None, heads, None)
    tok = P(batch, None)
    return jax.shard_map(
        kernel,
        mesh=sharder.mesh,
        in_specs=(act, act, act, tok, tok),
        out_specs=act,
        check_vma=False,
    )(q, k, v, pos, seg)
