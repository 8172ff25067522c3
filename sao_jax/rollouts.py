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
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax

from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.sampler import AsyncSampler, SamplerConfig
from sao_jax.sampling.trajectory import Trajectory


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
    ):
        self.prompts = RepeatPrompts(prompts, group_size) if group_size > 1 else prompts
        self.group_size = group_size
        self.groups = GroupCollector(group_size)
        self.handed = 0  # trajectories returned by take (the sampler's `taken` - grouping)
        self.sampler = AsyncSampler(
            policy_def, tokenizer, env_factory, self.prompts, engine=engine_cfg, config=sampler_cfg
        )

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> bool:
        return self.sampler.stop()

    def publish(self, params: Params, version: int) -> None:
        self.sampler.publish(params, version)

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        if self.group_size == 1:
            out = self.sampler.take(n, timeout)
        else:
            while (out := self.groups.pop(n // self.group_size)) is None:
                for traj in self.sampler.take(1, timeout):
                    self.groups.add(traj)
        self.handed += len(out)
        return out

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
    ):
        self.prompts = RepeatPrompts(prompts, group_size) if group_size > 1 else prompts
        self.engine = Engine.create(policy_def, tokenizer, env_factory, engine_cfg, seed=seed)
        self._engine_args = (tokenizer, env_factory, engine_cfg)
        self._key = jax.random.key(seed)
        self.group_size = group_size
        self._params: Params | None = None
        self._version = 0
        self._draws = 0  # takes since the last publish
        self.counts: collections.Counter[str] = collections.Counter()
        self.dropped: collections.Counter[str] = collections.Counter()

    def start(self) -> None:
        pass

    def stop(self) -> bool:
        return True

    def publish(self, params: Params, version: int) -> None:
        self._params, self._version, self._draws = params, version, 0

    def _fresh_engine(self) -> Engine:
        """The engine of one take: shared compiled programs, an empty cache and sampling
        key fold_in(fold_in(key(seed), version), draw), so what a take generates depends
        only on (params, prompts, version, draw) and a resumed run draws it again."""
        key = jax.random.fold_in(jax.random.fold_in(self._key, self._version), self._draws)
        self._draws += 1
        return Engine(self.engine.fns, *self._engine_args, seed=key)

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """n trajectories from the next prompts; dropped episodes are replaced (whole
        groups are regenerated so that every group stays complete)."""
        del timeout
        engine = self._fresh_engine()
        out: list[Trajectory] = []
        while len(out) < n:
            need = n - len(out)
            prompts = [next(self.prompts) for _ in range(need)]
            trajs, drops = engine.run(self._params, prompts, self._version)
            self.dropped.update(d.reason for d in drops)
            if self.group_size > 1:
                dropped_uids = {d.prompt_uid for d in drops}
                kept = [t for t in trajs if t.prompt_uid not in dropped_uids]
                self.dropped["incomplete_group"] += len(trajs) - len(kept)
                trajs = kept
            self.counts["generated"] += len(trajs)
            out += trajs
        self.counts["taken"] += n
        return out[:n]

    def prompt_state(self) -> Any:
        return self.prompts.get_state()

    def stats(self) -> dict[str, Any]:
        return dict(
            generated=self.counts["generated"],
            taken=self.counts["taken"],
            dropped=dict(self.dropped),
            queued=self.counts["generated"] - self.counts["taken"],
            version=self._version,
        )
