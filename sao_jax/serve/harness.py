"""The training driver's harness processes: one per task, each its own session's episode.

`HarnessPool` runs up to `processes` harness processes at once from the command template
(`gateway.harness.command`, sao_jax/serve/settings.py). For each, from one thread:

1. the next dataset prompt becomes a task, `{"id", "prompt", "answer", "meta"}`, and a
   gateway session is opened for it (`open_session(task)` -> the session's id, OpenAI
   base URL and key);
2. the template's words are formatted with `{base_url}`, `{api_key}`, `{task_json}`,
   `{python}` and `{workdir}` (and the process gets `OPENAI_BASE_URL`, `OPENAI_API_KEY`,
   `SAO_TASK` in its environment), and it starts in a session and process group of its
   own (`start_new_session`), in a working directory of its own
   (`<run workdir>/harness/<n>-<session id>/`, stdout.txt and stderr.txt there), inside
   the bubblewrap sandbox with `sandbox` (sao_jax/serve/harness_sandbox.py);
3. when it exits with status 0 its session is ended as by `/end` unless the harness
   ended it itself (posted its reward: the usual way); a non-zero status drops the
   episode (`harness_error`) unless the reward was already in; a process still running
   `timeout_s` after its start is killed (its whole group: SIGTERM, then SIGKILL 2 s
   later) and its episode dropped (`harness_timeout`). A clean exit's working directory
   is removed; a failed one's is kept (its stdout and stderr say why).

`on_failure(reason, message)` hears of every failed process (the rollouts source counts
them and stops the run after `sampling.max_env_errors` in a row). `can_start()` is the
backpressure: no new process while the learner's queue is full. `stop()` kills every
running process group and waits for them; their sessions are then dropped by the gateway
(`shutdown`) by the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from sao_jax.envs.base import Prompt
from sao_jax.serve import harness_sandbox
from sao_jax.serve.settings import HarnessConfig

log = logging.getLogger("sao_jax")
KILL_GRACE_S = 2.0  # SIGTERM -> SIGKILL of a process group
POLL_S = 0.05


def task_of(prompt: Prompt) -> dict[str, Any]:
    """The task a harness gets (`{task_json}`) and the session records."""
    return {"id": prompt.uid, "prompt": prompt.text, "answer": prompt.answer, "meta": prompt.meta}


@dataclasses.dataclass
class Running:
    proc: subprocess.Popen
    session: str  # the gateway session's id
    cwd: pathlib.Path
    started: float
    files: tuple  # its open stdout / stderr


def format_command(words: tuple[str, ...], values: dict[str, str]) -> list[str]:
    return [w.format(**values) for w in words]


def _tail(path: pathlib.Path, n: int = 300) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return " ".join(text[-n:].split())


def kill_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM to the process's group, SIGKILL `grace_s` later if it is still there."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class HarnessPool:
    """Runs harness processes for the training driver; see the module docstring."""

    def __init__(
        self,
        cfg: HarnessConfig,
        prompts,
        *,
        open_session: Callable[[dict, str | None], dict],
        end_session: Callable[[str, str | None], None],
        workdir: pathlib.Path,
        on_failure: Callable[[str, str], None],
        can_start: Callable[[], bool] = lambda: True,
        socket_dir: pathlib.Path | None = None,
    ):
        self.cfg = cfg
        self.prompts = prompts
        self.prompt_lock = threading.Lock()  # prompt_state() reads under it
        self.open_session, self.end_session = open_session, end_session
        self.root = pathlib.Path(workdir) / "harness"
        self.on_failure, self.can_start = on_failure, can_start
        self.socket_dir = socket_dir
        self.running: list[Running] = []
        self.counters = {"started": 0, "exited": 0, "failed": 0, "timed_out": 0}
        self.exhausted = False
        self.error: BaseException | None = None  # the driver thread's own failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sao-harness", daemon=True)
        self._serial = 0

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stops launching, kills every running process group, waits for the thread."""
        self._stop.set()
        self._thread.join(timeout)
        for r in list(self.running):
            kill_group(r.proc)
            self._close(r)
        self.running.clear()

    # ---- the driver thread --------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._reap()
                while (
                    len(self.running) < self.cfg.processes
                    and not self.exhausted
                    and not self._stop.is_set()
                    and self.can_start()
                ):
                    self._launch()
                self._stop.wait(POLL_S)
        except BaseException as e:  # a gateway or OS failure: the learner's take raises it
            self.error = e

    def _next_prompt(self) -> Prompt | None:
        with self.prompt_lock:
            try:
                return next(self.prompts)
            except StopIteration:
                self.exhausted = True
                return None

    def _launch(self) -> None:
        prompt = self._next_prompt()
        if prompt is None:
            return
        task = task_of(prompt)
        base = None
        if self.cfg.sandbox:
            base = f"http://127.0.0.1:{harness_sandbox.FORWARD_PORT}"
        session = self.open_session(task, base)
        self._serial += 1
        cwd = self.root / f"{self._serial:06d}-{session['id']}"
        cwd.mkdir(parents=True)
        task_json = json.dumps(task, ensure_ascii=False, default=str)
        values = dict(base_url=session["base_url"], api_key=session["api_key"],
                      task_json=task_json, python=sys.executable, workdir=str(cwd))  # fmt: skip
        argv = format_command(self.cfg.command, values)
        env = {"OPENAI_BASE_URL": session["base_url"], "OPENAI_API_KEY": session["api_key"],
               "SAO_TASK": task_json}  # fmt: skip
        if self.cfg.sandbox:
            env |= {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(cwd.resolve())}
            argv = harness_sandbox.command(
                argv,
                workdir=cwd,
                socket_dir=self.socket_dir,
                read_only=self.cfg.sandbox_paths,
                env=env,
            )
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        else:
            env = {**os.environ, **env}
        out = open(cwd / "stdout.txt", "wb")  # noqa: SIM115 (closed in _close)
        err = open(cwd / "stderr.txt", "wb")  # noqa: SIM115
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        except OSError as e:
            out.close()
            err.close()
            self.end_session(session["id"], "harness_error")
            self.counters["failed"] += 1
            self.on_failure("harness_error", f"the harness command did not start: {e}")
            return
        self.counters["started"] += 1
        self.running.append(Running(proc, session["id"], cwd, time.monotonic(), (out, err)))

    def _reap(self) -> None:
        now = time.monotonic()
        for r in list(self.running):
            code = r.proc.poll()
            if code is None and now - r.started > self.cfg.timeout_s:
                kill_group(r.proc)
                self._finish(r, "harness_timeout", f"killed after {self.cfg.timeout_s:g} s")
            elif code is not None:
                kill_group(r.proc, grace_s=0.0)  # anything it left in its group
                if code == 0:
                    self._finish(r, None, "")
                else:
                    self._finish(r, "harness_error", f"exited with status {code}")

    def _finish(self, r: Running, reason: str | None, what: str) -> None:
        self.running.remove(r)
        self._close(r)
        self.end_session(r.session, reason)
        if reason is None:
            self.counters["exited"] += 1
            shutil.rmtree(r.cwd, ignore_errors=True)
            return
        self.counters["timed_out" if reason == "harness_timeout" else "failed"] += 1
        stderr = _tail(r.cwd / "stderr.txt")
        message = f"harness of session {r.session} {what} ({r.cwd})"
        self.on_failure(reason, message + (f"; stderr: ...{stderr}" if stderr else ""))

    @staticmethod
    def _close(r: Running) -> None:
        for f in r.files:
            f.close()
