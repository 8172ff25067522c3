"""Input checks shared by the RL math: shapes always, values in checked mode. (Its
metrics are sao_jax/rl/metrics.py; its estimators and losses are picked by name from
registries of the one mechanism, sao_jax/registry.py.)

Input checks come in two strengths:
- Shape, rank and dtype checks run always, at trace time (they cost nothing at run time).
- Value checks (mask entries in {0, 1}, lambda and gamma in [0, 1], rewards only on action
  tokens, ...) run in *checked mode* only. Turn it on per call with `checked=True`, or for
  a block of code with `with checked_mode():` (a per-call `checked=` wins). On concrete
  inputs a failed value check raises ValueError at once; on traced inputs (inside `jit`)
  it raises the same ValueError from a host callback when the step runs, which JAX
  surfaces as a runtime error whose text contains the message.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_CHECKED = contextvars.ContextVar("sao_rl_checked", default=False)


@contextlib.contextmanager
def checked_mode(enabled: bool = True) -> Iterator[None]:
    """Within the block, RL math functions run their value checks (unless `checked=False`)."""
    token = _CHECKED.set(bool(enabled))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def is_checked(checked: bool | None) -> bool:
    """The per-call `checked` flag, or the enclosing `checked_mode` when it is None."""
    return _CHECKED.get() if checked is None else bool(checked)


def _raise_unless(message: str, ok: Any) -> None:
    if not bool(ok):
        raise ValueError(message)


def require_value(ok: jax.Array | bool, message: str) -> None:
    """Raises ValueError(message) unless `ok` (a bool scalar), now or when the step runs."""
    if isinstance(ok, jax.core.Tracer):
        jax.debug.callback(functools.partial(_raise_unless, message), ok)
    else:
        _raise_unless(message, ok)


# ----------------------------------------------------------------------------- shapes


def shape_of(x: Any, name: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    return tuple(x.shape)


def check_bt(x: Any, name: str, bt: tuple[int, int] | None = None) -> tuple[int, int]:
    """Checks `x` is [B, T] (and equals `bt` when given); returns its shape."""
    shape = shape_of(x, name)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected shape [B, T], got {shape}")
    if bt is not None and shape != bt:
        raise ValueError(f"{name}: shape {shape} does not match [B, T] = {bt}")
    return shape  # type: ignore[return-value]


def check_b(x: Any, name: str, b: int) -> None:
    shape = shape_of(x, name)
    if shape != (b,):
        raise ValueError(f"{name}: expected shape [B] = ({b},), got {shape}")


def check_float(x: Any, name: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a float array, got dtype {x.dtype}")


def as_mask(mask: Any, name: str, bt: tuple[int, int] | None, checked: bool) -> jax.Array:
    """A bool [B, T] mask from a bool or 0/1 int/float array (entries != 0 count as on).

    Checked mode also requires every entry to be exactly 0 or 1.
    """
    bt = check_bt(mask, name, bt)
    dt = np.dtype(mask.dtype)
    if dt.kind not in "biuf":
        raise TypeError(f"{name}: expected a bool or 0/1 numeric mask, got dtype {dt}")
    mask = jnp.asarray(mask)
    if dt.kind == "b":
        return mask
    if checked:
        require_value(jnp.all((mask == 0) | (mask == 1)), f"{name}: entries must be 0 or 1")
    return mask != 0


_NUMBER = (int, float, np.integer, np.floating)  # host scalars: range-checked always


def as_unit_interval(x: Any, name: str, b: int, checked: bool) -> jax.Array:
    """A float32 [B] array from a scalar or [B] value; checked mode requires [0, 1]."""
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected a number or a [B] array, got a bool")
    arr = jnp.asarray(x, jnp.float32)
    if arr.ndim == 0:
        arr = jnp.broadcast_to(arr, (b,))
    elif arr.shape != (b,):
        raise ValueError(f"{name}: expected a scalar or shape [B] = ({b},), got {arr.shape}")
    if isinstance(x, _NUMBER) and not 0.0 <= x <= 1.0:
        raise ValueError(f"{name}: must be in [0, 1], got {x}")
    if checked:
        require_value(jnp.all((arr >= 0) & (arr <= 1)), f"{name}: entries must be in [0, 1]")
    return arr


def as_unit_scalar(x: Any, name: str, checked: bool) -> jax.Array:
    """A float32 scalar; Python numbers are range-checked always, arrays in checked mode."""
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected a number, got a bool")
    arr = jnp.asarray(x, jnp.float32)
    if arr.ndim != 0:
        raise ValueError(f"{name}: expected a scalar, got shape {arr.shape}")
    if isinstance(x, _NUMBER) and not 0.0 <= x <= 1.0:
        raise ValueError(f"{name}: must be in [0, 1], got {x}")
    if checked:
        require_value((arr >= 0) & (arr <= 1), f"{name}: must be in [0, 1]")
    return arr
