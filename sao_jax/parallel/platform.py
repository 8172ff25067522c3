"""The platform a program is traced for: the running backend, or the one a lowering targets.

Kernel choices that depend on the hardware ask `backend()` while a program is traced:
`attention_backends.resolve` ('auto': cuDNN flash on GPU, Pallas splash on TPU, compiled
rather than interpreted there), `moe.dispatch.resolve_impl` ('auto': `ragged_dot` on
accelerators) and `rl.gae.default_gae_impl`. Outside any context it is
`jax.default_backend()`. Inside `target("tpu")` (or "cuda", "gpu", "rocm", "cpu") a CPU host
traces the program that platform would run, which `jax.export.export(fn,
platforms=[...])` then lowers without the hardware: `lower` does both, and names the
program and the platform in any error (tests/test_lowering.py).

jit caches a trace per function object, so a program traced for one target must be
rebuilt (a new `jax.jit`, e.g. a new `Learner` or `GenerateFns`) to be traced for another:
`lower` takes a function that builds it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax

# jax.export platform names -> jax.default_backend() names (what the resolvers compare).
BACKEND_OF = {"cpu": "cpu", "tpu": "tpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("sao_target", default=None)


def backend() -> str:
    """'cpu', 'gpu' or 'tpu': the `target` in effect, else jax.default_backend()."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target(platform: str) -> Iterator[str]:
    """Traces inside this block choose the kernels of `platform` (a jax.export name)."""
    if platform not in BACKEND_OF:
        raise ValueError(f"platform: {platform!r} is not one of {tuple(BACKEND_OF)}")
    token = _TARGET.set(BACKEND_OF[platform])
    try:
        yield BACKEND_OF[platform]
    finally:
        _TARGET.reset(token)


class LoweringError(RuntimeError):
    """A program did not lower for a platform; the message names both."""


def lower(program: str, platform: str, build: Callable[[], Callable], *args: Any):
    """`jax.export.export(build(), platforms=[platform])(*args)`, traced inside
    `target(platform)`: the `jax.export.Exported` of the program that platform would run.

    `build()` returns the jitted program (built inside the context, so that no trace made
    for another platform is reused); `args` are arrays or ShapeDtypeStructs, with
    shardings on a `jax.sharding.AbstractMesh` for a mesh no host here has. Raises
    LoweringError("<program> for <platform>: ...") on any failure.
    """
    with target(platform):
        try:
            return jax.export.export(build(), platforms=[platform])(*args)
        except Exception as e:
            raise LoweringError(f"{program} for {platform}: {type(e).__name__}: {e}") from e
