"""Multi-controller JAX: one process per host, one global mesh (`jax.distributed`).

On a TPU pod slice or a GPU cluster every host runs the same program. Before any JAX
computation, `initialize(resolve(...))` connects the processes (coordinator address,
process count, this process's id: from flags, else the environment, else JAX's own
cluster detection: Cloud TPU metadata, SLURM, Open MPI, Kubernetes). After that
`jax.devices()` lists every chip of every host, the one mesh spans them all, and each
jitted update step is one SPMD program that every process runs in the same order.

Data enters as global arrays assembled from per-process pieces:
  * `global_batch`: each host's sampler produced B / P trajectories; the [B, T] batch is
    the concatenation over processes in process order (rows of process p are
    [p * B / P, (p + 1) * B / P)), built without any host holding all of it;
  * `global_from_replicated`: data every process computed identically (demonstrations
    from one seed): each device takes its slice of the host copy;
  * `agree_max`: the one scalar all hosts must agree on (the padded length T);
  * `agree_stop`: the stop decision (SIGTERM on any host), agreed once per step;
  * `allgather_bytes`: every host's own host state (its prompt position) for a checkpoint.
Samplers run per host and asynchronously, so they must not run multi-process programs:
`host_local` turns the (global, sharded) policy into arrays on this host's devices only.

CPU (tests): collectives between processes go through gloo
(`jax_cpu_collectives_implementation`, the default in jax 0.10).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.schema import ConfigError

MODES = ("auto", "detect", "off")
# Environment variables read when the flag of the same meaning is not given.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # host:port of process 0 (jax reads it too)
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # comma-separated (jax reads it too)
# Variables that mean "launched as one of several processes of a cluster JAX can detect":
# mode 'auto' then hands over to jax's own detection (TPU pods, SLURM, Open MPI).
CLUSTER_MARKERS = (
    ("TPU_WORKER_HOSTNAMES", ","),  # multi-host TPU slice: comma-separated workers
    ("TPU_PROCESS_ADDRESSES", ","),
    ("SLURM_NTASKS", ">1"),
    ("OMPI_COMM_WORLD_SIZE", ">1"),
)


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """How this process joins the run: 'single' (no jax.distributed), 'explicit'
    (coordinator, count and id known) or 'detect' (jax detects the cluster)."""

    kind: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    timeout_s: int = 300

    @property
    def multi_process(self) -> bool:
        return self.kind != "single"


def _int(value: str | int | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not an int") from None


def _cluster_detected(env: Mapping[str, str]) -> bool:
    for var, rule in CLUSTER_MARKERS:
        value = env.get(var, "")
        if rule == "," and "," in value:
            return True
        if rule == ">1" and value.isdigit() and int(value) > 1:
            return True
    return False


def resolve(
    mode: str = "auto",
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | str | None = None,
    timeout_s: int = 300,
    env: Mapping[str, str] | None = None,
) -> DistributedSpec:
    """The DistributedSpec of this process from flags, then environment variables.

    mode 'off': one process, and no coordinator/count/id may be given. 'detect': always
    `jax.distributed.initialize()` with whatever is given (jax fills in the rest from
    the cluster: the TPU pod launcher uses this). 'auto' (default): explicit when a
    coordinator, count or id is given by flag or JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID (then all three are needed, unless the count is
    1); 'detect' when a multi-host cluster is visible in the environment
    (CLUSTER_MARKERS); else one process. Raises ConfigError naming the flag.
    """
    env = os.environ if env is None else env
    if mode not in MODES:
        raise ConfigError(f"flag --distributed: {mode!r} is not one of {MODES}")
    coord = coordinator_address or env.get(ENV_COORDINATOR) or None
    count = _int(num_processes, "flag --num_processes")
    if count is None:
        count = _int(env.get(ENV_NUM_PROCESSES), ENV_NUM_PROCESSES)
    pid = _int(process_id, "flag --process_id")
    if pid is None:
        pid = _int(env.get(ENV_PROCESS_ID), ENV_PROCESS_ID)
    ids = local_device_ids if local_device_ids is not None else env.get(ENV_LOCAL_DEVICE_IDS)
    if isinstance(ids, str):
        ids = [_int(s, "flag --local_device_ids") for s in ids.split(",") if s.strip()] or None
    ids = tuple(ids) if ids is not None else None
    given = (coord, count, pid) != (None, None, None)
    if count is not None and count < 1:
        raise ConfigError(f"flag --num_processes: must be >= 1, got {count}")
    if pid is not None and count is not None and not 0 <= pid < count:
        raise ConfigError(f"flag --process_id: {pid} is not in [0, num_processes={count})")
    if mode == "off":
        if given and count != 1:
            raise ConfigError(
                "flag --distributed=off, but a coordinator, process count or process id "
                f"is set (coordinator={coord!r}, num_processes={count}, process_id={pid})"
            )
        return DistributedSpec("single")
    if mode == "detect":
        return DistributedSpec("detect", coord, count, pid, ids, timeout_s)
    if given:
        if count == 1 and pid in (None, 0):
            return DistributedSpec("single")
        for flag, value in (
            ("--coordinator_address", coord),
            ("--num_processes", count),
            ("--process_id", pid),
        ):
            if value is None:
                raise ConfigError(
                    f"flag {flag}: needed with the other multi-process settings "
                    f"(coordinator={coord!r}, num_processes={count}, process_id={pid}); "
                    "set it or its JAX_* environment variable"
                )
        return DistributedSpec("explicit", coord, count, pid, ids, timeout_s)
    if _cluster_detected(env):
        return DistributedSpec("detect", None, None, None, ids, timeout_s)
    return DistributedSpec("single")


def initialize(spec: DistributedSpec) -> bool:
    """Calls `jax.distributed.initialize` for a multi-process spec (before any JAX
    computation); returns whether this process is part of a multi-process run."""
    if not spec.multi_process:
        return False
    if jax.distributed.is_initialized():
        return True
    jax.distributed.initialize(
        coordinator_address=spec.coordinator_address,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        initialization_timeout=spec.timeout_s,
    )
    return True


def is_primary() -> bool:
    """Process 0 logs, writes metrics and the report."""
    return jax.process_index() == 0


def local_batch_size(global_size: int, field: str = "rl.batch_size") -> int:
    """B / P trajectories per host; ConfigError naming `field` when P does not divide B."""
    p = jax.process_count()
    if global_size % p:
        raise ConfigError(
            f"config field {field}: {global_size} is not divisible by the {p} processes"
        )
    return global_size // p


def agree_max(value: int) -> int:
    """max over processes of an int (collective: every process must call it)."""
    if jax.process_count() == 1:
        return int(value)
    gathered = multihost_utils.process_allgather(np.asarray(value, np.int64))
    return int(np.max(gathered))


def allgather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data`, in process order (collective: every process calls it at
    the same point). Host state only (a prompt iterator's position), never tensors.
    One process: [data]."""
    if jax.process_count() == 1:
        return [bytes(data)]
    n = np.asarray(len(data), np.int64)
    lengths = np.asarray(multihost_utils.process_allgather(n)).reshape(-1)
    buf = np.zeros(int(lengths.max()), np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf))
    return [rows[p, : int(lengths[p])].tobytes() for p in range(jax.process_count())]


