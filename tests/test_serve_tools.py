"""Tool calls and reasoning through the gateway with the real `openai` client, over a
scripted backend (tests/serve_support.py: a random model never writes a well-formed call):
tool_calls with ids and JSON-string arguments (nested, non-ASCII), reasoning_content,
streaming equal to the non-streamed reply, tool_choice required / named / none (forced
prefixes recorded as observation), malformed calls as text, stop strings, and stitching:
the tool result is observation, a re-serialised reply still matches, an edited message
forks."""

import importlib.util
import json
import pathlib
import time

import numpy as np
import openai
import pytest

from sao_jax.serve.trajectories import episode_trajectories
from tests.serve_support import ScriptedBackend, episodes, http, serve, tokenizer

MODEL = "sao-policy"
ARGS = {"query": "café ☕", "filters": {"lang": ["fr", "日本語"], "depth": {"n": [1, 2]}}}
CALL = "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": ARGS}, ensure_ascii=False)
CALL += "\n</tool_call>"
REPLY = "<think>\nlook it up\n</think>\n\nLet me check." + "\n" + CALL + "<|im_end|>"
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Cherche — 探す",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                    "filters": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]  # fmt: skip
USER = [{"role": "user", "content": "Qu'est-ce que « café » ?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_tools")
    tok = tokenizer(root)
    backend = ScriptedBackend(tok)
    server, gateway = serve(backend, tok, root)
    yield server, gateway, backend, root, tok
    server.stop()
    backend.close()


def _session(server, gateway):
    _, _, s = http("POST", f"{server.url}/v1/sessions", {"task": "t"}, gateway.admin_key)
    return s, openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)


def _episode(server, root, s, reward=1.0):
    http("POST", f"{server.url}/v1/sessions/{s['id']}/reward", {"reward": reward}, s["api_key"])
    (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
    return ep


def test_tool_call_and_reasoning(scripted):
    server, gateway, backend, root, tok = scripted
    s, client = _session(server, gateway)
    backend.script = [REPLY]
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me check."
    assert c.message.model_extra["reasoning_content"] == "look it up"
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == ARGS
    assert "café ☕" in call.function.arguments and "日本語" in call.function.arguments
    # every sampled token, markup and the end-of-turn token included
    assert len(c.logprobs.content) == r.usage.completion_tokens == len(tok.encode(REPLY))
    assert c.logprobs.content[-1].token == "<|im_end|>"
    assert "<tool_call>" in [e.token for e in c.logprobs.content]

    # turn 2: the reply re-serialised (keys reordered, no reasoning) + the tool's result
    sent = {"role": "assistant", "content": c.message.content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "lookup",
         "arguments": json.dumps(dict(reversed(list(ARGS.items()))))}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": call.id, "content": "コーヒー: coffee"}
    backend.script = ["C'est du café.<|im_end|>"]
    r2 = client.chat.completions.create(model=MODEL, messages=[*USER, sent, result], tools=TOOLS)
    assert r2.choices[0].message.content == "C'est du café."
    assert r2.choices[0].finish_reason == "stop"
    ep = _episode(server, root, s)
    assert (ep["calls"], ep["forks"], len(ep["segments"])) == (2, 0, 1)
    seg = ep["segments"][0]
    k = r.usage.prompt_tokens + r.usage.completion_tokens
    obs = seg["token_ids"][k : r2.usage.prompt_tokens]
    assert not any(seg["action_mask"][k : r2.usage.prompt_tokens])
    # the sampled <|im_end|> is kept; the observation starts after it
    text = tok.decode(obs)
    assert text == "\n<|im_start|>user\n<tool_response>\nコーヒー: coffee\n</tool_response>" \
        "\n<|im_start|>assistant\n"  # fmt: skip
    assert seg["token_ids"][r.usage.prompt_tokens : k] == tok.encode(REPLY)
    assert ep["messages"][-1]["content"] == "C'est du café."
    assert all(v == 7 for v, m in zip(seg["versions"], seg["action_mask"], strict=True) if m)
    (traj,) = episode_trajectories(ep)  # what the learner would train on
    assert traj.num_turns == 2 and traj.reward_row()[-1] == 1.0 and traj.min_version == 7


def test_streamed_tool_call_equals_the_reply(scripted):
    server, gateway, backend, _, _ = scripted
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gateway.admin_key)
    backend.script = [REPLY, REPLY]
    full = admin.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    chunks = list(admin.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                stream=True, logprobs=True))  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks)  # fmt: skip
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert content == full.choices[0].message.content == "Let me check."
    assert reasoning == "look it up"
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        ("lookup", ARGS)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    n = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs)
    assert n == full.usage.completion_tokens


@pytest.mark.parametrize(
    "choice, script, forced",
    [
        ("required", '{"name": "now", "arguments": {}}\n</tool_call><|im_end|>', "<tool_call>\n"),
        ({"type": "function", "function": {"name": "lookup"}},
         '{"query": "x"}}\n</tool_call><|im_end|>',
         '<tool_call>\n{"name": "lookup", "arguments": '),
    ],
)  # fmt: skip
def test_forced_tool_choice_is_observation(scripted, choice, script, forced):
    server, gateway, backend, root, tok = scripted
    s, client = _session(server, gateway)
    backend.script = [script]
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice=choice, logprobs=True)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1
    assert (
        r.usage.completion_tokens == len(r.choices[0].logprobs.content) == len(tok.encode(script))
    )
    seg = _episode(server, root, s)["segments"][0]
    p = r.usage.prompt_tokens
    f = len(tok.encode(forced))
    assert tok.decode(seg["token_ids"][p - f : p]) == forced
    assert seg["action_mask"][p - f : p] == [0] * f and all(seg["action_mask"][p:])


