"""The rollout gateway against the in-process sampler, on the same engine and prompts.

    python -m experiments.bench.gateway                       # both models, 3 rounds
    python -m experiments.bench.gateway --models smoke --rounds 5 --tokens 32

For each model (configs/harness.py: `smoke`, the demo's size, and the default, about 4x
its parameters), with the harness tokenizer and the Qwen3-style template, one engine
setting (32 slots, temperature 1) and the calculator question rendered with its tool:

  in-process  `Engine.run` on 32 prompts (an environment that ends after one turn of at
              most --tokens tokens): the in-process sampler's path;
  gateway     32 concurrent sessions (async `openai` clients sharing one connection
              pool, in a client process of their own unless --same_process: one session,
              one chat call with max_tokens=--tokens, one reward each) through the
              gateway on its own NativeBackend with the same settings.

Rounds are INTERLEAVED (the machine may be shared); printed per model: the median
trajectories/s and decode tokens/s of both and their ratio (gateway / in-process), and
the gateway's added latency per call (client latency minus the backend's own time from
submit to result), p50 and p99 over all calls. A random-init model stops at eos at
random, so tokens are counted, not assumed. Not a timed test: docs/harness.md has the
rows and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx
from openai import AsyncOpenAI

from sao_jax import config as config_lib
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.backend_native import NativeBackend
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.serve.app import start_server
from sao_jax.serve.episodes import EpisodeLog
from sao_jax.serve.gateway import Gateway, GatewayConfig
from sao_jax.serve.render import ChatRenderer
from sao_jax.text.harness_tokenizer import CALCULATOR_TOOL, write_harness_tokenizer
from sao_jax.text.qwen3_template import qwen3_tools_template
from sao_jax.text.tokenizer import HFTokenizer

SESSIONS = 32
MESSAGES = [
    {"role": "system", "content": "Use the calculator tool, then answer with the number."},
    {"role": "user", "content": "what is 12 + 30?"},
]


class OneTurn:
    """The in-process twin of a gateway call: the rendered prompt, one turn, done."""

    max_turns = 1

    def reset(self, prompt):
        return prompt.text

    def step(self, action_text):
        return StepResult("", 0.0, True, {})


def _model(variant: str, sharder):
    config = config_lib.load_config(f"configs/harness.py{':smoke' if variant == 'smoke' else ''}")
    cfg = ModelConfig.from_config(config.model)
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), sharder)
    n = sum(x.size for x in jax.tree.leaves(params))
    return mdef, params, n


def _in_process(engine: Engine, params, text: str) -> tuple[float, int, int]:
    prompts = [Prompt(f"p{i}", text) for i in range(SESSIONS)]
    t0 = time.perf_counter()
    trajs, drops = engine.run(params, prompts)
    dt = time.perf_counter() - t0
    assert not drops, drops
    return dt, len(trajs), sum(t.num_actions for t in trajs)


async def _sessions(url: str, admin: str, tokens: int):
    """One round of the clients: (seconds, [(call latency, completion tokens)])."""
    admin_client = AsyncOpenAI(base_url=f"{url}/v1", api_key=admin, max_retries=0)

    async def one():
        s = await admin_client.post("/sessions", cast_to=object, body={"task": "12+30"})
        client = admin_client.with_options(base_url=s["base_url"], api_key=s["api_key"])
        t = time.perf_counter()
        r = await client.chat.completions.create(
            model="sao-policy", messages=MESSAGES, tools=[CALCULATOR_TOOL], max_tokens=tokens
        )
        latency = time.perf_counter() - t
        await admin_client.post(f"/sessions/{s['id']}/reward", cast_to=object, body={"reward": 0})
        return latency, r.usage.completion_tokens

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one() for _ in range(SESSIONS)))
    dt = time.perf_counter() - t0
    await admin_client.close()
    return dt, out


def _client_worker(url: str, admin: str, tokens: int, conn) -> None:
    """A client process: one round of sessions per message on `conn`, until None."""
    while conn.recv() is not None:
        conn.send(asyncio.run(_sessions(url, admin, tokens)))


def _gateway_round(run_clients, backend, added: list):
    """One round through the gateway; the backend's own time per request is measured in
    the server's process, and the added latency pairs calls and requests by rank (which
    call was which request is not observable from the client side)."""
    spans: dict[int, float] = {}
    submit = backend.submit

    def timed(request, on_tokens=None):
        h = submit(request, on_tokens)
        t = time.perf_counter()
        h.future.add_done_callback(lambda _: spans.__setitem__(id(h), time.perf_counter() - t))
        return h

    backend.submit = timed
    try:
        dt, out = run_clients()
    finally:
        backend.submit = submit
    latencies = sorted(lat for lat, _ in out)
    added += [c - e for c, e in zip(latencies, sorted(spans.values()), strict=False)]
    return dt, len(out), sum(n for _, n in out)


def bench(
    variant: str, rounds: int, tokens: int, root: pathlib.Path, client_process: bool = True
) -> None:
    tok = HFTokenizer(write_harness_tokenizer(root / "tok"))
    sharder = Sharder()
    mdef, params, n_params = _model(variant, sharder)
    text = qwen3_tools_template().render(
        MESSAGES, tools=[CALCULATOR_TOOL], add_generation_prompt=True
    )
    cfg = EngineConfig(num_slots=SESSIONS, max_len=512, max_turn_tokens=tokens, steps_per_sync=4,
                       add_bos=False)  # fmt: skip
    engine = Engine.create(mdef, tok, OneTurn, cfg, seed=0)
    backend = NativeBackend(mdef, params, tok, cfg, seed=0)
    renderer = ChatRenderer(qwen3_tools_template(), tok)
    gateway = Gateway(backend, renderer, GatewayConfig(), EpisodeLog(root / variant / "ep.jsonl"))
    server = start_server(gateway)
    rows = {"in-process": [], "gateway": []}
    added: list[float] = []
    args = (server.url, gateway.admin_key, tokens)
    worker = None
    if client_process:  # the clients in a process of their own (they need no GIL here)
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        worker = ctx.Process(target=_client_worker, args=(*args, child), daemon=True)
        worker.start()

        def run_clients():
            conn.send(True)
            return conn.recv()
    else:

        def run_clients():
            return asyncio.run(_sessions(*args))

    try:
        _in_process(engine, params, text)  # compile both paths before timing
        _gateway_round(run_clients, backend, [])
        for _ in range(rounds):
            rows["in-process"].append(_in_process(engine, params, text))
            rows["gateway"].append(_gateway_round(run_clients, backend, added))
    finally:
        if worker is not None:
            conn.send(None)
            worker.join(30)
        server.stop()
        backend.close()
    where = "a client process" if client_process else "the server's process"
    print(f"\n{variant}: {n_params / 1e6:.2f}M parameters, {SESSIONS} sessions in {where}, "
          f"max {tokens} tokens, {rounds} rounds, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    med = {}
    for name, rs in rows.items():
        traj_s = statistics.median(n / dt for dt, n, _ in rs)
        tok_s = statistics.median(k / dt for dt, _, k in rs)
        med[name] = (traj_s, tok_s)
        print(f"  {name:10s} {traj_s:8.2f} trajectories/s {tok_s:9.1f} decode tokens/s")
    ratio = [med["gateway"][i] / med["in-process"][i] for i in range(2)]
    print(f"  ratio      {ratio[0]:8.2f} (trajectories) {ratio[1]:8.2f} (tokens)")
    a = np.asarray(added) * 1000
    print(f"  added latency per call: p50 {np.percentile(a, 50):.1f} ms, "
          f"p99 {np.percentile(a, 99):.1f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smoke", "default"],
                        choices=["smoke", "default"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--same_process", action="store_true", help="the clients in the server's process"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for variant in args.models:
            bench(variant, args.rounds, args.tokens, pathlib.Path(d), not args.same_process)


if __name__ == "__main__":
    main()
