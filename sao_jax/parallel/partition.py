"""From an abstract model (`nnx.eval_shape`) to parameter shardings and sharded params.

Parameters travel through the jitted code as pure nested dicts of arrays (the output of
`nnx.to_pure_dict`); `ModelDef` holds the graph and the abstract state with each
parameter's logical axes, and rebinds a params dict into a module inside a traced
function. Shardings are always derived from the abstract state, never written by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from sao_jax.parallel.mesh import Sharder
from sao_jax.schema import ConfigError

Params = dict[str, Any]


def path_str(path) -> str:
    """'trunk.layers.0.attn.q_proj' from a pytree key path."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """A model's structure without its values: bind(params) -> module, axes, shapes."""

    graphdef: Any
    abstract: Any  # nnx.State of ShapeDtypeStruct-valued Params with `axes` metadata

    @classmethod
    def of(cls, ctor: Callable[[], nnx.Module]) -> ModelDef:
        graphdef, abstract = nnx.split(nnx.eval_shape(ctor), nnx.Param)
        return cls(graphdef, abstract)

    def bind(self, params: Params) -> nnx.Module:
        """A module using `params` (a pure dict with this model's structure)."""
        state = jax.tree.map(lambda v: v, self.abstract)  # fresh copy; filled in place
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def shapes(self) -> Params:
        """Pure dict of jax.ShapeDtypeStruct."""
        return nnx.to_pure_dict(self.abstract)

    def axes(self) -> Params:
        """Pure dict of logical-axis tuples, one per parameter."""
        out = nnx.to_pure_dict(
            jax.tree.map(
                lambda v: v.replace(v.get_metadata().get("axes", (None,) * len(v.shape))),
                self.abstract,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )
        )
        return out

    def shardings(self, sharder: Sharder) -> Params | None:
        """Pure dict of NamedSharding, or None unsharded. Raises ConfigError naming the
        parameter when a sharded dimension is not divisible by its mesh axes."""
        if sharder.mesh is None:
            return None
        shapes, axes = self.shapes(), self.axes()
        return jax.tree_util.tree_map_with_path(
            lambda path, s, a: sharder.named(
                a, s.shape, strict=True, what=f"parameter {path_str(path)}"
            ),
            shapes,
            axes,
            is_leaf=lambda x: (
                isinstance(x, tuple) and all(isinstance(e, (str, type(None))) for e in x)
            ),
        )


def init_params(ctor: Callable[[], nnx.Module], sharder: Sharder) -> tuple[ModelDef, Params]:
    """Initialises a model's params directly into their shardings (no host copy)."""
    mdef = ModelDef.of(ctor)
    shardings = mdef.shardings(sharder)

    def make():
        return nnx.to_pure_dict(nnx.state(ctor(), nnx.Param))

    params = jax.jit(make, out_shardings=shardings)()
    return mdef, params


def tree_bytes(tree, per_device: bool = False, shardings=None) -> int:
    """Bytes of a tree of arrays or ShapeDtypeStructs (per device when shardings given)."""
    leaves = jax.tree.leaves(tree)
    if not per_device or shardings is None:
        return sum(x.size * x.dtype.itemsize for x in leaves)
    shard_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    total = 0
    for x, s in zip(leaves, shard_leaves, strict=True):
        shard_shape = s.shard_shape(x.shape)
        n = 1
        for d in shard_shape:
            n *= d
        total += n * x.dtype.itemsize
    return total


def check_params(params: Params, mdef: ModelDef, what: str = "params") -> None:
    """Raises ConfigError naming the first missing, extra or misshapen parameter."""
    expected = {path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(mdef.shapes())}
    got = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    for name in sorted(expected):
        if name not in got:
            raise ConfigError(f"{what}: missing parameter {name}")
        if tuple(got[name].shape) != tuple(expected[name].shape):
            raise ConfigError(
                f"{what}: parameter {name} has shape {tuple(got[name].shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    extra = sorted(set(got) - set(expected))
    if extra:
        raise ConfigError(f"{what}: unexpected parameter {extra[0]}")
