"""Qwen3-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

A model turn may hold text and any number of tool calls (Qwen3 / Hermes format, what the
Qwen3 chat template renders from a message's `tool_calls`). Parsing never raises for model
output: a malformed call (unclosed tag, invalid JSON, no name, arguments not an object)
comes back as an error string that the environment turns into an error observation.

    calls, error = parse_tool_calls('x <tool_call>{"name": "python", '
                                    '"arguments": {"code": "print(1)"}}</tool_call>')
    calls == [ToolCall("python", {"code": "print(1)"})] and error is None
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_CALLS = 8  # per turn; more is an error (a runaway turn)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_message(self) -> dict[str, Any]:
        """The call as chat templates expect it in an assistant message's `tool_calls`."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def has_tool_call(text: str) -> bool:
    return OPEN in text


def content_of(text: str) -> str:
    """The turn's text without its tool calls (what precedes the first call, stripped)."""
    return text.split(OPEN, 1)[0].strip()


def _one(body: str) -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        return None, f"tool call is not valid JSON: {str(e)[:80]}"
    if not isinstance(obj, dict):
        return None, "tool call is not a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, "tool call has no 'name'"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None, f"tool call {name!r}: 'arguments' is not a JSON object"
    if not isinstance(args, dict):
        return None, f"tool call {name!r}: 'arguments' is not a JSON object"
    return ToolCall(name, args), None


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """(calls, None), or ([], error) when any call in `text` is malformed.

    No `<tool_call>` tag: ([], None). An opening tag without its closing tag, more than
    MAX_CALLS calls, or a call whose body is not `{"name": str, "arguments": object}`
    (arguments may also be a JSON-encoded object string) is an error.
    """
    if not isinstance(text, str) or OPEN not in text:
        return [], None
    if text.count(OPEN) != text.count(CLOSE) or text.rfind(OPEN) > text.rfind(CLOSE):
        return [], "tool call not closed with </tool_call>"
    bodies = _CALL_RE.findall(text)
    if len(bodies) > MAX_CALLS:
        return [], f"{len(bodies)} tool calls in one turn (at most {MAX_CALLS})"
    calls = []
    for body in bodies:
        call, error = _one(body.strip())
        if error is not None:
            return [], error
        calls.append(call)
    return calls, None
