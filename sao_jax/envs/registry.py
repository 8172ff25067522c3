"""The registry of tasks and rewards: register once, pick by name or by import path.

A task bundles what a run needs to train on it: the environment, its built-in
(procedural) prompt generator if it has one, and its SFT demonstration builder if it has
one. A new task is one module with one call, and no edit anywhere else:

    # my_pkg/tasks.py
    from sao_jax.envs.registry import register_task
    MY_TASK = register_task("my_task", env=MyEnv, prompts=my_sampler, demonstrations=my_demo)

and a run picks it with `--config.env.name=my_pkg.tasks:MY_TASK` (an import path:
`module:attribute`, the attribute a Task, or an Env class, i.e. a task with an env
only), or with `env.name=my_task` once `my_pkg.tasks` is imported (a config file that
imports it). Each built-in task registers itself at the end of its own module
(arithmetic, levels, python_tool, code_feedback, style, user_style, answer:
`BUILTIN_TASKS`), imported on the first lookup.

Rewards are registered the same way (`register_reward`), by name or import path
(`env.params.reward="my_pkg.rewards:score"`); the built-ins (`math`, `exact_match`,
`code_tests`) live in sao_jax/envs/rewards.py. A reward is a factory: `factory(**params)`
returns `fn(completion_text, prompt) -> Reward`. A reward or task that runs model-written
code (`runs_code=True`: `code_tests`, `python_tool`) needs the sandbox, and the run
checks at start-up that it can have it (sao_jax/run/settings.py `check_sandbox`). Both
registries are of the one registry mechanism (sao_jax/registry.py, which also holds the
how-to for losses and estimators).

Interfaces of a task's callables:
  env(**env.params) -> Env            (a class or factory; `chat=` is passed when the task
                                       says `chat=True` and the run renders a chat template)
  prompts(**env.prompts) -> sample    `sample(rng: np.random.Generator) -> Prompt`
  demonstrations(prompt, rng, error_rate=...) -> [(text, is_model_turn), ...]
  setup(params) -> (params, set_step) optional: shared per-run objects (a schedule) put
                                       into env params, and a hook the trainer calls with
                                       the policy step (non-stationary tasks), or None;
                                       value pretraining calls it with PRETRAIN_STEP (-1)

`make_env("arithmetic", max_turns=4)` builds one env; `env_factory(name, params, chat)`
builds a run's factory of fresh envs (one per sampler slot).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from sao_jax.envs.base import Env, Prompt
from sao_jax.registry import Registry, RegistryError

PRETRAIN_STEP = -1  # the step value pretraining judges at: a schedule's start (step 0) for
# every task, unless a task gives pretraining its own law (user_style's pretrain_targets)

# Modules whose import registers the built-in tasks and rewards (each registers its own).
BUILTIN_TASKS = (
    "sao_jax.envs.arithmetic",
    "sao_jax.envs.levels",
    "sao_jax.envs.python_tool",
    "sao_jax.envs.code_feedback",
    "sao_jax.envs.style",
    "sao_jax.envs.user_style",
    "sao_jax.envs.answer",
)
BUILTIN_REWARDS = ("sao_jax.envs.rewards",)


@dataclasses.dataclass(frozen=True)
class Task:
    """What a run needs of a task; see the module docstring for each callable."""

    name: str
    env: Callable[..., Env]
    prompts: Callable[..., Callable[[Any], Prompt]] | None = None
    demonstrations: Callable[..., list[tuple[str, bool]]] | None = None
    setup: Callable[[dict[str, Any]], tuple[dict[str, Any], Callable | None]] | None = None
    chat: bool = False  # the env accepts `chat=` (a text.chat_template.ChatFormat), uses it
    rewards: bool = False  # the env accepts `reward=` (a name or import path) and params
    runs_code: bool = False  # the env runs model-written code (in the sandbox)


@dataclasses.dataclass(frozen=True)
class Reward:
    """The score of one completion: reward, whether it counts as a success, details."""

    score: float
    success: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


RewardFn = Callable[[str, Prompt], Reward]


def _task_at(spec: str, obj: Any) -> Task:
    if isinstance(obj, Task):
        return obj
    if callable(obj):  # an Env class or factory: a task with an env only
        return Task(spec, obj)
    raise RegistryError(f"env.name {spec!r}: {obj!r} is neither a Task nor an Env class")


# A module reloaded registers its tasks and rewards again (replace=True).
TASKS: Registry[Task] = Registry("task", builtins=BUILTIN_TASKS, from_path=_task_at, replace=True)
REWARDS: Registry[Callable[..., RewardFn]] = Registry(
    "reward", builtins=BUILTIN_REWARDS, from_path=lambda spec, factory: factory, replace=True
)


def register_task(
    name: str,
    *,
    env: Callable[..., Env],
    prompts: Callable[..., Callable[[Any], Prompt]] | None = None,
    demonstrations: Callable[..., list[tuple[str, bool]]] | None = None,
    setup: Callable[[dict[str, Any]], tuple[dict[str, Any], Callable | None]] | None = None,
    chat: bool = False,
    rewards: bool = False,
    runs_code: bool = False,
) -> Task:
    """Registers (or re-registers, e.g. on a module reload) a task; returns it."""
    if not callable(env):
        raise RegistryError(f"task {name!r}: env must be an Env class or factory, got {env!r}")
    return TASKS.register(
        name, Task(name, env, prompts, demonstrations, setup, chat, rewards, runs_code)
    )


def register_reward(
    name: str, *, runs_code: bool = False
) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: `@register_reward("math")` on a factory `(**params) -> fn(text, prompt)`;
    `runs_code=True` marks a reward that runs model-written code (the factory's
    `runs_code` attribute, which a reward given by import path may set itself)."""

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if runs_code:
            factory.runs_code = True
        return REWARDS.register(name, factory)

    return wrap


def task_names() -> tuple[str, ...]:
    """Every registered task name (built-ins included), sorted."""
    return tuple(TASKS.names())


def reward_names() -> tuple[str, ...]:
    return tuple(REWARDS.names())


def get_task(name: str) -> Task:
    """The task registered as `name`, or the one an import path 'module:attr' names.

    Raises:
      RegistryError: an unknown name (the message lists the known ones) or a bad path.
    """
    return TASKS.get(name)


def reward_runs_code(name: str) -> bool:
    """Whether reward `name` runs model-written code (registered with runs_code=True)."""
    return bool(getattr(REWARDS.get(name), "runs_code", False))


def make_reward(name: str, **params: Any) -> RewardFn:
    """`fn(completion_text, prompt) -> Reward` of the reward `name` (or 'module:attr').

    Raises:
      RegistryError: an unknown name (listing the known ones), or parameters its
        factory does not take.
    """
    factory = REWARDS.get(name)
    try:
        return factory(**params)
    except TypeError as e:
        raise RegistryError(f"reward {name!r}: bad parameters {sorted(params)}: {e}") from None


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
