"""The native engine as a generation backend (sao_jax/sampling/backend.py).

`NativeBackend` drives the continuous-batching engine (sao_jax/sampling/engine.py) from
one background thread: requests of any number of callers wait in a bounded queue, fill
the engine's free slots as they open, and decode together, each at its own position.
The engine is used unchanged, through a subclass that replaces its environment hooks:

* a slot starts from the request's token ids (no env.reset, no tokenization, no bos);
* its turn ends at one of the request's stop ids or eos, a stop string in the decoded
  completion, or `max_tokens` (the engine's own `max_turn_tokens` is the cache length);
* the turn's "environment" ends the episode at once (`_OneTurn`), so the slot's
  trajectory is the prompt plus the sampled tokens, with both log-probs and versions;
* a cancelled request's slot is emptied between scheduling rounds (its pages return);
* new prompts are prefilled over their own slots only (`Engine.row_prefill`): requests
  admitted while others decode cost their rows, not all S.

Admission (`_admit_due`): the prompts taken into slots at one engine step are prefilled
together, so a burst of requests (many harness sessions calling at once) should be taken
whole. While no slot decodes, waiting requests are admitted once no new one has arrived
for `admit_gap_s` (the burst is over: a lone request waits that long and no more), once
the oldest has waited `admit_wait_s` (a stream with no pause still starts), or once they
fill the free slots (nothing more would fit). While slots decode, every request that
waits at a step's start is admitted at once: the step in progress was its window, and
holding it for the next would cost a whole step of latency to save one prefill call.

Streaming: after every engine step the thread reports each request's new tokens
(`on_tokens`). Weights: `publish` goes through a ParamsStore; every step reads the latest
pair, so requests in flight continue on new weights and each token carries the version
that sampled it. Sampling: a request's own temperature / top_p apply to its slot
(per-slot values in the decode call, sao_jax/sampling/generate.py `sample_tokens`);
without them the engine's `EngineConfig` values apply. `GenResult.sampling` says what
was used.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.envs.base import Prompt, StepResult
from sao_jax.sampling.backend import (
    BackendBusy,
    GenChunk,
    GenerationError,
    GenHandle,
    GenRequest,
    GenResult,
)
from sao_jax.sampling.engine import Engine, EngineConfig, generate_fns
from sao_jax.sampling.generate import GenerateFns
from sao_jax.sampling.params_store import ParamsStore
from sao_jax.sampling.slots import DropError, Slot

TOP_K_MAX = 20  # top log-probs a pass reports (OpenAI's limit)
ADMIT_GAP_S = 0.02  # the old fixed window: a lone request waits no longer than before
ADMIT_WAIT_S = (
    0.2  # a burst with no 20 ms pause (32 calls reach it over ~30-40 ms here) still starts
)


COUNTERS = ("submitted", "admissions", "finished", "dropped", "cancelled", "busy",
            "callback_errors")  # fmt: skip


def check_admission(admit_gap_s: float, admit_wait_s: float) -> None:
    """ValueError naming the field unless 0 <= admit_gap_s <= admit_wait_s."""
    if not admit_gap_s >= 0:
        raise ValueError(f"admit_gap_s: must be >= 0, got {admit_gap_s}")
    if not admit_wait_s >= admit_gap_s:
        raise ValueError(
            f"admit_wait_s: must be >= admit_gap_s ({admit_gap_s}), got {admit_wait_s}"
        )


def _top_logprobs(mdef, params, tokens_1t):
    """[T, TOP_K_MAX] values and ids of log_softmax(logits) at every position."""
    t = tokens_1t.shape[1]
    positions_1t = jnp.arange(t, dtype=jnp.int32)[None]
    logits_tv = mdef.bind(params)(tokens_1t, positions_1t, jnp.ones_like(tokens_1t)).out[0]
    return jax.lax.top_k(jax.nn.log_softmax(logits_tv.astype(jnp.float32), axis=-1), TOP_K_MAX)


class _OneTurn:
    """The environment of a request: its only turn ends the episode."""

    max_turns = 1

    def reset(self, prompt):  # never called: _RequestEngine._start takes the ids
        return ""

    def step(self, action_text):
        return StepResult("", 0.0, True, {})


class _RowSampling:
    """Per-slot sampling values, in SamplingParams' place (`arrays()` of [S] each)."""

    def __init__(self, temperature, top_k, top_p):
        self.values = (temperature, top_k, top_p)

    def arrays(self):
        t, k, p = self.values
        return (jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32))


