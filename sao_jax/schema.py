"""Config errors and per-section validators (the leaf every config-consuming module imports).

`sao_jax.config.validate` runs the validators registered here (a registry of the one
mechanism, sao_jax/registry.py); keeping them in this module, which imports nothing of
the project but that registry, lets each section's checks live beside the code that
consumes the section without import cycles.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

from sao_jax.registry import Registry

ConfigDict = ml_collections.ConfigDict


class ConfigError(ValueError):
    """A config field, batch field or checkpoint tensor is missing, unknown, mistyped or
    out of range. The message names it."""


Validator = Callable[[ConfigDict], None]
# Section name -> its validator (a module reloaded registers its validator again).
VALIDATORS: Registry[Validator] = Registry("config section validator", replace=True)


def register_validator(section: str) -> Callable[[Validator], Validator]:
    """Registers `fn(config)` to check the top-level `section` of a run config."""

    def wrap(fn: Validator) -> Validator:
        VALIDATORS.register(section, fn)
        return fn

    return wrap


def require(ok: bool, field: str, message: str) -> None:
    """Raises ConfigError naming `field` unless `ok`."""
    if not ok:
        raise ConfigError(f"config field {field}: {message}")
