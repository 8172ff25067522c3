"""The request bodies the gateway accepts, checked field by field.

`parse_chat(body)` and `parse_completion(body)` turn a decoded JSON body into a
`ChatRequest` / `CompletionRequest` or raise a 400 (`ApiError`) whose `param` names the
field. Three lists decide each field (docs/harness.md repeats them):

* handled: the fields of the dataclasses below;
* accepted and ignored (`IGNORED`): what frameworks send and that changes nothing here;
* sampling knobs the behaviour policy fixes (`SAMPLING_FIELDS`): parsed, and when they
  differ from the run's values ignored and counted (400 under strict sampling);
* anything else, and `n > 1`, a 400 naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sao_jax.serve.errors import invalid

IGNORED = (
    "parallel_tool_calls",
    "store",
    "metadata",
    "user",
    "service_tier",
    "stream_options",  # read for include_usage
    "safety_identifier",
    "prompt_cache_key",
)
SAMPLING_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias")
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass
class Sampling:
    """A request's sampling knobs as sent (None = not sent)."""

    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    seed: int | None = None

    def differs_from(self, used: dict[str, Any]) -> list[str]:
        """The fields sent with a value other than what `used` samples with."""
        out = []
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None and not math.isclose(v, used.get(name, v)):
                out.append(name)
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                out.append(name)
        if self.logit_bias:
            out.append("logit_bias")
        return out


@dataclasses.dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict  # 'auto' | 'none' | 'required' | {'type': 'function', ...}
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    sampling: Sampling
    template_kwargs: dict[str, Any]

    @property
    def forced_tool(self) -> str | None:
        """The tool a named tool_choice forces, else None."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None


@dataclasses.dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: int | None  # legacy: the number of top log-probs per token (0 = sampled only)
    echo: bool
    stream: bool
    include_usage: bool
    sampling: Sampling


def _check_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    return body


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise invalid(name, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"must be an integer {bound}, got {v!r}")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(name, f"must be a boolean, got {v!r}")
    return v


def _sampling(body: dict) -> Sampling:
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise invalid("logit_bias", "must be an object of token id -> bias")
    return Sampling(
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        logit_bias=bias,
        seed=_int(body, "seed", -(2**63)),
    )


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or len(v) > 4 or not all(isinstance(s, str) and s for s in v):
        raise invalid("stop", "must be a non-empty string or a list of at most 4 of them")
    return tuple(v)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise invalid("stream_options", "must be an object")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("stream_options.include_usage", "must be a boolean")
    return stream, usage


def _unknown(body: dict, handled: tuple[str, ...]) -> None:
    for name in body:
        if name not in handled and name not in IGNORED and name not in SAMPLING_FIELDS:
            raise invalid(name, "is not supported by this server")


def _n(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid("n", f"only n=1 is supported (one sample per request), got {n!r}")


def _max_tokens(body: dict) -> int | None:
    a = _int(body, "max_tokens", 1)
    b = _int(body, "max_completion_tokens", 1)
    if a is not None and b is not None and a != b:
        raise invalid("max_completion_tokens", f"{b} differs from max_tokens={a}")
    return b if b is not None else a


def _text_content(where: str, content: Any, *, optional: bool) -> None:
    if content is None and optional:
        return
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return
    raise invalid(where, "must be a string or a list of {'type': 'text', 'text': ...} parts")


def _messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        m = dict(m)
        if role == "developer":
            m["role"] = "system"
        calls = m.get("tool_calls")
        _text_content(f"{where}.content", m.get("content"), optional=role == "assistant")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise invalid(f"{where}.tool_calls", "only assistant messages carry a list")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                    raise invalid(f"{where}.tool_calls[{j}].function", "needs a 'name'")
                if not isinstance(fn.get("arguments", ""), (str, dict)):
                    raise invalid(f"{where}.tool_calls[{j}].function.arguments", "a JSON string")
        if role == "assistant" and m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def _tools(body: dict) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list of function tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):  # fmt: skip
            raise invalid(f"tools[{i}]", "must be {'type': 'function', 'function': {'name', ...}}")
    return tools or None


def _tool_choice(body: dict, tools) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise invalid("tool_choice", "'required' needs tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise invalid("tool_choice", "must be auto, none, required or a named function")
    names = [t["function"]["name"] for t in tools or ()]
    if fn["name"] not in names:
        raise invalid("tool_choice", f"names {fn['name']!r}, which is not in tools")
    return {"type": "function", "function": {"name": fn["name"]}}


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "must be the served model's name")
    return model


CHAT_FIELDS = (
    "model", "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens",
    "stop", "logprobs", "top_logprobs", "stream", "n", "seed", "chat_template_kwargs",
)  # fmt: skip


def parse_chat(body: Any) -> ChatRequest:
    body = _check_object(body)
    _unknown(body, CHAT_FIELDS)
    _n(body)
    tools = _tools(body)
    stream, usage = _stream(body)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise invalid("top_logprobs", "needs logprobs=true")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "must be an object")
    return ChatRequest(
        model=_model(body),
        messages=_messages(body),
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        max_tokens=_max_tokens(body),
        stop=_stop(body),
        logprobs=logprobs,
        top_logprobs=top,
        stream=stream,
        include_usage=usage,
        sampling=_sampling(body),
        template_kwargs=kwargs,
    )


COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "stop", "logprobs", "echo", "stream", "n",
                     "seed", "suffix", "best_of")  # fmt: skip


def parse_completion(body: Any) -> CompletionRequest:
    body = _check_object(body)
    _unknown(body, COMPLETION_FIELDS)
    _n(body)
    if body.get("suffix") is not None:
        raise invalid("suffix", "is not supported by this server")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", "only best_of=1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and prompt and all(
        isinstance(i, int) and not isinstance(i, bool) for i in prompt
    )  # fmt: skip
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise invalid("prompt", "must be a non-empty string or a list of token ids")
    stream, usage = _stream(body)
    return CompletionRequest(
        model=_model(body),
        prompt=prompt,
        max_tokens=_int(body, "max_tokens", 1),
        stop=_stop(body),
        logprobs=_int(body, "logprobs", 0, MAX_TOP_LOGPROBS),
        echo=_bool(body, "echo"),
        stream=stream,
        include_usage=usage,
        sampling=_sampling(body),
    )
