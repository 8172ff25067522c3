"""Where the sampler pool runs: on the trainer's devices, or on devices of its own.

`sampling.placement`:
  * 'colocated' (default): the samplers decode on the devices that run the update step
    (with several processes: each host's sampler on its own devices, a host-local copy
    of the policy, sao_jax/parallel/distributed.py). A device runs one program at a
    time, so decoding and updating take turns.
  * 'disaggregated': each process gives its last `sampling.pool_devices` local devices
    to the sampler pool; the trainer mesh (`mesh.shape`) is built over the rest, in
    process order. Decoding and updating then run at the same time on different
    devices; after every update the policy is cast to the compute dtype and moved to the
    pool (sao_jax/parallel/reshard.py), behind the next update, and the pool swaps to it
    between engine steps (sao_jax/sampling/params_store.py). With several processes every
    host has a pool of its own ("pools on every host"): the weight sync is the
    trainer-mesh reshard every process joins, then a copy that stays on the host.

The pool's mesh is `sampling.pool_mesh` (sizes over `mesh.axes`, product =
`sampling.pool_devices`; () = every pool device on the first axis, which the `batch`
rule maps the engine's slots onto). The policy the pool decodes with is sharded on it by
the same rules table as the trainer's (`mesh.rules`).

Bad placements fail at start-up naming the field (`ConfigError`, exit 2 from the entry
points): an unknown placement, a pool of every device of a process (the trainer's data
axis must split hosts, so each process keeps one trainer device at least), a pool mesh
that does not multiply to the pool's devices, a trainer that `mesh.shape` does not fit or
whose batch axes do not divide `rl.batch_size`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from sao_jax.parallel.mesh import Sharder, build_mesh, sharder_from_config
from sao_jax.schema import ConfigDict, ConfigError

PLACEMENTS = ("colocated", "disaggregated")
FIELDS = ("placement", "pool_devices", "pool_mesh")  # in the `sampling` section


@dataclasses.dataclass(frozen=True)
class Placement:
    """The device split of this process: trainer devices (all processes), pool mesh (this
    process's pool devices; None when colocated)."""

    kind: str
    trainer_devices: tuple[Any, ...]
    pool_mesh: Mesh | None = None

    @property
    def disaggregated(self) -> bool:
        return self.pool_mesh is not None

    @property
    def pool_devices(self) -> tuple[Any, ...]:
        return () if self.pool_mesh is None else tuple(self.pool_mesh.devices.flat)

    def pool_sharder(self, rules) -> Sharder | None:
        """The rules table on the pool mesh; None when colocated."""
        return None if self.pool_mesh is None else Sharder(self.pool_mesh, tuple(rules))

    def pool_context(self):
        """A context in which arrays created without a device (the engine's KV cache) land
        on the pool's first device; a no-op when colocated. Thread-local: enter it in the
        thread that runs the engine."""
        if self.pool_mesh is None:
            return contextlib.nullcontext()
        return jax.default_device(self.pool_devices[0])

    def describe(self) -> str:
        if self.pool_mesh is None:
            return f"colocated: sampler on the trainer's {len(self.trainer_devices)} devices"
        shape = dict(self.pool_mesh.shape)
        return (
            f"disaggregated: trainer {len(self.trainer_devices)} devices, pool "
            f"{len(self.pool_devices)} per process {shape}"
        )


def check_fields(section: ConfigDict | dict) -> None:
    """The device-free checks of the placement fields of `config.sampling`."""
    kind = section.get("placement", "colocated")
    if kind not in PLACEMENTS:
        raise ConfigError(f"config field sampling.placement: {kind!r} is not one of {PLACEMENTS}")
    n = section.get("pool_devices", 0)
    shape = tuple(section.get("pool_mesh", ()) or ())
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        raise ConfigError(f"config field sampling.pool_devices: must be an int >= 0, got {n!r}")
    if kind == "colocated":
        for name, value, off in (("pool_devices", n, 0), ("pool_mesh", shape, ())):
            if value != off:
                raise ConfigError(
                    f"config field sampling.{name}: {value!r} needs "
                    "sampling.placement='disaggregated' (colocated: the trainer's devices)"
                )
        return
    if n < 1:
        raise ConfigError(
            "config field sampling.pool_devices: sampling.placement='disaggregated' needs a "
            f"pool of >= 1 device per process, got {n}"
        )
    if shape and (any(not isinstance(s, int) or s < 1 for s in shape) or math.prod(shape) != n):
        raise ConfigError(
            f"config field sampling.pool_mesh: {shape} does not multiply to the pool's "
            f"sampling.pool_devices={n} devices"
        )


def split_devices(pool_devices: int, devices: Sequence[Any] | None = None):
    """(trainer devices of every process, this process's pool devices): each process's
    last `pool_devices` local devices (by id) go to the pool. ConfigError naming
    `sampling.pool_devices` when a process would keep no trainer device."""
    devices = list(jax.devices() if devices is None else devices)
    trainer, pool = [], []
    for p in sorted({d.process_index for d in devices}):
        mine = sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
        if pool_devices >= len(mine):
            raise ConfigError(
                f"config field sampling.pool_devices: {pool_devices} takes all of process "
                f"{p}'s {len(mine)} devices; the trainer needs >= 1 per process (its data "
                "axis splits the hosts' batches)"
            )
        trainer += mine[: len(mine) - pool_devices]
        if p == jax.process_index():
            pool = mine[len(mine) - pool_devices :]
    return trainer, pool


def placement_from_config(config: ConfigDict, devices: Sequence[Any] | None = None) -> Placement:
    """This process's Placement from `config.sampling` (ConfigError naming the field)."""
    section = config.sampling
    check_fields(section)
    kind = section.get("placement", "colocated")
    devices = list(jax.devices() if devices is None else devices)
    if kind == "colocated":
        return Placement(kind, tuple(devices))
    n = section.pool_devices
    trainer, pool = split_devices(n, devices)
    axes = tuple(config.mesh.axes)
    shape = tuple(section.pool_mesh) or (n,) + (1,) * (len(axes) - 1)
    if len(shape) != len(axes):
        raise ConfigError(
            f"config field sampling.pool_mesh: {shape} has {len(shape)} sizes for mesh.axes {axes}"
        )
    return Placement(kind, tuple(trainer), build_mesh(shape, axes, pool))


def trainer_sharder(config: ConfigDict, placement: Placement) -> Sharder:
    """The trainer's Sharder (mesh.shape over the trainer devices). Disaggregated: a
    mesh.shape the trainer's devices do not fit, or batch axes that do not divide
    rl.batch_size, raise ConfigError naming sampling.pool_devices."""
    if not placement.disaggregated:
        return sharder_from_config(config, placement.trainer_devices)
    n_pool = len(placement.pool_devices) * jax.process_count()
    what = (
        f"config field sampling.pool_devices: the pool takes {n_pool} devices and leaves "
        f"the trainer {len(placement.trainer_devices)}"
    )
    try:
        sharder = sharder_from_config(config, placement.trainer_devices)
    except ConfigError as e:
        raise ConfigError(f"{what}; {e}") from None
    shards = sharder.axis_size("batch")
    if config.rl.batch_size % shards:
        raise ConfigError(
            f"{what}, whose batch axes ({shards} shards) do not divide rl.batch_size "
            f"{config.rl.batch_size}; change mesh.shape or the pool size"
        )
    return sharder
