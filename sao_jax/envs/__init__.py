"""Environments: the task and reward registry, the built-in tasks, rewards and the sandbox.

The face: what an env is (`Env`, `Prompt`, `StepResult`), the registry (`register_task`,
`register_reward`, `get_task`, `make_env`, `env_factory`, `make_reward`; how to add a
task: sao_jax/envs/registry.py). The built-in tasks (arithmetic, arithmetic_levels,
python_tool, code_feedback, style, user_style, answer) register themselves in their own
modules, imported on the first lookup.
"""

from sao_jax.envs.base import Env, Prompt, StepResult
from sao_jax.envs.registry import (
    Reward,
    Task,
    env_factory,
    get_task,
    make_env,
    make_reward,
    register_reward,
    register_task,
    reward_names,
    task_names,
)

__all__ = [
    "Env",
    "Prompt",
    "Reward",
    "StepResult",
    "Task",
    "env_factory",
    "get_task",
    "make_env",
    "make_reward",
    "register_reward",
    "register_task",
    "reward_names",
    "task_names",
]
