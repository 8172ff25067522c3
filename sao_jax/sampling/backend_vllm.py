"""sampling.backend='vllm': the generation backend interface (sampling/backend.py) on vLLM.

vLLM cannot share this project's environment (docs/vllm.md), so `VllmBackend` starts
sao_jax/sampling/vllm_server.py with the vLLM env's python (`sampling.vllm.python`,
`make vllm-env`) in a process group of its own, and speaks JSON lines with it: commands on
its stdin, events on a pipe of their own (vLLM's logs go to `<workdir>/vllm.log`).

* Token ids in and out: the prompt's ids go to vLLM as a `TokensPrompt`; the sampled ids
  come back as ids (the server runs without a tokenizer, so nothing is re-tokenized).
* `rollout_logp`: vLLM's log-prob of each sampled token under the raw logits
  (log_softmax at temperature 1 over the full vocabulary, vLLM's default
  `logprobs_mode`), the value the learner recomputes. `sampled_logp`, log q(token)
  under the law it was drawn from: the same value at temperature 1 without truncation,
  0 under greedy, and for other laws the value the server computes beside vLLM's
  sampler (sampling/vllm_worker_sampled.py; NaN only where none was reported).
* `publish(params, version)` with `sampling.vllm.weight_sync='inplace'` (the default):
  the params go through models/hf.py's `hf_entries` (the one export mapping: Hugging
  Face names, shapes, `sampling.vllm.dtype`) into one flat buffer in shared memory
  (a /dev/shm file; the workdir when /dev/shm lacks room), and the server loads them in
  place between two engine steps (vllm_server.py, worker extension vllm_worker_ext.py).
  Requests in flight fail with RequestInterrupted (their streamed tokens stand, the
  caller resubmits the rest) and submissions wait for the sync; no token is sampled by
  mixed weights and no KV block of the old weights is reused. Shared memory rather than
  a file: no safetensors encoding, no disk, and the engine's tensors view the buffer
  (one copy into the model). With `'restart'`: the export is written by
  `save_hf_checkpoint` to `<workdir>/weights/v<version>/` and a new server starts on it
  (the same interruption). With `'nccl'` (GPU; never run on one): the server's workers
  join the trainer's NCCL group on the first publication and receive each tensor by
  broadcast from the trainer's GPU (weight_sync_nccl.ServerSync, the server's
  `nccl_init` / `nccl_receive`). `close()` deletes the exports.
* A server that exits (killed, crashed) or a sync that fails leaves the backend failed:
  every request in flight and every later call raises EngineDied naming the engine, its
  exit code and its log; `fatal_error()` says so to a caller that polls (the gateway's
  rollouts source, sao_jax/serve/source.py).
* The prompt vLLM holds (`prompt_token_ids`, sent back with a request's first tokens) is
  checked against the ids sent (GenerationError if they differ) and kept on the handle
  as `handle.engine_prompt_ids`.
* `cancel()` aborts the request in vLLM (its KV blocks are freed) and resolves the future
  with 'cancelled' and the tokens sampled so far.
* Stop strings: checked here on the streamed ids with the run's tokenizer (`decode`): the
  request ends with 'stop' at the token whose decoded completion first holds one (kept,
  as the native backend keeps it), and is aborted in vLLM; without `decode` they are
  refused (GenerationError).
* `record_routing` (sampling.record_routing): the server reports, with each tokens event,
  the experts vLLM routed every position its request computed to
  (vllm_worker_routing.py); each chunk carries them (`GenChunk.routing`) and the result
  the request's whole record, for rl.routing_replay (docs/vllm.md "Routing replay on
  vLLM rollouts").
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sao_jax.models import hf
from sao_jax.models.config import ModelConfig
from sao_jax.sampling.backend import (
    EngineDied,
    GenChunk,
    GenerationError,
    GenHandle,
    GenRequest,
    GenResult,
    RequestInterrupted,
)
from sao_jax.sampling.vllm_config import VllmConfig, check_python
from sao_jax.sampling.weight_staging import stage_weights, staged_size

SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_server.py")
SHM = "/dev/shm"  # shared memory on Linux: a tmpfs whose files live in RAM


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(cfg: VllmConfig) -> dict[str, str]:
    """The environment a vLLM process of this run gets: `cfg.omp_threads` unbound OpenMP
    threads, `cfg.kv_cache_gib` of KV space, a free (or `cfg.port`) port, the engine core
    in the process itself, and no PYTHONPATH (nothing of this environment leaks in)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(cfg.omp_threads),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_cache_gib),
        VLLM_PORT=str(cfg.port or free_port()),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    env.pop("PYTHONPATH", None)
    return env


