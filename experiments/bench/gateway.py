"""The rollout gateway against the in-process sampler, on the same engine and prompts.

    python -m experiments.bench.gateway                       # both models, 3 rounds
    python -m experiments.bench.gateway --models smoke --rounds 5 --tokens 32
    python -m experiments.bench.gateway --models default --full_prefill  # before the fix

For each model (configs/harness.py: `smoke`, the demo's size, and the default, about 4x
its parameters), with the harness tokenizer and the Qwen3-style template, one engine
setting (32 slots, temperature 1) and the calculator question rendered with its tool:

  in-process  `Engine.run` on 32 prompts (an environment that ends after one turn of at
              most --tokens tokens): the in-process sampler's path;
  gateway     32 concurrent sessions (in a client process of their own unless
              --same_process, its clients kept across rounds: one session and one
              reward each over aiohttp, as a driver posts them, one chat call with
              max_tokens=--tokens through the `openai` client, the sessions' clients
              sharing its connection pool) through the gateway on its own
              NativeBackend with the same settings (new prompts prefilled over their
              own slots, Engine.row_prefill; --full_prefill: over all 32, for
              comparison; every prefill program compiled before timing).

Rounds are INTERLEAVED (the machine may be shared); printed per model: the median
trajectories/s and decode tokens/s of both and their ratio (gateway / in-process), each
round's ratio and their median (paired rounds ran seconds apart, under the same load), the
gateway's added latency per call (client latency minus the backend's own time from
submit to result), p50 and p99 over all calls, and the admissions and prefill calls per
round (sao_jax/sampling/backend_native.py, Admission: a burst is admitted whole once no
request arrived for `admit_gap_s`, or its oldest waited `admit_wait_s`). A
random-init model stops at eos at random, so tokens are counted, not assumed. Not a
timed test: docs/benchmarks.md and docs/harness.md have the rows and the command.
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

import aiohttp
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
from sao_jax.sampling.backend import GenRequest
from sao_jax.sampling.backend_native import ADMIT_GAP_S, ADMIT_WAIT_S, NativeBackend
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


class _Clients:
    """The client side, kept across rounds as a long-running harness driver keeps it, on
    an event loop of its own: the admin routes (create a session, post its reward) over
    one aiohttp session, as a driver calls them; the model calls through one AsyncOpenAI
    client whose connection pool every session's client shares (`with_options`)."""

    def __init__(self, url: str, admin: str, tokens: int):
        self.url, self.tokens = url, tokens
        self.loop = asyncio.new_event_loop()
        headers = {"Authorization": f"Bearer {admin}"}
        self.http = self.loop.run_until_complete(self._open(headers))
        self.model = AsyncOpenAI(base_url=f"{url}/v1", api_key=admin, max_retries=0)

    @staticmethod
    async def _open(headers) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(headers=headers)

    async def _post(self, path: str, body: dict) -> dict:
        async with self.http.post(f"{self.url}/v1{path}", json=body) as r:
            r.raise_for_status()
            return await r.json()

    async def _one(self) -> tuple[float, int]:
        s = await self._post("/sessions", {"task": "12+30"})
        client = self.model.with_options(base_url=s["base_url"], api_key=s["api_key"])
        t = time.perf_counter()
        r = await client.chat.completions.create(
            model="sao-policy", messages=MESSAGES, tools=[CALCULATOR_TOOL], max_tokens=self.tokens
        )
        latency = time.perf_counter() - t
        await self._post(f"/sessions/{s['id']}/reward", {"reward": 0})
        return latency, r.usage.completion_tokens

    async def _round(self):
        t0 = time.perf_counter()
        out = await asyncio.gather(*(self._one() for _ in range(SESSIONS)))
        return t0, time.perf_counter() - t0, out

    def round(self):
        """One round: (its start, seconds, [(call latency, completion tokens)]); the start
        on perf_counter's clock, CLOCK_MONOTONIC on Linux, which the server's process
        shares."""
        return self.loop.run_until_complete(self._round())

    def close(self) -> None:
        self.loop.run_until_complete(self.http.close())
        self.loop.run_until_complete(self.model.close())
        self.loop.close()


