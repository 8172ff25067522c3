"""The engine's episodes on a generation backend: the in-process rollouts of
`sampling.backend='vllm'` (sao_jax/sampling/backend_factory.py picks it).

`BackendEngine` is sao_jax/sampling/engine.py's `Engine` with its device calls replaced
by requests to a GenerationBackend (sao_jax/sampling/backend.py). Everything an episode
is made of is the engine's own code, unchanged: env.reset and the prompt's ids (bos
first), a turn's end at eos, an env stop string or `max_turn_tokens`, env.step in the
pool of env calls (parked slots while it runs), the observation's ids appended (never
re-tokenized text), max_turns and max_len truncation, drops by reason and the
`Trajectory` records. What differs is where a model turn's tokens come from:

* a turn is one request: the slot's whole context as token ids (prompt, earlier turns,
  observations), at most the turn's remaining budget (and the room left in max_len),
  eos a stop id;
* its tokens stream in (`on_tokens`) with their rollout log-probs (log_softmax of the
  raw logits, what DIS reads), sampled log-probs and the version that sampled each; a
  `step` walks the tokens that arrived since the last one through the engine's turn
  logic, and where it ends the turn (a stop string in the decoded tail, say) the request
  is cancelled: later tokens are overshoot, discarded as the engine's are;
* weights: `step(params, version, ...)` hands newer weights to the backend
  (`SharedBackend`: one backend for all of a sampler's engines, built on the first
  weights, published to when the version moves); a request the publication interrupted
  (RequestInterrupted: the vLLM backend restarts its engine) is asked again from the
  context it reached, so the tokens already streamed keep their version and the rest
  carry the new one;
* any other GenerationError (the engine died) propagates: the sampler's worker fails
  and the learner's take raises SamplerError naming it.

A step waits at most `poll_s` for tokens (the sampler checks its stop flag between
steps). Context tokens take the step's version, as in the engine. The engine's sampling
key is unused: the backend draws with its own seeds, so the backend engine promises the
order of prompts and versions, not the engine's bits.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from flax import nnx

from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.backend import (
    BackendBusy,
    GenChunk,
    GenerationBackend,
    GenerationError,
    GenHandle,
    GenRequest,
    RequestInterrupted,
)
from sao_jax.sampling.engine import Engine
from sao_jax.sampling.slots import TURN_ENDED, Drop, EngineConfig, StepOutput

BackendBuilder = Callable[[Params, int], GenerationBackend]  # (params, version) -> backend


def model_facts(mdef: ModelDef) -> dict[str, Any]:
    """What a BackendEngine checks and records of the policy `mdef` describes: its
    `vocab_size` and `routing_lk` (MoE layers, experts per token; None without MoE)."""
    cfg = nnx.merge(mdef.graphdef, mdef.abstract).cfg
    moe = len(cfg.moe_layers)
    routing_lk = (moe, cfg.num_experts_per_tok) if moe else None
    return dict(vocab_size=cfg.vocab_size, routing_lk=routing_lk)


class SharedBackend:
    """One generation backend for a sampler's engines: built by `build(params, version)`
    on the first weights it is given, published to when a newer version comes, closed
    once. Submissions and publications are serialized (a restarting engine takes none)."""

    def __init__(self, build: BackendBuilder):
        self._build = build
        self._lock = threading.Lock()
        self.backend: GenerationBackend | None = None
        self._closed = False

    def serve(self, params: Params, version: int) -> None:
        """The backend serves `version` (or newer) from now on."""
        with self._lock:
            if self._closed:
                raise GenerationError("the backend is closed")
            if self.backend is None:
                self.backend = self._build(params, version)
            elif self.backend.version is None or version > self.backend.version:
                self.backend.publish(params, version)

    def submit(self, request: GenRequest, on_tokens: Callable[[GenChunk], None]) -> GenHandle:
        with self._lock:
            if self._closed or self.backend is None:
                raise GenerationError("the backend is closed")
            return self.backend.submit(request, on_tokens)

    def stats(self) -> dict[str, float]:
        backend = self.backend
        return {} if backend is None else backend.stats()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()


class _Turn:
    """A model turn's request in flight: the tokens streamed and not yet walked."""

    def __init__(self, wake: threading.Condition):
        self._wake = wake  # the engine's: notified on every chunk and at the end
        self.handle: GenHandle | None = None
        self._chunks: list[GenChunk] = []
        self._done = False
        self.received = 0  # tokens handed to the engine so far
        self.routing: list[tuple[list[int], list]] = []  # the chunks' routing, not yet kept

    def on_tokens(self, chunk: GenChunk) -> None:  # the backend's thread
        with self._wake:
            self._chunks.append(chunk)
            self._wake.notify_all()

    def on_done(self, _future) -> None:  # the backend's thread (or the submitter's)
        with self._wake:
            self._done = True
            self._wake.notify_all()

    @property
    def ready(self) -> bool:
        """Tokens or the end to walk (read under the engine's condition)."""
        return bool(self._chunks) or self._done

    def take(self) -> tuple[list[tuple[int, float, float, int]], BaseException | None, bool]:
        """([(token, rollout_logp, sampled_logp, version)] since the last take, the
        request's error, whether it ended). A backend delivers a request's chunks before
        it resolves its future, so once it ended every chunk is here; tokens its result
        holds beyond the chunks (a failed callback) are added from the result."""
        with self._wake:
            chunks, self._chunks = self._chunks, []
            done = self._done
        self.routing += [c.routing for c in chunks if c.routing is not None]
        out = [
            (t, r, p, v)
            for c in chunks
            for t, r, p, v in zip(c.token_ids, c.rollout_logp, c.sampled_logp, c.versions)
        ]
        self.received += len(out)
        if not done:
            return out, None, False
        error = self.handle.future.exception()
        if error is None:
            res = self.handle.future.result()
            rest = range(self.received, len(res.token_ids))
            out += [
                (res.token_ids[i], res.rollout_logp[i], res.sampled_logp[i], res.versions[i])
                for i in rest
            ]
            self.received = max(self.received, len(res.token_ids))
        return out, error, True