def server_command(
    python: str,
    cfg: VllmConfig,
    path: str,
    max_len: int,
    version: int,
    events_fd: int,
    record_routing: bool = False,
) -> list[str]:
    """The command line of vllm_server.py on the checkpoint at `path`
    (`--weight_sync` picks the server's worker extension; `--record_routing` reports the
    experts of every position)."""
    return [
        python,
        SERVER,
        f"--model={path}",
        f"--dtype={cfg.dtype}",
        f"--max_model_len={max_len}",
        f"--max_num_seqs={cfg.max_num_seqs}",
        f"--version={version}",
        f"--weight_sync={cfg.weight_sync}",
        f"--events_fd={events_fd}",
        *(["--record_routing"] if record_routing else []),
    ]


class _Live:
    """A request in flight: its handle, stream callback and the records so far."""

    def __init__(self, handle: GenHandle, on_tokens, sampling: dict[str, Any]):
        self.handle = handle
        self.on_tokens = on_tokens
        self.sampling = sampling
        self.ids: list[int] = []
        self.logp: list[float] = []
        self.sampled: list[float] = []
        self.versions: list[int] = []
        self.routing: tuple[list[int], list] | None = None  # with record_routing


def stop_string_end(decode, before: list[int], new: list[int], stops) -> int | None:
    """How many of the `new` tokens a completion `before + new` keeps when it ends at a
    stop string: the first k whose decoded `before + new[:k]` holds one of `stops` (the
    token that completes it kept, as the native engine keeps it); None when none does."""
    for k in range(1, len(new) + 1):
        text = decode(before + new[:k])
        if any(st in text for st in stops):
            return k
    return None


def sampled_logp(rollout_logp: float, temperature: float, top_p: float) -> float:
    """log q(token) under the law it was sampled with, where it follows from the raw
    log-prob: the same at temperature 1 without truncation, 0 under greedy, else NaN
    (the server reports those laws' values itself: vllm_worker_sampled.py)."""
    if temperature == 0:
        return 0.0
    if temperature == 1 and top_p == 1:
        return rollout_logp
    return math.nan


