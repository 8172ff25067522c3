"""The vLLM side of sampling.backend='vllm': a script run by the vLLM env's python.

It imports vLLM, never sao_jax (the two stacks live in separate environments, docs/vllm.md),
and speaks JSON lines: commands on stdin, events on the file descriptor `--events_fd`
(vLLM logs to stdout/stderr, which the caller sends to a log file). Commands:

  {"op": "generate", "id", "prompt_ids", "max_tokens", "stop_ids", "temperature", "top_p",
   "seed"}            token ids in; never text
  {"op": "cancel", "id"}                       aborts the request (its slot is freed)
  {"op": "load_weights", "version", "path", "manifest"}   in-place weight sync (below)
  {"op": "nccl_init", "init_info"}             joins the trainer's NCCL group (GPU, below)
  {"op": "nccl_receive", "version", "update_info"}        a GPU weight sync (below)
  {"op": "shutdown"}

Events: {"op": "ready", "version"}, {"op": "tokens", "id", "token_ids", "logp", "version",
"finish"} (the new tokens since the last event, each one's log-prob under the raw logits,
finish None | 'stop' | 'length' | 'cancelled'; and `sampled_logp`, each one's log-prob
under the law it was drawn from, where that is not the raw one: vllm_worker_sampled.py),
{"op": "synced", "version", "seconds", "interrupted"}, {"op": "nccl_ready", "ranks"},
{"op": "error", "id", "message"}.
With `--record_routing` (sampling.record_routing) a tokens event also carries `routing`:
{"positions", "experts" [m][L_moe][k]}, the positions its request computed since its
previous event (prompt positions included) and the experts vLLM routed each to
(vllm_worker_routing.py); prefix caching is then off, so every position is computed, and
reported, by every request that holds it.
A request's first tokens event also carries `prompt_ids`: the prompt's ids as vLLM holds
them (its `prompt_token_ids`), for the caller to check that nothing re-tokenized them.

Weights: the engine starts on the checkpoint `--model` (version `--version`). A sync
command is run between two engine steps, so no step ever mixes weights: every request in
flight is aborted first (each listed in the 'synced' event's `interrupted`; its streamed
tokens stand, the caller resubmits the rest), the weights are loaded in place by the
worker extension, and the prefix cache is reset (no KV block computed by the old weights
is reused). `--weight_sync` (sampling.vllm.weight_sync) picks the extension
(`WORKER_EXTENSIONS`): 'inplace' and 'restart' get vllm_worker_ext.py (`load_weights`:
shared memory; it redoes the CPU MoE prepacking vLLM's reload skips); 'nccl' gets
vllm_worker_nccl.py, whose two calls are `nccl_init` (once: the rendezvous on the
trainer's NCCL unique id, sao_jax/sampling/weight_sync_nccl.py) and `nccl_receive` (each
sync: the workers receive the trainer's broadcasts while the command runs). A failed sync
is an `error` event with no id: the engine's weights are then undefined, and the caller
treats the server as failed.

The command loop (`Server`) takes the engine and vLLM's request types as arguments, so it
runs without vLLM against a stand-in engine (tests/test_weight_payloads.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import sys
import threading
import traceback

# sampling.vllm.weight_sync -> the worker extension the engine starts with (this folder is
# on the server's sys.path)
WORKER_EXTENSIONS = {
    "inplace": "vllm_worker_ext.WeightSync",
    "restart": "vllm_worker_ext.WeightSync",
    "nccl": "vllm_worker_nccl.NcclWeightSync",
}
SYNC_OPS = ("load_weights", "nccl_init", "nccl_receive")  # a failure is fatal (id None)


def _read_commands(commands: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            commands.put(json.loads(line))
    commands.put({"op": "shutdown"})


class Server:
    """The command loop around a vLLM engine (`LLM.llm_engine`).

    Args:
      engine: add_request, abort_request, step, has_unfinished_requests, collective_rpc,
        reset_prefix_cache (vLLM's LLMEngine).
      make_request: a generate command -> (prompt, sampling params) for add_request.
      emit: writes one event.
      version: the weights the engine starts with.
    """

    def __init__(
        self, engine, make_request, emit, version: int, take_routing=None, take_sampled=None
    ):
        self.engine = engine
        self.make_request = make_request
        self.emit = emit
        self.version = version
        self.take_routing = take_routing  # a worker function (record_routing) or None
        self.take_sampled = take_sampled  # a worker function: {id: sampled_logp} or None
        self.sent: dict[str, int] = {}  # request id -> tokens already sent
        self.echoed: set[str] = set()  # requests whose prompt ids were sent back
        self.routing: dict[str, tuple[list, list]] = {}  # id -> (positions, experts) unsent

    def run(self, commands: queue.Queue) -> None:
        """Serves until a shutdown command."""
        self.emit(op="ready", version=self.version)
        while True:
            block = not self.engine.has_unfinished_requests()
            try:
                while True:
                    cmd = commands.get(block=block)
                    block = False
                    if cmd["op"] == "shutdown":
                        return
                    self.handle(cmd)
            except queue.Empty:
                pass
            if self.engine.has_unfinished_requests():
                self.step()

    def handle(self, cmd: dict) -> None:
        """One command; a failure is said (an `error` event) and the server goes on."""
        op = cmd["op"]
        try:
            if op == "generate":
                prompt, params = self.make_request(cmd)
                self.engine.add_request(cmd["id"], prompt, params)
                self.sent[cmd["id"]] = 0
            elif op == "load_weights":
                self._sync(cmd, "sao_load_weights", (cmd["path"], cmd["manifest"]))
            elif op == "nccl_init":
                infos = self.engine.collective_rpc("sao_nccl_init", args=(cmd["init_info"],))
                self.emit(op="nccl_ready", ranks=[info["rank"] for info in infos])
            elif op == "nccl_receive":
                self._sync(cmd, "sao_nccl_receive", (cmd["update_info"],))
            elif op == "cancel" and cmd["id"] in self.sent:  # else: it already finished
                self.engine.abort_request([cmd["id"]])
                del self.sent[cmd["id"]]
                self.echoed.discard(cmd["id"])
                self.routing.pop(cmd["id"], None)
                self.emit(
                    op="tokens",
                    id=cmd["id"],
                    token_ids=[],
                    logp=[],
                    version=self.version,
                    finish="cancelled",
                )
        except Exception as e:  # a bad command: said, and the server goes on
            rid = None if op in SYNC_OPS else cmd.get("id")  # None: fatal for the caller
            self.emit(op="error", id=rid, message=f"{type(e).__name__}: {e}")
            traceback.print_exc()

    def _sync(self, cmd: dict, method: str, args: tuple) -> None:
        """A weight sync between two steps: requests in flight aborted, the extension's
        `method` run on every worker, the prefix cache reset."""
        interrupted = sorted(self.sent)
        if interrupted:
            self.engine.abort_request(interrupted)
        self.sent.clear()
        self.echoed.clear()
        self.routing.clear()
        infos = self.engine.collective_rpc(method, args=args)
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset after a sync")
        self.version = cmd["version"]
        self.emit(op="synced", version=self.version, interrupted=interrupted, **infos[0])

    def step(self) -> None:
        """One engine step; its new tokens as events (with `record_routing`, each with the
        experts of the positions its request computed since its last event)."""
        outputs = self.engine.step()
        sampled = {}
        if self.take_sampled is not None:
            sampled = self.engine.collective_rpc(self.take_sampled)[0]
        if self.take_routing is not None:
            for rid, (pos, experts) in self.engine.collective_rpc(self.take_routing)[0].items():
                if rid in self.sent:  # else: cancelled or interrupted meanwhile
                    have = self.routing.setdefault(rid, ([], []))
                    have[0].extend(pos)
                    have[1].extend(experts)
        for out in outputs:
            rid = out.request_id
            if rid not in self.sent:
                continue
            completion = out.outputs[0]
            n = self.sent[rid]
            ids = list(completion.token_ids[n:])
            logp = [completion.logprobs[i][tok].logprob for i, tok in enumerate(ids, start=n)]
            extra = {}
            if rid in sampled and ids:  # this step's token: its law's log-prob
                extra["sampled_logp"] = [None] * (len(ids) - 1) + [sampled[rid]]
            if rid in self.routing:
                pos, experts = self.routing.pop(rid)
                extra["routing"] = {"positions": pos, "experts": experts}
            if rid not in self.echoed:  # the prompt vLLM holds, once per request
                self.echoed.add(rid)
                extra["prompt_ids"] = list(out.prompt_token_ids)
            finish = None
            if out.finished:
                finish = "length" if completion.finish_reason == "length" else "stop"
                del self.sent[rid]
                self.echoed.discard(rid)
            else:
                self.sent[rid] = n + len(ids)
            self.emit(
                op="tokens",
                id=rid,
                token_ids=ids,
                logp=logp,
                version=self.version,
                finish=finish,
                **extra,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max_model_len", type=int, required=True)
    parser.add_argument("--max_num_seqs", type=int, default=16)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--weight_sync", choices=sorted(WORKER_EXTENSIONS), default="inplace")
    parser.add_argument("--events_fd", type=int, required=True)
    parser.add_argument("--record_routing", action="store_true")
    args = parser.parse_args()
    events = os.fdopen(args.events_fd, "w", buffering=1)

    def emit(**event):
        events.write(json.dumps(event) + "\n")

    try:  # vLLM lives in its own environment (`make vllm-env`; docs/vllm.md), not .venv
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        emit(op="error", id=None, message=f"{e}: run this server with .vllm-venv's python")
        raise SystemExit(f"vllm_server: {e}; run it with `make vllm-env`'s python") from e

    def make_request(cmd: dict):
        params = SamplingParams(
            n=1,
            max_tokens=cmd["max_tokens"],
            temperature=cmd["temperature"],
            top_p=cmd["top_p"],
            seed=cmd.get("seed"),
            stop_token_ids=list(cmd["stop_ids"]),
            ignore_eos=True,  # the caller's stop ids decide
            logprobs=0,  # the sampled token's log-prob
            detokenize=False,
        )
        return TokensPrompt(prompt_token_ids=list(cmd["prompt_ids"])), params

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        worker_extension_cls=WORKER_EXTENSIONS[args.weight_sync],
        # recording routing: every request computes every position (a cached prefix from
        # another episode would have no experts to report)
        **({"enable_prefix_caching": False} if args.record_routing else {}),
    )
    # this file's folder's worker functions (on the server's sys.path: siblings, not
    # packages, imported by name as vLLM imports the worker extensions)
    routing = importlib.import_module("vllm_worker_routing")
    sampled = importlib.import_module("vllm_worker_sampled")

    def take_sampled(worker) -> dict[str, float]:
        taken = sampled.take_sampled_logp(worker)
        return {routing.internal_to_external(k): v for k, v in taken.items()}

    llm.llm_engine.collective_rpc(sampled.install_sampled_logp)
    if args.record_routing:
        llm.llm_engine.collective_rpc(routing.capture_routing)
    take = routing.take_routing if args.record_routing else None
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=_read_commands, args=(commands,), daemon=True).start()
    server = Server(llm.llm_engine, make_request, emit, args.version, take, take_sampled)
    server.run(commands)


if __name__ == "__main__":  # vLLM may start processes with spawn: they import this file
    main()
