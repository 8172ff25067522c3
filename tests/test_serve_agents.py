"""Agent frameworks drive episodes through the gateway unchanged, on the native engine:

* the OpenAI Agents SDK (`openai-agents`, its documented chat-completions switch:
  `OpenAIChatCompletionsModel` on an `AsyncOpenAI` client with the session's base URL
  and key) runs a calculator agent to its answer;
* smolagents' `ToolCallingAgent` on `OpenAIServerModel` (its class for OpenAI-compatible
  servers: `api_base` and `api_key` only) calls the calculator with
  `tool_choice="required"` (the forced `<tool_call>` prefix is observation).

The policy is a tiny random-init model briefly warm-started in the fixture on the
tool-format demonstrations of these very agents (the prompts each framework sends,
captured through the gateway over a scripted backend, and the replies: the SDK's
calculator call and answer; smolagents' calculator call), so that greedy decoding writes
well-formed calls; each framework executes its call and the result is recorded as
observation. Cost of the warm start: 50 Adam steps on three sequences of ~400-500 tokens
(it stops once greedy decoding reproduces every reply), about 12 s on this project's
shared CPU; the two tests share one backend and server (one compilation).

smolagents' default system prompt is ~2,250 tokens under the project's 506-token BPE,
past this model's 512-token context, so its agent takes a one-line system prompt
(`agent.prompt_templates["system_prompt"]`, its documented customisation); its second prompt
(the tool's result) would not fit the warm start's width either, so that agent runs one
step (`max_steps=1`) and then asks for its final answer in a call of its own, as
smolagents does at its step limit: that call's prompt holds the observation."""

import asyncio
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from flax import nnx
from openai import AsyncOpenAI
from smolagents import LogLevel, OpenAIServerModel, ToolCallingAgent, tool

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.backend_native import NativeBackend
from sao_jax.sampling.engine import EngineConfig
from sao_jax.text.harness_tokenizer import write_harness_tokenizer
from sao_jax.text.tokenizer import HFTokenizer
from tests.sampling_support import MODEL
from tests.serve_support import ScriptedBackend, episodes, http, serve

CALL = json.dumps({"name": "calculator", "arguments": {"expression": "12 + 30"}})
REPLIES = [f"<tool_call>\n{CALL}\n</tool_call><|im_end|>", "It is 42.<|im_end|>"]
SMOL_REPLY = f"{CALL}\n</tool_call><|im_end|>"  # after the forced "<tool_call>\n"
WIDTH = 512  # the engine's max_len and the warm start's sequence width
set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's servers


def _session(server, gateway) -> dict:
    _, _, s = http("POST", f"{server.url}/v1/sessions", {"task": "12+30"}, gateway.admin_key)
    return s


def _agent(server, gateway, executed: list):
    """A calculator agent of the Agents SDK on a new session, the way the SDK documents it."""

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression."""
        executed.append(expression)
        return "42" if expression.replace(" ", "") == "12+30" else "unknown"

    s = _session(server, gateway)
    client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    model = OpenAIChatCompletionsModel(model="sao-policy", openai_client=client)
    return s, Agent(name="calc", instructions="Use the calculator.", tools=[calculator],
                    model=model)  # fmt: skip


def _smol_agent(server, gateway, executed: list):
    """smolagents' ToolCallingAgent on a new session: OpenAIServerModel with the session's
    base URL and key, one step, a one-line system prompt (module docstring)."""

    @tool
    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: the expression.
        """
        executed.append(expression)
        return "42" if expression.replace(" ", "") == "12+30" else "unknown"

    s = _session(server, gateway)
    model = OpenAIServerModel("sao-policy", api_base=s["base_url"], api_key=s["api_key"],
                              client_kwargs={"max_retries": 0})  # fmt: skip
    agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=1,
                             verbosity_level=LogLevel.OFF)  # fmt: skip
    agent.prompt_templates["system_prompt"] = "Use the calculator, then final_answer."
    return s, agent


def _capture(tok, root, replies: list[str], drive) -> list[list[int]]:
    """The prompt ids of each call `drive(server, gateway)` makes over a scripted backend
    that answers with `replies`."""
    backend = ScriptedBackend(tok, max_len=WIDTH)
    prompts = []
    submit = backend.submit

    def capture(request, on_tokens=None):
        prompts.append(list(request.prompt_ids))
        return submit(request, on_tokens)

    backend.submit = capture
    backend.script = list(replies)
    server, gateway = serve(backend, tok, root)
    try:
        drive(server, gateway)
    finally:
        server.stop()
        backend.close()
    return prompts


def _demonstrations(tok, root) -> tuple[list, list]:
    """(prompt ids, reply ids) of the SDK agent's two calls and smolagents' first call."""

    def sdk(server, gateway):
        _, agent = _agent(server, gateway, [])
        assert asyncio.run(Runner.run(agent, "what is 12 + 30?")).final_output == "It is 42."

    def smol(server, gateway):
        _, agent = _smol_agent(server, gateway, [])
        assert agent.run("what is 12 + 30?") == "42"

    prompts = _capture(tok, root / "sdk", REPLIES, sdk)
    sdk_demos = [(p, tok.encode(r)) for p, r in zip(prompts, REPLIES, strict=True)]
    prompts = _capture(tok, root / "smol", [SMOL_REPLY, "42<|im_end|>"], smol)
    return sdk_demos, [(prompts[0], tok.encode(SMOL_REPLY))]


