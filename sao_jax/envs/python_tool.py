"""Tool-integrated reasoning with a Python interpreter (the code runs in `sandbox/`).

Turn format (prompts are the arithmetic ones, `q:<expr>\\n`):
```
q:(123*45)-67\\n                 prompt
```python\\nprint((123*45)-67)\\n```\\n      model: any text, then a fenced code block
```output\\n5468\\n```\\n          env: stdout (+ last stderr lines and the limit hit, if any)
a:5468\\n                        model: final answer -> done, reward 1.0 / 0.0
```
The only stop string is the closing fence "```\\n" (the opening "```python\\n" does not
contain it); an answer turn ends at EOS (or "\\n" at the end of the `a:` line when the
sampler also stops there). A turn runs the last "```python\\n" block in it; a block
that is never closed, or a turn with neither code nor an `a:` line, gets `e:bad\\n`.
Turns count towards `max_turns` exactly as in the arithmetic env.
"""

from __future__ import annotations

import re
from typing import Any

from sao_jax.envs import arithmetic, sandbox, tool_calls
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.episode import IntegerAnswerEpisode
from sao_jax.envs.registry import register_task

CODE_OPEN, FENCE_CLOSE, OUTPUT_OPEN = "```python\n", "```\n", "```output\n"
STOP_STRINGS = (FENCE_CLOSE,)
_ANSWER_RE = re.compile(r"^a:[ \t]*(-?[0-9]{1,18})[ \t]*$", re.MULTILINE)


def render_output(
    result: sandbox.SandboxResult, *, max_chars: int = 512, err_lines: int = 3
) -> str:
    """The observation body: stdout (cut to fit), then the last stderr lines and the error.

    The error part is kept whole (each line cut to 200 chars) so the model always sees why
    the code failed; stdout gets the rest of `max_chars`.
    """
    tail: list[str] = []
    if not result.ok:
        tail = [line[:200] for line in result.stderr.splitlines() if line.strip()][-err_lines:]
        if not result.error.startswith("exit status") or not tail:
            tail.append(f"error: {result.error}")
    err = "".join(line + "\n" for line in tail)
    out = result.stdout
    room = max(0, max_chars - len(err))
    if len(out) > room:
        out = out[:room] + "\n...(truncated)"
    if out and not out.endswith("\n"):
        out += "\n"
    return out + err


def extract_code(text: str) -> tuple[str | None, str | None]:
    """(code, None) for the last closed ```python block, (None, error) when not closed,
    (None, None) when the text has no code block. A Qwen3-style tool call
    `<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>` counts as a
    block (the last call); a malformed one is an error (sao_jax/envs/tool_calls.py)."""
    if tool_calls.has_tool_call(text):
        calls, error = tool_calls.parse_tool_calls(text)
        if error is not None:
            return None, error
        call = calls[-1]
        code = call.arguments.get("code")
        if call.name != "python" or not isinstance(code, str):
            return None, f"tool call {call.name!r}: the tool is 'python' with a string 'code'"
        return code, None
    start = text.rfind(CODE_OPEN)
    if start < 0:
        return None, None
    rest = text[start + len(CODE_OPEN) :]
    end = rest.find("```")
    if end < 0:
        return None, "code block not closed"
    return rest[:end], None


class PythonToolEnv(IntegerAnswerEpisode):
    """Python as a tool; reward 1.0 for a correct `a:` answer, else 0.0."""

    stop_strings = STOP_STRINGS
    task = "python_tool"
    tool_count = "code_runs"

    def __init__(
        self,
        *,
        max_turns: int = 4,
        max_turn_chars: int = 4096,
        max_obs_chars: int = 512,
        limits: sandbox.SandboxLimits | None = None,
        isolation: str = "auto",
        allow_weak_isolation: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"python_tool max_turns={max_turns}: must be >= 1")
        if max_turn_chars < 8 or max_obs_chars < 16:
            raise ValueError("python_tool max_turn_chars must be >= 8 and max_obs_chars >= 16")
        if isolation not in sandbox.ISOLATIONS:
            raise ValueError(f"python_tool isolation={isolation!r}: one of {sandbox.ISOLATIONS}")
        # Probes the machine once per process: without kernel isolation this raises
        # SandboxUnavailable (one line) unless the weak mode is allowed (one warning line).
        sandbox.resolve_isolation(isolation, allow_weak_isolation)
        self.max_turns = max_turns
        self.max_turn_chars = max_turn_chars
        self.max_obs_chars = max_obs_chars
        self.limits = limits or sandbox.SandboxLimits()
        self.isolation = isolation
        self.allow_weak_isolation = allow_weak_isolation

    def reset(self, prompt: Prompt) -> str:
        self._start(prompt)
        return prompt.text

    def step(self, action_text: str) -> StepResult:
        self._next_turn()
        text = action_text if isinstance(action_text, str) else repr(action_text)
        lead = "" if text.endswith("\n") else "\n"
        info: dict[str, Any] = {"turn": self._turn}
        if len(text) > self.max_turn_chars:
            return self._continue(f"{lead}e:bad\n", {**info, "error": "turn too long"})
        code, error = extract_code(text)
        if error is not None:
            return self._continue(f"{lead}e:bad\n", {**info, "error": error})
        if code is not None:
            self._tools += 1
            result = sandbox.run_python(
                code, self.limits, isolation=self.isolation, allow_weak=self.allow_weak_isolation
            )
            info["sandbox"] = {"error": result.error, "isolation": result.isolation}
            body = render_output(result, max_chars=self.max_obs_chars)
            return self._continue(f"{lead}{OUTPUT_OPEN}{body}{FENCE_CLOSE}", info)
        answers = _ANSWER_RE.findall(text)
        if answers:
            value = int(answers[-1])
            return self._finish(value == self._target, answer=value, info=info)
        return self._continue(f"{lead}e:bad\n", {**info, "error": "neither code nor answer"})


def demonstration(prompt: Prompt, **env_kwargs: Any) -> list[tuple[str, bool]]:
    """A correct trajectory as (text, is_model_turn) segments: print the expression, answer.

    Runs the code through the sandbox, so the observation is the real one. The code is
    ours (`print(<expr>)`), not the model's: the weak sandbox is allowed by default.
    """
    expr = prompt.meta.get("expr") or prompt.text.removeprefix(arithmetic.QUESTION).strip()
    env = PythonToolEnv(**{"allow_weak_isolation": True, **env_kwargs})
    segments = [(env.reset(prompt), False)]
    code_turn = f"{CODE_OPEN}print({expr})\n{FENCE_CLOSE}"
    result = env.step(code_turn)
    segments.append((code_turn, True))
    if result.done:  # max_turns == 1: nothing left for the answer
        return segments
    segments.append((result.observation, False))
    answer = result.observation.removeprefix(OUTPUT_OPEN).split("\n", 1)[0].strip()
    answer_turn = f"{arithmetic.ANSWER}{answer}\n"
    env.step(answer_turn)
    return [*segments, (answer_turn, True)]


# ------------------------------------------------------------------------------ the task


def task_prompts(**params: Any):
    """Arithmetic problems, harder by default (two or three operations on 10..999)."""
    return arithmetic.task_prompts({"n_ops": (2, 3), "operand_range": (10, 999)}, **params)


def _demonstration(prompt, rng, *, error_rate: float = 0.0):
    del rng, error_rate  # always correct (the sandbox output is real)
    return demonstration(prompt)


register_task(
    "python_tool",
    env=PythonToolEnv,
    prompts=task_prompts,
    demonstrations=_demonstration,
    runs_code=True,
)
