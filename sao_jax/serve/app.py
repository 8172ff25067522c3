"""The HTTP surface of the gateway (aiohttp), and running it.

Routes (docs/harness.md has the contract):

  admin key:    GET /v1/models[/{model}], POST /v1/chat/completions, POST /v1/completions (served,
                not recorded), POST /v1/sessions, GET /v1/stats (the gateway's counters and
                the backend's: slots decoding together, queue, cancels)
  admin or the session's key:  POST /v1/sessions/{id}/reward, POST /v1/sessions/{id}/end
  session key:  GET /sessions/{id}/v1/models[/{model}], POST /sessions/{id}/v1/chat/completions,
                POST /sessions/{id}/v1/completions (recorded into the session's episode),
                POST /sessions/{id}/v1/reward and /end (the same as the admin routes: a
                harness that knows only its base_url and key ends its own episode)

Every error is OpenAI's shape (sao_jax/serve/errors.py), unknown routes and too large
bodies included; a client's input never causes a 500. A retry (`x-stainless-retry-count`
> 0, or the previous request's body again while it is in flight or before its reply was
continued) gets the previous call's response and records nothing.

`start_server(gateway, host, port, unix_path)` runs the app on its own event loop in a
thread (the test fixtures, the CLI, the training driver; `unix_path`: also on that Unix
socket, the only network of sandboxed harnesses) and returns a `Server` (its url,
`stop()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import threading

from aiohttp import web

from sao_jax.serve.errors import ApiError, invalid
from sao_jax.serve.gateway import CallRecord, Disconnected, Gateway
from sao_jax.serve.protocol import parse_chat, parse_completion

log = logging.getLogger("sao_jax")


def _json(payload, status: int = 200, headers=None) -> web.Response:
    return web.Response(
        text=json.dumps(payload, ensure_ascii=False),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _error(e: ApiError) -> web.Response:
    return _json(e.body(), e.status, e.headers())


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e)
    except web.HTTPRequestEntityTooLarge as e:
        return _error(ApiError(413, f"request body too large: {e.text}", code="body_too_large"))
    except web.HTTPNotFound:
        return _error(ApiError(404, f"no route {request.method} {request.path}",
                               code="unknown_route"))  # fmt: skip
    except web.HTTPMethodNotAllowed:
        return _error(ApiError(404, f"no route {request.method} {request.path}",
                               code="unknown_route"))  # fmt: skip
    except (asyncio.CancelledError, ConnectionError, Disconnected):
        raise
    except Exception:
        log.exception("gateway: internal error on %s %s", request.method, request.path)
        return _error(ApiError(500, "internal server error", code="internal_error"))


def _key(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    if not auth:
        raise ApiError(401, "missing API key (Authorization: Bearer ...)", code="missing_key")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "malformed Authorization header", code="invalid_api_key")
    return key.strip()


async def _body(request: web.Request) -> tuple[bytes, object]:
    raw = await request.read()
    try:
        return raw, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid("body", f"not valid JSON: {e}") from None


def _disconnected(request: web.Request):
    def gone() -> bool:
        t = request.transport
        return t is None or t.is_closing()

    return gone


class Routes:
    def __init__(self, gateway: Gateway):
        self.g = gateway

    # ---- auth ---------------------------------------------------------------------------

    def admin(self, request: web.Request) -> None:
        if _key(request) != self.g.admin_key:
            raise ApiError(401, "wrong API key", code="invalid_api_key")

    def session_key(self, request: web.Request, *, admin_ok: bool):
        s = self.g.session(request.match_info["sid"])
        key = _key(request)
        if key != s.key and not (admin_ok and key == self.g.admin_key):
            raise ApiError(401, "wrong API key for this session", code="invalid_api_key")
        return s

    # ---- admin --------------------------------------------------------------------------

    async def models(self, request):
        self.admin(request)
        return _json(self.g.models())

    async def model(self, request):
        if "sid" in request.match_info:
            self.session_key(request, admin_ok=True)
        else:
            self.admin(request)
        self.g.check_model(request.match_info["model"])
        return _json(self.g.models()["data"][0])

    async def stats(self, request):
        self.admin(request)
        return _json(self.g.stats())

    async def session_models(self, request):
        self.session_key(request, admin_ok=True)
        return _json(self.g.models())

    async def new_session(self, request):
        self.admin(request)
        body = {}
        if await request.read():
            _, body = await _body(request)
            if not isinstance(body, dict):
                raise invalid("body", "must be a JSON object")
            extra = set(body) - {"task", "metadata"}
            if extra:
                raise invalid(sorted(extra)[0], "is not a session field (task, metadata)")
        base = f"{request.scheme}://{request.host}"  # the address the admin reached
        return _json(self.g.new_session(body.get("task"), body.get("metadata"), base))

    async def reward(self, request):
        s = self.session_key(request, admin_ok=True)
        _, body = await _body(request)
        if not isinstance(body, dict):
            raise invalid("body", "must be a JSON object")
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise invalid("reward", f"must be a number, got {reward!r}")
        if not math.isfinite(reward):
            raise invalid("reward", "must be finite")
        turns = body.get("turn_rewards")
        if turns is not None and not (
            isinstance(turns, list)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                    for x in turns)
        ):  # fmt: skip
            raise invalid("turn_rewards", "must be a list of finite numbers, one per call")
        extra = set(body) - {"reward", "turn_rewards"}
        if extra:
            raise invalid(sorted(extra)[0], "is not a reward field (reward, turn_rewards)")
        turns = None if turns is None else [float(x) for x in turns]
        return _json(await self.g.end(s.id, float(reward), turns))

    async def end(self, request):
        s = self.session_key(request, admin_ok=True)
        return _json(await self.g.end(s.id, None, None))

    # ---- generation ---------------------------------------------------------------------

    async def admin_chat(self, request):
        self.admin(request)
        return await self._generate(request, None, chat=True)

    async def admin_completion(self, request):
        self.admin(request)
        return await self._generate(request, None, chat=False)

    async def session_chat(self, request):
        return await self._session_call(request, chat=True)

    async def session_completion(self, request):
        return await self._session_call(request, chat=False)

    async def _session_call(self, request, *, chat: bool):
        s = self.session_key(request, admin_ok=False)
        raw = await request.read()
        if s.ended:
            raise ApiError(409, f"session {s.id!r} has ended", param="session", code="ended")
        # The previous call's body again is a retry: its reply was never continued (a
        # continuation would have made another call the previous one).
        prev = s.last_response
        transient = prev is not None and prev.error is not None and prev.error.status >= 429
        if prev is not None and prev.body == raw and not transient:
            await prev.done.wait()
            if not prev.cancelled:  # a call whose client went away counts for nothing
                self.g.count("retries")
                s.count("retries")
                return await self._replay(request, prev)
        async with s.lock:
            if s.ended:
                raise ApiError(409, f"session {s.id!r} has ended", param="session", code="ended")
            record = CallRecord(raw)
            s.last_response = record
            try:
                return await self._generate(request, s, chat=chat, record=record, raw=raw)
            finally:
                record.done.set()

    async def _replay(self, request, record: CallRecord):
        if record.error is not None:
            return _error(record.error)
        if record.events:
            resp = await self._stream_response(request)
            for e in record.events:
                await resp.write(e.encode())
            await resp.write_eof()
            return resp
        if record.payload is None:
            raise ApiError(409, "the retried request did not finish", code="retry_unfinished")
        return _json(record.payload)

    async def _stream_response(self, request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await resp.prepare(request)
        return resp

    async def _generate(self, request, session, *, chat: bool, record=None, raw=None):
        if raw is None:
            raw = await request.read()
        try:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise invalid("body", f"not valid JSON: {e}") from None
            req = parse_chat(body) if chat else parse_completion(body)
        except ApiError as e:
            if record is not None:
                record.error = e
            raise
        gone = _disconnected(request)
        if not req.stream:
            try:
                fn = self.g.chat if chat else self.g.completion
                payload = await fn(req, session, gone, None)
            except Disconnected:
                if record is not None:
                    record.cancelled = True
                return web.Response(status=499)
            except ApiError as e:
                if record is not None:
                    record.error = e
                raise
            if record is not None:
                record.payload = payload
            return _json(payload)
        # streaming: checks that fail before the first byte still get a JSON error
        resp: web.StreamResponse | None = None
        events = record.events if record is not None else []

        async def emit(event: str):
            nonlocal resp
            if resp is None:
                resp = await self._stream_response(request)
            events.append(event)
            await resp.write(event.encode())

        try:
            fn = self.g.chat if chat else self.g.completion
            payload = await fn(req, session, gone, emit)
        except ApiError as e:
            if record is not None:
                record.error = e
            if resp is None:
                raise
            await resp.write(("data: " + json.dumps(e.body()) + "\n\n").encode())
            await resp.write_eof()
            return resp
        except (Disconnected, ConnectionError):
            if record is not None:
                record.cancelled = True
            return resp or web.Response(status=499)
        if record is not None:
            record.payload = payload
        await resp.write_eof()
        return resp

    async def not_found(self, request):
        raise ApiError(404, f"no route {request.method} {request.path}", code="unknown_route")


def make_app(gateway: Gateway) -> web.Application:
    r = Routes(gateway)
    app = web.Application(client_max_size=gateway.cfg.max_body_bytes,
                          middlewares=[errors_middleware])  # fmt: skip
    app.add_routes([
        web.get("/v1/models", r.models),
        web.get("/v1/models/{model}", r.model),
        web.get("/v1/stats", r.stats),
        web.post("/v1/chat/completions", r.admin_chat),
        web.post("/v1/completions", r.admin_completion),
        web.post("/v1/sessions", r.new_session),
        web.post("/v1/sessions/{sid}/reward", r.reward),
        web.post("/v1/sessions/{sid}/end", r.end),
        web.get("/sessions/{sid}/v1/models", r.session_models),
        web.get("/sessions/{sid}/v1/models/{model}", r.model),
        web.post("/sessions/{sid}/v1/chat/completions", r.session_chat),
        web.post("/sessions/{sid}/v1/completions", r.session_completion),
        web.post("/sessions/{sid}/v1/reward", r.reward),
        web.post("/sessions/{sid}/v1/end", r.end),
    ])  # fmt: skip
    return app


@dataclasses.dataclass
class Server:
    """A gateway serving on a thread of its own."""

    gateway: Gateway
    host: str
    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    _stop: asyncio.Event

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout)


async def _serve(gateway: Gateway, host: str, port: int, unix_path, ready, stop_box: list):
    stop = asyncio.Event()
    stop_box.append(stop)
    runner = web.AppRunner(make_app(gateway), access_log=None, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    if unix_path is not None:  # the same app on a Unix socket (sandboxed harnesses)
        await web.UnixSite(runner, str(unix_path)).start()
    gateway.base_url = f"http://{host}:{bound}"
    ready(bound)
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(5.0, gateway.cfg.reward_timeout_s))
            await gateway.expire()
    finally:
        await runner.cleanup()


def start_server(
    gateway: Gateway, host: str = "127.0.0.1", port: int = 0, unix_path=None
) -> Server:
    """Serves `gateway` on host:port (0 = a free port), and on the Unix socket `unix_path`
    too when given, from a new thread; returns once it accepts connections."""
    box: dict = {}
    stop_box: list = []
    started = threading.Event()

    def ready(bound):
        box["port"] = bound
        started.set()

    def run():
        loop = asyncio.new_event_loop()
        box["loop"] = loop
        try:
            loop.run_until_complete(_serve(gateway, host, port, unix_path, ready, stop_box))
        except BaseException as e:
            box["error"] = e
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="sao-gateway", daemon=True)
    thread.start()
    started.wait(60)
    if "error" in box:
        raise box["error"]
    if "port" not in box:
        raise RuntimeError("the gateway did not start within 60 s")
    return Server(gateway, host, box["port"], box["loop"], thread, stop_box[0])
