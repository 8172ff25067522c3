"""The vLLM side of sampling.backend='vllm': a script run by the vLLM env's python.

It imports vLLM, never sao_jax (the two stacks live in separate environments, docs/vllm.md),
and speaks JSON lines: commands on stdin, events on the file descriptor `--events_fd`
(vLLM logs to stdout/stderr, which the caller sends to a log file). Commands:

  {"op": "generate", "id", "prompt_ids", "max_tokens", "stop_ids", "temperature", "top_p",
   "seed"}            token ids in; never text
  {"op": "cancel", "id"}                       aborts the request (its slot is freed)
  {"op": "load_weights", "version", "path", "manifest"}   in-place weight sync (below)
  {"op": "shutdown"}

Events: {"op": "ready", "version"}, {"op": "tokens", "id", "token_ids", "logp", "version",
"finish"} (the new tokens since the last event, each one's log-prob under the raw logits,
finish None | 'stop' | 'length' | 'cancelled'),
{"op": "synced", "version", "seconds", "interrupted"}, {"op": "error", "id", "message"}.
A request's first tokens event also carries `prompt_ids`: the prompt's ids as vLLM holds
them (its `prompt_token_ids`), for the caller to check that nothing re-tokenized them.

Weights: the engine starts on the checkpoint `--model` (version `--version`). A
`load_weights` command is run between two engine steps, so no step ever mixes weights:
every request in flight is aborted first (each listed in the 'synced' event's
`interrupted`; its streamed tokens stand, the caller resubmits the rest), the weights are
loaded in place by the worker extension vllm_worker_ext.py (shared memory; it redoes the
CPU MoE prepacking vLLM's reload skips), and the prefix cache is reset (no KV block
computed by the old weights is reused). A failed load is an `error` event with no id: the
engine's weights are then undefined, and the caller treats the server as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import traceback


def _read_commands(commands: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            commands.put(json.loads(line))
    commands.put({"op": "shutdown"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max_model_len", type=int, required=True)
    parser.add_argument("--max_num_seqs", type=int, default=16)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--events_fd", type=int, required=True)
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

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        skip_tokenizer_init=True,
        seed=0,
        worker_extension_cls="vllm_worker_ext.WeightSync",  # this folder is on sys.path
    )
    engine = llm.llm_engine
    version = args.version
    sent: dict[str, int] = {}  # request id -> tokens already sent
    echoed: set[str] = set()  # requests whose prompt ids were sent back
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=_read_commands, args=(commands,), daemon=True).start()
    emit(op="ready", version=version)
    while True:
        block = not engine.has_unfinished_requests()
        try:
            while True:
                cmd = commands.get(block=block)
                block = False
                op = cmd["op"]
                if op == "shutdown":
                    return
                if op == "generate":
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
                    prompt = TokensPrompt(prompt_token_ids=list(cmd["prompt_ids"]))
                    engine.add_request(cmd["id"], prompt, params)
                    sent[cmd["id"]] = 0
                elif op == "load_weights":
                    interrupted = sorted(sent)
                    if interrupted:
                        engine.abort_request(interrupted)
                    sent.clear()
                    echoed.clear()
                    (info,) = engine.collective_rpc(
                        "sao_load_weights", args=(cmd["path"], cmd["manifest"])
                    )
                    if not engine.reset_prefix_cache():
                        raise RuntimeError("the prefix cache could not be reset after a sync")
                    version = cmd["version"]
                    emit(op="synced", version=version, interrupted=interrupted, **info)
                elif op == "cancel" and cmd["id"] in sent:  # else: it already finished
                    engine.abort_request([cmd["id"]])
                    del sent[cmd["id"]]
                    echoed.discard(cmd["id"])
                    emit(
                        op="tokens",
                        id=cmd["id"],
                        token_ids=[],
                        logp=[],
                        version=version,
                        finish="cancelled",
                    )
        except queue.Empty:
            pass
        except Exception as e:  # a bad command: said, and the server goes on
            rid = None if cmd["op"] == "load_weights" else cmd.get("id")  # None: fatal
            emit(op="error", id=rid, message=f"{type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            rid = out.request_id
            if rid not in sent:
                continue
            completion = out.outputs[0]
            n = sent[rid]
            ids = list(completion.token_ids[n:])
            logp = [completion.logprobs[i][tok].logprob for i, tok in enumerate(ids, start=n)]
            extra = {}
            if rid not in echoed:  # the prompt vLLM holds, once per request
                echoed.add(rid)
                extra["prompt_ids"] = list(out.prompt_token_ids)
            finish = None
            if out.finished:
                finish = "length" if completion.finish_reason == "length" else "stop"
                del sent[rid]
                echoed.discard(rid)
            else:
                sent[rid] = n + len(ids)
            emit(
                op="tokens",
                id=rid,
                token_ids=ids,
                logp=logp,
                version=version,
                finish=finish,
                **extra,
            )


if __name__ == "__main__":  # vLLM may start processes with spawn: they import this file
    main()
