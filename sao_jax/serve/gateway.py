"""The gateway's core: requests to backend calls, replies, sessions, episodes.

`Gateway` holds the generation backend (sao_jax/sampling/backend.py), the renderer, the
sessions and the episode log. Its coroutines run on the server's asyncio loop
(sao_jax/serve/app.py); backend token chunks reach them through the loop.

A call: render (or stitch, sao_jax/serve/session.py) -> prompt ids [+ the forced
tool-call prefix of tool_choice required / named, observation] -> `backend.submit` ->
stream or wait -> parse the text (sao_jax/serve/reply.py) -> record (sessions only) ->
reply. `logprobs.content` lists every sampled token (reasoning, tool-call markup, the
end-of-turn token) with the log-prob the session records, and `usage.completion_tokens`
counts the same tokens. A client that disconnects mid-generation cancels its request:
its slot is freed and nothing is recorded.

Sampling rule: in serve-only mode (`request_sampling`, the default of a server without
training) a request's temperature and top_p apply to its slot; in training
(`request_sampling=False`) the behaviour policy is the run's (`backend.sampling`) and a
request's differing temperature / top_p are not applied. Knobs not applied (those, and
penalties or logit_bias, which no backend applies) are counted (`sampling_ignored`), or
refused with a 400 under `strict_sampling`; each episode records the law of every call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from sao_jax.sampling.backend import BackendBusy, GenerationError, GenRequest, GenResult
from sao_jax.serve.episodes import EpisodeLog
from sao_jax.serve.errors import ApiError, invalid
from sao_jax.serve.protocol import ChatRequest, CompletionRequest
from sao_jax.serve.render import ChatRenderer
from sao_jax.serve.reply import parse_reply
from sao_jax.serve.scoring import score, task_reward
from sao_jax.serve.session import EndedSession, Plan, Session
from sao_jax.serve.stream import StreamView, close_stream, sse


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    model_name: str = "sao-policy"
    max_tokens: int = 0  # per request at most; 0 = whatever the context leaves
    max_body_bytes: int = 4 << 20  # larger bodies: 413
    reward_timeout_s: float = 600.0  # an episode with no reward this long after its last call ends
    request_sampling: bool = True  # serve-only: a request's temperature / top_p apply;
    # False (training): the run's law applies and differing values are ignored and counted
    strict_sampling: bool = False  # True: sampling knobs not applied are a 400, not ignored
    admin_key: str = ""  # "" = a random one
    ended_kept: int = 100_000  # ended sessions whose id and key are kept (409, not 404)


class Disconnected(Exception):
    """The client went away mid-generation."""


class CallRecord:
    """A call's response kept for retries: the JSON payload or the SSE events."""

    def __init__(self, body: bytes):
        self.body = body
        self.done = asyncio.Event()
        self.payload: dict | None = None
        self.events: list[str] = []
        self.error: ApiError | None = None
        self.cancelled = False  # the client went away: nothing was recorded