def _keep_routing(sl, turn: _Turn) -> None:
    """The turn's routing records into the slot (Slot.record_experts); those of positions
    the slot does not hold yet stay with the turn."""
    pending = [sl.record_experts(pos, experts) for pos, experts in turn.routing]
    turn.routing = [rest for rest in pending if rest is not None]


class _NoPrograms:
    """What Engine.__init__ reads of its compiled programs (GenerateFns): this engine has
    none, its tokens come from the backend."""

    shards = 1

    def __init__(self, cfg: EngineConfig, vocab_size: int, routing_lk: tuple[int, int] | None):
        self.record_routing, self.routing_shape = routing_lk is not None, routing_lk
        self.num_slots, self.max_len = cfg.num_slots, cfg.max_len
        self.steps, self.per_token_keys = cfg.steps_per_sync, cfg.per_token_keys
        self.layout = cfg.layout
        self.model_cfg = types.SimpleNamespace(vocab_size=vocab_size)


class BackendEngine(Engine):
    """The engine's episodes with a backend's tokens; see the module docstring.

    Args:
      backend: the SharedBackend of the sampler (or of the synchronous rollouts).
      tokenizer, env_factory, cfg: as the Engine's. The KV layout is the native engine's
        and is ignored here; `cfg.record_routing` keeps the experts the backend reports
        for each position (GenChunk.routing; the vLLM backend's `record_routing`).
      vocab_size, routing_lk: the policy's (model_facts): prompt and observation ids are
        checked against the first; the second shapes the routing records.
      poll_s: the longest a step waits for tokens.
    """

    def __init__(
        self,
        backend: SharedBackend,
        tokenizer,
        env_factory: Callable[[], Env],
        cfg: EngineConfig,
        *,
        vocab_size: int,
        routing_lk: tuple[int, int] | None = None,
        poll_s: float = 0.05,
    ):
        if cfg.record_routing and routing_lk is None:
            raise ValueError("cfg.record_routing=True but the policy has no MoE layers")
        routing_lk = routing_lk if cfg.record_routing else None
        cfg = dataclasses.replace(cfg, kv_layout="dense")
        programs = _NoPrograms(cfg, vocab_size, routing_lk)
        super().__init__(programs, tokenizer, env_factory, cfg)
        self.shared = backend
        self.poll_s = poll_s
        self._wake = threading.Condition()
        self._turns: list[_Turn | None] = [None] * cfg.num_slots
        self.counters.update(resubmitted=0, busy=0)  # in stats(), beside the engine's

    # ---- requests -----------------------------------------------------------------------

    def _submit(self, s: int) -> None:
        """Asks the backend for the rest of slot s's turn (BackendBusy: next step)."""
        sl = self._slots[s]
        room = min(self.cfg.max_turn_tokens - (sl.n - sl.turn_start), self.cfg.max_len - sl.n)
        eos = getattr(self.tok, "eos_id", None)
        request = GenRequest(
            tuple(int(t) for t in sl.tokens[: sl.n]),
            max_tokens=room,
            stop_ids=frozenset() if eos is None else frozenset({eos}),
            uid=sl.prompt.uid,
        )
        turn = _Turn(self._wake)
        try:
            turn.handle = self.shared.submit(request, turn.on_tokens)
        except BackendBusy:
            self.counters["busy"] += 1
            return
        turn.handle.future.add_done_callback(turn.on_done)
        self._turns[s] = turn

    def _close_turn(self, s: int) -> None:
        """Slot s's request is no longer wanted (its turn ended here): cancelled."""
        turn, self._turns[s] = self._turns[s], None
        if turn is not None and turn.handle is not None:
            turn.handle.cancel()

    def _wait_for_tokens(self) -> None:
        """Until some slot has tokens or an ended request to walk, at most poll_s."""
        deadline = time.monotonic() + self.poll_s
        with self._wake:
            while not any(t is not None and t.ready for t in self._turns):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.wait(left)

    def _walk(self, s: int) -> tuple[Any, int]:
        """Slot s through the tokens that arrived; returns (TURN_ENDED, a finished
        trajectory, or None while the turn goes on; tokens kept). The engine's
        `_advance`, for streamed tokens."""
        sl, turn = self._slots[s], self._turns[s]
        records, error, ended = turn.take()
        _keep_routing(sl, turn)
        kept = 0
        for token, rollout_logp, sampled_logp, version in records:
            sl.append_action(int(token), sampled_logp, rollout_logp, int(version))
            sl.written = sl.n
            if turn.routing:  # positions of tokens appended just now
                _keep_routing(sl, turn)
            kept += 1
            if self._turn_ended(sl, int(token)):
                self._close_turn(s)
                return TURN_ENDED, kept
            if sl.n >= self.cfg.max_len:
                self._close_turn(s)
                return sl.finish(terminated=False, outcome=0.0, truncation="max_len"), kept
        if not ended:
            return None, kept
        self._turns[s] = None
        if isinstance(error, RequestInterrupted):  # new weights: asked again next step
            self.counters["resubmitted"] += 1
            return None, kept
        if error is not None:
            raise GenerationError(f"the generation backend failed: {error}") from error
        # the backend ended the request before the engine's turn logic did (its own
        # length limit): the cache is full, as far as this episode is concerned
        return sl.finish(terminated=False, outcome=0.0, truncation="max_len"), kept

    # ---- public -------------------------------------------------------------------------

    def step(
        self, params: Params, version: int, next_prompt: Callable[[], Prompt | None]
    ) -> StepOutput:
        """One round: newer weights to the backend, free slots filled, a request for
        every decoding slot without one, then the tokens that arrived (waiting up to
        poll_s for some) walked through the turn logic; env calls as in Engine.step."""
        finished: list = []
        dropped: list[Drop] = []
        self.shared.serve(params, version)
        if self._parked:
            self._split(
                self._collect_env_steps(version, block=False, every=False), finished, dropped
            )
        self._fill(next_prompt, version, dropped)
        for s, sl in enumerate(self._slots):
            if sl is not None and self._turns[s] is None:
                self._submit(s)
        if all(sl is None for sl in self._slots):
            if self._parked:
                done = self._collect_env_steps(version, block=True, every=False)
                self._split(done, finished, dropped)
            return StepOutput(finished, dropped, self.active, 0)
        self._wait_for_tokens()
        running = [
            s for s, sl in enumerate(self._slots) if sl is not None and self._turns[s] is not None
        ]
        generated = self._advance_slots(
            running, self._walk, version, finished, dropped, on_drop=self._close_turn
        )
        return StepOutput(finished, dropped, self.active, generated)
