"""The gateway with the real `openai` client, over the native engine with a tiny random-init
model (one module-scoped server): chat with tools, logprobs, streaming, sessions recorded
into episodes.jsonl with what the client received, stitching across turns (tool results
are observation tokens), 16 concurrent requests decoding in more than one slot."""

import concurrent.futures

import numpy as np
import openai
import pytest

from tests.serve_support import episodes, http, native_backend, serve, tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
MODEL = "sao-policy"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_native")
    tok = tokenizer(root)
    backend, _ = native_backend(tok)
    server, gateway = serve(backend, tok, root)
    yield server, gateway, root, tok
    server.stop()
    backend.close()


def _session(server, gateway, **body):
    status, _, s = http("POST", f"{server.url}/v1/sessions", body or None, gateway.admin_key)
    assert status == 200, s
    assert s["base_url"] == f"{server.url}/sessions/{s['id']}/v1"
    return s, openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)


def _reward(server, s, reward, **extra):
    url = f"{server.url}/v1/sessions/{s['id']}/reward"
    return http("POST", url, {"reward": reward, **extra}, s["api_key"])


def test_models(native):
    server, gateway, *_ = native
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gateway.admin_key)
    assert [m.id for m in admin.models.list()] == [MODEL]
    _, client = _session(server, gateway)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == admin.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_session_records_what_the_client_received(native):
    """Two calls of a tool-using episode: logprobs cover every sampled token and equal the
    recorded ones; the assistant reply and the tool result are stitched (one segment,
    the tool result observation tokens); the reward lands in episodes.jsonl."""
    server, gateway, root, tok = native
    s, client = _session(server, gateway, task={"q": "1+2"}, metadata={"k": "v"})
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "what is 1 plus 2? ünïcode"}]  # fmt: skip
    r1 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=6, logprobs=True,
        top_logprobs=3, parallel_tool_calls=False, user="u1",
    )  # fmt: skip
    c1 = r1.choices[0]
    assert len(c1.logprobs.content) == r1.usage.completion_tokens >= 1
    for e in c1.logprobs.content:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-4  # the most likely is first
    assert c1.finish_reason in ("length", "stop", "tool_calls")
    # turn 2: the reply as the client got it, plus a tool result and a user message
    reply = c1.message.model_dump(exclude_none=True)
    messages2 = [*messages, reply, {"role": "user", "content": "the tool says 3"}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages2, max_tokens=5,
                                        tools=TOOLS, logprobs=True)  # fmt: skip
    status, _, out = _reward(server, s, 1.5, turn_rewards=[0.5, 1.0])
    assert status == 200 and out["reward"] == 1.5, out
    (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
    assert ep["reward"] == 1.5 and ep["dropped"] is None and ep["turn_rewards"] == [0.5, 1.0]
    assert (ep["calls"], ep["forks"], ep["task"], ep["metadata"]) == (2, 0, {"q": "1+2"},
                                                                      {"k": "v"})  # fmt: skip
    (seg,) = ep["segments"]
    n = len(seg["token_ids"])
    assert len(seg["action_mask"]) == len(seg["logprobs"]) == len(seg["versions"]) == n
    mask = np.asarray(seg["action_mask"], bool)
    received = [e.logprob for r in (r1, r2) for e in r.choices[0].logprobs.content]
    assert [seg["logprobs"][i] for i in np.flatnonzero(mask)] == received
    assert all(seg["logprobs"][i] is None and seg["versions"][i] is None
               for i in np.flatnonzero(~mask))  # fmt: skip
    # the prompt of call 2 = the held ids of call 1 + observation: the reply was not re-tokenized
    k = r1.usage.prompt_tokens + r1.usage.completion_tokens
    assert r2.usage.prompt_tokens > k
    assert mask[r1.usage.prompt_tokens : k].all() and not mask[k : r2.usage.prompt_tokens].any()
    obs = tok.decode(seg["token_ids"][k : r2.usage.prompt_tokens])
    assert "the tool says 3" in obs and obs.endswith("<|im_start|>assistant\n")
    assert ep["messages"][-2]["content"] == "the tool says 3"
    # ended: 409 for the session, on both the OpenAI surface and the reward route
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert _reward(server, s, 1.0)[0] == 409


def test_streaming(native):
    server, gateway, root, _ = native
    s, client = _session(server, gateway)
    messages = [{"role": "user", "content": "stream please"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=7, stream=True, logprobs=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(finish) == 1
    lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]  # fmt: skip
    assert len(lps) == chunks[-1].usage.completion_tokens
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the same call, not streamed, is a retry of nothing: a new body -> recorded separately
    _reward(server, s, 0.0)
    (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
    seg = ep["segments"][0]
    assert [x for x, m in zip(seg["logprobs"], seg["action_mask"], strict=True) if m] == lps
    assert ep["messages"][-1]["content"] == content
    # the raw SSE ends with data: [DONE]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True}
    status, hdrs, text = http("POST", f"{server.url}/v1/chat/completions", body, gateway.admin_key)
    assert status == 200 and hdrs["Content-Type"].startswith("text/event-stream")
    assert text.rstrip().endswith("data: [DONE]")


def test_only_streamed_calls_ask_the_backend_for_chunks(native, monkeypatch):
    """A call that is not streamed passes no chunk callback (each chunk would wake the
    event loop once per engine step and request: ~20 ms of a 32-call round's generation,
    experiments/bench/gateway.py); a streamed one does, for both routes."""
    server, gateway, *_ = native
    submit, asked = gateway.backend.submit, []

    def spy(request, on_tokens=None):
        asked.append(on_tokens is not None)
        return submit(request, on_tokens)

    monkeypatch.setattr(gateway.backend, "submit", spy)
    _, client = _session(server, gateway)
    messages = [{"role": "user", "content": "chunks?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                        stream=True))  # fmt: skip
    client.completions.create(model=MODEL, prompt="chunks?", max_tokens=3)
    list(client.completions.create(model=MODEL, prompt="chunks?", max_tokens=3, stream=True))
    assert asked == [False, True, False, True]


def test_identical_body_is_a_retry(native):
    server, gateway, root, _ = native
    s, client = _session(server, gateway)
    messages = [{"role": "user", "content": "again"}]
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    b = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert a.id == b.id and a.choices[0].message.content == b.choices[0].message.content
    _reward(server, s, 0.0)
    (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
    assert ep["calls"] == 1 and ep["counters"]["retries"] == 1


def test_completions_and_stitching_by_ids(native):
    """Completions in a session: a prompt of token ids that extends the held ids continues
    the segment (the extension is observation)."""
    server, gateway, root, tok = native
    s, client = _session(server, gateway)
    r1 = client.completions.create(model=MODEL, prompt="what is", max_tokens=3, logprobs=0)
    assert len(r1.choices[0].logprobs.token_logprobs) == r1.usage.completion_tokens
    held = list(gateway.sessions[s["id"]].segment.token_ids)
    assert held[:2] == tok.encode("what is")[:2]
    more = tok.encode(" the answer")
    r2 = client.completions.create(model=MODEL, prompt=held + more, max_tokens=2)
    assert r2.usage.prompt_tokens == len(held) + len(more)
    _reward(server, s, 0.25)
    (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
    assert (ep["calls"], ep["forks"], len(ep["segments"])) == (2, 0, 1)
    seg = ep["segments"][0]
    assert seg["token_ids"][: len(held) + len(more)] == held + more
    assert seg["action_mask"][len(held) : len(held) + len(more)] == [0] * len(more)


def test_concurrent_requests_share_slots(native):
    server, gateway, *_ = native
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gateway.admin_key)
    before = gateway.backend.stats()

    def one(i):
        r = admin.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"q {i}"}], max_tokens=6
        )
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(one, range(16)))
    assert all(1 <= c <= 6 for c in counts)
    status, _, stats = http("GET", f"{server.url}/v1/stats", key=gateway.admin_key)
    assert status == 200
    assert stats["backend"]["max_active_slots"] > 1, stats
    assert stats["backend"]["finished"] - before["finished"] == 16


def test_request_temperature_applies(native):
    """Serve-only mode: temperature=0 is greedy, so every sampled token is the most likely
    one, whatever the run's sampling."""
    server, gateway, *_ = native
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gateway.admin_key)
    before = gateway.counters.get("sampling_ignored", 0)
    r = admin.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "greedy"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    for e in r.choices[0].logprobs.content:
        assert e.token == e.top_logprobs[0].token
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4
    assert gateway.counters.get("sampling_ignored", 0) == before
