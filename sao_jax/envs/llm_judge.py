"""An LLM judge over the OpenAI-compatible chat-completions HTTP API (stdlib only).

`LLMJudge.score(prompt, text, style)` posts one chat completion to
`{base_url}/chat/completions` and parses the reply strictly into (r_quality, r_style),
each 0.0 or 1.0. The judge must answer with exactly one JSON object
`{"quality": 0|1, "style": 0|1}` (optionally inside one ```json fence). Every failure is a
`JudgeError`: after bounded retries with exponential backoff for timeouts, connection
errors, HTTP 429 and 5xx; at once for other HTTP errors and unparsable replies. A
semaphore caps concurrent requests per judge. The style env turns a JudgeError into a
dropped trajectory.

Time bounds are totals, not per socket read: one attempt (connect, send, status line,
headers, body) ends within `timeout_s`, and one `score` call (slot wait, every attempt,
every backoff) within `deadline_s`: a watchdog timer shuts the socket down when an
attempt's time is up, so a server that trickles one byte at a time cannot hold a call.
The error names the last failure (e.g. `ConnectionRefusedError ... from <url>`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

from sao_jax.envs.base import Prompt

DESCRIPTIONS = {
    "cute": "cute, sweet and playful (kawaii), like a cheerful pet",
    "chuunibyou": "grandiose dark-fantasy delusions (chuunibyou): sealed powers, destiny",
    "classical": "archaic classical diction, like Shakespeare (thee, thou, hath)",
}
SYSTEM_PROMPT = (
    "You judge very short texts. Reply with exactly one JSON object and nothing else: "
    '{"quality": 0 or 1, "style": 0 or 1}. quality is 1 when the text is fluent, about '
    "the given topic and not repetitive; style is 1 when it is clearly written in the "
    "target style."
)
_FENCE_RE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


class JudgeError(RuntimeError):
    """The judge gave no usable verdict (timeout, HTTP error, unparsable reply)."""


def parse_judge_reply(content: str) -> tuple[float, float]:
    """`{"quality": q, "style": s}` with q, s in {0, 1} -> (q, s); JudgeError otherwise."""
    if not isinstance(content, str):
        raise JudgeError(f"judge reply is not text: {type(content).__name__}")
    text = content.strip()
    fenced = _FENCE_RE.fullmatch(text)
    text = fenced.group(1) if fenced else text
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise JudgeError(f"judge reply is not a JSON object: {content[:80]!r}") from None
    if not isinstance(obj, dict) or set(obj) != {"quality", "style"}:
        raise JudgeError(f"judge reply needs exactly the keys quality, style: {content[:80]!r}")
    out = []
    for key in ("quality", "style"):
        v = obj[key]
        if not isinstance(v, int | float) or v not in (0, 1):
            raise JudgeError(f"judge reply {key}={v!r}: expected 0 or 1")
        out.append(float(v))
    return out[0], out[1]


def parse_completion(body: bytes) -> str:
    """choices[0].message.content of a chat-completions response body."""
    try:
        obj = json.loads(body)
        content = obj["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError(f"malformed chat-completions response: {body[:80]!r}") from None
    if not isinstance(content, str):
        raise JudgeError("chat-completions response: message content is not a string")
    return content


class LLMJudge:
    """Scores with a chat model; thread-safe; every call ends within `deadline_s`.

    An attempt ends within `timeout_s` (its whole exchange); the slot wait within
    `queue_timeout_s`; all of it, retries and backoff included, within `deadline_s`.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_concurrency: int = 8,
        queue_timeout_s: float = 300.0,
        deadline_s: float = 60.0,
        max_response_bytes: int = 1 << 20,
        temperature: float = 0.0,
        max_tokens: int = 32,
        descriptions: dict[str, str] | None = None,
        seed: int = 0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"LLMJudge base_url={base_url!r}: must start with http(s)://")
        if min(timeout_s, queue_timeout_s, deadline_s) <= 0 or min(backoff_s, backoff_max_s) < 0:
            raise ValueError(
                "LLMJudge timeout_s, queue_timeout_s, deadline_s > 0; backoff_s, backoff_max_s >= 0"
            )
        if max_retries < 0 or max_concurrency < 1:
            raise ValueError("LLMJudge max_retries must be >= 0 and max_concurrency >= 1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._parts = urllib.parse.urlsplit(self.url)
        self.deadline_s = deadline_s
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.queue_timeout_s = queue_timeout_s
        self.max_response_bytes = max_response_bytes
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.descriptions = dict(DESCRIPTIONS if descriptions is None else descriptions)
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()

    def messages(self, prompt: Prompt, text: str, style: str) -> list[dict[str, str]]:
        topics = " ".join(prompt.meta.get("topics", ())) or prompt.text.strip()
        target = self.descriptions.get(style, style)
        user = f"Target style: {style} ({target}).\nTopic: {topics}\nText: {text}"
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def score(self, prompt: Prompt, text: str, style: str) -> tuple[float, float]:
        """(r_quality, r_style); raises JudgeError."""
        payload = {
            "model": self.model,
            "messages": self.messages(prompt, text, style),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        data = json.dumps(payload).encode("utf-8")
        start = time.monotonic()
        deadline = start + self.deadline_s
        if not self._slots.acquire(timeout=min(self.queue_timeout_s, self.deadline_s)):
            raise JudgeError(
                f"judge busy: no free slot within {min(self.queue_timeout_s, self.deadline_s):g} s"
            )
        try:
            body = self._post_with_retries(data, start, deadline)
        finally:
            self._slots.release()
        return parse_judge_reply(parse_completion(body))

    def _post_with_retries(self, data: bytes, start: float, deadline: float) -> bytes:
        last, attempts = "no attempt", 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause = self._backoff(attempt - 1)
                if time.monotonic() + pause >= deadline:
                    break
                time.sleep(pause)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            attempts += 1
            try:
                return self._post(data, min(self.timeout_s, left))
            except _Retryable as e:
                last = str(e)
        spent = time.monotonic() - start
        raise JudgeError(
            f"judge failed after {attempts} attempt{'s' if attempts != 1 else ''} in "
            f"{spent:.1f}s (timeout_s={self.timeout_s:g}, deadline_s={self.deadline_s:g}): {last}"
        )

    def _backoff(self, attempt: int) -> float:
        """min(backoff_max, backoff * 2**attempt), scaled by a jitter factor in [0.5, 1]."""
        with self._rng_lock:
            jitter = 0.5 + 0.5 * self._rng.random()
        return min(self.backoff_max_s, self.backoff_s * 2**attempt) * jitter

    def _connection(self, budget: float) -> tuple[http.client.HTTPConnection, str]:
        """(connection, request target), through the environment's proxy if it has one."""
        u = self._parts
        https = u.scheme == "https"
        cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        path = urllib.parse.urlunsplit(("", "", u.path or "/", u.query, ""))
        proxy = urllib.request.getproxies().get(u.scheme)
        if proxy and not urllib.request.proxy_bypass(u.hostname or ""):
            p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            conn = cls(p.hostname, p.port, timeout=budget)
            if https:
                conn.set_tunnel(u.hostname, u.port)
                return conn, path
            return conn, self.url
        return cls(u.hostname, u.port, timeout=budget), path

    def _post(self, data: bytes, budget: float) -> bytes:
        """One attempt, all of it within `budget` seconds."""
        conn, target = self._connection(budget)
        expired = threading.Event()

        def cut():  # the attempt's time is up: wake any blocked read or write
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

        timer = threading.Timer(budget, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.request("POST", target, body=data, headers=self._headers)
            resp = conn.getresponse()
            status, reason = resp.status, resp.reason
            body = resp.read(self.max_response_bytes + 1)
        except (OSError, http.client.HTTPException, ValueError) as e:
            # The socket's own timeout and the watchdog race at `budget`: either way the
            # attempt ran out of time, and it is reported as such.
            if expired.is_set() or isinstance(e, TimeoutError):
                raise _Retryable(
                    f"no complete answer within {budget:.3g} s from {self.url}"
                ) from None
            raise _Retryable(f"{type(e).__name__} from {self.url}: {e}") from None
        finally:
            timer.cancel()
            conn.close()
        if expired.is_set():
            raise _Retryable(f"no complete answer within {budget:.3g} s from {self.url}")
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status} from {self.url}")
        if status >= 400:
            raise JudgeError(f"HTTP {status} from {self.url}: {reason}")
        if len(body) > self.max_response_bytes:
            raise JudgeError(f"judge response over {self.max_response_bytes} bytes")
        return body


class _Retryable(Exception):
    """A transient failure worth another attempt."""


def judge_from_config(cfg: dict[str, Any]) -> LLMJudge:
    """LLMJudge(**cfg) with a clear error naming unknown keys."""
    try:
        return LLMJudge(**cfg)
    except TypeError as e:
        raise ValueError(f"llm judge config: {e}") from None
