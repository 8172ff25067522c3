r"""Prompts with reference answers (a dataset): answer, optionally after Python tool calls.

The task for file-backed datasets (GSM8K, MATH, code problems): the policy answers the
prompt in one turn, scored by a reward registered in sao_jax/envs/registry.py (`math`,
`exact_match`, `code_tests` or an import path). With `tools=("python",)` it may first
call a Python interpreter (sandbox.run_python) any number of turns, up to `max_turns`.

With a chat template (`chat`, a sao_jax.text.chat_template.ChatFormat) the prompt is rendered
as a conversation (the dataset's messages, or its prompt as one user message), tools are
described to the template, a turn's Qwen3-style `<tool_call>{json}</tool_call>` calls are
run and their results come back as tool turns; turns end at the tokenizer's eos. Without
one (a base model, the built-in character tokenizer) the prompt is the raw text and a
tool call is a fenced ```python block answered by a ```output block.

Never raises for model output: a malformed tool call or a failed run is an error
observation, and the episode goes on until an answer or `max_turns`.

Model code (tool calls, and a reward that runs code, e.g. `code_tests`, which gets
`isolation` / `allow_weak_isolation` from here unless `reward_params` sets them) runs in
the sandbox's kernel isolation; the weak mode only with `allow_weak_isolation=True`
(a missing bubblewrap otherwise fails at construction, and a run at start-up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sao_jax.envs import sandbox, tool_calls
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.python_tool import render_output
from sao_jax.envs.registry import make_reward, register_task, reward_runs_code
from sao_jax.envs.rewards import last_code_block

TOOLS = ("python",)
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs a Python 3 script and returns what it prints (stdout and errors).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The script to run."}},
            "required": ["code"],
        },
    },
}
RAW_OUTPUT_OPEN, RAW_FENCE_CLOSE = "```output\n", "```\n"


class AnswerEnv:
    """Reward `reward` (name or import path, built with `reward_params`) on the answer."""

    def __init__(
        self,
        *,
        reward: str = "math",
        reward_params: Mapping[str, Any] | None = None,
        tools: tuple[str, ...] | list[str] = (),
        max_turns: int | None = None,
        max_turn_chars: int = 16384,
        max_obs_chars: int = 1024,
        limits: Mapping[str, Any] | None = None,
        isolation: str = "auto",
        allow_weak_isolation: bool = False,
        chat=None,
    ) -> None:
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"answer env tools={list(tools)}: unknown {unknown}; known {TOOLS}")
        self.tools = tuple(tools)
        self.max_turns = (4 if self.tools else 1) if max_turns is None else int(max_turns)
        if self.max_turns < 1:
            raise ValueError(f"answer env max_turns={max_turns}: must be >= 1")
        self.reward_name = reward
        reward_params = dict(reward_params or {})
        if reward_runs_code(reward):
            reward_params.setdefault("isolation", isolation)
            reward_params.setdefault("allow_weak_isolation", allow_weak_isolation)
        if self.tools:  # one line now (SandboxUnavailable), not at the first tool call
            sandbox.resolve_isolation(isolation, allow_weak_isolation)
        self.reward = make_reward(reward, **reward_params)
        self.max_turn_chars = max_turn_chars
        self.max_obs_chars = max_obs_chars
        self.limits = sandbox.SandboxLimits(**dict(limits or {}))
        self.isolation = isolation
        self.allow_weak_isolation = allow_weak_isolation
        self.chat = chat
        # Raw text with tools: a turn that closes a fence may be a call; chat: eos only.
        self.stop_strings = (RAW_FENCE_CLOSE,) if (self.tools and chat is None) else ()
        self.tool_schemas = [PYTHON_TOOL] if self.tools else None  # what the chat template shows
        self._prompt: Prompt | None = None
        self._turn = 0
        self._calls = 0

    def reset(self, prompt: Prompt) -> str:
        if prompt.answer is None:
            raise ValueError(f"answer env: prompt {prompt.uid!r} has no reference answer")
        self._prompt, self._turn, self._calls = prompt, 0, 0
        if self.chat is None:
            return prompt.text
        messages = self.chat.messages(prompt.text, prompt.meta.get("messages"))
        return self.chat.prompt(messages, tools=self.tool_schemas)

    def step(self, action_text: str) -> StepResult:
        if self._prompt is None:
            raise RuntimeError("answer env: step() before reset() or after the episode ended")
        self._turn += 1
        text = action_text if isinstance(action_text, str) else repr(action_text)
        info: dict[str, Any] = {"turn": self._turn}
        if len(text) > self.max_turn_chars:
            return self._tool_result(f"error: turn longer than {self.max_turn_chars}", info)
        if self.tools:
            code, error = self._tool_code(text)
            if error is not None:
                info["error"] = error
                return self._tool_result(f"error: {error}", info)
            if code is not None:
                self._calls += 1
                result = sandbox.run_python(
                    code, self.limits, isolation=self.isolation,
                    allow_weak=self.allow_weak_isolation,
                )  # fmt: skip
                info["sandbox"] = {"error": result.error, "isolation": result.isolation}
                return self._tool_result(render_output(result, max_chars=self.max_obs_chars), info)
        return self._finish(text, info)

    def _tool_code(self, text: str) -> tuple[str | None, str | None]:
        """(code to run, None), (None, error) for a malformed call, (None, None) for none."""
        if self.chat is None:
            if not text.endswith(RAW_FENCE_CLOSE) or "```python" not in text:
                return None, None
            return last_code_block(text), None
        calls, error = tool_calls.parse_tool_calls(text)
        if error is not None or not calls:
            return None, error
        if len(calls) > 1:
            return None, "one tool call per turn"
        call = calls[0]
        if call.name != "python":
            return None, f"unknown tool {call.name!r}; the tool is 'python'"
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return None, "the python tool needs a string argument 'code'"
        return code, None

    def _tool_result(self, body: str, info: dict[str, Any]) -> StepResult:
        if self._turn >= self.max_turns:
            return self._end(0.0, False, {**info, "truncated": True, "answer": None})
        if self.chat is None:
            return StepResult(f"{RAW_OUTPUT_OPEN}{body}{RAW_FENCE_CLOSE}", 0.0, False, info)
        obs = self.chat.observation([{"role": "tool", "content": body}], tools=self.tool_schemas)
        return StepResult(obs, 0.0, False, info)

    def _finish(self, text: str, info: dict[str, Any]) -> StepResult:
        r = self.reward(text, self._prompt)
        return self._end(r.score, r.success, {**info, **r.info, "truncated": False})

    def _end(self, reward: float, success: bool, info: dict[str, Any]) -> StepResult:
        info.update(success=success, target=self._prompt.answer, tool_calls=self._calls)
        self._prompt = None
        return StepResult("", float(reward), True, info)


# Datasets: prompts come from data.train (JSONL / Parquet / HF datasets directory).
register_task("answer", env=AnswerEnv, chat=True, rewards=True)
