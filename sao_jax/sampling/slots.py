"""The engine's host-side records (sao_jax/sampling/engine.py): its settings
(`EngineConfig`), one in-flight trajectory (`Slot`), what a step returns (`StepOutput`,
`Drop` with one of `DROP_REASONS`), and the checks on what an environment returns."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from sao_jax.envs.base import Prompt, StepResult
from sao_jax.sampling.generate import SamplingParams, default_buckets, span_buckets
from sao_jax.sampling.page_pool import KVLayout
from sao_jax.sampling.trajectory import Trajectory

DROP_REASONS = (
    "env_error",  # env.reset / env.step raised or returned something invalid
    "env_timeout",  # env call exceeded env_timeout_s
    "env_dropped",  # the env asked to drop the episode (info["dropped"], e.g. judge failure)
    "tokenizer_error",  # encode/decode raised
    "empty_prompt",  # the rendered prompt has no tokens
    "prompt_too_long",  # prompt leaves no room for one generated token in max_len
)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Rollout engine settings (one engine per sampler worker)."""

    num_slots: int = 4  # S: trajectories decoded together
    max_len: int = 128  # L: cache length = longest trajectory in tokens
    max_turn_tokens: int = 64  # a model turn ends after this many tokens
    prefill_buckets: tuple[int, ...] = ()  # chunk widths; () = powers of two 8..L
    span_buckets: tuple[int, ...] = ()  # cache read spans; () = powers of two 128..L, L
    lane_slots: int = 0  # long-lane rows: the longest slots read their own span; 0 = off
    steps_per_sync: int = 1  # decode steps per host check (overshoot is discarded)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    record_routing: bool = False  # keep each token's chosen experts (routing replay)
    add_bos: bool = True  # prepend tokenizer.bos_id (when it has one) to each prompt
    env_timeout_s: float | None = 120.0  # per env call, then a drop; None = no timeout
    env_workers: int = 8  # env calls running at once (threads off the decoding thread)
    kv_layout: str = "dense"  # 'dense' (S x max_len) | 'paged' (a pool of pages, page_pool.py)
    page_size: int = 16  # paged: positions per page
    num_pages: int = 0  # paged: pages per layer in the pool; 0 = num_slots x max_len worth
    paged_kernel: str = "auto"  # paged decode read: auto | gather | pallas_tpu | pallas_gpu
    per_token_keys: bool = False  # key each draw by (trajectory, position): schedule-free

    def __post_init__(self):
        for name in ("num_slots", "max_len", "max_turn_tokens", "steps_per_sync", "env_workers"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"EngineConfig.{name}: must be a positive int, got {v!r}")
        if self.max_len < 2:
            raise ValueError(f"EngineConfig.max_len: must be >= 2, got {self.max_len}")
        for name in ("prefill_buckets", "span_buckets"):
            b = tuple(getattr(self, name))
            if b and (any(x <= 0 for x in b) or list(b) != sorted(set(b))):
                raise ValueError(f"EngineConfig.{name}: must be increasing positive ints, got {b}")
        if not (isinstance(self.lane_slots, int) and 0 <= self.lane_slots < self.num_slots):
            raise ValueError(
                f"EngineConfig.lane_slots: must be an int in [0, num_slots), "
                f"got {self.lane_slots!r}"
            )
        if self.env_timeout_s is not None and not self.env_timeout_s > 0:
            raise ValueError(f"EngineConfig.env_timeout_s: must be > 0, got {self.env_timeout_s}")
        SamplingParams(self.temperature, self.top_k, self.top_p)  # validates them
        try:
            self.layout.check(self.num_slots, self.max_len)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None

    @property
    def layout(self) -> KVLayout:
        try:
            return KVLayout(self.kv_layout, self.page_size, self.num_pages, self.paged_kernel)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self.prefill_buckets) or default_buckets(self.max_len)

    @property
    def spans(self) -> tuple[int, ...]:
        """Read spans, ending at max_len; `span_buckets=(max_len,)` reads the whole cache."""
        if not self.span_buckets:
            return span_buckets(self.max_len)
        return (*(b for b in self.span_buckets if b < self.max_len), self.max_len)


class Drop(NamedTuple):
    reason: str  # one of DROP_REASONS
    prompt_uid: str
    error: BaseException | None


class StepOutput(NamedTuple):
    finished: list[Trajectory]
    dropped: list[Drop]
    active: int  # busy slots after this step
    generated: int  # action tokens kept this step


TURN_ENDED = object()  # _advance: the slot's turn ended; its env.step is due


class DropError(Exception):
    def __init__(self, reason: str, error: BaseException | None):
        super().__init__(reason)
        self.reason, self.error = reason, error


