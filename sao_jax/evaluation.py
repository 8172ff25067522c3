"""Held-out evaluation: greedy and sampled pass@1 on prompts training never sees."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.trajectory import Trajectory


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


class Evaluator:
    """Engines built once (compiled once) and reused: greedy and sampled pass@1."""

    def __init__(
        self,
        policy_def: ModelDef,
        tokenizer,
        env_factory: Callable[[], Env],
        prompts: Sequence[Prompt],
        engine_cfg: EngineConfig,
        *,
        sampled: bool = True,
        seed: int = 0,
    ):
        if not prompts:
            raise ValueError("evaluation prompts: need at least one")
        self.prompts = list(prompts)
        self.seed = seed
        self._tok, self._env_factory = tokenizer, env_factory
        greedy_cfg = dataclasses.replace(engine_cfg, temperature=0.0)
        self.greedy = Engine.create(policy_def, tokenizer, env_factory, greedy_cfg)
        self.sampled = (
            Engine.create(policy_def, tokenizer, env_factory, engine_cfg) if sampled else None
        )

    def __call__(self, params: Params, version: int = 0, *, step: int = 0) -> dict[str, float]:
        """Greedy and sampled pass@1. The sampling key depends on (seed, step) only, so an
        evaluation after a resume samples exactly what the uninterrupted run sampled."""
        engines = {"greedy": self.greedy}
        if self.sampled is not None:  # a fresh engine sharing the compiled programs
            key = jax.random.fold_in(jax.random.key(self.seed), step)
            s = self.sampled
            engines["sampled"] = Engine(s.fns, self._tok, self._env_factory, s.cfg, seed=key)
        out = {}
        for name, engine in engines.items():
            trajs, drops = engine.run(params, self.prompts, version)
            out.update(summarize(trajs, len(drops), f"eval/{name}_"))
        return out