def agree_stop(local: bool) -> bool:
    """Whether any process wants to stop (a SIGTERM reached it, or its wait was
    interrupted): one tiny all-reduce, so every process takes the same decision before
    the next collective (an update step, a save) and all save the same step. Collective:
    every process calls it at the same point of the loop. One process: `local`."""
    if jax.process_count() == 1:
        return bool(local)
    return agree_max(int(bool(local))) > 0


def _check_rows(sharding: NamedSharding, global_shape: tuple[int, ...], local_rows: int) -> None:
    """Each process must own exactly `local_rows` distinct batch rows, a contiguous block."""
    starts = set()
    for idx in sharding.addressable_devices_indices_map(global_shape).values():
        start, stop, _ = idx[0].indices(global_shape[0])
        starts.add((start, stop))
    lo, hi = min(s for s, _ in starts), max(e for _, e in starts)
    if hi - lo != local_rows:
        raise ConfigError(
            f"config field mesh.rules: the batch sharding {sharding.spec} gives this process "
            f"rows [{lo}, {hi}) of {global_shape[0]}, but each of the {jax.process_count()} "
            f"processes brings {local_rows}; shard 'batch' over mesh axes that split hosts"
        )


def global_batch(
    local: Mapping[str, np.ndarray],
    sharding: NamedSharding | None,
    *,
    id_fields: Sequence[str] = ("group_ids",),
) -> dict[str, Any]:
    """Global [B, ...] arrays from this process's [B / P, ...] rows.

    Process p's rows form one contiguous block (rows [p B/P, (p+1) B/P) on a mesh whose
    devices are in process order). Ids in `id_fields` number things within one
    process's rows (>= 0; -1 = none): they are offset by p * B / P so that they stay
    distinct in the global batch. Every leaf must have the same leading size and every
    process the same trailing shapes (agree on T first). Single process: the local dict
    unchanged (jit places it).
    """
    if jax.process_count() == 1 or sharding is None:
        return dict(local)
    p = jax.process_count()
    sizes = {k: np.shape(v)[0] for k, v in local.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"local batch: leading sizes differ across fields {sizes}")
    rows = next(iter(sizes.values()))
    out = {}
    for name, x in local.items():
        x = np.asarray(x)
        if name in id_fields:
            x = np.where(x >= 0, x + jax.process_index() * rows, x).astype(x.dtype)
        shape = (rows * p, *x.shape[1:])
        spec = PartitionSpec(*sharding.spec[: x.ndim])
        leaf_sharding = NamedSharding(sharding.mesh, spec)
        _check_rows(leaf_sharding, shape, rows)
        out[name] = jax.make_array_from_process_local_data(leaf_sharding, x, shape)
    return out


