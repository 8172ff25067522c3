"""Versioned parameter publication: the learner publishes, sampler workers read atomically.

`publish(params, version)` replaces the (version, params) pair under a lock; a reader
gets one consistent pair from `latest()`. Workers read between engine steps only, so a
step never mixes versions. By default the params are copied on publish: the learner's
update step donates its state, which would otherwise free the arrays a worker is using.

Double buffering (`publish(..., when_ready=True)`, the weight sync of
sao_jax/sampling/rollouts.py): the params are a transfer still in flight (the learner's
update, then the cast-and-reshard to the pool, both dispatched asynchronously). They
become the current version only once every array has landed, in a background thread;
until then workers keep reading the previous version, so the pool decodes version v
while v + 1 lands. Versions land in publication order; a version still waiting when a
newer one is published is skipped (`superseded`: the learner ran ahead of the transfer).
`target` is the newest version published, landed or not (the learner's current version,
which the staleness cap measures against).
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from sao_jax.parallel.partition import Params


class ParamsStore:
    """The latest published (version, params); versions must strictly increase."""

    def __init__(self):
        self._cond = threading.Condition()
        self._version: int | None = None
        self._params: Params | None = None
        self._target: int | None = None  # newest version published (landed or landing)
        self._pending: tuple[int, Params, float] | None = None  # waiting for its arrays
        self._lander: threading.Thread | None = None
        self._error: BaseException | None = None  # a transfer that failed
        self._closed = False
        self.landed = 0  # versions that became current after landing
        self.superseded = 0  # versions skipped: a newer one was published before they landed
        self.landing_s = 0.0  # total seconds from publish to landed (update + transfer)

    def publish(
        self, params: Params, version: int, *, copy: bool = True, when_ready: bool = False
    ) -> None:
        """Makes `params` the current policy, tagged `version` (an int > the last one):
        now, or (`when_ready`) once every array is ready, in the background."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version: must be an int, got {type(version).__name__}")
        if copy:
            params = jax.tree.map(jnp.copy, params)
        with self._cond:
            self._raise_if_failed()
            if self._target is not None and version <= self._target:
                raise ValueError(
                    f"version: {version} does not increase on the published {self._target}"
                )
            self._target = version
            if not when_ready:
                self._version, self._params = version, params
                self._cond.notify_all()
                return
            if self._pending is not None:
                self.superseded += 1
            self._pending = (version, params, time.perf_counter())
            if self._lander is None:
                self._lander = threading.Thread(target=self._land, name="sao-weight-sync")
                self._lander.daemon = True  # never blocks interpreter exit
                self._lander.start()
            self._cond.notify_all()

    def _land(self) -> None:
        """The background swap: wait for the oldest pending version's arrays, then make it
        current (unless an even newer version was published meanwhile)."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                (version, params, t0), self._pending = self._pending, None
            try:
                jax.block_until_ready(params)
            except BaseException as e:  # a failed transfer: readers re-raise it
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._version, self._params = version, params
                self.landed += 1
                self.landing_s += time.perf_counter() - t0
                self._cond.notify_all()

    def close(self) -> None:
        """Ends the background thread once what is landing has landed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"weight sync failed: {self._error}") from self._error

    @property
    def version(self) -> int | None:
        """The current version (landed): what workers read."""
        with self._cond:
            return self._version

    @property
    def target(self) -> int | None:
        """The newest version published, landed or still landing."""
        with self._cond:
            return self._target

    def latest(self) -> tuple[int | None, Params | None]:
        """One consistent (version, params) pair; (None, None) before the first publish."""
        with self._cond:
            self._raise_if_failed()
            return self._version, self._params

    def wait_for(self, min_version: int, timeout: float) -> bool:
        """Blocks up to `timeout` s until a version >= min_version is current."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._error is not None
                    or (self._version is not None and self._version >= min_version)
                ),
                timeout,
            )
            self._raise_if_failed()
            return ok

    def wait_landed(self, timeout: float | None = None) -> bool:
        """Blocks until the newest published version is current (or `timeout` s)."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._error is not None or self._version == self._target, timeout
            )
            self._raise_if_failed()
            return ok
