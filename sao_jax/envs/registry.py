"""Environments by name: `make_env("arithmetic", max_turns=4)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sao_jax.envs.arithmetic import ArithmeticEnv
from sao_jax.envs.base import Env
from sao_jax.envs.python_tool import PythonToolEnv
from sao_jax.envs.style import StyleEnv

_FACTORIES: dict[str, Callable[..., Env]] = {
    "arithmetic": ArithmeticEnv,
    "python_tool": PythonToolEnv,
    "style": StyleEnv,
}
ENV_NAMES = tuple(_FACTORIES)


def make_env(name: str, **params: Any) -> Env:
    """A fresh env instance (one per sampler worker); params go to its constructor.

    Raises:
      ValueError: unknown name (the message lists ENV_NAMES) or an unknown parameter.
    """
    if name not in _FACTORIES:
        raise ValueError(f"unknown env {name!r}; known envs: {', '.join(ENV_NAMES)}")
    try:
        return _FACTORIES[name](**params)
    except TypeError as e:
        raise ValueError(f"make_env({name!r}): bad parameters {sorted(params)}: {e}") from None
