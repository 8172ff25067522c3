"""Device mesh from config and the one logical-axis rules table.

Model code names every parameter and key activation dimension by meaning (`embed`,
`q_heads`, `expert`, `batch`, ...). `config.mesh.rules` maps each logical name to zero,
one or several mesh axes. `Sharder` carries (mesh, rules) into the layers, which call
`sharder.constrain(x, names)`; with no mesh it is a no-op, so the same model code runs
unsharded in tests and on a laptop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None = replicated). Parameters first,
# then activations (prefixed `act_` where a parameter uses the same word, so that an
# activation never asks for the mesh axis its batch dimension already uses).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("router_experts", None),
    ("norm", None),
    ("value_out", None),
    ("layers", None),  # leading axis of stacked decoder layers (model.scan_layers)
    # activations
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_topk", None),
    ("cache_length", None),
)

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def rules_dict(rules: Rules) -> dict[str, tuple[str, ...]]:
    """Normalises a rules table to name -> tuple of mesh axes (empty = replicated)."""
    out = {}
    for name, axes in rules:
        if axes is None:
            out[name] = ()
        elif isinstance(axes, str):
            out[name] = (axes,)
        else:
            out[name] = tuple(axes)
    return out


def build_mesh(shape: Sequence[int], axes: Sequence[str] = MESH_AXES, devices=None) -> Mesh:
    """Builds a mesh whose axis sizes multiply to the device count; one size may be -1.

    Raises ConfigError naming `mesh.shape` when the sizes cannot cover the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = [int(s) for s in shape]
    n = len(devices)
    if len(shape) != len(axes):
        raise ConfigError(
            f"config field mesh.shape: {shape} has {len(shape)} sizes for axes {axes}"
        )
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ConfigError(f"config field mesh.shape: {shape}: sizes must be >= 1, one may be -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if n % known:
            raise ConfigError(
                f"config field mesh.shape: fixed sizes multiply to {known}, which does not "
                f"divide the {n} devices"
            )
        shape[shape.index(-1)] = n // known
    if math.prod(shape) != n:
        raise ConfigError(
            f"config field mesh.shape: {dict(zip(axes, shape))} needs {math.prod(shape)} "
            f"devices, but {n} are present"
        )
    device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def mesh_from_config(mesh_cfg: ConfigDict, devices=None) -> Mesh:
    return build_mesh(mesh_cfg.shape, mesh_cfg.axes, devices)


@dataclasses.dataclass(frozen=True)
class Sharder:
    """Maps logical dimension names to shardings on `mesh` through `rules`.

    `mesh=None` means unsharded: every method is then the identity / None.
    """

    mesh: Mesh | None = None
    rules: Rules = DEFAULT_RULES

    @property
    def table(self) -> dict[str, tuple[str, ...]]:
        return rules_dict(self.rules)

    def mesh_axes(self, name: str | None) -> tuple[str, ...]:
        """Mesh axes of one logical name, keeping only axes the mesh has."""
        if name is None or self.mesh is None:
            return ()
        table = self.table
        if name not in table:
            raise ConfigError(f"config field mesh.rules: no rule for logical axis {name!r}")
        return tuple(a for a in table[name] if a in self.mesh.axis_names)

    def spec(
        self,
        names: Sequence[str | None],
        shape: Sequence[int] | None = None,
        *,
        strict: bool = False,
        what: str = "array",
    ) -> PartitionSpec:
        """PartitionSpec for a dimension-name tuple.

        A mesh axis already used by an earlier dimension is skipped (an array cannot be
        split twice over one axis). With `shape`, axes that do not divide a dimension are
        dropped, or raise a ConfigError naming `what` when `strict` (parameters).
        """
        used: set[str] = set()
        entries = []
        for d, name in enumerate(names):
            axes = [a for a in self.mesh_axes(name) if a not in used]
            if shape is not None and axes:
                size = math.prod(self.mesh.shape[a] for a in axes)
                if shape[d] % size:
                    if strict:
                        raise ConfigError(
                            f"{what}: dimension {d} ({name!r}, size {shape[d]}) is not divisible "
                            f"by mesh axes {axes} (size {size}); change mesh.shape or mesh.rules"
                        )
                    axes = [a for a in axes if shape[d] % self.mesh.shape[a] == 0][:1]
            used.update(axes)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        return PartitionSpec(*entries)

    def named(self, names, shape=None, *, strict=False, what="array") -> NamedSharding | None:
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, self.spec(names, shape, strict=strict, what=what))

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """`with_sharding_constraint` by logical names; identity when unsharded."""
        if self.mesh is None:
            return x
        assert x.ndim == len(names), (x.shape, names)
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, self.spec(names, x.shape))
        )

    def axis_size(self, name: str) -> int:
        """Number of shards a logical name splits into (1 when unsharded)."""
        return math.prod(self.mesh.shape[a] for a in self.mesh_axes(name)) if self.mesh else 1


def sharder_from_config(config: ConfigDict, devices=None) -> Sharder:
    return Sharder(mesh_from_config(config.mesh, devices), tuple(map(tuple, config.mesh.rules)))


@register_validator("mesh")
def _validate_section(config: ConfigDict) -> None:
    m = config.mesh
    require(len(m.axes) == len(m.shape), "mesh.shape", f"{m.shape} does not match axes {m.axes}")
    require(len(set(m.axes)) == len(m.axes), "mesh.axes", f"duplicate axis names in {m.axes}")
    for name, axes in m.rules:
        for a in (axes,) if isinstance(axes, str) else axes or ():
            require(a in m.axes, "mesh.rules", f"rule {name!r} names unknown mesh axis {a!r}")
