"""A session: one episode of a harness, recorded token-in-token-out.

The session keeps the token ids of everything it has rendered or sampled (the current
`Segment`) and the messages they stand for: the last request's messages plus the reply
it returned. A new chat request is matched against them message by message:

* earlier messages must be equal (role, text, tool call names and parsed arguments);
* the assistant message the gateway returned is matched by its tool-call ids, else by its
  content (stripped), so re-serialised arguments, reordered keys and a dropped reasoning
  field still match;
* the tools and template arguments must be the same.

Matched: the engine is fed the held ids plus only the ids of the newly rendered messages
(the template text between turns included: `ChatRenderer.observation_ids`), never a
re-rendering or re-tokenization of sampled text; the appended ids are observation
(`action_mask` 0, log-prob and version null). Anything else is a real break (an edited or
removed earlier message, new tools, the same context sampled again): the current segment
is closed and a new one starts from the whole conversation rendered (`forks` counts them).
Each segment is its own trajectory row ending in the episode's reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _calls(message: dict) -> list[tuple[str, Any]]:
    out = []
    for c in message.get("tool_calls") or ():
        fn = c.get("function", c)
        out.append((fn.get("name"), _args(fn.get("arguments", {}))))
    return out


def same_message(sent: dict, held: dict) -> bool:
    """A message the client sent again equals the one held (module docstring)."""
    if sent.get("role") != held.get("role"):
        return False
    if held.get("_reply"):  # what the gateway returned
        ids = [c.get("id") for c in held.get("tool_calls") or ()]
        if ids:
            return [c.get("id") for c in sent.get("tool_calls") or ()] == ids
        return _text(sent.get("content")).strip() == _text(held.get("content")).strip()
    if _text(sent.get("content")).strip() != _text(held.get("content")).strip():
        return False
    if sent.get("role") == "tool":
        return sent.get("tool_call_id") == held.get("tool_call_id")
    return _calls(sent) == _calls(held)


@dataclasses.dataclass
class Segment:
    """One trajectory row: per-token lists of equal length."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    action_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    versions: list[int | None] = dataclasses.field(default_factory=list)

    def observe(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.action_mask += [0] * len(ids)
        self.logprobs += [None] * len(ids)
        self.versions += [None] * len(ids)

    def act(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.token_ids += ids
        self.action_mask += [1] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += list(versions)

    @property
    def has_actions(self) -> bool:
        return any(self.action_mask)

    def record(self) -> dict[str, Any]:
        """The four lists, copied (dataclasses.asdict deep-copies every element: ~1 ms a
        segment of a few hundred tokens, on the server's event loop)."""
        return {f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclasses.dataclass
class Plan:
    """What a request feeds the engine: `segment` ids + `new_ids` (observation)."""

    stitched: bool  # continues the current segment
    new_ids: list[int]  # observation ids to append (the whole prompt on a new segment)


@dataclasses.dataclass(frozen=True)
class EndedSession:
    """What the gateway keeps of an ended session: its id and key, so a later request
    gets 401 for a wrong key and 409 for the right one (serve/gateway.py `retire`)."""

    id: str
    key: str
    ended: bool = True


class Session:
    def __init__(self, sid: str, key: str, task: Any = None, metadata: Any = None):
        self.id, self.key, self.task, self.metadata = sid, key, task, metadata
        self.lock = asyncio.Lock()  # one call (or the end) at a time
        self.reward_fn = None  # the task's registered reward (sao_jax/serve/scoring.py)
        self.segments: list[Segment] = []
        self.segment = Segment()
        self.held: list[dict] = []  # last request's messages + the reply returned
        self.context_key: str | None = None  # tools + template kwargs of `held`
        self.after_eos = False  # the held reply ended with the eos token
        self.calls = 0
        self.forks = 0
        self.counters: dict[str, int] = {}
        self.ended = False
        self.last_call = time.monotonic()
        self.last_messages: list[dict] = []
        self.last_reply: dict | None = None
        self.sampling_used: list[dict[str, Any]] = []  # the law of each call
        self.last_response = None  # the previous call's CallRecord (serve/gateway.py)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # ---- stitching ----------------------------------------------------------------------

    def plan_chat(self, messages, tools, kwargs, renderer) -> Plan:
        """How a chat request continues this session (module docstring)."""
        key = json.dumps([tools, kwargs], sort_keys=True, default=str)
        n = len(self.held)
        if (
            n
            and key == self.context_key
            and len(messages) > n
            and all(same_message(m, h) for m, h in zip(messages, self.held, strict=False))
        ):
            ids = renderer.observation_ids(messages[n:], tools, kwargs, after_eos=self.after_eos)
            return Plan(True, ids)
        return Plan(False, renderer.prompt_ids(messages, tools, kwargs))

    def plan_ids(self, prompt_ids: list[int]) -> Plan:
        """A completions request (token ids): stitched when the held ids are its prefix."""
        held = self.segment.token_ids
        if held and len(prompt_ids) > len(held) and prompt_ids[: len(held)] == held:
            return Plan(True, prompt_ids[len(held) :])
        return Plan(False, list(prompt_ids))

    def context(self, plan: Plan) -> list[int]:
        """The ids the engine is fed for `plan` (before any forced prefix)."""
        return (self.segment.token_ids if plan.stitched else []) + plan.new_ids

    def commit(
        self,
        plan: Plan,
        forced_ids: list[int],
        sampled: list[int],
        logprobs: list[float],
        versions: list[int],
        *,
        held: list[dict],
        context_key: str | None,
        after_eos: bool,
    ) -> None:
        """Records a finished call: the observation, the forced prefix, the sampled ids."""
        if not plan.stitched:
            if self.segment.token_ids:
                if self.segment.has_actions:
                    self.segments.append(self.segment)
                self.forks += 1
            self.segment = Segment()
        self.segment.observe(plan.new_ids + forced_ids)
        self.segment.act(sampled, logprobs, versions)
        self.held, self.context_key, self.after_eos = held, context_key, after_eos
        self.calls += 1
        self.last_call = time.monotonic()

    def all_segments(self) -> list[Segment]:
        out = list(self.segments)
        if self.segment.has_actions:
            out.append(self.segment)
        return out

    def episode(
        self, reward: float | None, dropped: str | None, turn_rewards: list[float] | None
    ) -> dict[str, Any]:
        """The episodes.jsonl record."""
        messages = list(self.last_messages)
        if self.last_reply is not None:
            messages.append(self.last_reply)
        return {
            "id": self.id,
            "task": self.task,
            "metadata": self.metadata,
            "reward": reward,
            "dropped": dropped,
            "turn_rewards": turn_rewards,
            "calls": self.calls,
            "forks": self.forks,
            "segments": [s.record() for s in self.all_segments()],
            "messages": messages,
            "sampling": self.sampling_used,
            "counters": dict(self.counters),
        }
