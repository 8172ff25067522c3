"""Weight sync: the trainer's params, cast to the compute dtype, onto the sampler's shardings.

After every update the sampler gets the policy in its compute dtype (bf16 for the 30B
recipe: every weight is cast to it at use anyway, so rollouts do not change, and half the
bytes move) laid out as the sampler wants it, which is not the trainer's layout (a
host-local split, or a pool mesh of its own). `cast_and_reshard(params, shardings, dtype)`
is that transfer. It is dispatched asynchronously, so the call returns at once and the copy
runs behind the caller's next program (the learner's next update); the result's arrays
become ready when their bytes have landed (sao_jax/sampling/params_store.py publishes them
to the sampler only then). The result is always in fresh buffers: the learner donates its
state to the next update.

Where the target is (sao_jax/parallel/placement.py):
  * the same devices as the params, in the same mesh order (colocated; any mesh shape or
    axis names over them): ONE jitted program, cast then reshard, whose collectives XLA
    derives from the two shardings (`reshard_program`; it lowers for TPU and GPU on
    abstract meshes, tests/test_lowering.py); `shardings=None` keeps the source layout;
  * other devices (a sampler pool beside the trainer, in this process), or the same ones in
    another order: the cast runs where the params are, then `jax.device_put` copies the
    shards;
  * several processes: first `distributed.host_local` (collective: every process calls it,
    in the same order) gives each host its own full copy on its own trainer devices, then
    a host-local `device_put` moves it onto that host's pool devices. JAX's multi-controller
    `device_put` between two device sets spanning processes is refused on CPU and GPU in
    jax 0.10 (docs/scaling.md, "Sampler pool placement"), so the cross-host part is the
    trainer-mesh reshard and the move to the pool never leaves the host.

Floating leaves are cast, integer leaves are moved unchanged (`cast_floating`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from sao_jax.parallel import distributed
from sao_jax.parallel.distributed import cast_floating, first_divisible_spec

__all__ = [
    "cast_and_reshard",
    "cast_floating",
    "first_divisible_spec",
    "host_split_shardings",
    "reshard_program",
]


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


def _fresh(source: Any, out: Any) -> Any:
    """`out` with every leaf that is still a buffer of `source` copied."""
    copy = lambda x, y: y if y is not x else jax.device_put(y, y.sharding, may_alias=False)
    return jax.tree.map(copy, source, out)


def cast_and_reshard(
    params: Any,
    shardings: Any = None,
    dtype: Any = None,
    *,
    source_devices: Sequence[Any] | None = None,
) -> Any:
    """`params` (arrays) with floating leaves cast to `dtype` (None: kept), placed on
    `shardings` (a tree of Shardings matching `params`, or None: the source shardings), in
    fresh buffers. Asynchronous, as any JAX dispatch: block on the result to time it.

    Several processes: collective (see the module docstring); `source_devices` are the
    devices the leaves live on (the trainer's), `shardings` must then be on this
    process's devices only.
    """
    if jax.process_count() > 1:
        local = distributed.host_local(params, dtype, devices=source_devices)
        if shardings is None:
            return _fresh(params, local)
        return jax.device_put(local, shardings, may_alias=False)
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, params)
    if len(_device_orders(params) | _device_orders(shardings)) == 1:
        return _fresh(params, reshard_program(shardings, dtype)(params))
    return jax.device_put(cast_floating(params, dtype), shardings, may_alias=False)


def host_split_shardings(params: Any, mesh: jax.sharding.Mesh, axis: str) -> Any:
    """NamedShardings on `mesh` that split each leaf's first divisible dimension over
    `axis` and replicate it over the mesh's other axes (`first_divisible_spec`)."""
    size = mesh.shape[axis]
    return jax.tree.map(
        lambda x: NamedSharding(mesh, first_divisible_spec(x.shape, axis, size)), params
    )
