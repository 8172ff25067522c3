"""Versioned parameter publication: the learner publishes, sampler workers read atomically.

`publish(params, version)` replaces the (version, params) pair under a lock; a reader
gets one consistent pair from `latest()`. Workers read between decode steps only, so a
step never mixes versions. By default the params are copied on publish: the learner's
update step donates its state, which would otherwise free the arrays a worker is using.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp

from sao_jax.parallel.partition import Params


class ParamsStore:
    """The latest published (version, params); versions must strictly increase."""

    def __init__(self):
        self._cond = threading.Condition()
        self._version: int | None = None
        self._params: Params | None = None

    def publish(self, params: Params, version: int, *, copy: bool = True) -> None:
        """Makes `params` the current policy, tagged `version` (an int > the last one)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version: must be an int, got {type(version).__name__}")
        if copy:
            params = jax.tree.map(jnp.copy, params)
        with self._cond:
            if self._version is not None and version <= self._version:
                raise ValueError(
                    f"version: {version} does not increase on the published {self._version}"
                )
            self._version, self._params = version, params
            self._cond.notify_all()

    @property
    def version(self) -> int | None:
        with self._cond:
            return self._version

    def latest(self) -> tuple[int | None, Params | None]:
        """One consistent (version, params) pair; (None, None) before the first publish."""
        with self._cond:
            return self._version, self._params

    def wait_for(self, min_version: int, timeout: float) -> bool:
        """Blocks up to `timeout` s until a version >= min_version is published."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._version is not None and self._version >= min_version, timeout
            )
