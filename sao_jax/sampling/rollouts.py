"""Where the learner's trajectories come from: the async sampler, or a synchronous engine.

* `AsyncRollouts` (the default, SAO): worker threads run ahead with the last published
  parameters and the learner takes whatever finished first.
* `SyncRollouts` (deterministic mode): the learner generates exactly the next prompts to
  completion with the current parameters, in its own thread. Nothing is in flight between
  updates and each draw's sampling key is fold_in(seed, version, draw), so a checkpoint
  plus the prompt iterator state resumes bit-exactly.

`prompt_state()` of both is the state of the wrapped prompt iterator at the next group
boundary (`prompts.set_state` restores it): a partly emitted group is not resumed, as its
rollouts in flight at save time are discarded on resume anyway.

With `group_size` G > 1 (GRPO-style estimators) every prompt is rolled out G times and
the learner waits for complete groups: the synchronous group barrier that SAO removes.

`publish(params, version, synced=True)` hands over a weight sync's output
(sao_jax/parallel/reshard.py: new buffers, possibly still in flight): the async sampler
makes it current once it has landed and decodes the previous version meanwhile (double
buffering, sampling/params_store.py); the synchronous engine's next take waits for it.
`device_context` (placement.Placement.pool_context) is entered wherever an engine runs, so
its KV cache is created on the pool's devices.

`backend` (a builder `(params, version) -> GenerationBackend`; sampling.backend='vllm',
sao_jax/sampling/backend_factory.py) makes both sources generate with that backend
through BackendEngines (sao_jax/sampling/backend_engine.py): the same episodes and
records, built on the first published weights, published to as versions move, closed
by `stop()`. The synchronous source then promises the order of prompts and versions,
not bits (the backend draws with its own seeds).

Every `take` is bounded, whoever calls it (the RL loop, value pretraining):
* in time: no trajectory for `timeout` s (`take(n, timeout)`, else the constructor's
  `take_timeout_s`: `train.take_timeout_s`) raises NoProgress (a TimeoutError) naming
  what was generated and dropped, by reason, and the last drop's cause;
* in failures: `max_env_errors` (`sampling.max_env_errors`) environment failures in a
  row (errors, timeouts, episodes the env dropped, e.g. a failed judge call) raise
  EnvErrorLimit naming the last cause, and `max_dropped_in_a_row` dropped episodes in a
  row of any reason (e.g. every prompt longer than `sampling.max_len`) NoProgress
  naming the drops by reason (`sampler.DropStreak`);
* by a stop request: SIGTERM (`sao_jax.stop`) raises StopRequested within a poll
  interval, also while an environment call hangs;
* by the engine: a generation backend whose engine died (EngineDied, e.g. the vLLM
  server exited) raises SamplerError naming it (the synchronous take is rewound first,
  so a checkpoint saved then resumes with it; the async sampler's worker fails with it).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any

import jax

from sao_jax import stop
from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.backend import GenerationError, engine_died
from sao_jax.sampling.backend_engine import (
    BackendBuilder,
    BackendEngine,
    SharedBackend,
    model_facts,
)
from sao_jax.sampling.engine import Engine, EngineConfig, StepOutput, generate_fns
from sao_jax.sampling.generate import GenerateFns
from sao_jax.sampling.sampler import (
    AsyncSampler,
    DropStreak,
    NoProgress,
    SamplerConfig,
    SamplerError,
    no_trajectory_message,
)
from sao_jax.sampling.trajectory import Trajectory

TAKE_TIMEOUT_S = 600.0  # default bound of one take (configs: train.take_timeout_s)


class RepeatPrompts:
    """Yields each prompt of `inner` `times` times in a row; checkpointable at group bounds."""

    def __init__(self, inner, times: int):
        self.inner, self.times = inner, times
        self._current: Prompt | None = None
        self._emitted = times

    def __iter__(self):
        return self

    def __next__(self) -> Prompt:
        if self._emitted >= self.times:
            self._current = next(self.inner)
            self._emitted = 0
        self._emitted += 1
        return self._current

    def get_state(self) -> Any:
        """The inner iterator's state after the current group (the rest of a partly
        emitted group is skipped on restore)."""
        return self.inner.get_state()

    def set_state(self, state: Any) -> None:
        self.inner.set_state(state)
        self._current, self._emitted = None, self.times


class GroupCollector:
    """Buffers trajectories by prompt uid; releases complete groups of `size`."""

    def __init__(self, size: int):
        self.size = size
        self._open: dict[str, list[Trajectory]] = collections.defaultdict(list)
        self._ready: collections.deque[list[Trajectory]] = collections.deque()

    def add(self, traj: Trajectory) -> None:
        group = self._open[traj.prompt_uid]
        group.append(traj)
        if len(group) == self.size:
            self._ready.append(self._open.pop(traj.prompt_uid))

    def pop(self, groups: int) -> list[Trajectory] | None:
        if len(self._ready) < groups:
            return None
        return [t for _ in range(groups) for t in self._ready.popleft()]

    @property
    def incomplete(self) -> int:
        return sum(len(g) for g in self._open.values())


class AsyncRollouts:
    """The async single-rollout sampler (and group barrier when group_size > 1)."""

    def __init__(
        self,
        policy_def: ModelDef,
        tokenizer,
        env_factory: Callable[[], Env],
        prompts,
        engine_cfg: EngineConfig,
        sampler_cfg: SamplerConfig,
        *,
        group_size: int = 1,
        take_timeout_s: float = TAKE_TIMEOUT_S,
        device_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        backend: BackendBuilder | None = None,
        fns: GenerateFns | None = None,
    ):
        self.prompts = RepeatPrompts(prompts, group_size) if group_size > 1 else prompts
        self.group_size = group_size
        self.take_timeout_s = take_timeout_s
        self.groups = GroupCollector(group_size)
        self.handed = 0  # trajectories returned by take (the sampler's `taken` - grouping)
        self.sampler = AsyncSampler(
            policy_def,
            tokenizer,
            env_factory,
            self.prompts,
            engine=engine_cfg,
            config=sampler_cfg,
            device_context=device_context,
            backend=backend,
            fns=fns,
        )

    def start(self) -> None:
        self.sampler.start()

    def stop(self, timeout: float = 30.0) -> bool:
        return self.sampler.stop(timeout)

    def publish(self, params: Params, version: int, *, synced: bool = False) -> None:
        """`synced`: a weight sync's new buffers, current once landed (no copy)."""
        self.sampler.publish(params, version, copy=not synced, when_ready=synced)

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """n trajectories (complete groups); NoProgress when none arrives for `timeout`
        s (default take_timeout_s)."""
        timeout = self.take_timeout_s if timeout is None else timeout
        if self.group_size == 1:
            out = self.sampler.take(n, timeout)
        else:
            while (out := self.groups.pop(n // self.group_size)) is None:
                for traj in self.sampler.take(1, timeout):
                    self.groups.add(traj)
        self.handed += len(out)
        return out

    def give_back(self, trajs: list[Trajectory]) -> None:
        """Undoes the last take (the run stopped before training it): in flight again."""
        self.handed -= len(trajs)
        self.sampler.give_back(trajs)

    def prompt_state(self) -> Any:
        return self.sampler.prompt_state()

    def stats(self) -> dict[str, Any]:
        """The sampler's stats; `taken` counts what the learner got (trajectories still
        waiting in open groups are `in_open_groups`, not taken)."""
        stats = self.sampler.stats()
        stats["taken"] = self.handed
        stats["in_open_groups"] = self.groups.incomplete
        return stats


class SyncRollouts:
    """Deterministic mode: generate the next prompts to completion with the current params."""

    def __init__(
        self,
        policy_def: ModelDef,
        tokenizer,
        env_factory: Callable[[], Env],
        prompts,
        engine_cfg: EngineConfig,
        *,
        group_size: int = 1,
        seed: int = 0,
        take_timeout_s: float = TAKE_TIMEOUT_S,
        max_env_errors: int = 8,
        max_dropped_in_a_row: int = 64,
        sharder=None,
        device_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        backend: BackendBuilder | None = None,
        fns: GenerateFns | None = None,
    ):
        self.prompts = RepeatPrompts(prompts, group_size) if group_size > 1 else prompts
        self.device_context = device_context or contextlib.nullcontext
        self.take_timeout_s = take_timeout_s
        self.max_env_errors = max_env_errors
        self.max_dropped_in_a_row = max_dropped_in_a_row
        self._engine_args = (tokenizer, env_factory, engine_cfg)
        self.backend = None if backend is None else SharedBackend(backend)
        if self.backend is None:
            # `fns`: compiled programs shared with others (a run's evaluator); `sharder`:
            # the pool's mesh (default: the model's)
            fns = fns or generate_fns(policy_def, engine_cfg, sharder)
            self.engine = Engine(fns, tokenizer, env_factory, engine_cfg, seed=seed)
        else:
            self.engine = None
            self._model_facts = model_facts(policy_def)
        self._key = jax.random.key(seed)
        self.group_size = group_size
        self._params: Params | None = None
        self._version = 0
        self._draws = 0  # takes since the last publish
        self._last_mark: tuple | None = None  # before the last take (give_back)
        self.counts: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.pool: collections.Counter[str] = collections.Counter()  # paged: admission

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 30.0) -> bool:
        del timeout
        if self.backend is not None:
            self.backend.close()
        return True

    def publish(self, params: Params, version: int, *, synced: bool = False) -> None:
        """The next takes generate with `params` (a weight sync's in-flight arrays are
        waited for by the first program that reads them)."""
        del synced
        self._params, self._version, self._draws = params, version, 0

    def _fresh_engine(self) -> Engine:
        """The engine of one take: shared compiled programs, an empty cache and sampling
        key fold_in(fold_in(key(seed), version), draw), so what a take generates depends
        only on (params, prompts, version, draw) and a resumed run draws it again."""
        key = jax.random.fold_in(jax.random.fold_in(self._key, self._version), self._draws)
        self._draws += 1
        if self.backend is not None:
            return BackendEngine(self.backend, *self._engine_args, **self._model_facts)
        return Engine(self.engine.fns, *self._engine_args, seed=key)

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """n trajectories from the next prompts; dropped episodes are replaced (whole
        groups are regenerated so that every group stays complete).

        Raises NoProgress after `timeout` s without a trajectory (default
        take_timeout_s) or max_dropped_in_a_row drops in a row, EnvErrorLimit after
        max_env_errors environment failures in a row, StopRequested on SIGTERM.
        """
        timeout = self.take_timeout_s if timeout is None else timeout
        mark = self._last_mark = self._mark()
        try:
            with self.device_context():
                return self._take(n, timeout)
        except stop.StopRequested:
            self._rewind(mark)  # a checkpoint saved now resumes with exactly this take
            raise
        except GenerationError as e:
            if not engine_died(e):
                raise
            self._rewind(mark)  # the run ends: its checkpoint resumes with this take
            raise SamplerError(f"the generation engine died: {e}") from e

    def give_back(self, trajs: list[Trajectory]) -> None:
        """Undoes the last take (the run stopped before training it): a checkpoint saved
        now resumes with exactly this take again."""
        del trajs
        self._rewind(self._last_mark)

    def _mark(self) -> tuple:
        """What a take changes: prompt position, draw number, counters."""
        return (self.prompts.get_state(), self._draws, self.counts.copy(), self.dropped.copy())

    def _rewind(self, mark: tuple) -> None:
        state, self._draws, self.counts, self.dropped = mark
        self.prompts.set_state(state)

    def _take(self, n: int, timeout: float) -> list[Trajectory]:
        engine = self._fresh_engine()
        streak = DropStreak(self.max_env_errors, self.max_dropped_in_a_row)
        guard = _TakeGuard(n, timeout, streak, self.stats)
        engine.env_calls.check = guard.check
        out: list[Trajectory] = []
        while len(out) < n:
            need = n - len(out)
            prompts = iter([next(self.prompts) for _ in range(need)])
            next_prompt = lambda it=prompts: next(it, None)
            trajs, drops = [], []
            while True:  # Engine.run, with the bounds checked between steps
                guard.check()
                step = engine.step(self._params, self._version, next_prompt)
                self.dropped.update(d.reason for d in step.dropped)
                guard.count(step, len(out) + len(trajs))
                trajs += step.finished
                drops += step.dropped
                if step.active == 0 and not step.finished and not step.dropped:
                    break
            if self.group_size > 1:
                dropped_uids = {d.prompt_uid for d in drops}
                kept = [t for t in trajs if t.prompt_uid not in dropped_uids]
                self.dropped["incomplete_group"] += len(trajs) - len(kept)
                trajs = kept
            self.counts["generated"] += len(trajs)
            out += trajs
        self.counts["taken"] += n
        stats = engine.stats()  # this take's engine: its admission counters, its peak
        self.pool.update(admission_waits=stats["admission_waits"], preemptions=stats["preemptions"])
        self.pool["pages_peak"] = max(self.pool["pages_peak"], stats["pages_peak"])
        return out[:n]

    def prompt_state(self) -> Any:
        return self.prompts.get_state()

    def stats(self) -> dict[str, Any]:
        out = dict(
            generated=self.counts["generated"],
            taken=self.counts["taken"],
            dropped=dict(self.dropped),
            queued=self.counts["generated"] - self.counts["taken"],
            version=self._version,
        )
        if self.engine is not None and self.engine.pool is not None:  # paged KV pool
            out.update({"admission_waits": 0, "preemptions": 0, "pages_peak": 0, **self.pool})
        return out


class _TakeGuard:
    """The bounds of one SyncRollouts.take: a silence of `timeout` s (no trajectory),
    the drop streak, SIGTERM."""

    def __init__(self, n: int, timeout: float, streak: DropStreak, stats):
        self.n, self.timeout, self.streak, self.stats = n, timeout, streak, stats
        self.deadline = time.monotonic() + timeout
        self.got = 0

    def check(self) -> None:
        stop.raise_if_requested(f"generating {self.n} trajectories")
        if time.monotonic() > self.deadline:
            stats = self.stats()
            raise NoProgress(
                no_trajectory_message(self.n, self.got, self.timeout, stats, self.streak.last)
            )

    def count(self, step: StepOutput, got: int) -> None:
        self.streak.update(step)
        self.got = got
        if step.finished:
            self.deadline = time.monotonic() + self.timeout