class VllmBackend:
    """GenerationBackend on a vLLM server process; see the module docstring.

    Args:
      cfg: the `sampling.vllm` knobs (vllm_config.vllm_config).
      model_cfg, params: the policy; written in Hugging Face layout as the engine's first
        weights (version `version`).
      workdir: where the weights, the server's log and nothing else go.
      max_len: prompt + completion tokens per request (vLLM's max_model_len unless
        cfg.max_model_len is set).
      eos_id: the turn's end token (a stop id of every request).
      temperature, top_p: the backend's own law (a request without values samples with it).
      base_config: the source checkpoint's config.json (fields the export keeps).
      decode: the tokenizer's ids -> text, for requests' stop strings (checked here, on
        the streamed ids: the server has no tokenizer); None refuses them.
    """

    def __init__(
        self,
        cfg: VllmConfig,
        model_cfg: ModelConfig,
        params,
        *,
        workdir: str,
        max_len: int,
        eos_id: int | None = None,
        version: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        base_config: dict | None = None,
        decode: Callable[[list[int]], str] | None = None,
        record_routing: bool = False,
    ):
        self._python = check_python(cfg)
        self.record_routing = record_routing
        self._decode = decode  # ids -> text: requests' stop strings (None: refused)
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.max_len = cfg.max_model_len or max_len
        self.eos_id = eos_id
        self._law = dict(temperature=temperature, top_p=top_p)
        self._seed = seed
        self._base_config = base_config
        self._workdir = os.path.abspath(workdir)
        os.makedirs(self._workdir, exist_ok=True)
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._restarting = False
        self._ready = threading.Event()
        self._synced = threading.Event()  # an in-place sync answered (or the server failed)
        self.syncs: list[dict] = []  # the server's 'synced' events (seconds, interrupted)
        self._answers: dict[str, Future] = {}  # event op -> the Future of a command (_rpc)
        self._nccl = None  # weight_sync_nccl.ServerSync, on the first 'nccl' publication
        self._serving = threading.Event()  # set while a ready server takes requests
        self._version: int | None = None
        self._error: str | None = None
        self._closed = False
        self.counters: collections.Counter = collections.Counter()
        self.publish_s: list[float] = []
        self._log = open(os.path.join(self._workdir, "vllm.log"), "ab")  # noqa: SIM115 (close())
        self._proc = None
        self._start(self._export(params, version), version)

    # ---- the interface -------------------------------------------------------------------

    def submit(
        self, request: GenRequest, on_tokens: Callable[[GenChunk], None] | None = None
    ) -> GenHandle:
        if request.stop_strings and self._decode is None:
            raise GenerationError("stop_strings: this vLLM backend has no detokenizer")
        if len(request.prompt_ids) >= self.max_len:
            raise GenerationError(
                f"{len(request.prompt_ids)} prompt tokens leave no room in max_len={self.max_len}"
            )
        sampling = self.sampling_of(request)
        handle = GenHandle(request, self._request_cancel)
        stop_ids = set(request.stop_ids) | ({self.eos_id} if self.eos_id is not None else set())
        with self._lock:
            self._wait_serving()
            handle.uid = f"r{next(self._uids)}"
            self._live[handle.uid] = _Live(handle, on_tokens, sampling)
            self.counters["submitted"] += 1
            self._send(
                op="generate",
                id=handle.uid,
                prompt_ids=list(request.prompt_ids),
                max_tokens=min(request.max_tokens, self.max_len - len(request.prompt_ids)),
                stop_ids=sorted(stop_ids),
                seed=self._seed + int(handle.uid[1:]),
                **sampling,
            )
        return handle

    def _wait_serving(self) -> None:
        """Under the lock: returns once a server serves (a publication's restart waited
        for, up to startup_timeout_s), else GenerationError."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            self._check_alive()
            if self._serving.is_set():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise GenerationError(
                    f"vLLM server not serving after {self.cfg.startup_timeout_s} s (restarting "
                    f"on new weights); its log: {self._log.name}"
                )
            self._lock.release()
            try:
                self._serving.wait(left)
            finally:
                self._lock.acquire()

    def _request_cancel(self, handle: GenHandle) -> None:
        with self._lock:  # a restart fails the request anyway
            if not self._closed and self._error is None and self._serving.is_set():
                self._send(op="cancel", id=handle.uid)

    def publish(self, params: Any, version: int) -> None:
        """Hands `params` to the engine as `version`; returns once it serves them.

        In place (`weight_sync='inplace'`) or by a restart (module docstring): either way
        requests in flight fail with RequestInterrupted (the caller resubmits them from
        the tokens streamed so far: backend_engine.py), submissions wait, and no token is
        sampled by mixed weights."""
        start = time.perf_counter()
        with self._lock:
            self._check_alive()
        if self.cfg.weight_sync == "inplace":
            self._sync_in_place(params, version)
        elif self.cfg.weight_sync == "nccl":
            self._sync_nccl(params, version)
        else:
            self._restart_on(params, version)
        self.publish_s.append(time.perf_counter() - start)

    def _sync_in_place(self, params: Any, version: int) -> None:
        """Stages `params` in shared memory and has the server load them (module doc)."""
        path, manifest = self._stage(params, version)
        try:
            with self._lock:
                self._check_alive()
                self._serving.clear()  # submissions wait for the sync (_wait_serving)
                self._synced.clear()
                self._send(op="load_weights", version=version, path=path, manifest=manifest)
            if not self._synced.wait(self.cfg.startup_timeout_s):
                with self._lock:
                    self._error = (
                        f"no answer to weights v{version} in {self.cfg.startup_timeout_s} s"
                    )
            with self._lock:
                self._check_alive()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._serving.set()  # waiting submissions go on, or hear of the failure

    def _sync_nccl(self, params: Any, version: int) -> None:
        """The GPU sync (weight_sync='nccl', a plan: never run on a GPU): the rendezvous
        on the first call, then the trainer's broadcasts while the server's workers
        receive (weight_sync_nccl.ServerSync). A failure leaves the NCCL group and the
        engine's weights undefined: the backend is failed (EngineDied)."""
        from sao_jax.sampling import weight_sync_nccl  # jax and, on a GPU, torch

        with self._lock:
            self._check_alive()
            self._serving.clear()  # submissions wait for the sync (_wait_serving)
        try:
            if self._nccl is None:
                import jax

                # the trainer at rank 0 and the server's one worker (no tensor parallel)
                self._nccl = weight_sync_nccl.ServerSync(
                    self._rpc, world_size=2, device=jax.local_devices()[0]
                )
            self._nccl.publish(self.model_cfg, params, self.cfg.dtype, version)
        except Exception as e:
            with self._lock:
                if self._error is None:
                    self._error = f"NCCL weight sync of v{version} failed: {e}"
            self._check_alive()
            raise
        finally:
            self._serving.set()  # waiting submissions go on, or hear of the failure

    def _rpc(self, op: str, answer: str, **fields) -> Future:
        """Sends the command `op`; a Future of the event `answer` (EngineDied when the
        server fails first)."""
        future: Future = Future()
        with self._lock:
            self._check_alive()
            self._answers[answer] = future
            self._send(op=op, **fields)
        return future

    def _answer(self, op: str, event: dict) -> None:
        with self._lock:
            future = self._answers.pop(op, None)
        if future is not None:
            future.set_result(event)

    def _stage(self, params: Any, version: int) -> tuple[str, list[dict]]:
        """The params' export staged for the worker extension (`stage_weights`): in
        /dev/shm when it has room for the buffer twice, else in the workdir."""
        entries = hf.hf_entries(self.model_cfg, params, dtype=self.cfg.dtype)
        size = staged_size(entries)
        shm_ok = os.path.isdir(SHM) and shutil.disk_usage(SHM).free > 2 * size
        folder = SHM if shm_ok else os.path.join(self._workdir, "weights")
        path = os.path.join(folder, f"sao-vllm-{os.getpid()}-{id(self):x}-v{version}.bin")
        manifest = stage_weights(entries, path, self.cfg.dtype)
        self.counters["staged_in_shm" if shm_ok else "staged_in_workdir"] += 1
        return path, manifest

    def _restart_on(self, params: Any, version: int) -> None:
        """Exports `params` and restarts the server on them (weight_sync='restart')."""
        path = self._export(params, version)
        with self._lock:  # submissions wait for the new server (_wait_serving)
            self._serving.clear()
        self._restarting = True
        try:
            self._stop()
            self._fail_all(
                f"weights v{version} published: the engine restarted", RequestInterrupted
            )
            self._start(path, version)
        finally:
            self._restarting = False
        self._prune_weights(keep=path)

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def sampling(self) -> dict[str, Any]:
        return dict(self._law)

    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    def sampling_of(self, request: GenRequest) -> dict[str, Any]:
        """The law `request` is sampled with."""
        return request.law(self.sampling)

    def fatal_error(self) -> str | None:
        """Why this backend can serve nothing more (its engine exited, a sync failed),
        naming the engine, its exit code and its log; None while it serves (or once
        closed)."""
        with self._lock:
            if self._closed or self._error is None:
                return None
            return self._failure()

    def stats(self) -> dict[str, float]:
        with self._lock:
            live = len(self._live)
        return dict(self.counters, active_requests=live, publishes=len(self.publish_s))

    def close(self) -> None:
        """Ends the server's process group; requests in flight fail with GenerationError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._serving.set()  # submissions waiting for a restart hear of the close
            self._synced.set()  # so does a publication waiting for its sync
        self._stop()
        self._fail_all("the backend is closed")
        self._log.close()
        shutil.rmtree(os.path.join(self._workdir, "weights"), ignore_errors=True)

    def _start(self, path: str, version: int) -> None:
        """Starts the server on the checkpoint at `path` and waits until it is ready."""
        cfg = self.cfg
        read_fd, write_fd = os.pipe()
        env = server_env(cfg)
        cmd = server_command(
            self._python, cfg, path, self.max_len, version, write_fd, self.record_routing
        )
        with self._lock:
            self._error = None
        self._ready = threading.Event()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            env=env,
            start_new_session=True,  # its own process group: _stop ends all of it
        )
        os.close(write_fd)
        events = os.fdopen(read_fd, "r")
        threading.Thread(
            target=self._read, args=(events, self._proc), name="sao-vllm-events", daemon=True
        ).start()
        if not self._ready.wait(cfg.startup_timeout_s) or self._error is not None:
            error = self._error or f"not ready after {cfg.startup_timeout_s} s"
            self.close()
            raise GenerationError(f"vLLM server: {error}; its log: {self._log.name}")
        self._serving.set()

    def _stop(self) -> None:
        """Ends the server's process group (a shutdown command first, then signals)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.write(b'{"op": "shutdown"}\n')
            proc.stdin.flush()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    # ---- internals -----------------------------------------------------------------------

    def _export(self, params, version: int) -> str:
        path = os.path.join(self._workdir, "weights", f"v{version}")
        shutil.rmtree(path, ignore_errors=True)
        hf.save_hf_checkpoint(
            path, self.model_cfg, params, dtype=self.cfg.dtype, base_config=self._base_config
        )
        return path

    def _prune_weights(self, keep: str) -> None:
        root = os.path.dirname(keep)
        for name in os.listdir(root):
            if os.path.join(root, name) != keep:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def _failure(self) -> str:
        """What failed and where its log is (self._error set; called under the lock)."""
        return f"vLLM server failed: {self._error}; its log: {self._log.name}"

    def _check_alive(self) -> None:
        if self._closed:
            raise GenerationError("the backend is closed")
        if self._error is not None:
            raise EngineDied(self._failure())

    def _send(self, **command) -> None:
        try:
            self._proc.stdin.write((json.dumps(command) + "\n").encode())
            self._proc.stdin.flush()
        except OSError as e:
            raise GenerationError(f"vLLM server gone ({e}); its log: {self._log.name}") from e

    def _read(self, events, proc) -> None:
        for line in events:
            event = json.loads(line)
            op = event["op"]
            if op == "ready":
                with self._lock:
                    self._version = event["version"]
                self._ready.set()
            elif op == "tokens":
                self._on_tokens(event)
            elif op == "synced":
                with self._lock:
                    self._version = event["version"]
                    self.syncs.append(event)
                self._fail_all(f"weights v{event['version']} synced in place", RequestInterrupted)
                self._synced.set()
                self._answer("synced", event)
            elif op == "nccl_ready":
                self._answer("nccl_ready", event)
            elif op == "error":
                live = None
                with self._lock:
                    live = self._live.pop(event.get("id") or "", None)
                if live is not None:
                    live.handle.future.set_exception(GenerationError(event["message"]))
                else:
                    with self._lock:
                        self._error = event["message"]
                    self._synced.set()
                    self._fail_answers()
        code = proc.wait()
        with self._lock:  # the server ended
            if self._closed or self._restarting:
                return
            if self._error is None:
                self._error = f"the engine (pid {proc.pid}) exited with code {code}"
            message = self._failure()
        self._ready.set()
        self._synced.set()
        self._fail_answers()
        self._fail_all(message, EngineDied)

    def _fail_answers(self) -> None:
        """The commands waiting for an answer (_rpc) fail: the server is failed."""
        with self._lock:
            futures, self._answers = list(self._answers.values()), {}
            message = self._failure()
        for future in futures:
            if not future.done():
                future.set_exception(EngineDied(message))

    def _on_tokens(self, event: dict) -> None:
        ids, logp, version = event["token_ids"], event["logp"], event["version"]
        finish = event["finish"]
        with self._lock:
            live = self._live.get(event["id"])
            if live is None:
                return
            seen = event.get("prompt_ids")
            if seen is not None:
                live.handle.engine_prompt_ids = seen
                if seen != list(live.handle.request.prompt_ids):
                    del self._live[event["id"]]
                    if event["finish"] is None and not self._closed and self._error is None:
                        with contextlib.suppress(GenerationError):  # frees its slot
                            self._send(op="cancel", id=event["id"])
                    live.handle.future.set_exception(
                        GenerationError(f"vLLM holds prompt ids {seen[:8]}..., not the ids sent")
                    )
                    return
            stops = live.handle.request.stop_strings
            end = stop_string_end(self._decode, live.ids, ids, stops) if stops else None
            if end is not None:  # the completion holds a stop string: it ends here
                ids, logp, finish = ids[:end], logp[:end], "stop"
                if event["finish"] is None and not self._closed and self._error is None:
                    with contextlib.suppress(GenerationError):  # a dead server: no matter
                        self._send(op="cancel", id=event["id"])  # its 'cancelled' ignored
            if finish is not None:
                del self._live[event["id"]]
        reported = event.get("sampled_logp") or [None] * len(logp)
        sampled = [
            sampled_logp(lp, **live.sampling) if got is None else got
            for lp, got in zip(logp, reported, strict=False)  # a stop string cut `logp`
        ]
        live.sampled += sampled
        live.ids += ids
        live.logp += logp
        live.versions += [version] * len(ids)
        routing = event.get("routing")
        if routing is not None:
            routing = (routing["positions"], routing["experts"])
            if live.routing is None:
                live.routing = ([], [])
            live.routing[0].extend(routing[0])  # in place: one copy of each event's rows
            live.routing[1].extend(routing[1])
        if (ids or routing) and live.on_tokens is not None:
            chunk = GenChunk(list(ids), list(logp), sampled, [version] * len(ids), routing)
            live.on_tokens(chunk)
        if finish is not None:
            self.counters[finish] += 1
            live.handle.future.set_result(
                GenResult(
                    token_ids=live.ids,
                    rollout_logp=live.logp,
                    sampled_logp=live.sampled,
                    versions=live.versions,
                    finish_reason=finish,
                    sampling=live.sampling,
                    routing=live.routing,
                )
            )

    def _fail_all(self, message: str, error=GenerationError) -> None:
        with self._lock:
            lives, self._live = list(self._live.values()), {}
        for live in lives:
            if not live.handle.future.done():
                live.handle.future.set_exception(error(message))
