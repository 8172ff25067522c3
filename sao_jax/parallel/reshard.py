"""Weight sync: the trainer's params, cast to the compute dtype, onto the sampler's shardings.

After every update the sampler pool needs the new policy in its own layout: bf16 (every
weight is cast to the compute dtype at use anyway, so the samples are unchanged and half
the bytes move) and sharded for decoding, not for training. `cast_and_reshard` is that
transfer, and only that: a cast on the source devices, then `jax.device_put` to the
target shardings. Both are dispatched asynchronously, so the call returns at once and the
copy runs behind the caller's next program (the learner's next update); the result's
arrays become ready when their bytes have landed (`sao_jax/sampling/params_store.py`
publishes them to the sampler only then).

Where the pool is (sao_jax/parallel/placement.py):
  * colocated (`shardings=None`): the cast tree in the trainer's own shardings, always in
    fresh buffers (the learner donates its state to the next update);
  * disaggregated, one process: the cast tree moved to the pool's devices;
  * several processes: first `distributed.host_local` (collective: every process calls it,
    in the same order) gives each host its own full copy on its own trainer devices, then
    a host-local `device_put` moves it onto that host's pool devices. JAX's multi-controller
    `device_put` between two device sets spanning processes is refused on CPU and GPU in
    jax 0.10 (docs/scaling.md, "Sampler pool placement"), so the cross-host part is the
    trainer-mesh reshard and the move to the pool never leaves the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from sao_jax.parallel import distributed


def cast_and_reshard(
    tree: Any,
    shardings: Any = None,
    dtype: Any = None,
    *,
    source_devices: Sequence[Any] | None = None,
) -> Any:
    """`tree` with floating leaves cast to `dtype` (None: kept), placed on `shardings` (a
    pytree of Shardings matching `tree`, or None: the source shardings), in new buffers.

    Several processes: collective (see the module docstring); `source_devices` are the
    devices the leaves live on (the trainer's), `shardings` must then be on this
    process's devices only. Integer leaves are moved, never cast.
    """
    local = distributed.host_local(tree, dtype, devices=source_devices)
    if shardings is None:
        fresh = lambda x, y: y if y is not x else jax.device_put(y, y.sharding, may_alias=False)
        return jax.tree.map(fresh, tree, local)
    return jax.device_put(local, shardings, may_alias=False)
