"""Held-out evaluation: greedy and sampled pass@1 on prompts training never sees.

Episodes the environment fails (an exception, a timeout, a judge that gave up: the
sampler's ENV_FAILURES) count as failures of the policy and are reported as
`eval/<mode>_env_failures`. When at least `max_env_errors` of them make up the majority of
an evaluation, its success rate would measure the environment, not the policy: the
evaluation raises EnvErrorLimit naming the last cause, as training does
(sao_jax/sampling/sampler.py); `max_env_errors` of them in a row end it at once (a judge
that trickles or refuses must not hold a 128-prompt evaluation for 128 of its deadlines).
With `stall_timeout_s`, an evaluation in which no episode ends for that long (an env call
that hangs without `sampling.env_timeout_s`) raises NoProgress.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from sao_jax import stop
from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.engine import Drop, Engine, EngineConfig, generate_fns
from sao_jax.sampling.generate import GenerateFns
from sao_jax.sampling.sampler import (
    ENV_FAILURES,
    DropStreak,
    EnvErrorLimit,
    NoProgress,
    describe_drop,
)
from sao_jax.sampling.trajectory import Trajectory

LEVEL_KEY = "level"  # prompt meta: the difficulty level, scored separately when present


def summarize(trajs: Sequence[Trajectory], dropped: int, prefix: str) -> dict[str, float]:
    """Success rate (dropped episodes count as failures), reward, lengths, tool use."""
    n = len(trajs) + dropped
    success = sum(bool(t.info.get("success", False)) for t in trajs)
    out = {
        f"{prefix}success": success / max(n, 1),
        f"{prefix}reward": float(np.mean([t.outcome for t in trajs])) if trajs else 0.0,
        f"{prefix}episodes": float(n),
        f"{prefix}truncated": float(np.mean([t.truncated for t in trajs])) if trajs else 0.0,
        f"{prefix}action_tokens": float(np.mean([t.num_actions for t in trajs])) if trajs else 0.0,
        f"{prefix}turns": float(np.mean([t.num_turns for t in trajs])) if trajs else 0.0,
    }
    calls = [t.info["tool_calls"] for t in trajs if "tool_calls" in t.info]
    if calls:
        out[f"{prefix}tool_calls"] = float(np.mean(calls))
    return out


def success_by_level(
    trajs: Sequence[Trajectory], drops: Sequence[Drop], levels: dict[str, int], prefix: str
) -> dict[str, float]:
    """`<prefix>success_level<k>`: success over the prompts of level k (`levels`: prompt
    uid -> its LEVEL_KEY meta), dropped episodes counting as failures."""
    won, total = collections.Counter(), collections.Counter()
    for t in trajs:
        total[levels[t.prompt_uid]] += 1
        won[levels[t.prompt_uid]] += bool(t.info.get("success", False))
    for d in drops:
        total[levels[d.prompt_uid]] += 1
    return {f"{prefix}success_level{k}": won[k] / total[k] for k in sorted(total)}


class Evaluator:
    """Engines built once (compiled once) and reused: greedy and sampled pass@1, and per
    level where the prompts have one (meta LEVEL_KEY, e.g. sao_jax/envs/levels.py)."""

    def __init__(
        self,
        policy_def: ModelDef,
        tokenizer,
        env_factory: Callable[[], Env],
        prompts: Sequence[Prompt],
        engine_cfg: EngineConfig,
        *,
        sampled: bool = True,
        sampled_repeats: int = 1,
        greedy: bool = True,
        seed: int = 0,
        max_env_errors: int = 8,
        stall_timeout_s: float | None = None,
        fns: GenerateFns | None = None,
    ):
        if not prompts:
            raise ValueError("evaluation prompts: need at least one")
        if not (sampled or greedy):
            raise ValueError("evaluation: neither greedy nor sampled decoding asked for")
        if sampled_repeats < 1:
            raise ValueError(f"evaluation sampled_repeats={sampled_repeats}: must be >= 1")
        self.sampled_repeats = int(sampled_repeats)
        self.prompts, self.seed = list(prompts), seed
        self._levels = _levels(self.prompts)
        self.max_env_errors = max_env_errors
        self.stall_timeout_s = stall_timeout_s
        self._tok, self._env_factory = tokenizer, env_factory
        # one set of compiled programs for both (the temperature is traced, not static);
        # `fns`: a run's, shared with its samplers (engine_cfg's slots and lengths)
        fns = fns or generate_fns(policy_def, engine_cfg)
        greedy_cfg = dataclasses.replace(engine_cfg, temperature=0.0)
        self.greedy = Engine(fns, tokenizer, env_factory, greedy_cfg) if greedy else None
        self.sampled = Engine(fns, tokenizer, env_factory, engine_cfg) if sampled else None

    def for_prompts(self, prompts: Sequence[Prompt], *, seed: int) -> Evaluator:
        """This evaluator on other prompts and sampling seed, sharing the compiled engines
        (sao_jax/run/rescore.py: the same model and task, another run's held-out prompts)."""
        if not prompts:
            raise ValueError("evaluation prompts: need at least one")
        other = copy.copy(self)
        other.prompts, other.seed = list(prompts), seed
        other._levels = _levels(other.prompts)
        return other

    def __call__(self, params: Params, version: int = 0, *, step: int = 0) -> dict[str, float]:
        """Greedy and sampled pass@1. The sampled evaluation runs every prompt
        `sampled_repeats` times (independent samples; its success is their mean: pass@1
        estimated from k samples a prompt, with k times fewer sampling-noise variance). The
        sampling key depends on (seed, step) only, so an evaluation after a resume samples
        exactly what the uninterrupted run sampled."""
        engines = {"greedy": self.greedy} if self.greedy is not None else {}
        if self.sampled is not None:  # a fresh engine sharing the compiled programs
            key = jax.random.fold_in(jax.random.key(self.seed), step)
            s = self.sampled
            engines["sampled"] = Engine(s.fns, self._tok, self._env_factory, s.cfg, seed=key)
        out = {}
        for name, engine in engines.items():
            episodes = self.prompts * (self.sampled_repeats if name == "sampled" else 1)
            trajs, drops = self._run(name, engine, params, version, episodes)
            out.update(summarize(trajs, len(drops), f"eval/{name}_"))
            if self._levels:
                out.update(success_by_level(trajs, drops, self._levels, f"eval/{name}_"))
            failed = self.check_env_failures(name, drops, len(episodes))
            out[f"eval/{name}_env_failures"] = float(failed)
        return out

    def _run(self, name: str, engine: Engine, params: Params, version: int, prompts):
        """engine.run on the prompts, ended early by the env-failure streak and by a
        silence of stall_timeout_s (NoProgress), both naming the evaluation."""
        streak = DropStreak(self.max_env_errors, None, where=f"{name} evaluation: ")
        last = [time.monotonic()]  # when an episode last ended

        def check() -> None:
            stop.raise_if_requested(f"running the {name} evaluation")
            timeout = self.stall_timeout_s
            if timeout is not None and time.monotonic() - last[0] > timeout:
                raise NoProgress(
                    f"{name} evaluation: no episode ended within {timeout:g}s "
                    f"(train.take_timeout_s); last drop: {streak.last or 'none'}"
                )

        def on_step(step) -> None:
            streak.update(step)
            if step.finished or step.dropped:
                last[0] = time.monotonic()
            check()

        engine.env_calls.check = check
        return engine.run(params, prompts, version, on_step=on_step)

    def check_env_failures(self, name: str, drops: Sequence[Drop], episodes: int) -> int:
        """The number of episodes the environment failed; EnvErrorLimit when they are at
        least max_env_errors and the majority of the evaluation."""
        failed = [d for d in drops if d.reason in ENV_FAILURES]
        if len(failed) >= self.max_env_errors and 2 * len(failed) > episodes:
            raise EnvErrorLimit(
                f"{name} evaluation: the environment failed {len(failed)} of "
                f"{episodes} episodes (sampling.max_env_errors="
                f"{self.max_env_errors}); last: {describe_drop(failed[-1])}"
            ) from failed[-1].error
        return len(failed)


def _levels(prompts: Sequence[Prompt]) -> dict[str, int]:
    """{uid: level} when every prompt has a LEVEL_KEY meta, else {}."""
    if not prompts or not all(LEVEL_KEY in (p.meta or {}) for p in prompts):
        return {}
    return {p.uid: int(p.meta[LEVEL_KEY]) for p in prompts}
