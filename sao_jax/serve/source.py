"""A training run's rollouts through the gateway: harness or live episodes, as they end.

`GatewayRollouts` is the rollouts source of a run with `gateway.mode` 'harness' or 'live'
(sao_jax/train.py `Run.rollouts`); it has the face of the in-process sources
(sao_jax/sampling/rollouts.py: `publish`, `start`, `take`, `give_back`, `prompt_state`,
`stats`, `stop`), so the RL loop, the batches and the learner are the same code whatever
made the trajectories.

* `start()` serves the gateway (sao_jax/serve/: the run's generation backend, `backend`
  from sao_jax/sampling/backend_factory.py, `sampling.backend` native or vLLM; the
  native engine when none is given; the run's sampling law for every request) on `gateway.host`:
  `gateway.port` (and a Unix socket for sandboxed harnesses), writes
  `<workdir>/gateway.json`, and in 'harness' mode starts the harness driver
  (sao_jax/serve/harness.py) on the run's prompt stream. In 'live' mode any client's
  sessions are the episodes (serve with training on).
* Every episode the gateway writes to `<workdir>/episodes.jsonl` also comes here: a
  finished one becomes its trajectories (sao_jax/serve/trajectories.py, one per segment)
  on an unbounded queue; a dropped one is counted by its reason.
* `take(n)` hands out whole episodes' trajectories in the order they ended. An episode's
  staleness is the learner's version (the last published) minus the version of its
  oldest action token, when it is taken; over `gateway.max_staleness` it is dropped
  whole (reason `stale`, per trajectory, as the in-process sampler counts). Bounds, as
  the in-process take's: no trajectory for `timeout` s raises NoProgress naming the drops;
  `sampling.max_env_errors` harness failures in a row (crashed, timed out, failed to
  start) raise EnvErrorLimit naming the last; SIGTERM raises StopRequested within
  `POLL_S`; an engine that died (the backend's `fatal_error()`: the vLLM server exited)
  raises SamplerError naming it, its exit code and its log within `POLL_S` of the
  backend seeing the exit (not counted as harness failures).
* `publish(params, version)` goes to the backend: requests in flight continue on the
  new weights from the engine's next step, and each token records the version that
  sampled it (docs/harness.md, "Training on harness episodes"); the vLLM backend
  restarts its engine on them instead (the learner waits; requests in flight fail and
  the harness's call is retried or its episode dropped, docs/vllm.md).
* `stop()` kills the harness processes, drops the live sessions (`shutdown`: written
  to episodes.jsonl, counted) and closes the server and the backend (a training run's is
  lent: its requests are cancelled, and the run closes the backend itself,
  sao_jax/sampling/backend_factory.py `RunBackend`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import pathlib
import tempfile
import threading
import time
from typing import Any

import jax

from sao_jax import stop
from sao_jax.sampling.backend import EngineDied
from sao_jax.sampling.backend_engine import BackendBuilder
from sao_jax.sampling.backend_factory import build_backend
from sao_jax.sampling.engine import EngineConfig
from sao_jax.sampling.sampler import EnvErrorLimit, NoProgress, SamplerError
from sao_jax.sampling.trajectory import Trajectory
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.serve import harness_sandbox
from sao_jax.serve.app import start_server
from sao_jax.serve.episodes import EpisodeLog
from sao_jax.serve.errors import ApiError
from sao_jax.serve.gateway import Gateway
from sao_jax.serve.harness import HarnessPool
from sao_jax.serve.launch import write_gateway_json
from sao_jax.serve.render import ChatRenderer
from sao_jax.serve.settings import gateway_config, harness_config
from sao_jax.serve.trajectories import episode_trajectories

log = logging.getLogger("sao_jax")
POLL_S = 0.05


@dataclasses.dataclass
class _Episode:
    trajs: list[Trajectory]
    accepted: bool = False  # past the staleness check (the rest of a split episode)

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajs)


class GatewayRollouts:
    """Harness or live episodes as the RL loop's trajectories; see the module docstring."""

    def __init__(
        self,
        section: ConfigDict,
        *,
        policy_def,
        tokenizer,
        chat,
        engine_cfg: EngineConfig,
        prompts,
        workdir: pathlib.Path,
        seed: int,
        queue_size: int,
        max_env_errors: int,
        take_timeout_s: float,
        backend: BackendBuilder | None = None,
    ):
        if jax.process_count() > 1:
            raise ConfigError(
                f"config field gateway.mode: {section.mode!r} runs one gateway in one "
                f"process; this run has {jax.process_count()} processes"
            )
        self.section = section
        self.mode = section.mode
        self.max_staleness = section.max_staleness
        self.mdef, self.tok, self.engine_cfg, self.seed = policy_def, tokenizer, engine_cfg, seed
        self.chat = chat
        self.prompts = prompts
        self.workdir = pathlib.Path(workdir)
        self.queue_size = queue_size
        self.max_env_errors = max_env_errors
        self.take_timeout_s = take_timeout_s
        self.build_backend = backend  # (params, version) -> backend; None: the native one
        self.backend = self.gateway = self.server = self.pool = None
        self._initial: tuple[Any, int] | None = None
        self._version = 0
        self._cond = threading.Condition()
        self._queue: collections.deque[_Episode] = collections.deque()
        self._generated = self._taken = 0
        self._dropped: collections.Counter[str] = collections.Counter()
        self._staleness: collections.Counter[int] = collections.Counter()
        self._failures_in_a_row = 0
        self._last_failure = ""
        self._socket_dir: tempfile.TemporaryDirectory | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def publish(self, params, version: int, *, synced: bool = False) -> None:
        """New weights for the backend (copied: the learner may donate its buffers)."""
        del synced
        self._version = version
        if self.backend is None:
            self._initial = (params, version)
        else:
            self.backend.publish(params, version)

    def start(self) -> None:
        if self._initial is None:
            raise RuntimeError("publish the policy before start()")
        if self.chat is None:
            raise ConfigError(
                f"config field gateway.mode: {self.mode!r} needs a chat template "
                "(init.chat_template): the gateway renders messages with it"
            )
        params, version = self._initial
        self._initial = None
        if self.build_backend is not None:
            self.backend = self.build_backend(params, version)
        else:
            self.backend = build_backend(
                "native", mdef=self.mdef, params=params, tokenizer=self.tok,
                engine_cfg=self.engine_cfg, version=version, seed=self.seed,
            )  # fmt: skip
        cfg = gateway_config(self.section, training=True)
        episodes = EpisodeLog(self.workdir / "episodes.jsonl", on_episode=self._on_episode)
        renderer = ChatRenderer(self.chat.template, self.tok)
        self.gateway = Gateway(self.backend, renderer, cfg, episodes)
        hcfg = harness_config(self.section)
        unix_path = None
        if self.mode == "harness" and hcfg.sandbox:
            # short and private: a socket path must fit in 108 bytes
            self._socket_dir = tempfile.TemporaryDirectory(prefix="sao-gw-")
            unix_path = pathlib.Path(self._socket_dir.name) / harness_sandbox.SOCKET_NAME
        self.server = start_server(self.gateway, self.section.host, self.section.port, unix_path)
        path = write_gateway_json(self.workdir, self.server)
        log.info("gateway (%s mode): %s/v1 (%s)", self.mode, self.server.url, path)
        if self.mode == "harness":
            self.pool = HarnessPool(
                hcfg,
                self.prompts,
                open_session=self._open_session,
                end_session=self._end_session,
                workdir=self.workdir,
                on_failure=self._on_failure,
                can_start=lambda: self.queued() < self.queue_size,
                socket_dir=None if unix_path is None else unix_path.parent,
            )
            self.pool.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Kills the harnesses, drops the live sessions (`shutdown`), closes everything."""
        if self.pool is not None:
            self.pool.stop(timeout)
        if self.server is not None:
            dropping = asyncio.run_coroutine_threadsafe(
                self.gateway.drop_all("shutdown"), self.server.loop
            )
            dropped = dropping.result(timeout=timeout)
            if dropped:
                log.info("gateway: %d live sessions dropped (shutdown)", dropped)
            self.server.stop()
            self.server = None
        if self.backend is not None:
            self.backend.close()
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
            self._socket_dir = None
        return True

    # ---- the gateway's side -------------------------------------------------------------

    def _on_loop(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.server.loop).result(timeout)

    def _open_session(self, task: dict, base_url: str | None) -> dict:
        async def new():
            return self.gateway.new_session(task, None, base_url)

        return self._on_loop(new())

    def _end_session(self, sid: str, dropped: str | None) -> None:
        """/end (dropped None) or a drop; a session the harness ended itself stays ended."""

        async def end():
            with contextlib.suppress(ApiError):  # 409: already ended (its reward came)
                await self.gateway.end(sid, None, None, dropped)

        self._on_loop(end())

    def _on_failure(self, reason: str, message: str) -> None:
        log.warning("gateway: %s", message)
        with self._cond:
            self._failures_in_a_row += 1
            self._last_failure = f"{reason}: {message}"
            self._cond.notify_all()

    def _on_episode(self, record: dict) -> None:
        """An episodes.jsonl record (from the gateway's executor threads)."""
        with self._cond:
            if record.get("dropped") is not None:
                self._dropped[record["dropped"]] += 1
                return
            trajs = episode_trajectories(record)
            if not trajs:
                self._dropped["no_actions"] += 1
                return
            self._queue.append(_Episode(trajs))
            self._generated += len(trajs)
            self._failures_in_a_row = 0
            self._cond.notify_all()

    # ---- the learner's side -------------------------------------------------------------

    def queued(self) -> int:
        with self._cond:
            return sum(len(e.trajs) for e in self._queue)

    def _raise_if_failed(self) -> None:
        why = None if self.backend is None else self.backend.fatal_error()
        if why is not None:
            raise SamplerError(f"the generation engine died: {why}") from EngineDied(why)
        if self.pool is not None and self.pool.error is not None:
            err = self.pool.error
            raise SamplerError(f"the harness driver failed: {type(err).__name__}: {err}") from err
        if self._failures_in_a_row >= self.max_env_errors:
            raise EnvErrorLimit(
                f"{self._failures_in_a_row} harness failures in a row "
                f"(sampling.max_env_errors); last: {self._last_failure}"
            )

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory]:
        """n trajectories of whole episodes that pass the staleness cap, in the order the
        episodes ended (the rest of a split episode comes first next time)."""
        timeout = self.take_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        out: list[Trajectory] = []
        with self._cond:
            while len(out) < n:
                self._raise_if_failed()
                if stop.requested():
                    self._give_back_locked(out)
                    stop.raise_if_requested(f"waiting for {n} harness trajectories")
                if not self._queue:
                    if time.monotonic() > deadline:
                        self._give_back_locked(out)
                        raise NoProgress(self._silence(n, len(out), timeout))
                    self._cond.wait(POLL_S)
                    continue
                ep = self._queue.popleft()
                lag = self._version - ep.min_version
                cap = self.max_staleness
                if not ep.accepted and cap is not None and lag > cap:
                    self._dropped["stale"] += len(ep.trajs)
                    continue
                room = n - len(out)
                if len(ep.trajs) > room:
                    self._queue.appendleft(_Episode(ep.trajs[room:], accepted=True))
                got = ep.trajs[:room]
                out += got
                self._taken += len(got)
                self._staleness[lag] += len(got)
                deadline = time.monotonic() + timeout  # the bound is on a silence
        return out

    def give_back(self, trajs: list[Trajectory]) -> None:
        """Undoes the last take (the run stopped before training it)."""
        with self._cond:
            self._give_back_locked(trajs)

    def _give_back_locked(self, trajs: list[Trajectory]) -> None:
        if not trajs:
            return
        self._queue.appendleft(_Episode(list(trajs), accepted=True))
        self._taken -= len(trajs)
        self._staleness.subtract(self._version - t.min_version for t in trajs)
        self._staleness += collections.Counter()  # drops the zero counts

    def _silence(self, n: int, got: int, timeout: float) -> str:
        text = (
            f"take({n}): timed out after {timeout:g}s without a harness trajectory "
            f"(train.take_timeout_s; {got} of {n} taken): generated {self._generated}, "
            f"dropped {dict(self._dropped) or 'none'}"
        )
        if self._last_failure:
            text += f"; last harness failure: {self._last_failure}"
        return text

    def prompt_state(self) -> Any:
        """The prompt iterator's state: tasks already handed to a harness are past it."""
        lock = self.pool.prompt_lock if self.pool is not None else contextlib.nullcontext()
        with lock:
            return self.prompts.get_state()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out = dict(
                generated=self._generated,
                taken=self._taken,
                dropped=dict(self._dropped),
                staleness=dict(sorted(self._staleness.items())),
                queued=sum(len(e.trajs) for e in self._queue),
                version=self._version,
            )
        if self.gateway is not None:
            c = self.gateway.counters  # (no walk over the sessions the loop changes)
            ended = c.get("episodes", 0) + c.get("episodes_dropped", 0)
            out["live_sessions"] = c.get("sessions", 0) - ended
            for k in ("calls", "retries", "sampling_ignored", "malformed_tool_calls"):
                out[f"gateway_{k}"] = self.gateway.counters.get(k, 0)
        if self.pool is not None:
            out |= {f"harness_{k}": v for k, v in self.pool.counters.items()}
            out["harness_running"] = len(self.pool.running)
        return out