class Slot:
    """Host record of one in-flight trajectory (arrays preallocated to max_len)."""

    def __init__(
        self, prompt: Prompt, max_len: int, routing_lk: tuple[int, int] | None, serial: int = 0
    ):
        self.prompt = prompt
        self.serial = serial  # the engine's count of prompts before this one (age, RNG)
        self.tokens = np.zeros(max_len, np.int32)
        self.action = np.zeros(max_len, np.bool_)
        self.rollout_logp = np.zeros(max_len, np.float32)
        self.sampled_logp = np.zeros(max_len, np.float32)
        self.versions = np.zeros(max_len, np.int32)
        self.turn_ids = np.full(max_len, -1, np.int32)
        self.experts = None if routing_lk is None else np.full((max_len, *routing_lk), -1)
        self.n = 0  # tokens so far
        self.written = 0  # tokens whose keys/values are in the cache
        self.turn = 0  # current model turn
        self.turn_start = 0  # index of its first token
        self.ended_at_eos = False  # the last finished turn ended with the eos token
        self.turn_rewards: list[float] = []
        self.infos: list[dict[str, Any]] = []

    def append_context(self, ids: list[int], version: int) -> None:
        self.tokens[self.n : self.n + len(ids)] = ids
        self.versions[self.n : self.n + len(ids)] = version
        self.n += len(ids)
        self.turn_start = self.n

    def append_action(self, token: int, sampled_logp: float, rollout_logp: float, version: int):
        i = self.n
        self.tokens[i], self.action[i], self.turn_ids[i] = token, True, self.turn
        self.sampled_logp[i], self.rollout_logp[i], self.versions[i] = (
            sampled_logp,
            rollout_logp,
            version,
        )
        self.n += 1

    def record_experts(self, positions: list[int], experts_mlk):
        """An engine's experts [m, L_moe, k] for `positions`: kept where the position is
        one of this slot's tokens and has no record yet (the first computation of a
        position is the one its tokens were sampled under). Returns the positions past
        the slot's tokens and their experts (a streamed token not appended yet), or None."""
        pos = np.asarray(positions, np.int64)
        if self.experts is None or pos.size == 0:
            return None
        experts = np.asarray(experts_mlk, np.int64)
        if experts.shape != (pos.size, *self.experts.shape[1:]):
            raise ValueError(
                f"routing: experts of shape {experts.shape} for {pos.size} positions, "
                f"want [m, {', '.join(map(str, self.experts.shape[1:]))}]"
            )
        later = pos >= self.n
        inside = (pos >= 0) & ~later
        held, got = pos[inside], experts[inside]
        fresh = self.experts[held, 0, 0] < 0
        self.experts[held[fresh]] = got[fresh]
        return (pos[later], experts[later]) if later.any() else None

    def finish(self, *, terminated: bool, outcome: float, truncation: str | None) -> Trajectory:
        n = self.n
        errors = [i.get("error") for i in self.infos if i.get("error")]
        info = dict(
            success=self.infos[-1].get("success") if self.infos else None,
            errors=errors,
            truncation=truncation,
            turn_infos=self.infos,
            meta=dict(self.prompt.meta),
        )
        return Trajectory(
            tokens=self.tokens[:n].copy(),
            action_mask=self.action[:n].copy(),
            rollout_logp=self.rollout_logp[:n].copy(),
            sampled_logp=self.sampled_logp[:n].copy(),
            versions=self.versions[:n].copy(),
            turn_ids=self.turn_ids[:n].copy(),
            turn_rewards=np.asarray(self.turn_rewards, np.float32),
            outcome=float(outcome),
            terminated=terminated,
            truncated=not terminated,
            prompt_uid=self.prompt.uid,
            info=info,
            experts=None if self.experts is None else self.experts[:n].astype(np.int32),
        )


def checked_step(result) -> StepResult:
    """The env's StepResult, or a drop (env_error) when it is malformed."""
    ok = (
        isinstance(result, StepResult)
        and isinstance(result.observation, str)
        and isinstance(result.reward, (int, float, np.number))
        and math.isfinite(float(result.reward))
        and isinstance(result.info, dict)
    )
    if not ok:
        raise DropError("env_error", TypeError(f"env.step returned an invalid {result!r}"))
    return result


def after_turn(observation: str, tokenizer, ended_at_eos: bool) -> str:
    """The observation text to tokenize after a model turn. A chat observation starts with
    the end-of-turn token's text (sao_jax/text/chat_template.py); when the policy emitted that
    token itself it is already in the trajectory, so only the text after it is new."""
    eos_text = getattr(tokenizer, "eos_text", None)
    if ended_at_eos and eos_text and observation.startswith(eos_text):
        return observation[len(eos_text) :]
    return observation
