"""A sampled assistant turn as OpenAI's message: reasoning, content and tool calls.

The text of a completion (special tokens decoded, the end-of-turn token dropped) is split
the Qwen3 way (sao_jax/text/qwen3_template.py):

* `<think>...</think>` at its start -> `reasoning_content` (the text between, stripped);
* `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks -> `tool_calls`, each
  `{"id": "call_<uid>", "type": "function", "function": {"name", "arguments"}}` with the
  arguments re-serialised as a JSON string (OpenAI's shape; non-ASCII kept as is);
* the rest -> `content` (None when empty and there are tool calls).

The calls are parsed by the one tool-call parser of the project
(sao_jax/envs/tool_calls.py); a malformed call (unclosed tag, bad JSON, no name) leaves the
whole turn as text content and is reported (`Reply.malformed`, the gateway counts it).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from sao_jax.envs import tool_calls as tc

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclasses.dataclass
class Reply:
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    malformed: str | None  # why the tool calls were left as text, or None

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, the rest). Reasoning is a leading `<think>` block; a turn cut
    inside it (no `</think>`) is all reasoning."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        if THINK_CLOSE in text:  # the generation prompt opened the block
            before, after = text.split(THINK_CLOSE, 1)
            return before.strip(), after.strip()
        return None, text
    body = stripped[len(THINK_OPEN) :]
    if THINK_CLOSE not in body:
        return body.strip(), ""
    reasoning, rest = body.split(THINK_CLOSE, 1)
    return reasoning.strip(), rest.strip()


def parse_reply(text: str, *, tools_allowed: bool = True) -> Reply:
    """The completion `text` as an OpenAI message (module docstring). With
    `tools_allowed=False` (tool_choice 'none', no tools) tool-call markup stays text."""
    reasoning, rest = split_reasoning(text)
    if not tools_allowed or not tc.has_tool_call(rest):
        return Reply(rest.strip(), reasoning, [], None)
    calls, error = tc.parse_tool_calls(rest)
    if error is not None:
        return Reply(rest.strip(), reasoning, [], error)
    content = tc.content_of(rest) or None
    out = [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]
    return Reply(content, reasoning, out, None)