class _RequestEngine(Engine):
    """The engine with request-driven slot starts and turn ends (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_calls = 0
        self.active_sum = 0  # slots decoding, summed over decode calls
        self.active_max = 0

    def _start(self, s: int, prompt: Prompt, version: int) -> Slot:
        req: GenRequest = prompt.meta["request"]
        if len(req.prompt_ids) >= self.cfg.max_len:
            err = ValueError(f"{len(req.prompt_ids)} prompt tokens; max_len={self.cfg.max_len}")
            raise DropError("prompt_too_long", err)
        vocab = self.fns.model_cfg.vocab_size
        if any(not 0 <= i < vocab for i in req.prompt_ids):
            raise DropError("tokenizer_error", ValueError(f"a prompt id is outside [0, {vocab})"))
        slot = Slot(prompt, self.cfg.max_len, self._routing, serial=self._serial - 1)
        slot.append_context(list(req.prompt_ids), version)
        return slot

    def _turn_ended(self, sl: Slot, token: int) -> bool:
        req: GenRequest = sl.prompt.meta["request"]
        if token in req.stop_ids or token == getattr(self.tok, "eos_id", None):
            return True
        if sl.n - sl.turn_start >= req.max_tokens:
            return True
        if req.stop_strings:
            tail = self._decode_text(sl.tokens[sl.turn_start : sl.n])
            return any(st in tail for st in req.stop_strings)
        return False

    def _decode(self, params):
        rows = [self._running(s) for s in range(self.cfg.num_slots)]
        running = sum(sl is not None for sl in rows)
        self.decode_calls += 1
        self.active_sum += running
        self.active_max = max(self.active_max, running)
        self._sampling = self._row_sampling(rows)
        return super()._decode(params)

    def _row_sampling(self, rows):
        """The engine's law when every request uses it (one compiled program), else
        per-slot [S] values (generate.sample_tokens; one more program per read span)."""
        default = self.cfg.sampling
        t = [default.temperature] * len(rows)
        p = [default.top_p] * len(rows)
        for s, sl in enumerate(rows):
            if sl is not None:
                req: GenRequest = sl.prompt.meta["request"]
                t[s] = default.temperature if req.temperature is None else req.temperature
                p[s] = default.top_p if req.top_p is None else req.top_p
        if all(x == default.temperature for x in t) and all(x == default.top_p for x in p):
            return default
        return _RowSampling(t, [default.top_k] * len(rows), p)

    def slots_of(self) -> dict[str, Slot]:
        """uid -> the slot record of every request holding a slot."""
        held = [sl for sl in self._slots if sl is not None]
        held += [sl for sl, _ in self._parked.values()]
        return {sl.prompt.uid: sl for sl in held}

    def evict(self, uid: str) -> Slot | None:
        """Empties the slot of request `uid` (between steps); returns its record."""
        for s, sl in enumerate(self._slots):
            if sl is not None and sl.prompt.uid == uid:
                self._slots[s] = None
                break
        else:
            for s, (sl, _) in list(self._parked.items()):
                if sl.prompt.uid == uid:
                    del self._parked[s]
                    break
            else:
                return None
        if self.pool is not None:
            self.pool.release(s)
        return sl


class _Live:
    """A request's bookkeeping on the backend thread."""

    def __init__(self, handle: GenHandle, on_tokens, since: float):
        self.handle = handle
        self.on_tokens = on_tokens
        self.reported = 0  # sampled tokens already reported
        self.since = since  # when it was submitted (the backend's clock)


