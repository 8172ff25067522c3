"""GracefulExit: turn SIGTERM / SIGINT into a flag the training loop polls.

    with GracefulExit() as stop:
        while step < total and not stop.requested:
            ...  # one update
        ckpt.save(step, state, meta, force=True); ckpt.wait()

The first signal only sets `requested` (the current update finishes, the loop saves and
returns, the process exits 0) and the process-wide flag of `sao_jax.stop`, which every
wait polls (the rollouts' `take` raises `StopRequested` within a poll interval). A
second SIGINT (Ctrl-C twice) raises KeyboardInterrupt. The previous handlers come back
on exit, and the flag is cleared on entry and exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence

from sao_jax import stop

log = logging.getLogger(__name__)


class GracefulExit:
    """Context manager installing handlers for `signals` (main thread only)."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.signal: int | None = None  # the first signal received
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulExit:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("GracefulExit: enter it in the main thread (signals arrive there)")
        stop.clear()
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous = {}
        stop.clear()

    @property
    def requested(self) -> bool:
        """A signal arrived (or `stop.request` was called) since entering."""
        return stop.requested()

    def _handle(self, signum: int, frame) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt(f"second signal ({name}) while stopping")
        if not self.requested:
            self.signal = signum
        stop.request(name)
        log.warning(
            "received %s: finishing the current step, saving a checkpoint, exiting "
            "(press Ctrl-C again to abort)",
            name,
        )
