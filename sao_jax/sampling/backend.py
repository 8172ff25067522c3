"""The generation backend interface: token ids in; sampled ids, log-probs and versions out.

The rollout gateway (sao_jax/serve/) talks to a model only through this interface, so a
backend other than the native engine (vLLM, later) plugs in by implementing it:

* `submit(request, on_tokens)` queues one generation (`GenRequest`: the prompt's token
  ids, `max_tokens`, stop ids and strings, optional sampling values) and returns a
  `GenHandle` at once. Requests of many callers share the backend's slots.
  `on_tokens(chunk)` (optional) is called from the backend's thread with every new
  `GenChunk` as tokens are sampled (streaming); the handle's `future` resolves to the
  `GenResult` (all sampled tokens, finish reason) or raises `GenerationError`.
* `handle.cancel()`: the request leaves its slot at the next scheduling round; its future
  resolves with finish_reason 'cancelled' and whatever was sampled so far.
* `publish(params, version)`: new weights. Requests in flight continue on them (each
  token records the version that sampled it, `GenResult.versions`), or, where the
  backend must restart its engine to load them (vLLM, backend_vllm.py), fail with
  `RequestInterrupted`: their tokens streamed so far stand, and the caller resubmits
  the rest (sao_jax/sampling/backend_engine.py does).
* `stats()`: counters, among them the slots decoding together (`max_active_slots`,
  `mean_active_slots` over decode calls).

Per sampled token two log-probs are reported, the two the in-process sampler records
(sao_jax/sampling/generate.py): `rollout_logp` = log_softmax(raw logits)[token], the
temperature-1 full-vocabulary log-prob that the learner recomputes, and `sampled_logp` =
log q(token) under the truncated, tempered law that was sampled (0 under greedy).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

FINISH_REASONS = ("stop", "length", "cancelled")


class GenerationError(RuntimeError):
    """A request the backend could not serve (the message says why)."""


class EngineDied(GenerationError):
    """The backend's engine is gone (its process exited, or a weight sync left it unusable):
    nothing more can be served; a run ends (sao_jax/train.py checkpoints first)."""


def engine_died(error: BaseException | None) -> bool:
    """Whether `error` came from an engine that died: EngineDied anywhere in its chain
    (the backend engine, the sampler and the rollouts sources wrap it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, EngineDied):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class RequestInterrupted(GenerationError):
    """A weight publication ended the request early (the engine restarted on the new
    weights); the tokens it streamed stand, the rest may be asked for again."""


class BackendBusy(GenerationError):
    """The backend's queue is full; retry later (the gateway answers 429)."""


@dataclasses.dataclass(frozen=True)
class GenRequest:
    """One generation: continue `prompt_ids` by at most `max_tokens` tokens.

    It ends at the first sampled id in `stop_ids` (kept: it is a sampled token), once the
    decoded completion contains one of `stop_strings`, or after `max_tokens`.
    `temperature` / `top_p`: this request's sampling law (None: the backend's own values;
    `GenResult.sampling` says what was used). `uid` names it in drops.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    uid: str = ""

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("GenRequest.prompt_ids: empty prompt")
        if not (isinstance(self.max_tokens, int) and self.max_tokens > 0):
            raise ValueError(f"GenRequest.max_tokens: must be an int > 0, got {self.max_tokens!r}")
        if self.temperature is not None and not 0 <= self.temperature < float("inf"):
            raise ValueError(f"GenRequest.temperature: must be >= 0, got {self.temperature!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"GenRequest.top_p: must be in (0, 1], got {self.top_p!r}")

    def law(self, backend_law: dict[str, Any]) -> dict[str, Any]:
        """The law this request is sampled with: `backend_law` (a backend's own values)
        with this request's temperature / top_p where it sets them."""
        mine = {"temperature": self.temperature, "top_p": self.top_p}
        return {**backend_law, **{k: v for k, v in mine.items() if v is not None}}


@dataclasses.dataclass
class GenChunk:
    """Tokens sampled since the previous chunk of the same request."""

    token_ids: list[int]
    rollout_logp: list[float]
    sampled_logp: list[float]
    versions: list[int]
    # (positions, experts [m][L_moe][k]) the engine computed since the previous chunk, when
    # the backend records routing (sampling.record_routing; prompt positions included)
    routing: tuple[list[int], list] | None = None


@dataclasses.dataclass
class GenResult:
    """A finished generation: every sampled token, in order, with its records."""

    token_ids: list[int]
    rollout_logp: list[float]
    sampled_logp: list[float]
    versions: list[int]
    finish_reason: str  # one of FINISH_REASONS
    sampling: dict[str, Any]  # the values the tokens were sampled with
    routing: tuple[list[int], list] | None = None  # every chunk's, in order (GenChunk)


class GenHandle:
    """A submitted request: its `future` (GenResult) and `cancel()`."""

    def __init__(self, request: GenRequest, cancel: Callable[[GenHandle], None]):
        self.request = request
        self.uid = ""  # the backend's name for it, set on submit
        self.future: concurrent.futures.Future[GenResult] = concurrent.futures.Future()
        self._cancel = cancel
        self.cancelled = False

    def cancel(self) -> None:
        """Frees the request's slot (a no-op once it finished)."""
        if not self.future.done() and not self.cancelled:
            self.cancelled = True
            self._cancel(self)


class GenerationBackend(Protocol):
    max_len: int  # prompt + completion tokens one request may hold
    eos_id: int | None  # the token that ends a turn (also a stop id of every request)

    def submit(
        self, request: GenRequest, on_tokens: Callable[[GenChunk], None] | None = None
    ) -> GenHandle: ...

    def publish(self, params: Any, version: int) -> None: ...

    @property
    def version(self) -> int | None: ...

    def stats(self) -> dict[str, float]: ...

    def fatal_error(self) -> str | None:
        """Why the backend can serve nothing more (its engine died), or None."""
        ...

    def close(self) -> None: ...