def _records(sl_tokens, rollout, sampled, versions, lo: int, hi: int) -> GenChunk:
    return GenChunk(
        [int(t) for t in sl_tokens[lo:hi]],
        [float(x) for x in rollout[lo:hi]],
        [float(x) for x in sampled[lo:hi]],
        [int(v) for v in versions[lo:hi]],
    )


class NativeBackend:
    """The native engine behind the GenerationBackend interface; see the module docstring.

    Args:
      mdef: the policy model def; params: its initial weights (version `version`).
      tokenizer: the engine's tokenizer (eos ends every request; stop strings decode).
      cfg: the engine's settings (slots, max_len, sampling); max_turn_tokens is ignored.
      max_pending: requests waiting for a slot beyond which `submit` raises BackendBusy.
      admit_gap_s: while no slot decodes, waiting requests are admitted once no new one
        arrived for this long (module docstring, Admission); 0 = at once.
      admit_wait_s: ... or once the oldest has waited this long (a burst with no pause
        of `admit_gap_s` still starts); must be >= admit_gap_s.
      clock: the admission window's clock (tests pass a fake one).
      row_prefill: new prompts are prefilled over their own slots (Engine.row_prefill);
        False: every prefill is an [S, C] call over all slots (for comparison).
    """

    def __init__(
        self,
        mdef,
        params,
        tokenizer,
        cfg: EngineConfig,
        *,
        version: int = 0,
        seed: int = 0,
        max_pending: int = 256,
        admit_gap_s: float = ADMIT_GAP_S,
        admit_wait_s: float = ADMIT_WAIT_S,
        row_prefill: bool = True,
        sharder=None,
        clock: Callable[[], float] = time.monotonic,
        fns: GenerateFns | None = None,
    ):
        check_admission(admit_gap_s, admit_wait_s)
        cfg = dataclasses.replace(cfg, max_turn_tokens=cfg.max_len)
        self.cfg = cfg
        self.max_len = cfg.max_len
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.max_pending = max_pending
        self.admit_gap_s, self.admit_wait_s = admit_gap_s, admit_wait_s
        self._clock = clock
        self._last_arrival = 0.0  # when the newest waiting request was submitted
        self._admitting = False  # this engine step takes waiting requests into free slots
        self._admitted_now = 0  # requests this engine step took
        self._engine = _RequestEngine(
            fns or generate_fns(mdef, cfg, sharder), tokenizer, _OneTurn, cfg, seed=seed
        )
        self._engine.row_prefill = row_prefill
        self._store = ParamsStore()
        self._store.publish(params, version, copy=False)
        self._cond = threading.Condition()
        self._pending: collections.deque[_Live] = collections.deque()
        self._cancels: list[GenHandle] = []
        self._live: dict[str, _Live] = {}
        self._uids = itertools.count()
        self._closed = False
        self._error: BaseException | None = None
        # every counter reported from the start (stats() of a fresh backend has them at 0)
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self._top = jax.jit(functools.partial(_top_logprobs, mdef))
        self._thread = threading.Thread(target=self._run, name="sao-native-backend", daemon=True)
        self._thread.start()

    # ---- the interface -------------------------------------------------------------------

    def submit(
        self, request: GenRequest, on_tokens: Callable[[GenChunk], None] | None = None
    ) -> GenHandle:
        if len(request.prompt_ids) >= self.max_len:
            raise GenerationError(
                f"{len(request.prompt_ids)} prompt tokens leave no room in max_len={self.max_len}"
            )
        handle = GenHandle(request, self._request_cancel)
        with self._cond:
            if self._closed:
                raise GenerationError("the backend is closed")
            if self._error is not None:
                raise GenerationError(f"the backend failed: {self._error!r}")
            if len(self._pending) >= self.max_pending:
                self.counters["busy"] += 1
                raise BackendBusy(f"{len(self._pending)} requests already wait for a slot")
            handle.uid = f"r{next(self._uids)}"
            live = _Live(handle, on_tokens, self._clock())
            self._last_arrival = live.since
            self._pending.append(live)
            self.counters["submitted"] += 1
            self._cond.notify_all()
        return handle

    def _request_cancel(self, handle: GenHandle) -> None:
        with self._cond:
            self._cancels.append(handle)
            self._cond.notify_all()

    def publish(self, params: Any, version: int) -> None:
        self._store.publish(params, version)

    @property
    def version(self) -> int | None:
        return self._store.version

    @property
    def sampling(self) -> dict[str, Any]:
        """The backend's own law (a request without values samples with it)."""
        return dict(temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k)

    def sampling_of(self, request: GenRequest) -> dict[str, Any]:
        """The law `request` is sampled with."""
        return request.law(self.sampling)

    @property
    def vocab_size(self) -> int:
        return self._engine.fns.model_cfg.vocab_size

    def top_logprobs(self, token_ids, start: int, k: int) -> list[list[tuple[int, float]]]:
        """For each token at positions [start, len): the k most likely (id, log-prob) of
        log_softmax(logits[t - 1]) under the current weights, by a teacher-forced pass
        (one compiled program per power-of-two length)."""
        if not 0 < k <= TOP_K_MAX:
            raise ValueError(f"k: must be in [1, {TOP_K_MAX}], got {k}")
        _, params = self._store.latest()
        t = len(token_ids)
        width = min(1 << max(t - 1, 1).bit_length(), self.max_len)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :t] = token_ids
        vals, ids = jax.device_get(self._top(params, tokens))
        return [
            [(int(ids[i - 1, j]), float(vals[i - 1, j])) for j in range(k)] for i in range(start, t)
        ]

    def fatal_error(self) -> str | None:
        """None: the engine runs in this process (its failures reach each request)."""
        return None

    def stats(self) -> dict[str, float]:
        eng = self._engine
        calls = max(eng.decode_calls, 1)
        with self._cond:
            waiting = len(self._pending)
        return dict(
            self.counters,
            num_slots=self.cfg.num_slots,
            waiting=waiting,
            active_slots=eng.active,
            decode_calls=eng.decode_calls,
            prefill_calls=eng.calls["prefill"],
            max_active_slots=eng.active_max,
            mean_active_slots=eng.active_sum / calls,
            **eng.stats(),
        )

    def close(self) -> None:
        """Stops the thread; requests still waiting or running fail with GenerationError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._store.close()

    # ---- the backend thread --------------------------------------------------------------

    def _admit_due(self) -> float:
        """Seconds until the waiting requests should take slots (<= 0: now); the rule is
        the module docstring's (Admission). Called under the lock."""
        if not self._pending:
            return float("inf")
        if self._engine.active or len(self._pending) >= self.cfg.num_slots:
            return 0.0
        now = self._clock()
        quiet = self._last_arrival + self.admit_gap_s - now
        return min(quiet, self._pending[0].since + self.admit_wait_s - now)

    def _next_prompt(self) -> Prompt | None:
        with self._cond:
            if not self._admitting:
                return None
            while self._pending:
                live = self._pending.popleft()
                if live.handle.cancelled:
                    self._finish_cancelled(live, None)
                    continue
                self._live[live.handle.uid] = live
                self._admitted_now += 1
                return Prompt(live.handle.uid, "", None, {"request": live.handle.request})
        return None

    def _run(self) -> None:
        eng = self._engine
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._cancels or eng.active):
                        due = self._admit_due()
                        if due <= 0:
                            break
                        self._cond.wait(None if due == float("inf") else due)
                    if self._closed:
                        break
                    cancels, self._cancels = self._cancels, []
                    self._admitting = self._admit_due() <= 0
                for handle in cancels:
                    self._cancel_now(handle)
                if not (eng.active or self._admitting):
                    continue
                version, params = self._store.latest()
                self._admitted_now = 0
                out = eng.step(params, version, self._next_prompt)
                if self._admitted_now:  # one admission: its prompts prefilled together
                    self.counters["admissions"] += 1
                self._report_progress()
                for traj in out.finished:
                    self._finish(traj)
                for drop in out.dropped:
                    live = self._live.pop(drop.prompt_uid, None)
                    if live is not None:
                        self.counters["dropped"] += 1
                        live.handle.future.set_exception(
                            GenerationError(f"request dropped: {drop.reason}: {drop.error}")
                        )
        except BaseException as e:  # a model / jit failure: every caller hears of it
            with self._cond:
                self._error = e
            self._fail_all(GenerationError(f"the backend failed: {e!r}"))
            raise
        self._fail_all(GenerationError("the backend closed"))

    def _fail_all(self, error: GenerationError) -> None:
        with self._cond:
            lives = list(self._live.values()) + list(self._pending)
            self._live.clear()
            self._pending.clear()
        for live in lives:
            if not live.handle.future.done():
                live.handle.future.set_exception(error)

    def _report_progress(self) -> None:
        for uid, sl in self._engine.slots_of().items():
            live = self._live.get(uid)
            if live is None:
                continue
            start = len(live.handle.request.prompt_ids)
            self._report(live, sl.tokens, sl.rollout_logp, sl.sampled_logp, sl.versions,
                         start, sl.n)  # fmt: skip

    def _report(self, live: _Live, tokens, rollout, sampled, versions, start: int, n: int):
        lo = start + live.reported
        if n > lo and live.on_tokens is not None:
            try:
                live.on_tokens(_records(tokens, rollout, sampled, versions, lo, n))
            except Exception:  # a caller's callback never stops the engine
                self.counters["callback_errors"] += 1
        live.reported = max(live.reported, n - start)

    def _finish(self, traj) -> None:
        live = self._live.pop(traj.prompt_uid)
        start = len(live.handle.request.prompt_ids)
        n = len(traj.tokens)
        self._report(live, traj.tokens, traj.rollout_logp, traj.sampled_logp, traj.versions,
                     start, n)  # fmt: skip
        chunk = _records(traj.tokens, traj.rollout_logp, traj.sampled_logp, traj.versions,
                         start, n)  # fmt: skip
        req = live.handle.request
        last = chunk.token_ids[-1] if chunk.token_ids else None
        stopped = last is not None and (last in req.stop_ids or last == self.eos_id)
        if not stopped and req.stop_strings and len(chunk.token_ids) < req.max_tokens:
            stopped = True  # ended by a stop string (not by the cache: see below)
        if traj.info.get("truncation") == "max_len":
            stopped = False
        self.counters["finished"] += 1
        live.handle.future.set_result(
            GenResult(
                chunk.token_ids,
                chunk.rollout_logp,
                chunk.sampled_logp,
                chunk.versions,
                "stop" if stopped else "length",
                self.sampling_of(req),
            )
        )

    def _cancel_now(self, handle: GenHandle) -> None:
        """Cancels on the backend thread: out of the queue, or out of its slot."""
        with self._cond:
            live = self._live.pop(handle.uid, None)
        if live is None:  # still queued: `_next_prompt` resolves it when it comes up
            return
        sl = self._engine.evict(handle.uid)
        self._finish_cancelled(live, sl)

    def _finish_cancelled(self, live: _Live, sl: Slot | None) -> None:
        start = len(live.handle.request.prompt_ids)
        if sl is None:
            chunk = GenChunk([], [], [], [])
        else:
            chunk = _records(sl.tokens, sl.rollout_logp, sl.sampled_logp, sl.versions,
                             start, sl.n)  # fmt: skip
        self.counters["cancelled"] += 1
        if not live.handle.future.done():
            live.handle.future.set_result(
                GenResult(
                    chunk.token_ids,
                    chunk.rollout_logp,
                    chunk.sampled_logp,
                    chunk.versions,
                    "cancelled",
                    self.sampling_of(live.handle.request),
                )
            )