def _client_worker(url: str, admin: str, tokens: int, conn) -> None:
    """A client process: one round of sessions per message on `conn`, until None."""
    clients = _Clients(url, admin, tokens)
    while conn.recv() is not None:
        conn.send(clients.round())
    clients.close()


def _gateway_round(run_clients, backend, added: list, phases: list):
    """One round through the gateway; the backend's own time per request is measured in
    the server's process, and the added latency pairs calls and requests by rank (which
    call was which request is not observable from the client side). `phases` gets the
    round's `_phases`."""
    spans: dict[int, float] = {}
    submits: list[float] = []
    results: list[float] = []
    submit = backend.submit
    admissions = backend.stats().get("admissions", 0)

    def timed(request, on_tokens=None):
        h = submit(request, on_tokens)
        t = time.perf_counter()
        submits.append(t)

        def done(_):
            now = time.perf_counter()
            results.append(now)
            spans[id(h)] = now - t

        h.future.add_done_callback(done)
        return h

    backend.submit = timed
    try:
        t0, dt, out = run_clients()
    finally:
        backend.submit = submit
    latencies = sorted(lat for lat, _ in out)
    added += [c - e for c, e in zip(latencies, sorted(spans.values()), strict=False)]
    submits.sort()
    phases.append(
        dict(
            lead_in=submits[0] - t0,
            arrivals=submits[-1] - submits[0],
            largest_gap=float(np.max(np.diff(submits), initial=0.0)),
            backend=max(results) - submits[0],
            tail=t0 + dt - max(results),
            admissions=backend.stats().get("admissions", 0) - admissions,
        )
    )
    return dt, len(out), sum(n for _, n in out)


def _compile_admissions(backend, prompt_ids: list[int]) -> None:
    """Compiles the prefill programs an admission of the bench's prompt may run: groups
    of 1, 2, 4, ... requests submitted at once are admitted together, and each group's
    rows are prefilled in one call of that many rows (Engine.row_prefill), so no timed
    round compiles."""
    n = 1
    while n < SESSIONS:
        handles = [backend.submit(GenRequest(tuple(prompt_ids), 1)) for _ in range(n)]
        for h in handles:
            h.future.result(timeout=600)
        n *= 2


