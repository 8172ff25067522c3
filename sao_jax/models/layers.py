"""Small building blocks: logically-named parameters, per-token products (`token_einsum`),
RMSNorm, embeddings, RoPE, SwiGLU MLP.

Every parameter carries its logical dimension names in the `axes` metadata; the rules
table (parallel/mesh.py) turns them into shardings. Shapes are in names and comments:
B batch, T length, D model width, V vocab, F MLP width, N query heads, H head width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.parallel.mesh import Sharder

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]


def token_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, w) for a per-token product such as "btd,dnh->btnh": x's first two
    dims (B, T) and the output's first two are the tokens, and w has no token dim.

    The product runs over the B T tokens as ONE dim: x [B, T, ...] -> [B T, ...], then the
    result back to [B, T, ...]. Same values. Why: the weight gradient of the two-token-dim
    form contracts over (b, t), and XLA:CPU lays that out as a transposing fusion of the
    whole [B T, F] activation gradient (with the SwiGLU backward fused into it), which ran a
    SwiGLU MLP's forward + backward 2.2x slower than the one-token-dim form (D = 256,
    F = 1024, 4 x 512 tokens; docs/benchmarks.md). On GPU / TPU the merge is a bitcast.
    """
    ins, out = spec.split("->")
    x_spec, w_spec = ins.split(",")
    tok = x_spec[:2]
    if out[:2] != tok or tok[0] in w_spec or tok[1] in w_spec or x.ndim != len(x_spec):
        raise ValueError(f"token_einsum: {spec!r} is not a per-token product of x {x.shape}")
    b, t = x.shape[:2]
    flat = f"{tok[1]}{x_spec[2:]},{w_spec}->{tok[1]}{out[2:]}"
    y = jnp.einsum(flat, x.reshape(b * t, *x.shape[2:]), w)
    return y.reshape(b, t, *y.shape[1:])


def param(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: jnp.dtype,
) -> nnx.Param:
    """A parameter initialised by `init`, tagged with its logical `axes` (one per dim)."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(init(next_key(rngs.params), tuple(shape), dtype), axes=tuple(axes))


def next_key(stream: nnx.RngStream) -> jax.Array:
    """`stream()`: the same key, and the same count afterwards, without its indexed update.

    flax's `count[...] += 1` compares the new count's `sharding` with the old one's; on a
    tracer (a module built under `nnx.eval_shape`, as every ModelDef is) that attribute
    raises an error whose message scans the whole trace, so building a 48-layer model
    cost ~10 s. A whole-value `set_value` makes no comparison: ~1 s. tests/test_model.py
    checks that the keys and counts are flax's.
    """
    key = jax.random.fold_in(stream.key[...], stream.count[...])
    stream.count.set_value(stream.count[...] + 1)
    return key


def normal(stddev: float) -> Initializer:
    return jax.nn.initializers.normal(stddev)


def ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


class RMSNorm(nnx.Module):
    """y = scale * x / sqrt(mean(x^2) + eps), computed in float32 (Qwen3: no +1 offset)."""

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs, axis_name="norm"):
        self.eps = eps
        self.scale = param(rngs, ones, (dim,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(dtype) * x32.astype(dtype)


class Embed(nnx.Module):
    """Token embedding table [V, D]; `attend` reuses it as a tied LM head."""

    def __init__(self, vocab: int, dim: int, *, init_std: float, param_dtype, rngs: nnx.Rngs):
        self.embedding = param(
            rngs, normal(init_std), (vocab, dim), ("vocab", "embed"), param_dtype
        )

    def __call__(self, tokens_bt: jax.Array, dtype) -> jax.Array:
        return jnp.take(self.embedding[...], tokens_bt, axis=0).astype(dtype)  # [B, T, D]

    def attend(self, x_btd: jax.Array) -> jax.Array:
        return token_einsum("btd,vd->btv", x_btd, self.embedding[...].astype(x_btd.dtype))


def rope_tables(positions_bt: jax.Array, head_dim: int, theta: float):
    """cos, sin of shape [B, T, H/2] for rotate-half RoPE (the Hugging Face convention)."""
    inv_freq_h = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq_h
    return jnp.cos(angles_bth), jnp.sin(angles_bth)


def apply_rope(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """Rotate-half RoPE: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] per half."""
    dtype = x_btnh.dtype
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(dtype)


class DenseMLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        init_std: float,
        param_dtype,
        sharder: Sharder,
        rngs: nnx.Rngs,
    ):
        self.sharder = sharder
        init = normal(init_std)
        self.gate_proj = param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.up_proj = param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
        self.down_proj = param(rngs, init, (hidden, dim), ("mlp", "embed"), param_dtype)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = x_btd.dtype
        gate_btf = token_einsum("btd,df->btf", x_btd, self.gate_proj[...].astype(dt))
        up_btf = token_einsum("btd,df->btf", x_btd, self.up_proj[...].astype(dt))
        h_btf = self.sharder.constrain(
            jax.nn.silu(gate_btf) * up_btf, ("batch", "length", "act_mlp")
        )
        return token_einsum("btf,fd->btd", h_btf, self.down_proj[...].astype(dt))
