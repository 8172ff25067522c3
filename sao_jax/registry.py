"""The one registry mechanism: entries by name, unknown names refused with the known ones.

Five things are picked by name from a config, each from one `Registry`:

  policy losses         sao_jax.rl.losses.LOSSES        rl.policy_loss, rl.losses.<name>.*
  advantage estimators  sao_jax.rl.advantages.ESTIMATORS  rl.advantage, rl.estimators.<name>.*
  critic targets        sao_jax.rl.critic_targets.CRITIC_TARGETS
                                                        rl.critic_target, rl.critic_targets.<name>.*
  tasks                 sao_jax.envs.registry.TASKS     env.name, env.params, env.prompts
  rewards               sao_jax.envs.registry.REWARDS   env.params.reward

(and the config sections' validators, sao_jax.schema.VALIDATORS). Adding one is ONE file
that registers it, plus a config that uses it:

    # my_pkg/my_loss.py: a policy loss (the interface: sao_jax/rl/losses.py)
    from sao_jax.rl import losses

    @losses.register("my_dis", {"eps_l": 0.2, "eps_h": 4.0})
    def my_dis(x: losses.LossInputs, eps_l, eps_h) -> losses.TokenLoss: ...

    # my_pkg/my_estimator.py: an advantage estimator (sao_jax/rl/advantages.py)
    from sao_jax.rl import advantages

    @advantages.register("my_baseline", needs_outcome=True, params={"scale": 1.0})
    def my_baseline(x: advantages.Inputs, scale) -> advantages.Advantages: ...

    # my_pkg/tasks.py: a task and a reward (sao_jax/envs/registry.py)
    from sao_jax.envs.registry import register_reward, register_task
    MY_TASK = register_task("my_task", env=MyEnv, prompts=my_sampler)

    @register_reward("my_reward")
    def my_reward(**params): ...  # -> fn(completion_text, prompt) -> Reward

    # configs/mine.py: import the file, then name the entry; its parameters (the
    # registered defaults) are config fields like the built-ins'
    import my_pkg.my_loss  # noqa: F401 (registers my_dis)
    from sao_jax.configs import base

    def get_config(arg=None):
        c = base.get_config()
        c.rl.policy_loss = "my_dis"  # c.rl.losses.my_dis.eps_l = 0.1, ...
        return c

Tasks and rewards may also be named by import path, with no import in the config:
`--config.env.name=my_pkg.tasks:MY_TASK`, `env.params.reward="my_pkg.tasks:my_reward"`.
A registry's built-in entries register themselves in their own modules, which it imports
on the first lookup (`builtins`), so importing a registry stays cheap and cycle-free.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

E = TypeVar("E")
IMPORT_PATH = "'package.module:attribute'"


class RegistryError(ValueError):
    """An unknown, malformed or twice-registered name; the message names it."""


class Registry(Generic[E]):
    """Entries by name; `get` rejects unknown names with the list of known ones.

    Args:
      kind: what the entries are, for messages ("loss", "advantage estimator", "task").
      builtins: modules whose import registers the built-in entries, imported on the
        first lookup.
      from_path: accept import paths 'module:attribute' as names: the attribute, made an
        entry by `from_path(name, attribute)` (which raises RegistryError if it is none).
      replace: a second registration of a name replaces the first (a module reloaded);
        otherwise it is an error.
    """

    def __init__(
        self,
        kind: str,
        *,
        builtins: tuple[str, ...] = (),
        from_path: Callable[[str, Any], E] | None = None,
        replace: bool = False,
    ):
        self.kind = kind
        self._builtins = builtins
        self._from_path = from_path
        self._replace = replace
        self._entries: dict[str, E] = {}
        self._lock = threading.RLock()
        self._loaded = not builtins

    def register(self, name: str, entry: E) -> E:
        """Adds `entry` as `name` (a non-empty name without ':'); returns it."""
        if not isinstance(name, str) or not name or ":" in name:
            raise RegistryError(f"{self.kind} name {name!r}: a non-empty name without ':'")
        with self._lock:
            if name in self._entries and not self._replace:
                raise RegistryError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
        return entry

    def get(self, name: str) -> E:
        """The entry `name`, or (with `from_path`) the one an import path names.

        Raises:
          RegistryError: an unknown name (listing the known ones) or a bad import path.
        """
        self._load_builtins()
        if isinstance(name, str) and ":" in name and self._from_path is not None:
            return self._from_path(name, import_path(name, self.kind))
        if not isinstance(name, str) or name not in self._entries:
            path = f" (or an import path {IMPORT_PATH})" if self._from_path else ""
            known = ", ".join(self.names()) or "none"
            raise RegistryError(f"unknown {self.kind} {name!r}; known: {known}{path}")
        return self._entries[name]

    def names(self) -> list[str]:
        """Every registered name (built-ins included), sorted."""
        self._load_builtins()
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, E]]:
        """(name, entry) pairs, sorted by name."""
        return ((name, self._entries[name]) for name in self.names())

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        with self._lock:  # re-entrant: a built-in module may look names up while imported
            if not self._loaded:
                for module in self._builtins:
                    importlib.import_module(module)
                self._loaded = True


def import_path(spec: str, what: str) -> Any:
    """The attribute `attr` of module `mod` for 'mod:attr'; RegistryError naming it."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{what} {spec!r}: an import path is {IMPORT_PATH}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RegistryError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from None
    if not hasattr(module, attr):
        raise RegistryError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def check_params(kind: str, name: str, params: dict[str, Any], accepted: tuple[str, ...]):
    """Raises TypeError naming keyword parameters that entry `name` does not accept."""
    extra = sorted(set(params) - set(accepted))
    if extra:
        raise TypeError(
            f"{kind} {name!r} got unexpected parameter(s) {extra}; it accepts {sorted(accepted)}"
        )