def bench(
    variant: str,
    rounds: int,
    tokens: int,
    root: pathlib.Path,
    client_process: bool = True,
    row_prefill: bool = True,
    admit_gap_s: float = ADMIT_GAP_S,
    admit_wait_s: float = ADMIT_WAIT_S,
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
    backend = NativeBackend(mdef, params, tok, cfg, seed=0, row_prefill=row_prefill,
                            admit_gap_s=admit_gap_s, admit_wait_s=admit_wait_s)  # fmt: skip
    renderer = ChatRenderer(qwen3_tools_template(), tok)
    gateway = Gateway(backend, renderer, GatewayConfig(), EpisodeLog(root / variant / "ep.jsonl"))
    server = start_server(gateway)
    rows = {"in-process": [], "gateway": []}
    added: list[float] = []
    phases: list[dict] = []
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
        clients = _Clients(*args)
        run_clients = clients.round

    try:
        _in_process(engine, params, text)  # compile both paths before timing
        _gateway_round(run_clients, backend, [], [])
        _compile_admissions(backend, renderer.prompt_ids(MESSAGES, tools=[CALCULATOR_TOOL]))
        before = _calls(backend, engine)
        for _ in range(rounds):
            rows["in-process"].append(_in_process(engine, params, text))
            rows["gateway"].append(_gateway_round(run_clients, backend, added, phases))
    finally:
        if worker is not None:
            conn.send(None)
            worker.join(30)
        else:
            clients.close()
        server.stop()
        backend.close()
    calls = {k: (v - before[k]) / rounds for k, v in _calls(backend, engine).items()}
    where = "a client process" if client_process else "the server's process"
    where += "" if row_prefill else ", full prefill"
    print(f"\n{variant}: {n_params / 1e6:.2f}M parameters, {SESSIONS} sessions in {where}, "
          f"max {tokens} tokens, {rounds} rounds, load {os.getloadavg()[0]:.1f}, admission "
          f"gap {admit_gap_s * 1e3:g} ms / wait {admit_wait_s * 1e3:g} ms")  # fmt: skip
    med = {}
    for name, rs in rows.items():
        traj_s = statistics.median(n / dt for dt, n, _ in rs)
        tok_s = statistics.median(k / dt for dt, _, k in rs)
        med[name] = (traj_s, tok_s)
        print(f"  {name:10s} {traj_s:8.2f} trajectories/s {tok_s:9.1f} decode tokens/s")
    ratio = [med["gateway"][i] / med["in-process"][i] for i in range(2)]
    print(f"  ratio      {ratio[0]:8.2f} (trajectories) {ratio[1]:8.2f} (tokens)")
    paired = [(g[1] / g[0]) / (p[1] / p[0]) for p, g in zip(*rows.values(), strict=True)]
    ratios = ", ".join(f"{r:.2f}" for r in paired)
    print(f"  per-round trajectories/s ratios (gateway / in-process, round by round): {ratios}; "
          f"median {statistics.median(paired):.2f}")  # fmt: skip
    a = np.asarray(added) * 1000
    print(f"  added latency per call: p50 {np.percentile(a, 50):.1f} ms, "
          f"p99 {np.percentile(a, 99):.1f} ms")  # fmt: skip
    c = calls
    print(f"  per round: gateway {c['admissions']:.1f} admissions, {c['prefill']:.1f} prefill "
          f"calls, {c['decode']:.1f} decode calls; in-process {c['in_prefill']:.1f} prefill, "
          f"{c['in_decode']:.1f} decode")  # fmt: skip
    ms = {k: statistics.median(p[k] for p in phases) * 1e3 for k in phases[0]}
    inproc = statistics.median(dt for dt, _, _ in rows["in-process"]) * 1e3
    print(f"  gateway round, median ms: {ms['lead_in']:.0f} from the round's start to the "
          f"first request at the backend (sessions created, the call sent and rendered), "
          f"{ms['backend']:.0f} from it to the last result ({ms['arrivals']:.0f} of "
          f"arrivals, largest gap {ms['largest_gap']:.1f}), {ms['tail']:.0f} from the last "
          f"result to the round's end (replies, rewards); in-process round "
          f"{inproc:.0f}")  # fmt: skip
    print("  admissions per round: " + " ".join(str(p["admissions"]) for p in phases))


def _calls(backend, engine) -> dict[str, int]:
    """The device calls and admissions made so far, by both paths."""
    stats = backend.stats()
    return dict(
        admissions=stats.get("admissions", 0),
        prefill=stats["prefill_calls"],
        decode=stats["decode_calls"],
        in_prefill=engine.calls["prefill"],
        in_decode=engine.calls["decode"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smoke", "default"],
                        choices=["smoke", "default"])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--same_process", action="store_true", help="the clients in the server's process"
    )
    parser.add_argument(
        "--full_prefill",
        action="store_true",
        help="the gateway's engine prefills over all slots (no Engine.row_prefill)",
    )
    parser.add_argument("--admit_gap_s", type=float, default=ADMIT_GAP_S,
                        help="NativeBackend's admission quiet gap")  # fmt: skip
    parser.add_argument("--admit_wait_s", type=float, default=ADMIT_WAIT_S,
                        help="NativeBackend's longest admission wait")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for variant in args.models:
            bench(variant, args.rounds, args.tokens, pathlib.Path(d), not args.same_process,
                  not args.full_prefill, args.admit_gap_s, args.admit_wait_s)  # fmt: skip


if __name__ == "__main__":
    main()
