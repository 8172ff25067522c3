"""Weight sync: params cast to the sampler's dtype and moved to the sampler's shardings.

After every update the sampler gets the policy in its compute dtype (bf16 for the 30B
recipe: every weight is cast to it at use anyway, so rollouts do not change) laid out as
the sampler wants it, which is not the trainer's layout (a host-local split, or a pool
mesh of its own). `cast_and_reshard(params, target_shardings, dtype)` does both:

  * target on the same devices as the params, in the same mesh order (colocated; any
    mesh shape or axis names over them): ONE jitted program, cast then reshard, whose
    collectives XLA derives from the two shardings (`reshard_program`; it lowers for TPU
    and GPU on abstract meshes, tests/test_lowering.py);
  * target on other devices (a sampler pool beside the trainer, in this process), or on
    the same ones in another order: the cast runs where the params are (half the bytes
    to move for float32 -> bf16), then `jax.device_put` copies the shards.

Floating leaves are cast, integer leaves are moved unchanged (`cast_floating`). In one
process only: `jax.device_put` cannot reach another process's devices, and that
transfer is not handled here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def cast_floating(tree: Any, dtype: Any = None) -> Any:
    """Floating leaves cast to `dtype` (None: unchanged); other leaves as they are."""

    def one(x):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if dtype is not None and floating and x.dtype != dtype else x

    return jax.tree.map(one, tree)


def first_divisible_spec(shape: Sequence[int], axis: str, size: int) -> PartitionSpec:
    """Split the first dimension that `size` divides over mesh axis `axis`; else replicate
    (the host-local sampler layout of `distributed.host_local`)."""
    for d, n in enumerate(shape):
        if n >= size and n % size == 0:
            return PartitionSpec(*([None] * d), axis)
    return PartitionSpec()


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


@functools.lru_cache(maxsize=32)
def _program(treedef, targets: tuple, dtype_name: str | None):
    dtype = None if dtype_name is None else jnp.dtype(dtype_name)
    out = jax.tree.unflatten(treedef, targets)
    return jax.jit(functools.partial(cast_floating, dtype=dtype), out_shardings=out)


def reshard_program(target_shardings: Any, dtype: Any = None):
    """The jitted cast + reshard onto `target_shardings` (a tree of shardings matching the
    params) for params on the same devices; one per (tree, targets, dtype), cached."""
    leaves, treedef = jax.tree.flatten(target_shardings, is_leaf=_is_sharding)
    return _program(treedef, tuple(leaves), None if dtype is None else jnp.dtype(dtype).name)


def _device_orders(tree: Any) -> set[tuple[int, ...]]:
    """The device ids of each leaf's sharding (a tree of arrays or of shardings), in
    mesh order: one jitted program can take inputs and give outputs only on one order."""
    out = set()
    for x in jax.tree.leaves(tree, is_leaf=_is_sharding):
        s = x if _is_sharding(x) else x.sharding
        if isinstance(s, NamedSharding):
            out.add(tuple(d.id for d in s.mesh.devices.flat))
        else:
            out.add(tuple(sorted(d.id for d in s.device_set)))
    return out


@functools.lru_cache(maxsize=8)
def _cast_program(dtype_name: str | None):
    dtype = None if dtype_name is None else jnp.dtype(dtype_name)
    return jax.jit(functools.partial(cast_floating, dtype=dtype))


def cast_and_reshard(params: Any, target_shardings: Any, dtype: Any = None) -> Any:
    """`params` (arrays) cast to `dtype` (floating leaves) and placed on `target_shardings`
    (a tree of NamedShardings of the same structure). Asynchronous, as any JAX dispatch:
    block on the result to time the transfer."""
    orders = _device_orders(params) | _device_orders(target_shardings)
    if len(orders) == 1:
        return reshard_program(target_shardings, dtype)(params)
    cast = _cast_program(None if dtype is None else jnp.dtype(dtype).name)
    return jax.device_put(cast(params), target_shardings)


def host_split_shardings(params: Any, mesh: jax.sharding.Mesh, axis: str) -> Any:
    """NamedShardings on `mesh` that split each leaf's first divisible dimension over
    `axis` and replicate it over the mesh's other axes (`first_divisible_spec`)."""
    size = mesh.shape[axis]
    return jax.tree.map(
        lambda x: NamedSharding(mesh, first_divisible_spec(x.shape, axis, size)), params
    )
