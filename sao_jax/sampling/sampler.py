"""The host-side async sampler: worker threads feeding single finished trajectories to a
bounded queue, with versioned parameters, a staleness cap and failures surfaced.

Workers (N threads, each with its own `Engine`: S slots and S environment instances;
all share one compiled `GenerateFns`) pull prompts from one shared iterator (under a
lock), read the latest published (version, params) before each engine step (never during
one, so a decode step uses one version and a trajectory may span several, recorded per
token), and push every finished trajectory into a bounded queue. A full queue blocks
them (backpressure) in a short-timeout loop, so `stop()` always gets through.

The learner calls `publish(params, version)` and `take(n)`. The staleness cap is checked
in `take`, when the learner takes a trajectory: with `max_staleness = m`, a trajectory
whose oldest action token was sampled by version v is dropped (reason 'stale') if
`current_version - v > m`. Taken trajectories feed a staleness histogram.

Failures:
* environment exceptions/timeouts and episodes the env drops (a judge that failed)
  drop that trajectory (counted by reason); a worker that sees `max_env_errors` of them
  in a row (no trajectory finishing in between) fails with EnvErrorLimit naming the last
  cause (e.g. the judge's connection error), as the environment is then broken rather
  than unlucky;
* a worker that sees `max_dropped_in_a_row` episodes dropped in a row for any reason
  (every prompt longer than `sampling.max_len`, a tokenizer that fails on every prompt)
  fails with NoProgress naming the drop counts by reason and the last cause
  (`DropStreak`); and a `take` that gets no trajectory for `timeout` s raises NoProgress
  with the same counts, so a sampler that produces nothing always says why;
* any other exception in a worker (model, jit, prompt iterator, tokenizer vocab) stops
  every worker and is re-raised in the learner by its next `take`, as `SamplerError`
  chained to the original (its traceback included).

Waits: every blocking call polls the stop event and the process-wide stop flag
(`sao_jax.stop`, set by SIGTERM) every `poll_s`: `take` raises StopRequested, workers
return (a worker waiting for env calls abandons them). Env calls run concurrently
(engine.py): a worker's slots whose env call is still running sit out the decode calls
while the others keep decoding (not in lockstep mode, which waits for them).

A `backend` (a builder `(params, version) -> GenerationBackend`, sampling.backend='vllm':
sao_jax/sampling/backend_factory.py) replaces the workers' engines by BackendEngines
(sao_jax/sampling/backend_engine.py: the same episodes, tokens from that one backend,
built on the first version a worker reads and published to as versions move); the
queue, the staleness cap, the failures and the waits above are this module's either way.

Deterministic mode (`lockstep = n`, one worker): after emitting k * n trajectories the
worker waits for version base + k before its next step, where base is the first version
it used. A learner that takes n and publishes version + 1 per update then sees the same
trajectories, versions included, run after run (fixed seeds, same params).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from sao_jax import stop
from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel import placement
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling import vllm_config
from sao_jax.sampling.backend_engine import (
    BackendBuilder,
    BackendEngine,
    SharedBackend,
    model_facts,
)
from sao_jax.sampling.engine import Engine, EngineConfig, generate_fns
from sao_jax.sampling.generate import GenerateFns
from sao_jax.sampling.params_store import ParamsStore
from sao_jax.sampling.trajectory import Trajectory, pad_batch
from sao_jax.schema import ConfigDict, ConfigError, register_validator

ENV_FAILURES = ("env_error", "env_timeout", "env_dropped")  # count toward max_env_errors


class SamplerError(RuntimeError):
    """A sampler worker failed; `__cause__` is the original exception."""


class PromptsExhausted(RuntimeError):
    """The prompt iterator ended and fewer trajectories than asked for remain."""


class EnvErrorLimit(RuntimeError):
    """A worker's environments failed too many times in a row."""


