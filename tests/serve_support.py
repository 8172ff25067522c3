"""Shared pieces of the gateway tests (tests/test_serve_*.py): a gateway on 127.0.0.1 with
a free port, in-process, over the native engine with a tiny random-init model or over a
scripted backend (a test double of sao_jax/sampling/backend.py that replays given replies,
for what a random model never samples: well-formed tool calls, reasoning), and small HTTP
helpers for the admin routes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import pathlib
import threading
import time
import urllib.error
import urllib.request

from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.backend import BackendBusy, GenChunk, GenHandle, GenResult
from sao_jax.sampling.backend_native import NativeBackend
from sao_jax.sampling.engine import EngineConfig
from sao_jax.serve import launch
from sao_jax.serve.app import start_server
from sao_jax.serve.episodes import EpisodeLog
from sao_jax.serve.gateway import Gateway, GatewayConfig
from sao_jax.serve.render import ChatRenderer
from sao_jax.text.qwen3_template import QWEN3_TOOLS_TEMPLATE, qwen3_tools_template
from sao_jax.text.tokenizer import HFTokenizer
from tests.chat_support import write_tokenizer
from tests.sampling_support import MODEL

MAX_LEN = 1024


def tokenizer(root):
    write_tokenizer(root / "tok", template=QWEN3_TOOLS_TEMPLATE)
    return HFTokenizer(root / "tok")


def native_backend(tok, num_slots: int = 4):
    cfg = dataclasses.replace(MODEL, vocab_size=tok.vocab_size)
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    engine = EngineConfig(num_slots=num_slots, max_len=MAX_LEN, steps_per_sync=4)
    return NativeBackend(mdef, params, tok, engine, seed=0, max_pending=64), (mdef, params)


class ScriptedBackend:
    """Replies with the next scripted text (its token ids, log-prob -0.25 - i / 100 for
    the i-th token, version 7), in chunks of 3 tokens, after `delay_s` (cancellable);
    `busy` makes submit raise."""

    def __init__(self, tok, max_len: int = MAX_LEN):
        self.tok, self.max_len, self.eos_id = tok, max_len, tok.eos_id
        self.vocab_size = tok.vocab_size
        self.sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        self.script: list[str] = []
        self.busy = False
        self.delay_s = 0.0
        self.submitted = 0
        self.cancelled = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(4)
        self._lock = threading.Lock()

    def submit(self, request, on_tokens=None) -> GenHandle:
        if self.busy:
            raise BackendBusy("scripted: busy")
        with self._lock:
            text = self.script.pop(0)
            self.submitted += 1
        cancel = threading.Event()
        handle = GenHandle(request, lambda h: cancel.set())
        ids = self.tok.encode(text)[: request.max_tokens]
        self._pool.submit(self._run, handle, ids, on_tokens, cancel)
        return handle

    def _run(self, handle, ids, on_tokens, cancel):
        if cancel.wait(self.delay_s):
            self.cancelled += 1
            handle.future.set_result(GenResult([], [], [], [], "cancelled", self.sampling))
            return
        lps = [-0.25 - i / 100 for i in range(len(ids))]
        for i in range(0, len(ids), 3):
            if on_tokens is not None:
                on_tokens(GenChunk(ids[i : i + 3], lps[i : i + 3], lps[i : i + 3], [7] * 3))
        finish = "stop" if ids and ids[-1] == self.eos_id else "length"
        handle.future.set_result(GenResult(ids, lps, lps, [7] * len(ids), finish, self.sampling))

    @property
    def version(self):
        return 7

    def publish(self, params, version):
        pass

    def stats(self):
        return {"submitted": self.submitted}

    def fatal_error(self):
        return None

    def close(self):
        self._pool.shutdown()


def serve(backend, tok, workdir, **cfg):
    """(server, gateway) serving `backend` on a free port of 127.0.0.1."""
    renderer = ChatRenderer(qwen3_tools_template(), tok)
    gateway = Gateway(
        backend, renderer, GatewayConfig(**cfg), EpisodeLog(workdir / "episodes.jsonl")
    )
    return start_server(gateway, "127.0.0.1", 0), gateway


@contextlib.contextmanager
def served(config, workdir: pathlib.Path, timeout: float):
    """A run config served as `python -m experiments.serve` serves it (sao_jax/serve/launch.py
    `serve`, in a thread): yields its gateway.json once it accepts connections (within
    `timeout` s); on exit, stops it and checks it ended cleanly within 60 s."""
    stop, errors = threading.Event(), []

    def run():
        try:
            launch.serve(config, workdir, GatewayConfig(), stop=stop)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    path = workdir / "gateway.json"
    deadline = time.monotonic() + timeout
    while not path.exists() and not errors and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not errors and path.exists(), errors
        yield json.loads(path.read_text())
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive() and not errors, errors


def calculator_call(info: dict, max_tokens: int = 3):
    """One session of the server `info` (its gateway.json) and one tool-enabled chat call
    through the `openai` client (no retries); the client's response."""
    import openai

    from sao_jax.text.harness_tokenizer import CALCULATOR_TOOL

    _, _, s = http("POST", f"{info['base_url']}/sessions", {"task": 1}, info["api_key"])
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    return client.chat.completions.create(
        model=info["model"], messages=[{"role": "user", "content": "what is 3 + 4?"}],
        tools=[CALCULATOR_TOOL], max_tokens=max_tokens,
    )  # fmt: skip


def http(method: str, url: str, body=None, key: str | None = None, raw: bytes | None = None,
         headers=None):  # fmt: skip
    """(status, headers, decoded JSON or text) of one request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return status, hdrs, text


def episodes(workdir) -> list[dict]:
    path = workdir / "episodes.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]