def _warm_start(mdef, params, demos, steps: int = 400):
    """Adam on the replies' tokens until greedy decoding reproduces every reply."""
    tokens = np.zeros((len(demos), WIDTH), np.int32)
    target = np.zeros((len(demos), WIDTH), np.float32)  # 1 where logits[t] predict a reply token
    for i, (prompt, reply) in enumerate(demos):
        seq = prompt + reply
        tokens[i, : len(seq)] = seq
        target[i, len(prompt) - 1 : len(seq) - 1] = 1
    positions = jnp.broadcast_to(jnp.arange(WIDTH), tokens.shape)
    nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    opt = optax.adam(3e-3)

    def logits(p):
        return mdef.bind(p)(tokens, positions, jnp.ones_like(tokens)).out.astype(jnp.float32)

    def loss(p):
        logp = jax.nn.log_softmax(logits(p), axis=-1)
        nll = -jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * target) / jnp.sum(target)

    @jax.jit
    def step(p, state):
        grads = jax.grad(loss)(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    @jax.jit
    def exact(p):
        return jnp.all((jnp.argmax(logits(p), axis=-1) == nxt) | (target == 0))

    state = opt.init(params)
    for i in range(steps):
        params, state = step(params, state)
        if i % 25 == 24 and exact(params):
            return params, i + 1
    raise AssertionError(f"the warm start did not reproduce the replies in {steps} steps")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    tok = HFTokenizer(write_harness_tokenizer(root / "tok"))
    sdk_demos, smol_demos = _demonstrations(tok, root / "capture")
    cfg = dataclasses.replace(MODEL, vocab_size=512)
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    params, steps = _warm_start(mdef, params, sdk_demos + smol_demos)
    return tok, mdef, params, sdk_demos, smol_demos, steps, root


@pytest.fixture(scope="module")
def served(policy):
    """The warm-started policy behind one gateway (both frameworks' sessions share it)."""
    tok, mdef, params, _, _, steps, root = policy
    assert steps <= 400
    engine = EngineConfig(num_slots=2, max_len=WIDTH, steps_per_sync=4, temperature=0.0)
    backend = NativeBackend(mdef, params, tok, engine, seed=0)
    server, gateway = serve(backend, tok, root)
    yield server, gateway
    server.stop()
    backend.close()


def _episode(root, sid: str) -> dict:
    (ep,) = [e for e in episodes(root) if e["id"] == sid]
    return ep


@pytest.mark.slow
def test_openai_agents_sdk_drives_an_episode(policy, served):
    tok, _, _, demos, _, _, root = policy
    server, gateway = served
    executed = []
    s, agent = _agent(server, gateway, executed)
    result = asyncio.run(Runner.run(agent, "what is 12 + 30?"))
    assert executed == ["12 + 30"]  # a well-formed call, executed by the framework
    assert result.final_output == "It is 42."
    http("POST", f"{server.url}/v1/sessions/{s['id']}/reward", {"reward": 1.0}, s["api_key"])
    ep = _episode(root, s["id"])
    assert (ep["calls"], ep["forks"], ep["reward"]) == (2, 0, 1.0)
    seg = ep["segments"][0]
    mask = np.asarray(seg["action_mask"], bool)
    ids = np.asarray(seg["token_ids"])
    assert ids[mask].tolist() == demos[0][1] + demos[1][1]  # what the policy sampled
    first_end = len(demos[0][0]) + len(demos[0][1])
    assert not mask[first_end : len(demos[1][0])].any()  # the tool result: observation
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(
        ids[first_end : len(demos[1][0])].tolist()
    )
    assert seg["token_ids"][: len(demos[1][0])] == demos[1][0]  # stitched, as captured


@pytest.mark.slow
def test_smolagents_tool_calling_agent_drives_an_episode(policy, served):
    """smolagents rewrites its past calls as text in the next request ("Calling tools:
    [...]" in an assistant message, "Observation:" in a user message), an edit of what
    the gateway returned: the next call starts a new segment (a fork) whose prompt,
    holding the tool's result, is all observation."""
    tok, _, _, _, demos, _, root = policy
    server, gateway = served
    executed = []
    s, agent = _smol_agent(server, gateway, executed)
    agent.run("what is 12 + 30?")
    assert executed == ["12 + 30"]  # a well-formed call under tool_choice="required"
    http("POST", f"{server.url}/v1/sessions/{s['id']}/reward", {"reward": 1.0}, s["api_key"])
    ep = _episode(root, s["id"])
    assert (ep["calls"], ep["forks"], ep["reward"]) == (2, 1, 1.0)
    first, second = ep["segments"]
    (prompt, reply) = demos[0]
    assert first["token_ids"] == prompt + reply  # the forced "<tool_call>\n" ends the prompt
    assert first["action_mask"] == [0] * len(prompt) + [1] * len(reply)
    assert tok.decode(prompt[-4:]).endswith("<tool_call>\n")
    mask = np.asarray(second["action_mask"], bool)
    context = tok.decode(np.asarray(second["token_ids"])[~mask].tolist())
    assert "Calling tools:\n[{'id': 'call_" in context  # the call, as smolagents rewrote it
    assert "Observation:\n42" in context  # the tool's result: observation
    assert not mask[: mask.argmax()].any() and mask[mask.argmax() :].all()
