"""The episode bookkeeping of the arithmetic-style envs (arithmetic, arithmetic_levels,
python_tool): an integer target, turns counted against `max_turns`, tool uses counted,
and the end of the episode (reward 1.0 iff the answer is the target).

A subclass sets `task` (its name in messages) and `tool_count` (the info key that counts
its tool uses), keeps `self.max_turns`, calls `_start(prompt)` in reset and `_next_turn()`
first in step, counts a tool use with `self._tools += 1`, and ends each step with
`_continue(observation, info)` or `_finish(success, answer=..., info=...)`. Every
episode's last info holds turn, success, truncated, answer, target and the tool count.
"""

from __future__ import annotations

from typing import Any

from sao_jax.envs.base import Prompt, StepResult


class IntegerAnswerEpisode:
    """Shared state and endings of an episode answered by one integer (module docstring)."""

    task = "env"  # the env's name in error messages
    tool_count = "tool_calls"  # the final info's key counting tool uses
    max_turns: int
    _target: int | None = None
    _done = True

    def _check_prompt(self, prompt: Prompt) -> None:
        if type(prompt.answer) is not int:
            raise ValueError(f"{self.task} prompt {prompt.uid!r}: answer must be an int")

    def _start(self, prompt: Prompt) -> None:
        self._check_prompt(prompt)
        self._target, self._turn, self._tools, self._done = prompt.answer, 0, 0, False

    def _next_turn(self) -> None:
        if self._target is None or self._done:
            raise RuntimeError(f"{self.task} env: step() before reset() or after the episode ended")
        self._turn += 1

    def _continue(self, observation: str, info: dict[str, Any] | None = None) -> StepResult:
        """The observation, or the truncated end of the episode once max_turns are used."""
        info = {"turn": self._turn, **(info or {})}
        if self._turn >= self.max_turns:
            return self._finish(False, answer=None, info=info, truncated=True)
        return StepResult(observation, 0.0, False, info)

    def _finish(
        self,
        success: bool,
        *,
        answer: int | None,
        info: dict[str, Any] | None = None,
        truncated: bool = False,
    ) -> StepResult:
        self._done = True
        info = {"turn": self._turn, **(info or {}), "success": success, "truncated": truncated}
        info.update(answer=answer, target=self._target, **{self.tool_count: self._tools})
        info.update(self._final_info())
        return StepResult("", 1.0 if success else 0.0, True, info)

    def _final_info(self) -> dict[str, Any]:
        """More entries of the last step's info (a subclass's own counts)."""
        return {}
