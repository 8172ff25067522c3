"""The environment protocol: text in, text out, one episode per prompt.

The sampler owns tokenisation. An environment sees the prompt and each finished model
turn as text and answers with observation text (appended to the context as
non-action tokens), a reward and whether the episode is over. Environments never raise
for bad model output: a malformed tool call is an error *observation*. An exception
that escapes `step` is a bug in the environment; the sampler drops that trajectory and
counts it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One task instance from a prompt source."""

    uid: str  # stable id (dedup, train/eval split, logging)
    text: str  # what the model sees first
    answer: Any = None  # ground truth for the reward, if any
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str  # text appended after the model's turn ("" when done)
    reward: float  # reward for this turn; the outcome reward comes with done=True
    done: bool  # episode over (terminated)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. success, error


@runtime_checkable
class Env(Protocol):
    """One episode at a time; create one instance per sampler worker."""

    # A model turn ends when the model emits EOS or any of these strings; the env then
    # gets the turn's text, stop string included.
    stop_strings: tuple[str, ...]
    max_turns: int  # the episode is truncated after this many model turns
    # Optional: `tool_schemas`, the tools' JSON schemas the chat template is given (None
    # or absent: no tools); a run refuses a template that ignores them (run/preflight.py).

    def reset(self, prompt: Prompt) -> str:
        """Starts an episode; returns the initial context text (the rendered prompt)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Consumes one model turn; returns the observation, reward and done flag."""
        ...


def tool_schemas(env) -> list[dict[str, Any]]:
    """The tools' JSON schemas an env gives the chat template ([] without tools)."""
    return list(getattr(env, "tool_schemas", None) or [])


def tool_names(env) -> list[str]:
    """The names of an env's tools (OpenAI-style schemas: {"function": {"name": ...}})."""
    return [str(s.get("function", s).get("name", "?")) for s in tool_schemas(env)]