def process_shard(dataset):
    """`dataset[p::P]`: this process's share of a grain MapDataset (the shares of all
    processes are disjoint and interleave to the whole); single process: `dataset`."""
    p, n = jax.process_index(), jax.process_count()
    return dataset if n == 1 else dataset[p::n]


def global_from_replicated(tree: Any, sharding: NamedSharding | None) -> Any:
    """Global arrays from host data that every process holds identically (same seed).

    Leaves are split along their leading axis by `sharding`'s spec (trailing axes
    replicated); single process: the tree unchanged.
    """
    if jax.process_count() == 1 or sharding is None:
        return tree

    def one(x):
        x = np.asarray(x)
        leaf = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[: x.ndim]))
        return jax.make_array_from_callback(x.shape, leaf, lambda idx: x[idx])

    return jax.tree.map(one, tree)


def host_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """`devices` (default: all) as a ('hosts', 'local') mesh: row p = process p's devices
    among them."""
    p = jax.process_count()
    devices = jax.devices() if devices is None else devices
    rows = [sorted((d for d in devices if d.process_index == i), key=lambda d: d.id)
            for i in range(p)]  # fmt: skip
    if len({len(r) for r in rows}) != 1:
        counts = [len(r) for r in rows]
        raise ValueError(f"host_mesh: processes hold different device counts {counts}")
    return Mesh(np.array(rows), ("hosts", "local"))


def cast_floating(tree: Any, dtype: Any = None) -> Any:
    """Floating leaves cast to `dtype` (None: unchanged); other leaves as they are."""

    def one(x):
        floating = jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
        return x.astype(dtype) if dtype is not None and floating and x.dtype != dtype else x

    return jax.tree.map(one, tree)


def first_divisible_spec(shape: Sequence[int], axis: str, size: int) -> PartitionSpec:
    """Split the first dimension that `size` divides over mesh axis `axis`; else replicate
    (the host-local sampler layout of `host_local`)."""
    for d, n in enumerate(shape):
        if n >= size and n % size == 0:
            return PartitionSpec(*([None] * d), axis)
    return PartitionSpec()


def host_local(tree: Any, dtype: Any = None, devices: Sequence[Any] | None = None) -> Any:
    """This host's copy of a tree of global arrays, on its own devices only, with
    floating leaves cast to `dtype` when given (a no-op where they already have it).

    Several processes: each leaf is resharded, collectively (every process must call
    this, in the same order), to be replicated across hosts and split over each host's
    devices along its first divisible dimension; the local shards then form an array on
    a one-host mesh, which per-host samplers use in their own jitted programs. `devices`
    are the devices the leaves live on (default: all; a disaggregated run's trainer
    devices, sao_jax/parallel/placement.py). One process: the (cast) tree, shardings
    unchanged.
    """
    tree = cast_floating(tree, dtype)
    if jax.process_count() == 1:
        return tree
    mesh = host_mesh(devices)
    n_local = mesh.shape["local"]
    local_mesh = Mesh(mesh.devices[jax.process_index()], ("local",))

    def one(x):
        spec = first_divisible_spec(x.shape, "local", n_local)
        y = jax.device_put(x, NamedSharding(mesh, spec))
        local = NamedSharding(local_mesh, spec)
        by_device = {s.device: s.data for s in y.addressable_shards}
        arrays = [by_device[d] for d in local_mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(x.shape, local, arrays)

    return jax.tree.map(one, tree)


def gather_to_host(tree: Any) -> Any:
    """Numpy copies of the full values of global arrays on every process (collective)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, jax.device_get(tree))
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
