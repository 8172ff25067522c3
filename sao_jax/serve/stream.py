"""A streamed reply's pieces: SSE events and what of the reply a client may see yet.

* `sse(obj)`: one server-sent event (`data: <json>` or `data: [DONE]`);
* `close_stream(...)`: the last events of a reply (finish reason, usage, `[DONE]`);
* `StreamView`: the reasoning and content deltas of the ids sampled so far, with
  tool-call markup, stop strings and trailing whitespace held back until the end, so the
  concatenated deltas equal the non-streamed message (sao_jax/serve/gateway.py streams
  through it).
"""

from __future__ import annotations

import json
from typing import Any

from sao_jax.serve.reply import THINK_CLOSE, split_reasoning

OPEN_CALL = "<tool_call>"


def sse(obj: Any) -> str:
    return (
        "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"
    )


async def close_stream(emit, head: dict, last_choice: dict, usage: dict | None) -> None:
    """The end of an SSE reply: the chunk with the finish reason, the usage chunk when the
    request asked for it (`stream_options.include_usage`), then `data: [DONE]`."""
    await emit(sse({**head, "choices": [last_choice]}))
    if usage is not None:
        await emit(sse({**head, "choices": [], "usage": usage}))
    await emit(sse("[DONE]"))


def held_back(text: str, marks: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could start one of `marks`."""
    for k in range(min(len(text), max((len(m) for m in marks), default=0)), 0, -1):
        if any(m.startswith(text[-k:]) and m != text[-k:] for m in marks):
            return k
    return 0


class StreamView:
    """What of a streamed reply the client may see yet: reasoning and content deltas, with
    tool-call markup, stop strings and trailing whitespace held back until the end (so the
    concatenated deltas equal the non-streamed message)."""

    def __init__(self, renderer, forced: list[int], stop: tuple[str, ...], tools_allowed: bool):
        self.renderer, self.ids, self.stop = renderer, list(forced), stop
        self.marks = (*stop, THINK_CLOSE, "<think>") + ((OPEN_CALL,) if tools_allowed else ())
        self.tools_allowed = tools_allowed
        self.sent = {"reasoning_content": "", "content": ""}
        self.in_call = False

    def _visible(self) -> dict[str, str]:
        text = self.renderer.text(self.ids)
        for s in self.stop:
            if s in text:
                text = text[: text.find(s)]
        reasoning, rest = split_reasoning(text)
        if text.lstrip().startswith("<think>") and THINK_CLOSE not in text:
            rest = ""
        if self.tools_allowed and OPEN_CALL in rest:
            rest = rest[: rest.find(OPEN_CALL)]
        rest = rest.lstrip()
        rest = rest[: len(rest) - held_back(rest, self.marks)].rstrip()
        out = {"content": rest}
        if reasoning is not None:
            r = reasoning if THINK_CLOSE in text else reasoning.rstrip()
            out["reasoning_content"] = r[: len(r) - held_back(r, self.marks)]
        return out

    def _delta(self, visible: dict[str, str]) -> dict[str, str]:
        delta = {}
        for field, value in visible.items():
            sent = self.sent[field]
            if value.startswith(sent) and len(value) > len(sent):
                delta[field] = value[len(sent) :]
                self.sent[field] = value
        return delta

    def advance(self, ids: list[int]) -> dict[str, str]:
        self.ids += ids
        return self._delta(self._visible())

    def finish(self, reply) -> list[dict]:
        """The last deltas: what was held back, then the tool calls."""
        final = {"content": reply.content or ""}
        if reply.reasoning is not None:
            final["reasoning_content"] = reply.reasoning
        out = []
        delta = self._delta(final)
        if delta:
            out.append(delta)
        if reply.tool_calls:
            calls = [{"index": i, **c} for i, c in enumerate(reply.tool_calls)]
            out.append({"tool_calls": calls})
        return out
