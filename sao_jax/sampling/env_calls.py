"""Environment calls off the decoding thread: a bounded pool of daemon threads.

`EnvCalls(workers, timeout_s)` runs `env.reset` / `env.step` calls, at most `workers` at a
time, each in a daemon thread (a call that hangs forever never blocks interpreter exit).
A call's clock starts when it gets a worker slot; past `timeout_s` it is abandoned: its
slot is given back at once, the engine drops that trajectory (`env_timeout`) and builds
a fresh env for the slot, and the thread keeps running until the call returns, counted
in `stuck`. More than `max_stuck` abandoned calls still running means the environment
hangs for good: `EnvCallsStuck` (fatal, it names the calls' functions).

Every wait here calls `check()` every `poll_s`; what it raises ends the wait (the pending
calls are abandoned). The default raises `StopRequested` once a stop was requested
(SIGTERM), so a stop is honoured within a poll interval even when a call never returns;
the rollouts add their deadline (TimeoutError), the async sampler its stop event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sao_jax import stop


class EnvTimeoutError(TimeoutError):
    """An environment call did not return within env_timeout_s."""


class EnvCallsStuck(RuntimeError):
    """Too many abandoned environment calls are still running (the env hangs)."""


class EnvCall:
    """One submitted call: `done` once it returned, raised or was abandoned."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.started: float | None = None  # monotonic time it got a worker slot
        self.finished = threading.Event()  # the function returned or raised
        self.abandoned = False  # timed out (error is an EnvTimeoutError)
        self._slot_held = False

    @property
    def done(self) -> bool:
        return self.finished.is_set() or self.abandoned


class EnvCalls:
    """The pool; thread-safe submit, single-consumer wait (the engine's thread)."""

    def __init__(
        self,
        workers: int = 8,
        timeout_s: float | None = None,
        *,
        poll_s: float = 0.05,
        max_stuck: int | None = None,
        check: Callable[[], None] | None = None,
    ):
        if workers < 1:
            raise ValueError(f"EnvCalls workers: must be >= 1, got {workers}")
        self.workers, self.timeout_s, self.poll_s = workers, timeout_s, poll_s
        self.max_stuck = 4 * workers if max_stuck is None else max_stuck
        self.check = check or (lambda: stop.raise_if_requested("waiting for environment calls"))
        self._slots = threading.Semaphore(workers)
        self._lock = threading.Lock()
        self._stuck: list[EnvCall] = []

    @property
    def stuck(self) -> int:
        with self._lock:
            self._stuck = [c for c in self._stuck if not c.finished.is_set()]
            return len(self._stuck)

    def submit(self, fn: Callable[..., Any], *args: Any) -> EnvCall:
        call = EnvCall(fn, args)
        name = f"env-call-{getattr(fn, '__name__', 'fn')}"
        threading.Thread(target=self._run, args=(call,), name=name, daemon=True).start()
        return call

    def _run(self, call: EnvCall) -> None:
        while not self._slots.acquire(timeout=self.poll_s):
            if call.abandoned:  # the waiter gave up before the call started
                return
        with self._lock:
            if call.abandoned:
                self._slots.release()
                return
            call.started, call._slot_held = time.monotonic(), True
        try:
            call.result = call.fn(*call.args)
        except BaseException as e:
            call.error = e
        finally:
            with self._lock:
                if call._slot_held:
                    call._slot_held = False
                    self._slots.release()
            call.finished.set()

    def _abandon(self, call: EnvCall, error: BaseException | None) -> None:
        with self._lock:
            if call.finished.is_set():
                return
            call.abandoned, call.error = True, error
            if call._slot_held:  # give the slot back; the thread runs on, unslotted
                call._slot_held = False
                self._slots.release()
                self._stuck.append(call)

    def wait(self, calls: Iterable[EnvCall], *, every: bool = True) -> None:
        """Blocks until every call (or, with every=False, at least one) is done.

        Calls past `timeout_s` are abandoned with an EnvTimeoutError. Re-raises what
        `check()` raises (StopRequested, a deadline's TimeoutError), abandoning the rest,
        and raises EnvCallsStuck when more than `max_stuck` abandoned calls still run.
        """
        calls = list(calls)
        while calls:
            now = time.monotonic()
            pending = []
            for c in calls:
                late = self.timeout_s is not None and c.started is not None
                if not c.done and late and now - c.started > self.timeout_s:
                    err = EnvTimeoutError(
                        f"environment call {_name(c.fn)} exceeded env_timeout_s={self.timeout_s:g}"
                    )
                    self._abandon(c, err)
                if not c.done:
                    pending.append(c)
            if len(pending) < len(calls) and not every:
                break
            if not pending:
                break
            if self.stuck > self.max_stuck:
                raise EnvCallsStuck(
                    f"{self.stuck} environment calls are still running past env_timeout_s="
                    f"{self.timeout_s}; last: {_name(self._stuck[-1].fn)}"
                )
            try:
                self.check()
            except BaseException:
                for c in pending:
                    self._abandon(c, None)
                raise
            pending[0].finished.wait(self.poll_s)
            calls = pending if every else calls

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) through the pool, waited for; raises what it raised (or a timeout)."""
        c = self.submit(fn, *args)
        self.wait([c])
        if c.error is not None:
            raise c.error
        return c.result


def _name(fn: Callable[..., Any]) -> str:
    owner = getattr(fn, "__self__", None)
    base = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{type(owner).__name__}.{fn.__name__}" if owner is not None else base
