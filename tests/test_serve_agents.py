"""An agent framework drives episodes through the gateway unchanged: the OpenAI Agents SDK
(`openai-agents`, its documented chat-completions switch: `OpenAIChatCompletionsModel` on
an `AsyncOpenAI` client with the session's base URL and key) runs a calculator agent on
the native engine. The policy is a tiny random-init model briefly warm-started in the
fixture on the tool-format demonstration of this very agent (the prompts the SDK sends,
captured through the gateway over a scripted backend, and the replies: a calculator call,
then the answer), so that greedy decoding writes a well-formed call; the framework
executes it and its result is recorded as observation. Cost of the warm start: 50 Adam
steps on two sequences of ~400 tokens (it stops once greedy decoding reproduces both
replies), about 20 s on this project's shared CPU."""

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
WIDTH = 512  # the engine's max_len and the warm start's sequence width
set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI's servers


def _agent(server, gateway, executed: list):
    """A calculator agent on a new session, the way the SDK documents it."""

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression."""
        executed.append(expression)
        return "42" if expression.replace(" ", "") == "12+30" else "unknown"

    _, _, s = http("POST", f"{server.url}/v1/sessions", {"task": "12+30"}, gateway.admin_key)
    client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    model = OpenAIChatCompletionsModel(model="sao-policy", openai_client=client)
    return s, Agent(name="calc", instructions="Use the calculator.", tools=[calculator],
                    model=model)  # fmt: skip


def _demonstrations(tok, root) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) of each call of the agent, captured over a scripted backend."""
    backend = ScriptedBackend(tok, max_len=WIDTH)
    prompts = []
    submit = backend.submit

    def capture(request, on_tokens=None):
        prompts.append(list(request.prompt_ids))
        return submit(request, on_tokens)

    backend.submit = capture
    backend.script = list(REPLIES)
    server, gateway = serve(backend, tok, root)
    try:
        _, agent = _agent(server, gateway, [])
        assert asyncio.run(Runner.run(agent, "what is 12 + 30?")).final_output == "It is 42."
    finally:
        server.stop()
        backend.close()
    return [(p, tok.encode(r)) for p, r in zip(prompts, REPLIES, strict=True)]


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
    demos = _demonstrations(tok, root / "capture")
    cfg = dataclasses.replace(MODEL, vocab_size=512)
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    params, steps = _warm_start(mdef, params, demos)
    return tok, mdef, params, demos, steps, root


@pytest.mark.slow
def test_openai_agents_sdk_drives_an_episode(policy):
    tok, mdef, params, demos, steps, root = policy
    assert steps <= 400
    engine = EngineConfig(num_slots=2, max_len=WIDTH, steps_per_sync=4, temperature=0.0)
    backend = NativeBackend(mdef, params, tok, engine, seed=0)
    server, gateway = serve(backend, tok, root)
    try:
        executed = []
        s, agent = _agent(server, gateway, executed)
        result = asyncio.run(Runner.run(agent, "what is 12 + 30?"))
        assert executed == ["12 + 30"]  # a well-formed call, executed by the framework
        assert result.final_output == "It is 42."
        http("POST", f"{server.url}/v1/sessions/{s['id']}/reward", {"reward": 1.0}, s["api_key"])
    finally:
        server.stop()
        backend.close()
    (ep,) = [e for e in episodes(root) if e["id"] == s["id"]]
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