class NoProgress(TimeoutError):
    """Rollouts stopped producing trajectories: no trajectory within a take's timeout,
    or every episode dropped, many in a row; the message names the drops by reason."""


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    num_workers: int = 1  # host threads, each with its own engine and environments
    queue_size: int = 64  # finished trajectories buffered ahead of the learner
    max_staleness: int | None = None  # drop if current - oldest version > this; None = off
    max_env_errors: int = 8  # env failures in a row (per worker) before the sampler fails
    max_dropped_in_a_row: int = 64  # dropped episodes (any reason) in a row: NoProgress
    lockstep: int | None = None  # deterministic mode: trajectories per version (1 worker)
    seed: int = 0  # worker i samples with fold_in(key(seed), i)
    poll_s: float = 0.05  # wait granularity of blocking calls (stop/failure latency)

    def __post_init__(self):
        for name in ("num_workers", "queue_size", "max_env_errors", "max_dropped_in_a_row"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"SamplerConfig.{name}: must be a positive int, got {v!r}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"SamplerConfig.max_staleness: must be >= 0, got {self.max_staleness}")
        if self.lockstep is not None:
            if not (isinstance(self.lockstep, int) and self.lockstep > 0):
                raise ValueError(f"SamplerConfig.lockstep: must be > 0, got {self.lockstep!r}")
            if self.num_workers != 1:
                raise ValueError("SamplerConfig.lockstep: deterministic mode needs num_workers=1")
        if not self.poll_s > 0:
            raise ValueError(f"SamplerConfig.poll_s: must be > 0, got {self.poll_s}")


def configs_from_section(section: ConfigDict, seed: int = 0) -> tuple[EngineConfig, SamplerConfig]:
    """(EngineConfig, SamplerConfig) from `config.sampling`; ConfigError names the field."""
    values = dict(section.to_dict() if isinstance(section, ConfigDict) else section)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    sampler_fields = {f.name for f in dataclasses.fields(SamplerConfig)} - {"seed", "poll_s"}
    unknown = set(values) - engine_fields - sampler_fields - set(placement.FIELDS)
    unknown = sorted(unknown - set(vllm_config.FIELDS))
    if unknown:
        raise ConfigError(f"config field sampling.{unknown[0]}: unknown sampling field")
    values["prefill_buckets"] = tuple(values.get("prefill_buckets", ()))
    values["span_buckets"] = tuple(values.get("span_buckets", ()))
    try:
        engine = EngineConfig(**{k: v for k, v in values.items() if k in engine_fields})
        sampler = SamplerConfig(
            seed=seed, **{k: v for k, v in values.items() if k in sampler_fields}
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config field sampling: {e}") from e
    if sampler.lockstep is not None and sampler.queue_size < sampler.lockstep + engine.num_slots:
        raise ConfigError(
            f"config field sampling.queue_size: lockstep needs >= lockstep + num_slots = "
            f"{sampler.lockstep + engine.num_slots}, got {sampler.queue_size}"
        )
    return engine, sampler


@register_validator("sampling")
def _validate_section(config: ConfigDict) -> None:
    configs_from_section(config.sampling, config.get("seed", 0))
    placement.check_fields(config.sampling)
    vllm_config.check_fields(config.sampling, config)


class AsyncSampler:
    """Bounded, stoppable producer of single trajectories; see the module docstring."""

    def __init__(
        self,
        mdef: ModelDef,
        tokenizer,
        env_factory: Callable[[], Env],
        prompts: Iterable[Prompt],
        *,
        engine: EngineConfig,
        config: SamplerConfig | None = None,
        fns: GenerateFns | None = None,
        sharder: Sharder | None = None,
        device_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        backend: BackendBuilder | None = None,
    ):
        self.cfg = config or SamplerConfig()
        # entered by every worker thread: where its engine's arrays live (the pool's
        # devices, sao_jax/parallel/placement.py); None = the default device
        self._device_context = device_context or contextlib.nullcontext
        self.engine_cfg = engine
        lockstep, size = self.cfg.lockstep, self.cfg.queue_size
        if lockstep is not None and size < lockstep + engine.num_slots:
            raise ValueError(
                f"SamplerConfig.queue_size: lockstep needs >= lockstep + num_slots = "
                f"{lockstep + engine.num_slots}, got {size}"
            )
        # None: the workers' own engines; else one backend they all generate with
        self._backend = None if backend is None else SharedBackend(backend)
        self._model_facts = None if backend is None else model_facts(mdef)
        if backend is None:
            self._fns = fns or generate_fns(mdef, engine, sharder)  # sharder: the pool's mesh
        self._tok, self._env_factory = tokenizer, env_factory
        self._prompts = iter(prompts)
        self._prompt_lock = threading.Lock()
        self._exhausted = False
        self._store = ParamsStore()
        self._queue: queue.Queue[Trajectory] = queue.Queue(self.cfg.queue_size)
        self._held: collections.deque[Trajectory] = collections.deque()  # taken back
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._failures: list[tuple[int, BaseException]] = []
        self._threads: list[threading.Thread] = []
        self._engines: list[Engine] = []  # the workers' engines (their admission counters)
        self._generated = 0
        self._taken = 0
        self._dropped: collections.Counter[str] = collections.Counter()
        self._last_drop = ""  # the cause of the latest dropped episode (for error messages)
        self._staleness: collections.Counter[int] = collections.Counter()

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> AsyncSampler:
        if self._threads:
            raise RuntimeError("sampler already started")
        for i in range(self.cfg.num_workers):
            t = threading.Thread(target=self._work, args=(i,), name=f"sao-sampler-{i}")
            t.daemon = True  # a worker stuck in an env call never blocks interpreter exit
            self._threads.append(t)
            t.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Stops and joins every worker; True when none is left alive."""
        self._stop.set()
        self._store.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._backend is not None:
            self._backend.close()
        return not any(t.is_alive() for t in self._threads)

    def __enter__(self) -> AsyncSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- learner side -------------------------------------------------------------------

    def publish(
        self, params: Params, version: int, *, copy: bool = True, when_ready: bool = False
    ) -> None:
        """Makes `params` (tagged `version`, increasing) what workers use from their next
        step on. Copies by default, so the learner may donate its own buffers. With
        `when_ready` (a weight sync in flight) workers keep the previous version until
        every array has landed (params_store.py: double buffering)."""
        self._store.publish(params, version, copy=copy, when_ready=when_ready)

    @property
    def version(self) -> int | None:
        return self._store.version

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """Blocks until n trajectories pass the staleness cap; returns them in order.

        Raises SamplerError if a worker failed, NoProgress (a TimeoutError) when no
        trajectory arrived for `timeout` s (naming the drops by reason and the latest
        one's cause), StopRequested within `poll_s` of a stop request (SIGTERM), and
        PromptsExhausted when the prompts ran out first (what was collected is kept for
        the next call in each case).
        """
        if n <= 0:
            raise ValueError(f"n: must be > 0, got {n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Trajectory] = []
        while len(out) < n:
            self._raise_if_failed()
            if stop.requested():
                self._held.extendleft(reversed(out))
                stop.raise_if_requested(f"waiting for {n} trajectories")
            traj = self._next_item()
            if traj is None:
                if self._finished() and self._queue.empty():
                    self._raise_if_failed()
                    self._held.extendleft(reversed(out))
                    if not self._exhausted:  # a stop request ends the workers too
                        stop.raise_if_requested(f"waiting for {n} trajectories")
                        raise RuntimeError("take: the sampler was stopped")
                    raise PromptsExhausted(
                        f"prompts exhausted: {len(self._held)} trajectories left, asked for {n}"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    self._held.extendleft(reversed(out))
                    raise NoProgress(
                        no_trajectory_message(n, len(out), timeout, self.stats(), self._last_drop)
                    )
                continue
            if self._accept(traj):
                out.append(traj)
                if timeout is not None:  # the bound is on a silence, not on the batch
                    deadline = time.monotonic() + timeout
        return out

    def give_back(self, trajs: list[Trajectory]) -> None:
        """Undoes the last `take` of `trajs` (the run stopped before training them): they
        are queued again, first, and no longer counted as taken."""
        lags = [(self._store.target or 0) - t.min_version for t in trajs]
        with self._lock:
            self._held.extendleft(reversed(trajs))
            self._taken -= len(trajs)
            self._staleness.subtract(lags)
            self._staleness += collections.Counter()  # drops the zero counts

    def take_batch(
        self, n: int, timeout: float | None = None, **pad_kwargs: Any
    ) -> tuple[dict[str, np.ndarray], list[Trajectory]]:
        """take(n) padded into the batch of sao_jax/batch_schema.py (kwargs go to `pad_batch`)."""
        trajs = self.take(n, timeout)
        return pad_batch(trajs, **pad_kwargs), trajs

    def prompt_state(self) -> Any:
        """The prompt iterator's `get_state()` (taken under the workers' prompt lock).

        Prompts already handed to a worker are past this state: on resume from it,
        trajectories in flight at save time are not regenerated.
        """
        with self._prompt_lock:
            return self._prompts.get_state()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = dict(
                generated=self._generated,
                taken=self._taken,
                dropped=dict(self._dropped),
                staleness=dict(sorted(self._staleness.items())),
                queued=self._queue.qsize() + len(self._held),
                version=self._store.version,
            )
            if self.engine_cfg.kv_layout == "paged":  # summed over the workers' engines
                for e in list(self._engines):
                    for k, v in e.stats().items():
                        out[k] = out.get(k, 0) + v
            if self._backend is not None:  # turns asked again after a weight publication
                out["resubmitted"] = sum(e.counters["resubmitted"] for e in self._engines)
        store = self._store
        if store.landed or store.superseded:  # double-buffered weight sync
            out["weight_sync_landed"] = store.landed
            out["weight_sync_superseded"] = store.superseded
            out["weight_sync_s"] = store.landing_s / max(store.landed, 1)
        return out

    def _finished(self) -> bool:
        return bool(self._threads) and not any(t.is_alive() for t in self._threads)

    def _next_item(self) -> Trajectory | None:
        if self._held:
            return self._held.popleft()
        try:
            return self._queue.get(timeout=self.cfg.poll_s)
        except queue.Empty:
            return None

    def _accept(self, traj: Trajectory) -> bool:
        lag = (self._store.target or 0) - traj.min_version  # the learner's version
        cap = self.cfg.max_staleness
        with self._lock:
            if cap is not None and lag > cap:
                self._dropped["stale"] += 1
                return False
            self._taken += 1
            self._staleness[lag] += 1
        return True

    def _raise_if_failed(self) -> None:
        with self._lock:
            failure = self._failures[0] if self._failures else None
        if failure is not None:
            idx, err = failure
            raise SamplerError(f"sampler worker {idx} failed: {type(err).__name__}: {err}") from err

    # ---- worker side --------------------------------------------------------------------

    def _check_stop(self) -> None:
        """The engine's env-call waits: stop when the sampler stops or SIGTERM arrives."""
        if self._stop.is_set():
            raise stop.StopRequested("sampler stopped while waiting for environment calls")
        stop.raise_if_requested("waiting for environment calls")

    def _next_prompt(self) -> Prompt | None:
        with self._prompt_lock:
            if self._exhausted or self._stop.is_set():
                return None
            try:
                return next(self._prompts)
            except StopIteration:
                self._exhausted = True
                return None

    def _put(self, traj: Trajectory) -> bool:
        """Enqueues and counts under one lock, so stats() never sees one without the other."""
        while not self._stop.is_set():
            with self._lock:
                try:
                    self._queue.put_nowait(traj)
                except queue.Full:
                    pass
                else:
                    self._generated += 1
                    return True
            self._stop.wait(self.cfg.poll_s)  # backpressure: the learner is behind
        return False

    def _wait_version(self, need: int | None) -> bool:
        """Waits (stoppably) for a published version >= need (any version if None)."""
        floor = -(2**62) if need is None else need
        while not self._stop.is_set():
            if self._store.wait_for(floor, self.cfg.poll_s):
                return True
        return False

    def _work(self, idx: int) -> None:
        with self._device_context():
            self._work_on(idx)

    def _work_on(self, idx: int) -> None:
        try:
            key = jax.random.fold_in(jax.random.key(self.cfg.seed), idx)
            if self._backend is None:
                engine = Engine(self._fns, self._tok, self._env_factory, self.engine_cfg, seed=key)
            else:
                engine = BackendEngine(self._backend, self._tok, self._env_factory,
                                       self.engine_cfg, **self._model_facts,
                                       poll_s=self.cfg.poll_s)  # fmt: skip
            with self._lock:
                self._engines.append(engine)
            engine.overlap_env = self.cfg.lockstep is None  # lockstep: deterministic steps
            engine.env_calls.check = self._check_stop
            streak = DropStreak(self.cfg.max_env_errors, self.cfg.max_dropped_in_a_row)
            emitted = 0
            base = None
            while not self._stop.is_set():
                need = None
                if self.cfg.lockstep is not None and base is not None:
                    need = base + emitted // self.cfg.lockstep
                if not self._wait_version(need):
                    return
                version, params = self._store.latest()
                base = version if base is None else base
                out = engine.step(params, version, self._next_prompt)
                for d in out.dropped:
                    with self._lock:
                        self._dropped[d.reason] += 1
                        self._last_drop = describe_drop(d)
                streak.update(out)  # EnvErrorLimit / NoProgress: the worker fails
                for traj in out.finished:
                    if not self._put(traj):
                        return
                    emitted += 1
                if out.active == 0 and self._exhausted:
                    return
        except stop.StopRequested:
            return  # stop() or SIGTERM while waiting for env calls: not a failure
        except BaseException as e:
            with self._lock:
                self._failures.append((idx, e))
            self._stop.set()


class DropStreak:
    """Dropped episodes since the last finished trajectory: EnvErrorLimit after
    `max_env_errors` environment failures, NoProgress after `max_dropped` drops of any
    reason (None: no such limit), each naming the last cause (and the drops by reason).
    One per engine loop: the async worker, a synchronous take, an evaluation."""

    def __init__(self, max_env_errors: int, max_dropped: int | None, where: str = ""):
        self.max_env_errors, self.max_dropped = max_env_errors, max_dropped
        self.where = where  # prefix of the messages, e.g. "greedy evaluation: "
        self.env_errors = 0
        self.reasons: collections.Counter[str] = collections.Counter()
        self.last = ""  # the latest drop's cause

    def update(self, step) -> None:
        """Counts one engine step's drops, then forgets them if a trajectory finished."""
        for d in step.dropped:
            self.last = describe_drop(d)
            self.reasons[d.reason] += 1
            if d.reason in ENV_FAILURES:
                self.env_errors += 1
                if self.env_errors >= self.max_env_errors:
                    raise EnvErrorLimit(
                        f"{self.where}{self.env_errors} environment failures in a row "
                        f"(sampling.max_env_errors); last: {self.last}"
                    ) from d.error
            dropped = sum(self.reasons.values())
            if self.max_dropped is not None and dropped >= self.max_dropped:
                raise NoProgress(
                    f"{self.where}{dropped} episodes dropped in a row, none finished "
                    f"(sampling.max_dropped_in_a_row={self.max_dropped}): dropped "
                    f"{dict(self.reasons)}; last: {self.last}"
                ) from d.error
        if step.finished:
            self.env_errors = 0
            self.reasons.clear()


def no_trajectory_message(n: int, got: int, timeout: float, stats: dict, last: str) -> str:
    """Why a take of n timed out (one line): what came, what was dropped, the last cause."""
    dropped = stats.get("dropped") or {}
    text = (
        f"take({n}): timed out after {timeout:g}s without a trajectory "
        f"(train.take_timeout_s; {got} of {n} taken): generated {stats.get('generated', 0)}, "
        f"dropped {dropped or 'none'}"
    )
    return text + (f"; last drop: {last}" if last else "; the environment or the model hangs")


def describe_drop(d) -> str:
    """`reason on prompt 'uid': ErrorType: message` (one line, at most ~300 characters)."""
    text = f"{d.reason} on prompt {d.prompt_uid!r}"
    if d.error is not None:
        msg = " ".join(f"{type(d.error).__name__}: {d.error}".split())
        text += ": " + (msg if len(msg) <= 300 else msg[:300] + " ...")
    return text
