"""Every error of the gateway's contract: its status, OpenAI's error body, the header that
stops the client's retries (all 4xx but 429), the `openai` client's exception class, and
that retries add nothing to the episode. Over a scripted backend (tests/serve_support.py)."""

import dataclasses
import json
import time

import openai
import pytest

from tests.serve_support import ScriptedBackend, episodes, http, serve, tokenizer

MODEL = "sao-policy"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_errors")
    tok = tokenizer(root)
    backend = ScriptedBackend(tok, max_len=64)
    server, gateway = serve(backend, tok, root, max_body_bytes=20_000, max_tokens=32,
                            request_sampling=False)  # fmt: skip
    yield server, gateway, backend, root
    server.stop()
    backend.close()


def _session(server, gateway):
    _, _, s = http("POST", f"{server.url}/v1/sessions", None, gateway.admin_key)
    return s


def _client(s, retries=0):
    return openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=retries)


def _check(status, headers, body, want, *, param=None, code=None):
    assert status == want, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert headers.get("x-should-retry") == ("false" if want != 429 else None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "messages": USER, "n": 2}, "n"),
        ({"model": MODEL, "messages": USER, "response_format": {"type": "json"}},
         "response_format"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]},
         "messages[0].content"),
        ({"model": MODEL, "messages": USER, "tools": [{"type": "x"}]}, "tools[0]"),
        ({"model": MODEL, "messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"model": MODEL, "messages": USER, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_tokens": 33}, "max_tokens"),
        ({"model": MODEL, "messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"model": MODEL, "messages": USER, "stream_options": 3}, "stream_options"),
        ([1, 2], "body"),
        ({"messages": USER}, "model"),
    ],
)  # fmt: skip
def test_invalid_request_is_400_naming_the_field(gw, body, param):
    server, gateway, *_ = gw
    _check(*http("POST", f"{server.url}/v1/chat/completions", body, gateway.admin_key), 400,
           param=param)  # fmt: skip


def test_openai_client_exception_classes(gw):
    server, gateway, backend, _ = gw
    s = _session(server, gateway)
    client = _client(s, retries=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, n=2)
    assert e.value.param == "n" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a " * 80}]
        )
    assert e.value.code == "context_length_exceeded" and "64" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s["base_url"], api_key="wrong", max_retries=2).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert e.value.code == "model_not_found"
    gone = openai.OpenAI(base_url=f"{server.url}/sessions/nope/v1", api_key="k", max_retries=2)
    with pytest.raises(openai.NotFoundError):
        gone.chat.completions.create(model=MODEL, messages=USER)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 30_000}]
        )
    assert e.value.status_code == 413
    # 429: the client retries (Retry-After 1 s), the backend never saw a request
    backend.busy = True
    try:
        with pytest.raises(openai.RateLimitError):
            _client(s, retries=1).chat.completions.create(model=MODEL, messages=USER)
    finally:
        backend.busy = False
    assert gateway.counters["busy"] == 2
    http("POST", f"{server.url}/v1/sessions/{s['id']}/end", None, gateway.admin_key)
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model=MODEL, messages=USER)
    assert backend.submitted == 0
    (ep,) = [x for x in episodes(gw[3]) if x["id"] == s["id"]]
    assert ep["dropped"] == "no_reward" and ep["calls"] == 0 and ep["segments"] == []


def test_raw_statuses_and_bodies(gw):
    server, gateway, backend, _ = gw
    s = _session(server, gateway)
    url = f"{server.url}/sessions/{s['id']}/v1/chat/completions"
    body = {"model": MODEL, "messages": USER}
    _check(*http("POST", url, raw=b"{not json", key=s["api_key"]), 400, param="body")
    _check(*http("POST", url, body), 401, code="missing_key")
    _check(*http("POST", url, body, key=gateway.admin_key), 401, code="invalid_api_key")
    other = _session(server, gateway)
    _check(*http("POST", url, body, key=other["api_key"]), 401, code="invalid_api_key")
    _check(*http("POST", f"{server.url}/v1/chat/completions", body, key=s["api_key"]), 401,
           code="invalid_api_key")  # fmt: skip
    _check(*http("GET", f"{server.url}/v1/nothing", key=gateway.admin_key), 404,
           code="unknown_route")  # fmt: skip
    _check(*http("POST", f"{server.url}/sessions/nope/v1/chat/completions", body, key="k"), 404,
           param="session")  # fmt: skip
    _check(*http("POST", url, raw=b"[" * 30_000, key=s["api_key"]), 413)
    reward = f"{server.url}/v1/sessions/{s['id']}/reward"
    _check(*http("POST", reward, {"reward": "x"}, s["api_key"]), 400, param="reward")
    _check(*http("POST", reward, {"reward": 1, "extra": 1}, s["api_key"]), 400, param="extra")
    _check(*http("POST", reward, {"reward": 1, "turn_rewards": [1.0]}, s["api_key"]), 400,
           param="turn_rewards")  # fmt: skip
    _check(*http("POST", reward, {"reward": 1}, other["api_key"]), 401, code="invalid_api_key")
    status, headers, out = http("POST", reward, {"reward": 1}, s["api_key"])
    assert status == 200 and out["dropped"] == "no_calls"
    _check(*http("POST", reward, {"reward": 1}, s["api_key"]), 409, param="session")
    backend.busy = True
    try:
        status, headers, out = http("POST", f"{server.url}/v1/chat/completions", body,
                                    gateway.admin_key)  # fmt: skip
    finally:
        backend.busy = False
    _check(status, headers, out, 429)
    assert headers["Retry-After"] == "1"


