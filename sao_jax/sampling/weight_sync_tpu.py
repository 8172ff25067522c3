"""The TPU weight sync: JAX params into vLLM-TPU's (tpu-inference's) in-process model,
resharded onto the engine's own shardings. The reshard plan and its execution run on CPU
(tests/test_weight_payloads.py, 8 fake devices); reading and writing a live
tpu-inference model runner's state is a PLAN, never run (no TPU, no tpu-inference here).

On TPU the engine is JAX too, so nothing crosses a framework: tunix's vLLM sampler
(`tunix/generate/vllm_sampler.py`, `update_params`) runs vLLM in the trainer's process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), reaches the model runner
(`llm.llm_engine.model_executor.driver_worker.model_runner`), whose `state` is an nnx
State of jax.Arrays on the runner's `mesh`, and writes each leaf with the trainer's
value moved onto that leaf's sharding. This module does the same from models/hf.py's
export (the one mapping: weight_payloads.device_entries) in three steps:

1. `engine_targets(leaves, name_of)`: for each engine leaf (its path, shape, dtype,
   sharding), the Hugging Face tensor it takes and how (`view`, `perm`: leaf =
   transpose(reshape(hf_tensor, view), perm), the `safetensors_io.Source` convention).
   tpu-inference's JAX Qwen3-MoE gives its modules the checkpoint's prefixes
   (`model.layers.{i}.self_attn...`), and a weight loader of its reshapes and permutes
   q/k/v to [D, N, H] and o to [N, H, D], models/hf.py's own layout: `our_layout(cfg)`
   gives those transforms (read in its source, not run; a live engine's leaf names, its
   MoE experts' above all, are what `name_of` must be checked against).
2. `plan_reshard(payloads, targets)`: every exported tensor feeds exactly one leaf,
   every leaf's shape follows from its tensor's, dtypes are known; errors name the leaf.
3. `reshard(entries, plan)`: each tensor produced on the trainer's devices, cast,
   transposed, then `jax.device_put` onto the leaf's sharding (device to device over
   ICI when trainer and engine share a slice; the trainer's meshes and the engine's
   may differ in shape and axis names).

`apply_to_state(state, arrays)` assigns the arrays to an nnx State's leaves in place
(what tunix does to `model_runner.state`; flax 0.12's Variable API).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np

from sao_jax.models import hf
from sao_jax.models import safetensors_io as st
from sao_jax.models.config import ModelConfig
from sao_jax.sampling.weight_payloads import Payload, payload_plan, st_dtype


@dataclasses.dataclass(frozen=True)
class Target:
    """One engine leaf: where it is, which exported tensor it takes, and how."""

    path: str  # the leaf's path in the engine's state, '.'-joined
    name: str  # the Hugging Face tensor (hf_entries name) it takes
    shape: tuple[int, ...]  # the leaf's shape
    dtype: str  # the leaf's dtype name
    sharding: jax.sharding.Sharding
    view: tuple[int, ...] | None = None  # hf tensor reshaped so first (None: as is)
    perm: tuple[int, ...] | None = None  # then transposed so (None: as is)


# name_of(path, shape) -> (hf name, view, perm), or None for a leaf the sync skips
NameOf = Callable[[str, tuple[int, ...]], "tuple[str, tuple | None, tuple | None] | None"]


def our_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{hf name: (view, perm)} taking each Hugging Face tensor to models/hf.py's layout
    (the `Source` of tensor_map, for the tensors that map to one param whole: not the
    per-expert ones, which stack several tensors into one param)."""
    out = {}
    for src in hf.tensor_map(cfg).values():
        if src.stacked or src.select is not None:
            continue
        out[src.names[0]] = (tuple(s for g in src.split for s in g), tuple(src.perm))
    return out


def name_of_by_path(layouts: Mapping[str, tuple]) -> NameOf:
    """The rule where a leaf's path is its tensor's name (tpu-inference's JAX models):
    the leaf in Hugging Face shape as is, or in the shape `layouts[name]` gives."""

    def name_of(path: str, shape: tuple[int, ...]):
        if path in layouts:
            view, perm = layouts[path]
            if tuple(np.array(view)[list(perm)]) == tuple(shape):
                return path, view, perm
        return path, None, None

    return name_of