class Gateway:
    def __init__(self, backend, renderer: ChatRenderer, cfg: GatewayConfig, log: EpisodeLog):
        self.backend, self.renderer, self.cfg, self.log = backend, renderer, cfg, log
        self.admin_key = cfg.admin_key or "sk-admin-" + secrets.token_hex(16)
        self.sessions: dict[str, Session] = {}  # the live ones
        self.ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> key
        self.counters: dict[str, int] = {}
        self.base_url = ""  # http://HOST:PORT, set by the server once it listens

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # ---- sessions -----------------------------------------------------------------------

    def new_session(
        self, task: Any = None, metadata: Any = None, base_url: str | None = None
    ) -> dict[str, str]:
        """A new session; its base_url starts with `base_url` (the address the admin
        reached, default the one the server listens on)."""
        base_url = base_url or self.base_url
        reward_fn = task_reward(task)  # a 400 now, not at the episode's end
        sid = "s" + secrets.token_hex(8)
        key = "sk-sess-" + secrets.token_hex(16)
        self.sessions[sid] = Session(sid, key, task, metadata)
        self.sessions[sid].reward_fn = reward_fn
        self.count("sessions")
        return {"id": sid, "base_url": f"{base_url}/sessions/{sid}/v1", "api_key": key}

    def session(self, sid: str) -> Session | EndedSession:
        """The live session `sid`, or what is kept of it once ended (404 for neither)."""
        s = self.sessions.get(sid)
        if s is not None:
            return s
        if sid in self.ended:
            return EndedSession(sid, self.ended[sid])
        raise ApiError(404, f"no session {sid!r}", param="session", code="session_not_found")

    def retire(self, s: Session) -> None:
        """An ended session leaves the live ones: its id and key are kept for the last
        `cfg.ended_kept` ended sessions (a later request gets 409; an older one's, 404), so
        a server that runs for days holds no episode it has written."""
        self.sessions.pop(s.id, None)
        self.ended[s.id] = s.key
        while len(self.ended) > self.cfg.ended_kept:
            self.ended.popitem(last=False)

    async def end(
        self,
        sid: str,
        reward: float | None,
        turn_rewards: list[float] | None,
        dropped: str | None = None,
        *,
        unrewarded: str = "no_reward",
    ) -> dict[str, Any]:
        """Ends session `sid`'s episode: with `reward`, or dropped for `dropped`, or (both
        None) scored by its task's registered reward (sao_jax/serve/scoring.py), else
        dropped for `unrewarded`."""
        s = self.session(sid)
        if s.ended:
            raise ApiError(409, f"session {sid!r} has ended", param="session", code="ended")
        async with s.lock:
            if s.ended:
                raise ApiError(409, f"session {sid!r} has ended", param="session", code="ended")
            if turn_rewards is not None and len(turn_rewards) != s.calls:
                raise invalid("turn_rewards", f"{len(turn_rewards)} rewards for {s.calls} calls")
            scored = None
            if reward is None and dropped is None:
                if s.reward_fn is not None and s.all_segments():
                    text = (s.last_reply or {}).get("content") or ""
                    scored = await asyncio.get_running_loop().run_in_executor(
                        None, score, s.reward_fn, s.task, s.id, text
                    )
                    reward = scored.get("reward")
                    dropped = "reward_error" if reward is None else None
                else:
                    dropped = unrewarded
            if dropped is None and not s.all_segments():
                dropped = "no_calls"
            if dropped is not None:
                reward = None
            record = s.episode(reward, dropped, turn_rewards)
            if scored is not None:
                record["scored_by"] = s.task["reward"]
                record["score_info"] = scored
            s.ended = True
            s.segments, s.segment = [], type(s.segment)()  # written: keep no copy
            s.held, s.last_response, s.last_messages, s.last_reply = [], None, [], None
            await asyncio.get_running_loop().run_in_executor(None, self.log.write, record)
            self.retire(s)
            self.count("episodes_dropped" if dropped else "episodes")
            return {"id": sid, "reward": reward, "dropped": dropped, "calls": s.calls}

    async def drop_all(self, reason: str) -> int:
        """Ends every live session as dropped (`reason`): a server shutting down."""
        n = 0
        for sid, s in list(self.sessions.items()):
            if not s.ended:
                with contextlib.suppress(ApiError):
                    await self.end(sid, None, None, dropped=reason)
                    n += 1
        return n

    async def expire(self) -> None:
        """Ends, as /end does, the sessions with no reward reward_timeout_s after their
        last call."""
        now = time.monotonic()
        for sid, s in list(self.sessions.items()):
            idle = now - s.last_call
            if not s.ended and idle > self.cfg.reward_timeout_s and not s.lock.locked():
                with contextlib.suppress(ApiError):  # ended meanwhile
                    await self.end(sid, None, None, unrewarded="reward_timeout")

    # ---- checks -------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model != self.cfg.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_sampling(self, sampling, session: Session | None) -> dict[str, float]:
        """The request's temperature / top_p to apply ({} = the run's; see the module
        docstring): in serve-only mode (`request_sampling`) they apply; in training the
        run's law applies. Knobs not applied are counted, or a 400 under strict_sampling."""
        differs = sampling.differs_from(self.backend.sampling)
        applied = {}
        if self.cfg.request_sampling:
            applied = {k: getattr(sampling, k) for k in ("temperature", "top_p")
                       if getattr(sampling, k) is not None}  # fmt: skip
            if applied.get("top_p") == 0:
                applied["top_p"] = 1e-9  # OpenAI's top_p 0: the most likely token only
            differs = [d for d in differs if d not in applied]
        if differs:
            if self.cfg.strict_sampling:
                raise invalid(
                    differs[0],
                    f"differs from the run's sampling {self.backend.sampling} (strict_sampling)",
                )
            self.count("sampling_ignored")
            if session is not None:
                session.count("sampling_ignored")
        return applied

    def limits(self, prompt_len: int, max_tokens: int | None) -> int:
        """The request's max_tokens, or a 400 when the prompt and it exceed the context."""
        ctx = self.backend.max_len
        cap = self.cfg.max_tokens or ctx
        if max_tokens is not None and max_tokens > cap:
            raise invalid("max_tokens", f"{max_tokens} is over this server's limit of {cap}")
        room = ctx - prompt_len
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_len + (max_tokens or 1)} tokens ({prompt_len} in the messages, "
                f"{max_tokens or 1} in the completion (max_tokens)).",
                param="messages",
                code="context_length_exceeded",
            )
        return min(max_tokens or room, room, cap)

    # ---- generation ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: tuple[str, ...],
        on_chunk: Callable[[Any], Any] | None,
        disconnected: Callable[[], bool],
        sampling: dict[str, float] | None = None,
    ) -> GenResult:
        """Runs one backend request; `on_chunk` (a coroutine function) sees token chunks.
        Without one (a call that is not streamed) the backend reports no chunks: each
        would wake this event loop once per engine step and request, for nothing."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = GenRequest(tuple(prompt), max_tokens, stop_strings=stop, **(sampling or {}))
        report = None if on_chunk is None else (
            lambda c: loop.call_soon_threadsafe(queue.put_nowait, c))  # fmt: skip
        try:
            handle = self.backend.submit(req, report)
        except BackendBusy as e:
            self.count("busy")
            raise ApiError(
                429, f"over capacity: {e}", code="over_capacity", retry_after=1
            ) from None
        except GenerationError as e:
            raise invalid("messages", str(e)) from None
        fut = asyncio.wrap_future(handle.future)
        try:
            while not fut.done():
                if on_chunk is None:
                    await asyncio.wait({fut}, timeout=0.25)
                else:
                    getter = asyncio.ensure_future(queue.get())
                    await asyncio.wait({getter, fut}, timeout=0.25,
                                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                    if not getter.done():
                        getter.cancel()
                        await asyncio.gather(getter, return_exceptions=True)
                    if getter.done() and not getter.cancelled():
                        await on_chunk(getter.result())
                if not fut.done() and disconnected():
                    raise Disconnected()
            while not queue.empty():  # chunks reported before the result
                chunk = queue.get_nowait()
                if on_chunk is not None:
                    await on_chunk(chunk)
        except (Disconnected, asyncio.CancelledError, ConnectionError):
            handle.cancel()
            self.count("disconnected")
            raise
        try:
            result = fut.result()
        except GenerationError as e:
            raise ApiError(503, f"generation failed: {e}", code="backend_error") from None
        if result.finish_reason == "cancelled":
            raise Disconnected()
        return result

    def finish(self, forced_ids, result: GenResult, stop, *, chat: bool, tools_allowed: bool):
        text = self.renderer.text(forced_ids + result.token_ids)
        finish = result.finish_reason
        cut = [text.find(s) for s in stop if s in text]
        if cut:
            text, finish = text[: min(cut)], "stop"
        reply = None
        if chat:
            reply = parse_reply(text, tools_allowed=tools_allowed)
            if reply.malformed is not None:
                self.count("malformed_tool_calls")
            if finish == "stop" and reply.tool_calls:
                finish = "tool_calls"
        return text, finish, reply

    def logprob_entries(self, result: GenResult, top) -> list[dict]:
        out = []
        for i, (tid, lp) in enumerate(zip(result.token_ids, result.rollout_logp, strict=True)):
            t = self.renderer.token_text(tid)
            entry = {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            if top is not None:
                entry["top_logprobs"] = [
                    {"token": (tt := self.renderer.token_text(j)), "logprob": v,
                     "bytes": list(tt.encode())}
                    for j, v in top[i]
                ]  # fmt: skip
            out.append(entry)
        return out

    async def top_logprobs(self, context: list[int], result: GenResult, k: int):
        """The k most likely tokens at each sampled position (None when k is 0), computed
        off the loop by the backend's scoring pass."""
        if not k or not result.token_ids:
            return None
        fn = getattr(self.backend, "top_logprobs", None)
        if fn is None:
            raise invalid("top_logprobs", "this backend does not report top log-probs")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, fn, context + result.token_ids, len(context), k)

    # ---- chat ---------------------------------------------------------------------------

    def _plan(self, req: ChatRequest, session: Session | None) -> Plan:
        if session is None:
            return Plan(False, self.renderer.prompt_ids(req.messages, req.tools,
                                                        req.template_kwargs))  # fmt: skip
        return session.plan_chat(req.messages, req.tools, req.template_kwargs, self.renderer)

    async def chat(
        self,
        req: ChatRequest,
        session: Session | None,
        disconnected: Callable[[], bool],
        emit: Callable[[str], Any] | None,
    ) -> dict:
        """One chat completion; `emit` (a coroutine function) gets SSE events when
        streaming. Returns the response payload (non-streaming shape)."""
        self.check_model(req.model)
        applied = self.check_sampling(req.sampling, session)
        plan = self._plan(req, session)
        context = session.context(plan) if session is not None else plan.new_ids
        forced = self.renderer.encode(self.renderer.forced_prefix(req.tool_choice))
        prompt = context + forced
        max_tokens = self.limits(len(prompt), req.max_tokens)
        tools_allowed = bool(req.tools) and req.tool_choice != "none"
        cid = "chatcmpl-" + secrets.token_hex(12)
        created = int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": self.cfg.model_name}  # fmt: skip
        view = StreamView(self.renderer, forced, req.stop, tools_allowed)

        async def on_chunk(chunk):  # streaming only
            delta = view.advance(chunk.token_ids)
            lp = None
            if req.logprobs and not req.top_logprobs:  # top ones: at the end, all at once
                part = GenResult(chunk.token_ids, chunk.rollout_logp, chunk.sampled_logp,
                                 chunk.versions, "", {})  # fmt: skip
                lp = {"content": self.logprob_entries(part, None)}
            if delta or lp:
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}
                await emit(sse({**head, "choices": [choice]}))

        if emit is not None:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}  # fmt: skip
            await emit(sse({**head, "choices": [first]}))
        result = await self.generate(prompt, max_tokens, req.stop,
                                     on_chunk if emit is not None else None, disconnected,
                                     applied)  # fmt: skip
        _, finish, reply = self.finish(forced, result, req.stop, chat=True,
                                          tools_allowed=tools_allowed)  # fmt: skip
        top = await self.top_logprobs(prompt, result, req.top_logprobs)
        message = reply.message()
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(result.token_ids),
                 "total_tokens": len(prompt) + len(result.token_ids)}  # fmt: skip
        if session is not None:
            held = [*req.messages, {**message, "_reply": True}]
            key = json.dumps([req.tools, req.template_kwargs], sort_keys=True, default=str)
            eos = bool(result.token_ids) and result.token_ids[-1] == self.renderer.eos_id
            session.commit(plan, forced, result.token_ids, result.rollout_logp, result.versions,
                           held=held, context_key=key, after_eos=eos)  # fmt: skip
            session.last_messages, session.last_reply = list(req.messages), message
            session.sampling_used.append(result.sampling)
        self.count("calls")
        logprobs = None
        if req.logprobs:
            logprobs = {"content": self.logprob_entries(result, top), "refusal": None}
        if emit is not None:
            for delta in view.finish(reply):
                await emit(
                    sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": delta,
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                )
            if top is not None:  # top log-probs come once the whole reply is known
                await emit(sse({**head, "choices": [{"index": 0, "delta": {},
                                "logprobs": logprobs, "finish_reason": None}]}))  # fmt: skip
            end = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
            await close_stream(emit, head, end, usage if req.include_usage else None)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": self.cfg.model_name,
            "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            ],
            "usage": usage,
        }

    # ---- completions --------------------------------------------------------------------

    async def completion(
        self,
        req: CompletionRequest,
        session: Session | None,
        disconnected: Callable[[], bool],
        emit: Callable[[str], Any] | None,
    ) -> dict:
        self.check_model(req.model)
        applied = self.check_sampling(req.sampling, session)
        if req.echo:
            raise invalid("echo", "is not supported by this server")
        if isinstance(req.prompt, str):
            ids = self.renderer.encode(req.prompt)
        else:
            vocab = self.backend.vocab_size
            bad = [i for i in req.prompt if not 0 <= i < vocab]
            if bad:
                raise invalid("prompt", f"token id {bad[0]} is outside [0, {vocab})")
            ids = list(req.prompt)
        plan = session.plan_ids(ids) if session is not None else Plan(False, ids)
        prompt = session.context(plan) if session is not None else ids
        max_tokens = self.limits(len(prompt), req.max_tokens)
        cid = "cmpl-" + secrets.token_hex(12)
        created = int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created,
                "model": self.cfg.model_name}  # fmt: skip

        async def on_chunk(chunk):  # streaming only
            choice = {"text": self.renderer.text(chunk.token_ids), "index": 0,
                      "logprobs": None, "finish_reason": None}  # fmt: skip
            await emit(sse({**head, "choices": [choice]}))

        result = await self.generate(prompt, max_tokens, req.stop,
                                     on_chunk if emit is not None else None, disconnected,
                                     applied)  # fmt: skip
        text, finish, _ = self.finish([], result, req.stop, chat=False, tools_allowed=False)
        top = await self.top_logprobs(prompt, result, req.logprobs or 0)
        if session is not None:
            eos = bool(result.token_ids) and result.token_ids[-1] == self.renderer.eos_id
            session.commit(plan, [], result.token_ids, result.rollout_logp, result.versions,
                           held=[], context_key=None, after_eos=eos)  # fmt: skip
            session.last_messages, session.last_reply = [], {"role": "assistant", "content": text}
            session.sampling_used.append(result.sampling)
        self.count("calls")
        logprobs = None
        if req.logprobs is not None:
            tokens = [self.renderer.token_text(t) for t in result.token_ids]
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": list(result.rollout_logp),
                "top_logprobs": None if top is None else [
                    {self.renderer.token_text(j): v for j, v in row} for row in top
                ],
                "text_offset": offsets,
            }  # fmt: skip
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(result.token_ids),
                 "total_tokens": len(prompt) + len(result.token_ids)}  # fmt: skip
        if emit is not None:
            end = {"text": "", "index": 0, "logprobs": logprobs, "finish_reason": finish}
            await close_stream(emit, head, end, usage if req.include_usage else None)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.cfg.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
            "usage": usage,
        }

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.cfg.model_name, "object": "model", "created": 0,
                      "owned_by": "sao_jax"}],
        }  # fmt: skip

    def stats(self) -> dict:
        return {"gateway": dict(self.counters), "backend": self.backend.stats()}
