"""One registry for tasks and rewards: register once, pick by name or by import path.

A task bundles what a run needs to train on it: the environment, its built-in
(procedural) prompt generator if it has one, and its SFT demonstration builder if it has
one. A new task is one module with one call, and no edit anywhere else:

    # my_pkg/tasks.py
    from sao_jax.envs.tasks import register_task
    MY_TASK = register_task("my_task", env=MyEnv, prompts=my_sampler, demonstrations=my_demo)

and a run picks it with `--config.env.name=my_pkg.tasks:MY_TASK` (an import path:
`module:attribute`, the attribute a Task, or an Env class, i.e. a task with an env
only), or with `env.name=my_task` once `my_pkg.tasks` is imported. The built-in tasks
register themselves in sao_jax/envs/registry.py.

Rewards are registered the same way (`register_reward`), by name or import path
(`env.params.reward="my_pkg.rewards:score"`); the built-ins (`math`, `exact_match`,
`code_tests`) live in sao_jax/envs/rewards.py. A reward is a factory: `factory(**params)`
returns `fn(completion_text, prompt) -> Reward`. A reward or task that runs model-written
code (`runs_code=True`: `code_tests`, `python_tool`) needs the sandbox, and the run
checks at start-up that it can have it (sao_jax/run/settings.py `check_sandbox`).

Interfaces of a task's callables:
  env(**env.params) -> Env            (a class or factory; `chat=` is passed when the task
                                       says `chat=True` and the run renders a chat template)
  prompts(**env.prompts) -> sample    `sample(rng: np.random.Generator) -> Prompt`
  demonstrations(prompt, rng, error_rate=...) -> [(text, is_model_turn), ...]
  setup(params) -> (params, set_step) optional: shared per-run objects (a schedule) put
                                       into env params, and a hook the trainer calls with
                                       the policy step (non-stationary tasks), or None
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable
from typing import Any

from sao_jax.envs.base import Env, Prompt

# Modules whose import registers the built-in tasks and rewards (loaded on first lookup,
# so that importing this registry stays cheap and cycle-free).
BUILTIN_MODULES = ("sao_jax.envs.registry", "sao_jax.envs.rewards")


@dataclasses.dataclass(frozen=True)
class Task:
    """What a run needs of a task; see the module docstring for each callable."""

    name: str
    env: Callable[..., Env]
    prompts: Callable[..., Callable[[Any], Prompt]] | None = None
    demonstrations: Callable[..., list[tuple[str, bool]]] | None = None
    setup: Callable[[dict[str, Any]], tuple[dict[str, Any], Callable | None]] | None = None
    chat: bool = False  # the env accepts `chat=` (a sao_jax.chat.ChatFormat) and uses it
    rewards: bool = False  # the env accepts `reward=` (a name or import path) and params
    runs_code: bool = False  # the env runs model-written code (in the sandbox)


@dataclasses.dataclass(frozen=True)
class Reward:
    """The score of one completion: reward, whether it counts as a success, details."""

    score: float
    success: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


RewardFn = Callable[[str, Prompt], Reward]

_TASKS: dict[str, Task] = {}
_REWARDS: dict[str, Callable[..., RewardFn]] = {}
_LOCK = threading.Lock()
_LOADED = False


class RegistryError(ValueError):
    """An unknown or malformed task or reward name; the message names it."""


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
    if not name or ":" in name:
        raise RegistryError(f"task name {name!r}: a non-empty name without ':'")
    if not callable(env):
        raise RegistryError(f"task {name!r}: env must be an Env class or factory, got {env!r}")
    task = Task(name, env, prompts, demonstrations, setup, chat, rewards, runs_code)
    with _LOCK:
        _TASKS[name] = task
    return task


def register_reward(
    name: str, *, runs_code: bool = False
) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: `@register_reward("math")` on a factory `(**params) -> fn(text, prompt)`;
    `runs_code=True` marks a reward that runs model-written code (the factory's
    `runs_code` attribute, which a reward given by import path may set itself)."""

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        if not name or ":" in name:
            raise RegistryError(f"reward name {name!r}: a non-empty name without ':'")
        if runs_code:
            factory.runs_code = True
        with _LOCK:
            _REWARDS[name] = factory
        return factory

    return wrap


def _load_builtins() -> None:
    global _LOADED
    if not _LOADED:
        for module in BUILTIN_MODULES:
            importlib.import_module(module)
        _LOADED = True


def _import_path(spec: str, what: str) -> Any:
    """The attribute `attr` of module `mod` for 'mod:attr'; RegistryError naming it."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{what} {spec!r}: an import path is 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RegistryError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from None
    if not hasattr(module, attr):
        raise RegistryError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def task_names() -> tuple[str, ...]:
    """Every registered task name (built-ins included), sorted."""
    _load_builtins()
    return tuple(sorted(_TASKS))


def reward_names() -> tuple[str, ...]:
    _load_builtins()
    return tuple(sorted(_REWARDS))


def get_task(name: str) -> Task:
    """The task registered as `name`, or the one an import path 'module:attr' names.

    Raises:
      RegistryError: an unknown name (the message lists the known ones) or a bad path.
    """
    _load_builtins()
    if ":" in name:
        obj = _import_path(name, "env.name")
        if isinstance(obj, Task):
            return obj
        if callable(obj):  # an Env class or factory: a task with an env only
            return Task(name, obj)
        raise RegistryError(f"env.name {name!r}: {obj!r} is neither a Task nor an Env class")
    if name not in _TASKS:
        raise RegistryError(
            f"unknown task {name!r}; known: {', '.join(sorted(_TASKS))} "
            "(or an import path 'package.module:Attribute')"
        )
    return _TASKS[name]


def _reward_factory(name: str) -> Callable[..., RewardFn]:
    _load_builtins()
    if ":" in name:
        return _import_path(name, "reward")
    if name not in _REWARDS:
        raise RegistryError(
            f"unknown reward {name!r}; known: {', '.join(sorted(_REWARDS))} "
            "(or an import path 'package.module:factory')"
        )
    return _REWARDS[name]


def reward_runs_code(name: str) -> bool:
    """Whether reward `name` runs model-written code (registered with runs_code=True)."""
    return bool(getattr(_reward_factory(name), "runs_code", False))


def make_reward(name: str, **params: Any) -> RewardFn:
    """`fn(completion_text, prompt) -> Reward` of the reward `name` (or 'module:attr').

    Raises:
      RegistryError: an unknown name (listing the known ones), or parameters its
        factory does not take.
    """
    factory = _reward_factory(name)
    try:
        return factory(**params)
    except TypeError as e:
        raise RegistryError(f"reward {name!r}: bad parameters {sorted(params)}: {e}") from None
