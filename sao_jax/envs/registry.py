"""Environments by name: `make_env("arithmetic", max_turns=4)`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from sao_jax.envs.arithmetic import ArithmeticEnv
from sao_jax.envs.base import Env
from sao_jax.envs.levels import LevelsEnv
from sao_jax.envs.llm_judge import judge_from_config
from sao_jax.envs.python_tool import PythonToolEnv
from sao_jax.envs.style import STYLES, LexiconJudge, StyleEnv, StyleSchedule

_FACTORIES: dict[str, Callable[..., Env]] = {
    "arithmetic": ArithmeticEnv,
    "arithmetic_levels": LevelsEnv,
    "python_tool": PythonToolEnv,
    "style": StyleEnv,
}
ENV_NAMES = tuple(_FACTORIES)


def make_env(name: str, **params: Any) -> Env:
    """A fresh env instance (one per sampler worker); params go to its constructor.

    Raises:
      ValueError: unknown name (the message lists ENV_NAMES) or an unknown parameter.
    """
    if name not in _FACTORIES:
        raise ValueError(f"unknown env {name!r}; known envs: {', '.join(ENV_NAMES)}")
    try:
        return _FACTORIES[name](**params)
    except TypeError as e:
        raise ValueError(f"make_env({name!r}): bad parameters {sorted(params)}: {e}") from None


def env_factory(name: str, params: dict[str, Any]) -> tuple[Callable[[], Env], Callable | None]:
    """(factory of fresh envs, `set_step(step)` hook or None) from a config's env.params.

    The style task's target style follows the training step: every env built by the
    factory shares one StyleSchedule, moved by the returned hook. Its params may hold
    `styles`, `switch_steps` and `judge` ('lexicon', or a dict for the LLM judge client).
    """
    params = dict(params)
    if name != "style":
        make_env(name, **params)  # fail now, naming the parameters, not in a worker
        return functools.partial(make_env, name, **params), None
    schedule = StyleSchedule(params.pop("styles", STYLES), params.pop("switch_steps", (150, 300)))
    judge_cfg = params.pop("judge", "lexicon")
    judge = LexiconJudge() if judge_cfg == "lexicon" else judge_from_config(dict(judge_cfg))
    make_env(name, schedule=schedule, judge=judge, **params)
    factory = functools.partial(make_env, name, schedule=schedule, judge=judge, **params)
    return factory, schedule.set_step
