"""The slot scheduler: continuous batching of single rollouts with their environments.

An `Engine` owns S slots (one compiled decode program for all of them), one environment
instance per slot, and the host record of every slot's trajectory. One `step`:

1. fills every free slot with the next prompt (env.reset -> encode);
2. prefills every slot's pending tokens (prompt, or last action token + observation) in
   bucketed [S, C] chunks; rows with nothing to write are inert (with `row_prefill`, a
   chunk is written over its writing rows only, [R, C] in power-of-two groups);
3. runs one decode call (`steps_per_sync` tokens per slot) and walks the sampled tokens
   on the host: a model turn ends at EOS, at an env stop string (found in the decoded
   tail of the turn), or at the per-turn token budget; the environment answers, and its
   observation becomes that slot's pending prefill. Tokens sampled after a turn ended
   (overshoot) are discarded; their cache entries are overwritten before use.
4. returns the trajectories that finished (env done, max_turns, or cache full); their
   slots take new prompts at the next step, whatever the other slots are doing.

Invariant between steps: an active slot has `n` tokens of which `written = n - 1` are in
the cache; its last token is fed by the next decode call. So sampling happens at one
place only, and a prompt or observation needs no logits from the prefill.

Failures never kill the engine: an exception (or timeout) in env.reset/step, a tokenizer
error, an empty or too long prompt drops that trajectory and reports a `Drop` with its
reason. Model/jit errors propagate.

Env calls run in a bounded pool of daemon threads (env_calls.py), concurrently across
slots; `step` applies their results in slot order after waiting for all (deterministic),
or, with `overlap_env` (the async sampler), parks a slot whose call still runs out of the
decode batch while the others decode. Waits honour SIGTERM (env_calls.EnvCalls.check).
The host records (settings, slots, drops) live in slots.py.

With a paged KV pool (`kv_layout='paged'`, page_pool.py) each step first gives every
active slot, oldest first, the pages its calls touch; a slot short of pages sits the step
out, and when a shard's slots are all stuck its youngest give their pages back
(`_admit`): admission control, counted in `stats()`. Pages return when a trajectory
ends. The programs run on the engine's sharder (generate.py: slots over the data axes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np

from sao_jax.envs.base import Env, Prompt
from sao_jax.parallel.partition import Params
from sao_jax.sampling.env_calls import EnvCall, EnvCalls, EnvTimeoutError
from sao_jax.sampling.generate import (
    GenerateFns,
    bucket_length,
    choose_spans,
    inert_rows,
)
from sao_jax.sampling.page_pool import PagePool
from sao_jax.sampling.slots import (  # noqa: F401  (EngineConfig, Drop: the engine's API)
    DROP_REASONS,
    TURN_ENDED,
    Drop,
    DropError,
    EngineConfig,
    Slot,
    StepOutput,
    after_turn,
    checked_step,
)
from sao_jax.sampling.trajectory import Trajectory


def generate_fns(mdef, cfg: EngineConfig, sharder=None) -> GenerateFns:
    """The compiled programs of an engine with settings `cfg` (one GenerateFns serves every
    engine of these settings: the sampler's workers share it), on `sharder`'s mesh
    (default: the model def's)."""
    return GenerateFns(
        mdef,
        num_slots=cfg.num_slots,
        max_len=cfg.max_len,
        steps=cfg.steps_per_sync,
        record_routing=cfg.record_routing,
        sharder=sharder,
        layout=cfg.layout,
        per_token_keys=cfg.per_token_keys,
    )


def row_groups(rows: list[int]) -> list[list[int]]:
    """`rows` cut into runs of power-of-two sizes, largest first (the binary digits of
    len(rows)): R rows cost R rows of prefill in at most log2(S) + 1 calls, and at most
    that many compiled row counts exist per chunk width and span."""
    out, i, size = [], 0, 1 << max(len(rows).bit_length() - 1, 0)
    while i < len(rows):
        if len(rows) - i >= size:
            out.append(rows[i : i + size])
            i += size
        size //= 2
    return out


class Engine:
    """Continuous-batching rollouts over S slots; see the module docstring."""

    def __init__(
        self,
        fns: GenerateFns,
        tokenizer,
        env_factory: Callable[[], Env],
        cfg: EngineConfig,
        *,
        seed: int | jax.Array = 0,
    ):
        built = (fns.num_slots, fns.max_len, fns.steps, fns.per_token_keys)
        wanted = (cfg.num_slots, cfg.max_len, cfg.steps_per_sync, cfg.per_token_keys)
        if built != wanted:
            raise ValueError(
                f"fns: built for (num_slots, max_len, steps, per_token_keys)={built} but cfg "
                f"has {wanted}"
            )
        layout = cfg.layout
        if (fns.layout.kind, fns.layout.page_size) != (layout.kind, layout.page_size) or (
            fns.layout.pool_pages(cfg.num_slots, cfg.max_len)
            != layout.pool_pages(cfg.num_slots, cfg.max_len)
        ):
            raise ValueError(f"fns: built for KV layout {fns.layout} but cfg has {layout}")
        if cfg.record_routing and not fns.record_routing:
            raise ValueError("cfg.record_routing=True but fns were built without routing")
        vocab = fns.model_cfg.vocab_size
        if tokenizer.vocab_size > vocab:
            raise ValueError(
                f"tokenizer: vocab_size {tokenizer.vocab_size} > model vocab_size {vocab}"
            )
        self.fns, self.tok, self.cfg = fns, tokenizer, cfg
        self._env_factory = env_factory
        self._envs: list[Env] = [env_factory() for _ in range(cfg.num_slots)]
        self._stops = tuple(getattr(self._envs[0], "stop_strings", ()))
        self._stop_window = 4 * max((len(st) for st in self._stops), default=0) + 8
        self._slots: list[Slot | None] = [None] * cfg.num_slots
        self._parked: dict[int, tuple[Slot, EnvCall]] = {}  # slots waiting for env.step
        self.env_calls = EnvCalls(cfg.env_workers, cfg.env_timeout_s)
        self.overlap_env = False  # True: decode other slots while env calls run
        # True: a chunk that some slots do not write is prefilled over the writing slots
        # only (GenerateFns.prefill_rows), so admitting a few prompts while the others
        # decode costs their rows, not S (the gateway's NativeBackend); False: every
        # chunk is one [S, C] call, as the in-process sampler computes it.
        self.row_prefill = False
        self._routing = fns.routing_shape if cfg.record_routing else None
        self._key = jax.random.key(seed) if isinstance(seed, int) else seed
        self._cache = None
        self._sampling = cfg.sampling
        self.calls = dict(decode=0, prefill=0)
        self._serial = 0  # prompts taken so far (a slot's age and, per-token keys, its RNG)
        self.pool = (
            PagePool(cfg.num_slots, cfg.max_len, fns.layout, fns.shards)
            if fns.layout.paged
            else None
        )
        self._paused: set[int] = set()  # slots waiting for pages in this step
        self._table = None  # the block table on the devices, as of `_table_changes`
        self._table_changes = -1
        self.counters = dict(admission_waits=0, preemptions=0)

    @classmethod
    def create(
        cls, mdef, tokenizer, env_factory, cfg: EngineConfig, *, seed: int = 0, sharder=None
    ) -> Engine:
        """An engine with its own compiled programs (samplers share one GenerateFns)."""
        return cls(generate_fns(mdef, cfg, sharder), tokenizer, env_factory, cfg, seed=seed)

    def stats(self) -> dict[str, int]:
        """Admission control's counters: `admission_waits` (slot-steps a slot sat out for
        want of pages), `preemptions` (slots whose pages were taken back so an older slot
        could go on; they recompute their cache later), and the pool's pages in use now
        and at most (0 for a dense cache)."""
        pool = self.pool
        return dict(
            self.counters,
            pages_in_use=pool.in_use if pool else 0,
            pages_peak=pool.peak if pool else 0,
        )

    @property
    def active(self) -> int:
        """Slots holding a trajectory: decoding, or parked while their env call runs."""
        return sum(s is not None for s in self._slots) + len(self._parked)

    # ---- host helpers -------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        try:
            ids = [int(i) for i in self.tok.encode(text)]
        except Exception as e:
            raise DropError("tokenizer_error", e) from e
        bad = [i for i in ids if not 0 <= i < self.fns.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"tokenizer.encode returned id {bad[0]} outside the model vocab")
        return ids

    def _decode_text(self, ids) -> str:
        try:
            return self.tok.decode([int(i) for i in ids])
        except Exception as e:
            raise DropError("tokenizer_error", e) from e

    def _env_call(self, s: int, fn_name: str, arg):
        """env.<fn_name>(arg) of slot s through the pool, waited for."""
        call = self.env_calls.submit(getattr(self._envs[s], fn_name), arg)
        self.env_calls.wait([call])
        return self._env_result(s, call)

    def _env_result(self, s: int, call: EnvCall):
        """What a finished call returned; a timed-out or failed one is a drop."""
        if isinstance(call.error, EnvTimeoutError):
            self._envs[s] = self._env_factory()  # the old one may still be busy
            raise DropError("env_timeout", call.error) from call.error
        if isinstance(call.error, Exception):
            raise DropError("env_error", call.error) from call.error
        if call.error is not None:  # KeyboardInterrupt, SystemExit in the env thread
            raise call.error
        return call.result

    def _start(self, s: int, prompt: Prompt, version: int) -> Slot:
        text = self._env_call(s, "reset", prompt)
        if not isinstance(text, str):
            raise DropError("env_error", TypeError(f"env.reset returned {type(text)}"))
        ids = self._encode(text)
        bos = getattr(self.tok, "bos_id", None)
        if self.cfg.add_bos and bos is not None:
            ids = [bos, *ids]
        if not ids:
            raise DropError("empty_prompt", None)
        if len(ids) >= self.cfg.max_len:
            err = ValueError(
                f"prompt {prompt.uid!r} has {len(ids)} tokens; max_len={self.cfg.max_len} "
                "leaves no room to generate"
            )
            raise DropError("prompt_too_long", err)
        slot = Slot(prompt, self.cfg.max_len, self._routing, serial=self._serial - 1)
        slot.append_context(ids, version)
        return slot

    def _fill(self, next_prompt: Callable[[], Prompt | None], version: int, dropped: list):
        """Fills the free slots; returns early once num_slots prompts were dropped in this
        call, so that a prompt stream the engine drops entirely (every prompt longer than
        max_len) still returns from `step` and reports its drops."""
        budget = len(dropped) + self.cfg.num_slots
        for s in range(self.cfg.num_slots):
            while self._slots[s] is None and s not in self._parked:
                if len(dropped) >= budget:
                    return
                prompt = next_prompt()
                if prompt is None:
                    return
                self._serial += 1
                try:
                    self._slots[s] = self._start(s, prompt, version)
                except DropError as d:
                    dropped.append(Drop(d.reason, prompt.uid, d.error))

    # ---- admission control (paged pool) -------------------------------------------------

    def _admit(self) -> None:
        """Gives every active slot, oldest first, the pages its next prefill and decode
        touch (positions [0, n - 1 + steps_per_sync)); a slot whose shard is short of pages
        sits this step out (`_paused`, counted in `admission_waits`), holding what it has.
        When no slot of a shard can go on, the youngest slots of that shard give their
        pages back (`preemptions`) until its oldest waiting slot fits: it always does,
        since a shard holds one full-length slot (KVLayout.check), so the oldest slot
        always progresses and nothing waits forever. A preempted slot recomputes its
        cache (a prefill of its tokens) once it gets pages again; nothing is dropped."""
        self._paused = set()
        pool = self.pool
        if pool is None:
            return
        holders = {s: sl for s, sl in enumerate(self._slots) if sl is not None}
        holders.update((s, sl) for s, (sl, _) in self._parked.items())
        order = sorted((s for s, sl in enumerate(self._slots) if sl is not None),
                       key=lambda s: holders[s].serial)  # fmt: skip
        waiting = [s for s in order if not pool.ensure(s, self._tokens_needed(s))]
        running = {pool.shard_of(s) for s in order if s not in waiting}
        for shard in sorted({pool.shard_of(s) for s in waiting} - running):
            first = next(s for s in waiting if pool.shard_of(s) == shard)
            victims = sorted(
                (v for v in holders if v != first and pool.shard_of(v) == shard and pool.held(v)),
                key=lambda v: -holders[v].serial,
            )
            while not pool.ensure(first, self._tokens_needed(first)):
                v = victims.pop(0)
                pool.release(v)
                holders[v].written = 0  # its cache is gone: prefilled again when it resumes
                self.counters["preemptions"] += 1
            waiting.remove(first)
        self._paused = set(waiting)
        self.counters["admission_waits"] += len(waiting)

    def _tokens_needed(self, s: int) -> int:
        """Positions slot s's next prefill and decode call write or attend."""
        return min(self._slots[s].n - 1 + self.cfg.steps_per_sync, self.cfg.max_len)

    def _block_table(self):
        """The pool's block table on the devices (re-sent only when it changed)."""
        if self.pool is None:
            return None
        if self._table_changes != self.pool.changes:
            self._table = self.fns.block_table(self.pool.table)
            self._table_changes = self.pool.changes
        return self._table

    def _running(self, s: int) -> Slot | None:
        """Slot s's record if it takes part in this step's device calls."""
        return None if s in self._paused else self._slots[s]

    # ---- device calls -------------------------------------------------------------------

    def _prefill_pending(self, params) -> None:
        """Writes tokens[written : n - 1] of every active slot, chunk by chunk: one [S, C]
        call per chunk, or with `row_prefill`, while some rows have nothing to write,
        calls over the writing rows only (`row_groups`)."""
        S = self.cfg.num_slots
        while True:
            slots = [self._running(s) for s in range(S)]
            pending = [0 if sl is None else sl.n - 1 - sl.written for sl in slots]  # per slot
            most = max(pending)
            if most <= 0:
                return
            width = bucket_length(most, self.cfg.buckets)
            counts = [min(p, width) for p in pending]
            writing = [s for s in range(S) if counts[s] > 0]
            if self.row_prefill and len(writing) < S and self.fns.shards == 1:
                for rows in row_groups(writing):
                    self._prefill_chunk(params, slots, counts, width, rows)
            else:
                self._prefill_chunk(params, slots, counts, width, None)

    def _prefill_chunk(self, params, slots, counts, width: int, rows) -> None:
        """Writes counts[s] tokens of each slot s of `rows` (None: one call over all S,
        rows with nothing to write inert) in one prefill call of width `width`."""
        L = self.cfg.max_len
        order = range(self.cfg.num_slots) if rows is None else rows  # row i is slot order[i]
        tokens_rc, positions_rc = inert_rows(len(order), width, L)
        need_r = np.zeros(len(order), np.int64)  # cache slots each writing row reads
        for i, s in enumerate(order):
            c = counts[s]
            if c > 0:
                sl = slots[s]
                tokens_rc[i, :c] = sl.tokens[sl.written : sl.written + c]
                positions_rc[i, :c] = np.arange(sl.written, sl.written + c)
                need_r[i] = sl.written + c
        spans = choose_spans(need_r, self.cfg.spans)  # inert rows' outputs are unused
        table = self._block_table()
        if rows is None:
            self._cache, experts = self.fns.prefill(
                params, self._cache, tokens_rc, positions_rc, spans, block_table=table
            )
        else:
            self._cache, experts = self.fns.prefill_rows(
                params, self._cache, np.asarray(rows), tokens_rc, positions_rc, spans,
                block_table=table,
            )  # fmt: skip
        self.calls["prefill"] += 1
        experts = None if (experts is None or self._routing is None) else np.asarray(experts)
        for i, s in enumerate(order):
            c = counts[s]
            if c > 0:
                sl = slots[s]
                if experts is not None:  # a recompute keeps the routing recorded first
                    part = sl.experts[sl.written : sl.written + c]
                    new = part[:, 0, 0] < 0
                    part[new] = experts[i, :c][new]
                sl.written += c

    def _decode(self, params):
        S, L = self.cfg.num_slots, self.cfg.max_len
        tokens_s = np.zeros(S, np.int32)
        positions_s = np.full(S, L, np.int32)
        need_s = np.zeros(S, np.int64)  # free slots' samples are unused
        serial_s = np.zeros(S, np.int32)
        for s in range(S):
            sl = self._running(s)
            if sl is not None:
                tokens_s[s], positions_s[s] = sl.tokens[sl.n - 1], sl.n - 1
                need_s[s] = min(sl.n - 1 + self.cfg.steps_per_sync, L)
                serial_s[s] = sl.serial
        spans = choose_spans(need_s, self.cfg.spans, self.cfg.lane_slots)
        if self.cfg.per_token_keys:
            step_key = self._key  # folded with (serial, position) inside
        else:
            self._key, step_key = jax.random.split(self._key)
        self._cache, out = self.fns.decode(
            params,
            self._cache,
            tokens_s,
            positions_s,
            step_key,
            self._sampling,
            spans,
            block_table=self._block_table(),
            serial_s=serial_s,
        )
        self.calls["decode"] += 1
        return jax.tree.map(np.asarray, out)

    # ---- turn logic ---------------------------------------------------------------------

    def _turn_ended(self, sl: Slot, token: int) -> bool:
        if token == getattr(self.tok, "eos_id", None):
            return True
        if sl.n - sl.turn_start >= self.cfg.max_turn_tokens:
            return True
        if self._stops:
            lo = max(sl.turn_start, sl.n - self._stop_window)
            tail = self._decode_text(sl.tokens[lo : sl.n])
            return any(st in tail for st in self._stops)
        return False

    def _end_turn(self, s: int) -> None:
        """Submits env.step on slot s's finished turn and parks the slot until it returns."""
        sl = self._slots[s]
        ids = sl.tokens[sl.turn_start : sl.n]
        ended_at_eos = bool(len(ids)) and ids[-1] == getattr(self.tok, "eos_id", None)
        if ended_at_eos:
            ids = ids[:-1]
        sl.ended_at_eos = ended_at_eos  # the observation then drops the template's eos text
        text = self._decode_text(ids)
        self._parked[s] = (sl, self.env_calls.submit(self._envs[s].step, text))
        self._slots[s] = None

    def _collect_env_steps(self, version: int, *, block: bool, every: bool):
        """[(slot, trajectory or None, drop or None)] of the parked slots whose env call is
        done, in slot order (waiting for all of them, or for one, when `block`); a slot
        whose episode goes on is back in the decode batch."""
        calls = [call for _, call in self._parked.values()]
        if block and calls:
            self.env_calls.wait(calls, every=every)
        out = []
        for s in sorted(self._parked):
            sl, call = self._parked[s]
            if not call.done:
                continue
            del self._parked[s]
            try:
                traj = self._apply_step(s, sl, self._env_result(s, call), version)
            except DropError as d:
                out.append((s, None, Drop(d.reason, sl.prompt.uid, d.error)))
                continue
            if traj is None:
                self._slots[s] = sl
            out.append((s, traj, None))
        return out

    def _apply_step(self, s: int, sl: Slot, result, version: int) -> Trajectory | None:
        """Records env.step's result on slot s; returns the trajectory if it is over."""
        result = checked_step(result)
        if result.info.get("dropped"):
            raise DropError("env_dropped", RuntimeError(str(result.info.get("error", ""))))
        sl.turn_rewards.append(float(result.reward))
        sl.infos.append(dict(result.info))
        sl.turn += 1
        if result.done:
            return sl.finish(terminated=True, outcome=result.reward, truncation=None)
        if sl.turn >= self._envs[s].max_turns:
            return sl.finish(terminated=False, outcome=0.0, truncation="max_turns")
        obs = self._encode(after_turn(result.observation, self.tok, sl.ended_at_eos))
        if sl.n + len(obs) + 1 > self.cfg.max_len:
            return sl.finish(terminated=False, outcome=0.0, truncation="max_len")
        sl.append_context(obs, version)
        return None

    def _advance(self, s: int, out, version: int) -> tuple[Trajectory | None, int]:
        """Walks slot s through the decoded steps; returns (finished or None, tokens kept)."""
        sl = self._slots[s]
        kept = 0
        for i in range(out.tokens_ns.shape[0]):
            if out.experts_nslk is not None and self._routing is not None:
                sl.experts[sl.n - 1] = out.experts_nslk[i, s]
            sl.written = sl.n  # the fed token is now in the cache
            token = int(out.tokens_ns[i, s])
            sl.append_action(token, out.sampled_logp_ns[i, s], out.rollout_logp_ns[i, s], version)
            kept += 1
            if self._turn_ended(sl, token):
                return TURN_ENDED, kept
            if sl.n >= self.cfg.max_len:
                return sl.finish(terminated=False, outcome=0.0, truncation="max_len"), kept
        return None, kept

    # ---- public -------------------------------------------------------------------------

    def step(
        self, params: Params, version: int, next_prompt: Callable[[], Prompt | None]
    ) -> StepOutput:
        """One scheduling round with `params` (tagged `version`); see the module docstring.

        `next_prompt()` returns the next Prompt or None when there is none for now.
        """
        finished: list[Trajectory] = []
        dropped: list[Drop] = []
        if self._cache is None:
            self._cache = self.fns.init_cache(params)
        if self._parked:  # overlap mode: env calls of earlier steps that are done by now
            self._split(
                self._collect_env_steps(version, block=False, every=False), finished, dropped
            )
        self._fill(next_prompt, version, dropped)
        if all(sl is None for sl in self._slots):  # nothing to decode
            if self._parked:  # wait for one env call, then report
                done = self._collect_env_steps(version, block=True, every=False)
                self._split(done, finished, dropped)
            return StepOutput(finished, dropped, self.active, 0)
        self._admit()
        self._prefill_pending(params)
        out = self._decode(params)
        running = [s for s in range(self.cfg.num_slots) if self._running(s) is not None]
        generated = self._advance_slots(
            running, lambda s: self._advance(s, out, version), version, finished, dropped
        )
        return StepOutput(finished, dropped, self.active, generated)

    def _advance_slots(
        self, running, advance, version: int, finished: list, dropped: list, on_drop=None
    ) -> int:
        """Moves each slot in `running` on by `advance(s)` -> (its trajectory, TURN_ENDED or
        None; the tokens kept): a turn's end starts its env step, a finished or dropped
        episode (`on_drop(s)` first) leaves its slot. Then the env steps of this round,
        which run concurrently: by default all are waited for, so the step's result does
        not depend on thread timing. Returns the tokens generated."""
        generated = 0
        ended: list[tuple[int, Trajectory | None, Drop | None]] = []  # (slot, traj, drop)
        for s in running:
            sl = self._slots[s]
            try:
                traj, kept = advance(s)
                generated += kept
                if traj is TURN_ENDED:
                    self._end_turn(s)
                elif traj is not None:
                    ended.append((s, traj, None))
                    self._slots[s] = None
            except DropError as d:
                if on_drop is not None:
                    on_drop(s)
                ended.append((s, None, Drop(d.reason, sl.prompt.uid, d.error)))
                self._slots[s] = None
        ended += self._collect_env_steps(version, block=not self.overlap_env, every=True)
        self._split(sorted(ended, key=lambda e: e[0]), finished, dropped)
        return generated

    def _split(self, entries, finished: list, dropped: list) -> None:
        """Sorts ended slots into finished / dropped and frees their pages."""
        for s, traj, drop in entries:
            if traj is not None or drop is not None:
                if self.pool is not None:
                    self.pool.release(s)
                (finished if drop is None else dropped).append(traj if drop is None else drop)

    def run(
        self,
        params: Params,
        prompts: Iterable[Prompt],
        version: int = 0,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> tuple[list[Trajectory], list[Drop]]:
        """Generates every prompt to completion with fixed params (evaluation, tests);
        `on_step(step_output)` sees each step (and may raise to end the run)."""
        it = iter(prompts)
        finished, dropped = [], []
        while True:
            out = self.step(params, version, lambda: next(it, None))
            finished += out.finished
            dropped += out.dropped
            if on_step is not None:
                on_step(out)
            if out.active == 0 and not out.finished and not out.dropped:
                return finished, dropped