def test_tool_choice_none_malformed_and_stop(scripted):
    server, gateway, backend, _, _ = scripted
    admin = openai.OpenAI(base_url=f"{server.url}/v1", api_key=gateway.admin_key)
    backend.script = [CALL + "<|im_end|>"]
    r = admin.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    before = gateway.counters.get("malformed_tool_calls", 0)
    bad = '<tool_call>\n{"name": "lookup", "arguments": {"query": }\n</tool_call><|im_end|>'
    backend.script = [bad]
    r = admin.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == bad[: -len("<|im_end|>")]
    assert gateway.counters["malformed_tool_calls"] == before + 1
    backend.script = ["hello STOP world<|im_end|>"]
    r = admin.chat.completions.create(model=MODEL, messages=USER, stop=["STOP"])
    assert r.choices[0].message.content == "hello" and r.choices[0].finish_reason == "stop"


def test_edited_history_forks(scripted):
    server, gateway, backend, root, _ = scripted
    s, client = _session(server, gateway)
    backend.script = ["one<|im_end|>", "two<|im_end|>", "three<|im_end|>"]
    r1 = client.chat.completions.create(model=MODEL, messages=USER)
    turn = [*USER, {"role": "assistant", "content": r1.choices[0].message.content}]
    client.chat.completions.create(model=MODEL, messages=[*turn, {"role": "user", "content": "b"}])
    edited = [{"role": "user", "content": "something else"}, turn[1]]
    client.chat.completions.create(
        model=MODEL, messages=[*edited, {"role": "user", "content": "c"}]
    )
    ep = _episode(server, root, s)
    assert (ep["calls"], ep["forks"], len(ep["segments"])) == (3, 1, 2)
    first, second = ep["segments"]
    assert np.sum(first["action_mask"]) > np.sum(second["action_mask"]) > 0


def test_reward_timeout_ends_the_episode(tmp_path):
    """No reward reward_timeout_s after the last call: ended as by /end (dropped)."""
    tok = tokenizer(tmp_path)
    backend = ScriptedBackend(tok)
    server, gateway = serve(backend, tok, tmp_path, reward_timeout_s=0.3)
    try:
        s, client = _session(server, gateway)
        backend.script = ["hi<|im_end|>"]
        client.chat.completions.create(model=MODEL, messages=USER)
        deadline = time.monotonic() + 10
        while not episodes(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        (ep,) = episodes(tmp_path)
        assert ep["id"] == s["id"] and ep["dropped"] == "reward_timeout" and ep["calls"] == 1
        with pytest.raises(openai.ConflictError):
            client.chat.completions.create(model=MODEL, messages=USER)
    finally:
        server.stop()
        backend.close()


def _example():
    path = pathlib.Path(__file__).parents[1] / "examples/harness/calculator_agent.py"
    spec = importlib.util.spec_from_file_location("calculator_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calculator_agent_example(scripted):
    """examples/harness/calculator_agent.py, a plain openai-client loop, unmodified: its
    tool call is executed and the result recorded as observation."""
    agent = _example()
    assert agent.calculator("2 * (3 + 4) - 1") == "13" and agent.calculator("7 / 2") == "3.5"
    assert agent.calculator("__import__('os')").startswith("error")
    server, gateway, backend, root, tok = scripted
    s, client = _session(server, gateway)
    call = json.dumps({"name": "calculator", "arguments": {"expression": "12 + 30"}})
    backend.script = [f"<tool_call>\n{call}\n</tool_call><|im_end|>", "It is 42.<|im_end|>"]
    text, messages = agent.run_episode(client, MODEL, "what is 12 + 30?")
    assert text == "It is 42." and agent.reward(text, "42") == 1.0
    assert messages[3]["role"] == "tool" and messages[3]["content"] == "42"
    assert messages[3]["tool_call_id"] == messages[2]["tool_calls"][0]["id"]
    ep = _episode(server, root, s)
    assert (ep["calls"], ep["forks"]) == (2, 0)
    seg = ep["segments"][0]
    obs = [t for t, m in zip(seg["token_ids"], seg["action_mask"], strict=True) if not m]
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(obs)


def test_end_scores_by_the_tasks_registered_reward(scripted):
    """/end of a session whose task names a registered reward scores the final reply
    (sao_jax/serve/scoring.py); a bad reward name is a 400 at session creation."""
    server, gateway, backend, root, _ = scripted
    url = f"{server.url}/v1/sessions"
    for reply, want in ((r"So it is \boxed{42}.", 1.0), (r"\boxed{41}", 0.0)):
        task = {"reward": "exact_match", "answer": "42"}
        _, _, s = http("POST", url, {"task": task}, gateway.admin_key)
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        backend.script = [reply + "<|im_end|>"]
        client.chat.completions.create(model=MODEL, messages=USER)
        status, _, out = http("POST", f"{url}/{s['id']}/end", None, s["api_key"])
        assert status == 200 and out["reward"] == want and out["dropped"] is None, out
        (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
        assert ep["reward"] == want and ep["scored_by"] == "exact_match"
        assert ep["score_info"]["info"]["answer"] in ("42", "41")
    status, _, out = http("POST", url, {"task": {"reward": "nope"}}, gateway.admin_key)
    assert status == 400 and out["error"]["param"] == "task.reward"
    status, _, out = http("POST", url, {"task": {"reward": "exact_match",
                          "reward_params": {"colour": 1}}}, gateway.admin_key)  # fmt: skip
    assert status == 400 and out["error"]["param"].startswith("task.reward")
