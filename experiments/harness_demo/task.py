"""The calculator agent's task in process: the harness demo's SFT demonstrations, value
pretraining and the in-process `Env` row (experiments/harness_demo/__main__.py).

examples/harness/calculator_agent.py talks to the policy through the gateway: a system
message, the arithmetic prompt as the user message, the `calculator` tool's schema, its
calls' results as `tool` messages, reward 1 when the last number of its tool-free reply
is the answer. `CalculatorAgentEnv` is that loop as an `Env` on the run's chat template
(`chat`, the harness tokenizer's Qwen3-style template): the same rendered context, the
same tool, the same reward (the agent's own functions, loaded from its file), so a
policy trained or measured here sees what the agent shows it. `demonstration` writes the
agent's episodes as SFT segments: one `<tool_call>` with the prompt's expression, the
result, then the number alone (written as the result is, so its tokens are the result's:
"The answer is N." split it differently, ' 3','32','8' for the result's '33','28', so the
copy was a re-tokenization; not measured apart); with probability `error_rate` an
imperfect one (no call and a wrong number, or a right call and a wrong final number) for
RL's headroom.

  --config.env.name=experiments.harness_demo.task:TASK   (configs/harness.py sets it)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
from typing import Any

import numpy as np

from sao_jax.envs import tool_calls
from sao_jax.envs.arithmetic import QUESTION, task_prompts
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.registry import register_task
from sao_jax.text.chat_template import ChatFormat
from sao_jax.text.qwen3_template import EOS_TOKEN, qwen3_tools_template

AGENT_PATH = (
    pathlib.Path(__file__).resolve().parents[2] / "examples" / "harness" / "calculator_agent.py"
)


def _load_agent():
    spec = importlib.util.spec_from_file_location("calculator_agent", AGENT_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AGENT = _load_agent()  # TOOL, SYSTEM, calculator, reward: the harness's own definitions
# Share of SFT demonstrations whose context leaves the tool schema (~280 of ~310 prompt
# tokens) out. With the schema in every demonstration the tiny policy learned the call's
# format but never found the prompt's expression behind the schema (0 of 154 calls copied
# it; results/harness_demo/README.md); the copy learned on short contexts is a
# relative-position circuit (RoPE) that carries over to the full one, where the agent's
# episodes and the evaluation always have the schema.
SCHEMA_FREE_RATE = 0.5


def expression_of(prompt: Prompt) -> str:
    return prompt.meta.get("expr") or prompt.text.removeprefix(QUESTION).strip()


def call_text(expression: str) -> str:
    """A model turn calling the calculator, as the Qwen3 template renders a tool call."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"{tool_calls.OPEN}\n{json.dumps(call)}\n{tool_calls.CLOSE}"


class CalculatorAgentEnv:
    """examples/harness/calculator_agent.py's loop as an Env (module docstring)."""

    def __init__(self, *, max_turns: int = AGENT.MAX_TURNS, chat=None) -> None:
        if chat is None:
            raise ValueError(
                "calculator agent env: needs a chat template (init.chat_template='tokenizer' "
                "with init.tokenizer='harness')"
            )
        if max_turns < 1:
            raise ValueError(f"calculator agent env max_turns={max_turns}: must be >= 1")
        self.chat = chat
        self.max_turns = int(max_turns)
        self.stop_strings = ()  # turns end at the tokenizer's eos, as through the gateway
        self.tool_schemas = [AGENT.TOOL]
        self._prompt: Prompt | None = None
        self._turn = 0
        self._calls = 0

    def reset(self, prompt: Prompt) -> str:
        self._prompt, self._turn, self._calls = prompt, 0, 0
        return self.chat.prompt(AGENT.messages_for(prompt.text), tools=self.tool_schemas)

    def step(self, action_text: str) -> StepResult:
        if self._prompt is None:
            raise RuntimeError("calculator agent env: step() before reset() or after the end")
        self._turn += 1
        text = action_text.removesuffix(self.chat.eos_text)
        info: dict[str, Any] = {"turn": self._turn}
        if not tool_calls.has_tool_call(text):  # the agent's stop: a reply without calls
            score = AGENT.reward(tool_calls.content_of(text), str(self._prompt.answer))
            return self._end(score, info)
        calls, error = tool_calls.parse_tool_calls(text)
        results = []
        if error is not None:  # the gateway returns a malformed call as text: the agent stops
            return self._end(AGENT.reward(text, str(self._prompt.answer)), info)
        for call in calls:
            self._calls += 1
            results.append(AGENT.calculator(str(call.arguments.get("expression", ""))))
        if self._turn >= self.max_turns:
            return self._end(0.0, {**info, "truncated": True})
        obs = self.chat.observation(
            [{"role": "tool", "content": r} for r in results], tools=self.tool_schemas
        )
        return StepResult(obs, 0.0, False, info)

    def _end(self, score: float, info: dict[str, Any]) -> StepResult:
        info.update(success=score > 0, target=self._prompt.answer, tool_calls=self._calls)
        self._prompt = None
        return StepResult("", float(score), True, info)


@functools.cache
def harness_chat() -> ChatFormat:
    """The harness tokenizer's chat format (sao_jax/text/harness_tokenizer.py writes this
    template), what SFT renders demonstrations with (the SFT stage passes no chat)."""
    return ChatFormat(qwen3_tools_template(), EOS_TOKEN)


def demonstration(
    prompt: Prompt,
    rng: np.random.Generator,
    *,
    error_rate: float = 0.0,
    schema_free_rate: float = 0.0,
    chat=None,
):
    """(text, is_model_turn) segments of one agent episode (module docstring); model turns
    end with the eos text, the observations start after it. With probability
    `schema_free_rate` the context leaves the tool schema out (SCHEMA_FREE_RATE)."""
    chat = chat or harness_chat()
    env = CalculatorAgentEnv(chat=chat)
    if schema_free_rate > 0 and rng.random() < schema_free_rate:
        env.tool_schemas = None
    answer = int(prompt.answer)
    bad = rng.random() < error_rate
    kind = ("guess", "typo")[int(rng.integers(2))] if bad else "correct"
    wrong = answer + int(rng.choice([-1, 1])) * int(rng.integers(1, 10))
    final = str(wrong if kind != "correct" else answer)  # tokenized as the tool's result is
    turns = [final] if kind == "guess" else [call_text(expression_of(prompt)), final]
    segments = [(env.reset(prompt), False)]
    for turn in turns:
        result = env.step(turn + chat.eos_text)
        segments.append((turn + chat.eos_text, True))
        if result.observation:
            segments.append((result.observation.removeprefix(chat.eos_text), False))
    return segments


TASK = register_task(
    "calculator_agent",
    env=CalculatorAgentEnv,
    prompts=task_prompts,
    demonstrations=functools.partial(demonstration, schema_free_rate=SCHEMA_FREE_RATE),
    chat=True,
)
