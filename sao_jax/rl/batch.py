"""The training batch's checks: its fields (declared once in sao_jax/batch_schema.py) and
the one rule that divides its rows among minibatches, microbatches and shards.

A padded batch holds single trajectories as [B, T] arrays; a packed one adds the same
tokens packed several per row, [R, Lp] (sao_jax/rl/packing.py). Token alignment, shapes,
padding values and which estimator or loss needs each field: sao_jax/batch_schema.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.batch_schema import AXIS_NAMES, BATCH_FIELDS, NEEDS, fields_for
from sao_jax.schema import ConfigError

_KINDS = {"i": ("iu", "int"), "f": ("f", "float"), "b": ("b", "bool")}


def check_divisible(
    rows: int, what: str, *, minibatches: int = 1, microbatches: int = 1, shards: int = 1
) -> None:
    """The one batch division rule: `rows` split into `minibatches` optimizer steps
    (rl.minibatches), each accumulated over `microbatches` passes (rl.microbatches), each
    pass spread evenly over `shards` data-parallel shards; so rows % (minibatches x
    microbatches x shards) == 0. Raises ConfigError `what: rows is not divisible by ...`
    naming the factors above 1. Used by the rl section's validator (no mesh yet),
    `sao_jax.run.settings.check_run` (with the mesh) and `Learner.check_batch` (the batch).
    """
    factors = [
        (f"rl.minibatches ({minibatches})", minibatches),
        (f"rl.microbatches ({microbatches})", microbatches),
        (f"the data-parallel shards ({shards})", shards),
    ]
    if rows % (minibatches * microbatches * shards):
        named = " x ".join(name for name, n in factors if n > 1)
        raise ConfigError(f"{what}: {rows} is not divisible by {named}")


def check_batch(
    batch: dict[str, Any], *, needs: Iterable[str] = (), need_groups: bool = False
) -> None:
    """Raises ConfigError naming the first unknown, missing, misshapen or mistyped field.

    Present: every field of `fields_for(needs)` (`need_groups`: the 'groups' need too;
    one packed field given: the 'packed' need too). Each field's rank and dtype kind are
    its declaration's, and each axis letter has one size over the batch."""
    extra = sorted(set(batch) - set(BATCH_FIELDS))
    if extra:
        raise ConfigError(f"batch: unknown field {extra[0]!r}; known: {sorted(BATCH_FIELDS)}")
    needs = set(needs) | ({"groups"} if need_groups else set())
    packed = [k for k, f in BATCH_FIELDS.items() if "packed" in f.needs and k in batch]
    if packed:  # one packed field given: all of them
        needs.add("packed")
    required = set(fields_for(needs))
    sizes: dict[str, int] = {}  # axis letter -> its size, from the first field that has it
    for name, f in BATCH_FIELDS.items():  # the first bad field in declaration order
        if name not in batch:
            if name in required:
                given = (
                    f"packed field {packed[0]!r} given but "
                    if packed and "packed" in f.needs
                    else ""
                )
                why = "; ".join(NEEDS[n] for n in sorted(f.needs))
                why = f" ({why})" if why else ""
                raise ConfigError(f"batch: {given}missing field {name!r}{why}")
            continue
        x = batch[name]
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        if len(shape) != len(f.axes):
            raise ConfigError(
                f"batch field {name!r}: rank {len(shape)} != {len(f.axes)} (shape {shape})"
            )
        kinds, want = _KINDS[np.dtype(f.dtype).kind]
        if dtype.kind not in kinds:
            raise ConfigError(f"batch field {name!r}: dtype {dtype} is not {want}")
        for axis, n in zip(f.axes, shape, strict=True):
            size = sizes.setdefault(axis, n)
            if n != size:
                raise ConfigError(f"batch field {name!r}: {AXIS_NAMES[axis]} {n} != {size}")


def token_staleness(step: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """[B, T] policy versions between the learner's `step` (its policy pi_step) and the
    policy that sampled each action token, max(step - versions, 0); 0 off action tokens.
    What the policy losses and the token dump read as staleness."""
    return jnp.where(batch["action_mask"], jnp.maximum(step - batch["versions"], 0), 0)