def engine_targets(leaves: Mapping[str, jax.Array], name_of: NameOf) -> list[Target]:
    """A Target for each engine leaf `name_of` names (path -> array or ShapeDtypeStruct,
    each with its sharding)."""
    out = []
    for path, leaf in leaves.items():
        got = name_of(path, tuple(leaf.shape))
        if got is None:
            continue
        name, view, perm = got
        out.append(
            Target(
                path, name, tuple(leaf.shape), np.dtype(leaf.dtype).name, leaf.sharding, view, perm
            )
        )
    return out


def _target_shape(payload: Payload, t: Target) -> tuple[int, ...]:
    view = t.view or payload.shape
    if math.prod(view) != math.prod(payload.shape):
        raise ValueError(
            f"weight sync: leaf {t.path}: view {view} does not hold {payload.name} {payload.shape}"
        )
    perm = t.perm or tuple(range(len(view)))
    if sorted(perm) != list(range(len(view))):
        raise ValueError(f"weight sync: leaf {t.path}: perm {perm} is not one of view {view}")
    return tuple(view[p] for p in perm)


def plan_reshard(payloads: Iterable[Payload], targets: Iterable[Target]) -> list[Target]:
    """The targets checked against the export: each tensor taken by exactly one leaf,
    each leaf's shape what its tensor gives, each dtype known. ValueError naming the
    first leaf or tensor that breaks it."""
    by_name = {p.name: p for p in payloads}
    taken: dict[str, str] = {}
    plan = list(targets)
    for t in plan:
        if t.name not in by_name:
            raise ValueError(f"weight sync: leaf {t.path} takes {t.name}, not in the export")
        if t.name in taken:
            raise ValueError(f"weight sync: {t.name} feeds leaves {taken[t.name]} and {t.path}")
        taken[t.name] = t.path
        shape = _target_shape(by_name[t.name], t)
        if shape != t.shape:
            raise ValueError(
                f"weight sync: leaf {t.path} has shape {t.shape}, {t.name} gives {shape}"
            )
        st_dtype(t.dtype)  # a dtype numpy knows
    left = [n for n in by_name if n not in taken]
    if left:
        raise ValueError(f"weight sync: {len(left)} exported tensors feed no leaf, first {left[0]}")
    return plan


def reshard(entries: Iterable[st.Entry], plan: list[Target]) -> dict[str, jax.Array]:
    """{leaf path: array on its sharding}: each tensor produced once (on the trainer's
    devices), reshaped, transposed and cast on them, then moved by `jax.device_put`."""
    by_name = {t.name: t for t in plan}
    out = {}
    for e in entries:
        t = by_name[e.name]
        x = e.produce()
        if t.view is not None:
            x = x.reshape(t.view)
        if t.perm is not None:
            x = x.transpose(t.perm)
        out[t.path] = jax.device_put(x.astype(st_dtype(t.dtype)), t.sharding)
    return out


def sync_plan(entries: list[st.Entry], leaves: Mapping[str, jax.Array], name_of: NameOf):
    """plan_reshard over the engine's leaves (engine_targets) and the export."""
    return plan_reshard(payload_plan(entries), engine_targets(leaves, name_of))


def apply_to_state(state, arrays: Mapping[str, jax.Array]) -> int:
    """Assigns `arrays` (path -> array) to an nnx State's leaves, in place; returns how
    many. KeyError naming a path the state lacks. A PLAN for tpu-inference's
    `model_runner.state` (tunix writes that state's leaves so): not run on an engine."""
    from flax import nnx

    leaves = {".".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}
    missing = [p for p in arrays if p not in leaves]
    if missing:
        raise KeyError(f"weight sync: the engine's state has no leaf {missing[0]}")
    for path, x in arrays.items():
        leaves[path].set_value(x)
    return len(arrays)
