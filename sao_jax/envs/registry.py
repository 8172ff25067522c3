"""The built-in tasks, one `register_task` call each, and envs by name.

`make_env("arithmetic", max_turns=4)` builds one env; `env_factory(name, params, chat)`
builds a run's factory of fresh envs (one per sampler slot). Any task registered in
sao_jax/envs/tasks.py works here, by name or by import path ('my_pkg.tasks:MY_TASK').
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from sao_jax.envs import arithmetic, levels, python_tool, style
from sao_jax.envs.answer import AnswerEnv
from sao_jax.envs.base import Env
from sao_jax.envs.llm_judge import judge_from_config
from sao_jax.envs.tasks import Task, get_task, register_task, task_names

# ---------------------------------------------------------------- built-in prompt samplers


def _arithmetic_prompts(_defaults=None, **params: Any):
    """`sample(rng)` of arithmetic problems; params: n_ops, operand_range, ops, parens."""
    try:
        p = arithmetic.make_params(**{**(_defaults or {}), **params})
    except TypeError as e:
        raise ValueError(
            f"prompt_source: bad arithmetic parameters {sorted(params)}: {e}"
        ) from None
    return functools.partial(arithmetic.sample_prompt, params=p)


def _python_tool_prompts(**params: Any):
    return _arithmetic_prompts({"n_ops": (2, 3), "operand_range": (10, 999)}, **params)


def _style_prompts(**params: Any):
    unknown = set(params) - {"n_topics"}
    if unknown:
        raise ValueError(f"prompt_source: unknown style parameters {sorted(unknown)}")
    n_topics = tuple(params.get("n_topics", (1, 2)))
    style.sample_prompt(np.random.default_rng(0), n_topics)  # validates n_topics
    return functools.partial(style.sample_prompt, n_topics=n_topics)


def _style_setup(params: dict[str, Any]) -> tuple[dict[str, Any], Callable]:
    """One StyleSchedule shared by every env of the run (moved by the returned hook); a
    judge from params['judge']: 'lexicon' or a dict for the LLM judge client."""
    params = dict(params)
    schedule = style.StyleSchedule(
        params.pop("styles", style.STYLES), params.pop("switch_steps", (150, 300))
    )
    judge_cfg = params.pop("judge", "lexicon")
    judge = style.LexiconJudge() if judge_cfg == "lexicon" else judge_from_config(dict(judge_cfg))
    return {**params, "schedule": schedule, "judge": judge}, schedule.set_step


def _arithmetic_demo(prompt, rng, *, error_rate: float = 0.0):
    return arithmetic.demonstration(prompt, rng, error_rate=error_rate)


def _levels_prompts(**params: Any):
    """`sample(rng)` of graded problems; params: levels (subset of levels.LEVELS), weights."""
    unknown = set(params) - {"levels", "weights"}
    if unknown:
        raise ValueError(f"prompt_source: unknown arithmetic_levels parameters {sorted(unknown)}")
    lv = tuple(params.get("levels", tuple(levels.LEVELS)))
    weights = params.get("weights")
    weights = None if weights is None else tuple(weights)
    levels.check_levels(lv, weights)
    return functools.partial(levels.sample_prompt, levels=lv, weights=weights)


def _levels_demo(prompt, rng, *, error_rate: float = 0.0):
    return levels.demonstration(prompt, rng, error_rate=error_rate)


def _python_tool_demo(prompt, rng, *, error_rate: float = 0.0):
    del rng, error_rate  # always correct (the sandbox output is real)
    return python_tool.demonstration(prompt)


def _style_demo(prompt, rng, *, error_rate: float = 0.0):
    del error_rate
    return style.demonstration(prompt, rng)


# ---------------------------------------------------------------- the built-in tasks

register_task(
    "arithmetic",
    env=arithmetic.ArithmeticEnv,
    prompts=_arithmetic_prompts,
    demonstrations=_arithmetic_demo,
)
register_task(
    "arithmetic_levels",
    env=levels.LevelsEnv,
    prompts=_levels_prompts,
    demonstrations=_levels_demo,
)
register_task(
    "python_tool",
    env=python_tool.PythonToolEnv,
    prompts=_python_tool_prompts,
    demonstrations=_python_tool_demo,
    runs_code=True,
)
register_task(
    "style",
    env=style.StyleEnv,
    prompts=_style_prompts,
    demonstrations=_style_demo,
    setup=_style_setup,
)
# Datasets: prompts come from data.train (JSONL / Parquet / HF datasets directory).
register_task("answer", env=AnswerEnv, chat=True, rewards=True)

ENV_NAMES = ("arithmetic", "arithmetic_levels", "python_tool", "style")  # built-in procedural


def _build(task: Task, params: dict[str, Any]) -> Env:
    try:
        return task.env(**params)
    except TypeError as e:
        raise ValueError(f"env {task.name!r}: bad parameters {sorted(params)}: {e}") from None


def make_env(name: str, **params: Any) -> Env:
    """A fresh env instance (one per sampler worker); params go to its constructor.

    Raises:
      ValueError: unknown name (the message lists the known tasks) or a bad parameter.
    """
    return _build(get_task(name), params)


def env_factory(
    name: str, params: dict[str, Any], chat=None
) -> tuple[Callable[[], Env], Callable | None]:
    """(factory of fresh envs, `set_step(step)` hook or None) from a config's env.params.

    A task's `setup` (the style task: a schedule shared by every env, moved by the hook)
    runs once here. `chat` (a ChatFormat or None) goes to tasks that render chats.
    """
    task = get_task(name)
    params = dict(params)
    hook = None
    if task.setup is not None:
        params, hook = task.setup(params)
    if task.chat:
        params["chat"] = chat
    _build(task, params)  # fail now, naming the parameters, not in a worker
    return functools.partial(_build, task, params), hook


__all__ = ["ENV_NAMES", "env_factory", "make_env", "task_names"]