def test_ended_sessions_are_retired_and_the_oldest_forgotten(gw):
    """An ended session leaves the live ones (the gateway keeps its id and key only): its
    key still gets 409, another key 401; past `ended_kept` the oldest gets 404."""
    server, gateway, _, _ = gw
    saved = gateway.cfg
    gateway.cfg = dataclasses.replace(saved, ended_kept=2)
    try:
        ended = [_session(server, gateway) for _ in range(3)]
        for s in ended:
            http("POST", f"{server.url}/v1/sessions/{s['id']}/end", None, gateway.admin_key)
            assert s["id"] not in gateway.sessions
        url = f"{ended[-1]['base_url']}/chat/completions"
        body = {"model": MODEL, "messages": USER}
        _check(*http("POST", url, body, key=ended[-1]["api_key"]), 409, param="session")
        _check(*http("POST", url, body, key=ended[0]["api_key"]), 401, code="invalid_api_key")
        end = f"{server.url}/v1/sessions/{ended[-1]['id']}/end"
        _check(*http("POST", end, None, gateway.admin_key), 409, param="session")
        first = f"{ended[0]['base_url']}/chat/completions"  # the oldest: forgotten
        _check(*http("POST", first, body, key=ended[0]["api_key"]), 404, param="session")
        assert list(gateway.ended) == [ended[1]["id"], ended[2]["id"]]
    finally:
        gateway.cfg = saved


def test_retries_add_nothing(gw):
    """The client's retry of a call (x-stainless-retry-count) gets the first completion."""
    server, gateway, backend, root = gw
    s = _session(server, gateway)
    url = f"{server.url}/sessions/{s['id']}/v1/chat/completions"
    body = {"model": MODEL, "messages": USER, "max_tokens": 4}
    backend.script = ["first<|im_end|>", "second<|im_end|>"]
    a = http("POST", url, body, s["api_key"])[2]
    b = http("POST", url, body, s["api_key"], headers={"x-stainless-retry-count": "1"})[2]
    assert a == b and backend.submitted == 1
    http("POST", f"{server.url}/v1/sessions/{s['id']}/reward", {"reward": 1}, s["api_key"])
    (ep,) = [x for x in episodes(root) if x["id"] == s["id"]]
    assert ep["calls"] == 1 and ep["counters"] == {"retries": 1}
    assert json.dumps(ep)  # one whole line
    # a streamed call's retry replays its events
    s = _session(server, gateway)
    url = f"{server.url}/sessions/{s['id']}/v1/chat/completions"
    backend.script = ["streamed<|im_end|>", "other<|im_end|>"]
    body = {**body, "stream": True}
    a, b = (http("POST", url, body, s["api_key"])[2] for _ in range(2))
    assert a == b and a.count("data: ") > 3 and a.rstrip().endswith("data: [DONE]")
    assert gateway.sessions[s["id"]].calls == 1
    backend.script = []


def test_sampling_knobs_ignored_and_counted(gw):
    """Training's rule (request_sampling=False): a differing temperature is not applied
    and is counted; under strict_sampling it is a 400 naming it."""
    server, gateway, backend, _ = gw
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gateway.admin_key, max_retries=0)
    backend.script = ["ok<|im_end|>"]
    before = gateway.counters.get("sampling_ignored", 0)
    ignored = dict(store=False, metadata={"a": "b"}, service_tier="auto", user="u")
    admin.chat.completions.create(model=MODEL, messages=USER, temperature=0.3, seed=3, **ignored)
    assert gateway.counters["sampling_ignored"] == before + 1


def test_disconnect_records_nothing(gw):
    """A client that goes away mid-generation (its timeout) cancels its backend request;
    nothing is recorded, and its retry (the same body) is a call of its own."""
    server, gateway, backend, root = gw
    s = _session(server, gateway)
    impatient = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0,
                              timeout=0.3)  # fmt: skip
    backend.script, backend.delay_s = ["slow<|im_end|>", "again<|im_end|>"], 5.0
    try:
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model=MODEL, messages=USER)
        deadline = time.monotonic() + 10
        while not backend.cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        backend.delay_s = 0.0
    assert backend.cancelled == 1 and gateway.counters["disconnected"] == 1
    assert gateway.sessions[s["id"]].calls == 0
    r = _client(s).chat.completions.create(model=MODEL, messages=USER)
    assert r.choices[0].message.content == "again"
    http("POST", f"{server.url}/v1/sessions/{s['id']}/reward", {"reward": 0}, s["api_key"])
    (ep,) = [x for x in episodes(root) if x["id"] == s["id"]]
    assert ep["calls"] == 1 and ep["messages"][-1]["content"] == "again"


def test_strict_sampling(tmp_path):
    tok = tokenizer(tmp_path)
    backend = ScriptedBackend(tok)
    server, gateway = serve(backend, tok, tmp_path, request_sampling=False, strict_sampling=True)
    try:
        body = {"model": MODEL, "messages": USER, "temperature": 0.5}
        _check(*http("POST", f"{server.url}/v1/chat/completions", body, gateway.admin_key), 400,
               param="temperature")  # fmt: skip
        body = {"model": MODEL, "messages": USER, "presence_penalty": 0.5}
        _check(*http("POST", f"{server.url}/v1/chat/completions", body, gateway.admin_key), 400,
               param="presence_penalty")  # fmt: skip
    finally:
        server.stop()
        backend.close()
