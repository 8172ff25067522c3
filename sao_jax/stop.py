"""The process-wide stop request: signal handlers set it, every wait polls it.

`checkpointing.GracefulExit` calls `request("SIGTERM")` from its handler. Nothing that
waits (the rollouts' `take`, the engine waiting for environment calls, the sampler's
workers) blocks longer than a poll interval without checking `requested()`; code on
the learner's side then raises `StopRequested`, which unwinds to the training loop, which
saves what is worth saving and exits 0. Setting the flag never interrupts a computation
(an update step finishes; the check comes at the next wait).
"""

from __future__ import annotations

import threading

_EVENT = threading.Event()
_reason: list[str] = []  # the first request's reason


class StopRequested(Exception):
    """A stop (SIGTERM / SIGINT) was requested while waiting; the loop saves and exits."""


def request(reason: str) -> None:
    """Sets the flag (safe in a signal handler: no locks, no I/O)."""
    if not _EVENT.is_set():
        _reason[:] = [reason]
    _EVENT.set()


def requested() -> bool:
    return _EVENT.is_set()


def reason() -> str | None:
    return _reason[0] if _reason else None


def clear() -> None:
    _EVENT.clear()
    _reason.clear()


def raise_if_requested(where: str) -> None:
    """Raises StopRequested naming `where` (what was waiting) when a stop was requested."""
    if _EVENT.is_set():
        raise StopRequested(f"stop requested ({reason() or 'stop'}) while {where}")


def sleep(seconds: float) -> bool:
    """Sleeps up to `seconds`; returns True at once when a stop is requested."""
    return _EVENT.wait(seconds)
