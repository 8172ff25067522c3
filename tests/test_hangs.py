"""Nothing hangs, and SIGTERM wins: each hang reproduced in issues 15 and 24 ends within
a stated bound, with an error naming the cause, or with StopRequested / exit code 0.

The rollouts run a tiny model (tests/sampling_support.py) on envs that always raise, hang
(with and without env_timeout_s), or ask an LLM judge that refuses connections or trickles
one byte at a time (servers on 127.0.0.1 only), on prompts that never fit max_len, in sync
and async rollouts and in evaluation. Then the main job itself (a subprocess on the style
task's smoke config): a refusing judge ends it with one FATAL line naming the connection
error, exit 2; a judge that never answers blocks it until SIGTERM, which it honours (exit
0). The bounds are generous multiples of the configured limits (a loaded machine), far
below "forever".
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from flax import nnx

from sao_jax import checkpointing, stop
from sao_jax.envs import llm_judge as J
from sao_jax.envs import style
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.run.evaluation import Evaluator
from sao_jax.sampling.engine import EngineConfig
from sao_jax.sampling.env_calls import EnvCalls, EnvCallsStuck
from sao_jax.sampling.rollouts import AsyncRollouts, SyncRollouts
from sao_jax.sampling.sampler import EnvErrorLimit, NoProgress, SamplerConfig, SamplerError
from tests import train_support as ts
from tests.sampling_support import MODEL, FakeTokenizer

SLACK_S = 60.0  # start-up and compile time on a loaded 2-core machine (a hang is unbounded)
JOB_BOUND_S = 420  # one main-job subprocess: compiles, warm start, then the hang
SIGTERM_BOUND_S = 30.0  # from SIGTERM to exit 0 while an env call hangs


@pytest.fixture(scope="module")
def cache_env(jax_cache_dir):
    """The session's compilation cache (tests/conftest.py) for this module and its
    subprocesses."""
    with ts.persistent_compilation_cache(jax_cache_dir) as env:
        yield env


@pytest.fixture(scope="module")
def model(cache_env):
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


def prompts():
    i = 0
    while True:
        yield Prompt(f"p{i}", "bcd", None, {"topics": ("moon",)})
        i += 1


class _Prompts:
    """An endless prompt iterator with the get_state/set_state the rollouts expect."""

    def __init__(self):
        self._it = prompts()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


class RaisingEnv:
    stop_strings = ("a",)
    max_turns = 2

    def reset(self, prompt):
        return prompt.text

    def step(self, action_text):
        raise RuntimeError("tool crashed: boom")


class HangingEnv(RaisingEnv):
    release = threading.Event()  # set at the end of the module: the threads may finish

    def step(self, action_text):
        self.release.wait()
        return StepResult("", 0.0, True, {})


@pytest.fixture(autouse=True, scope="module")
def _release_hung_calls():
    yield
    HangingEnv.release.set()


def _engine(**kw):
    return EngineConfig(**{"num_slots": 4, "max_len": 32, "max_turn_tokens": 4, **kw})


def _sync(model, env, *, timeout=60.0, errors=3, **engine_kw):
    src = SyncRollouts(
        model[0], FakeTokenizer(), env, _Prompts(), _engine(**engine_kw),
        take_timeout_s=timeout, max_env_errors=errors,
    )  # fmt: skip
    src.publish(model[1], 0)
    return src


def _async(model, env, *, timeout=60.0, errors=3, **engine_kw):
    src = AsyncRollouts(
        model[0], FakeTokenizer(), env, _Prompts(), _engine(**engine_kw),
        SamplerConfig(max_env_errors=errors), take_timeout_s=timeout,
    )  # fmt: skip
    src.publish(model[1], 0)
    src.start()
    return src


@contextlib.contextmanager
def within(seconds):
    t0 = time.monotonic()
    yield
    assert time.monotonic() - t0 < seconds, f"took {time.monotonic() - t0:.1f}s > {seconds}s"


# ------------------------------------------------------------------ env always raises


def test_env_always_raises_sync_and_async(model):
    with within(SLACK_S), pytest.raises(EnvErrorLimit, match="boom") as e:
        _sync(model, RaisingEnv).take(4)
    assert "max_env_errors" in str(e.value) and "env_error" in str(e.value)
    src = _async(model, RaisingEnv)
    try:
        with within(SLACK_S), pytest.raises(SamplerError, match="boom"):
            src.take(4)
    finally:
        assert src.stop()


def test_evaluation_with_a_broken_env_fails_naming_it(model):
    """An evaluation whose episodes the env mostly fails raises EnvErrorLimit; below the
    limit the failures are counted as policy failures and reported."""
    env_prompts = [Prompt(f"e{i}", "bcd", None, {}) for i in range(6)]
    ev = Evaluator(
        model[0], FakeTokenizer(), RaisingEnv, env_prompts, _engine(), sampled=False,
        max_env_errors=4,
    )  # fmt: skip
    with pytest.raises(EnvErrorLimit, match=r"greedy evaluation: 4 environment failures in a"):
        ev(model[1])  # at the 4th failure in a row, not after every prompt
    ev.max_env_errors = 7  # six failures stay under the limit
    out = ev(model[1])
    assert out["eval/greedy_env_failures"] == 6 and out["eval/greedy_success"] == 0


# ------------------------------------------------------------------ env hangs


def test_env_hangs_with_env_timeout(model):
    """3 timeouts of 0.5 s in a row: EnvErrorLimit naming the timeout, within ~2 s."""
    with within(SLACK_S), pytest.raises(EnvErrorLimit, match="exceeded env_timeout_s=0.5"):
        _sync(model, HangingEnv, env_timeout_s=0.5).take(4)
    src = _async(model, HangingEnv, env_timeout_s=0.5)
    try:
        with within(SLACK_S), pytest.raises(SamplerError, match="env_timeout"):
            src.take(4)
    finally:
        assert src.stop()


def test_env_hangs_without_env_timeout_take_timeout_bounds_it(model):
    """No trajectory for take_timeout_s: NoProgress (a TimeoutError), one line naming the
    bound's field and what came; in evaluation too (its stall bound)."""
    want = r"take\(4\): timed out after 1.5s without a trajectory \(train.take_timeout_s"
    with within(SLACK_S), pytest.raises(NoProgress, match=want) as e:
        _sync(model, HangingEnv, timeout=1.5, env_timeout_s=None).take(4)
    assert "\n" not in str(e.value) and "0 of 4 taken" in str(e.value)
    src = _async(model, HangingEnv, timeout=1.5, env_timeout_s=None)
    try:
        with within(SLACK_S), pytest.raises(NoProgress, match="timed out after 1.5s"):
            src.take(4)
    finally:
        assert src.stop(timeout=2 * SLACK_S)  # compiling, then leaving the env-call wait
    env_prompts = [Prompt(f"e{i}", "bcd", None, {}) for i in range(6)]
    ev = Evaluator(
        model[0], FakeTokenizer(), HangingEnv, env_prompts, _engine(env_timeout_s=None),
        sampled=False, stall_timeout_s=1.5,
    )  # fmt: skip
    with within(SLACK_S), pytest.raises(NoProgress, match="greedy evaluation: no episode ended"):
        ev(model[1])


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_prompts_that_never_fit_max_len_stop_naming_the_drops(model, kind):
    """Every prompt longer than max_len (the issue's max_len=4): not a silent stall until
    the take timeout, but NoProgress after max_dropped_in_a_row drops, naming the reason,
    the counts and max_len, within seconds."""
    engine = dict(max_len=4)
    if kind == "sync":
        with within(SLACK_S), pytest.raises(NoProgress, match="prompt_too_long") as e:
            _sync(model, RaisingEnv, timeout=600.0, **engine).take(4)
        message = str(e.value)
    else:
        src = AsyncRollouts(
            model[0], FakeTokenizer(), RaisingEnv, _Prompts(), _engine(**engine),
            SamplerConfig(max_dropped_in_a_row=16), take_timeout_s=600.0,
        )  # fmt: skip
        src.publish(model[1], 0)
        src.start()
        try:
            with within(SLACK_S), pytest.raises(SamplerError, match="prompt_too_long") as e:
                src.take(4)
            message = str(e.value)
            assert src.stats()["dropped"]["prompt_too_long"] >= 16  # counted, not silent
        finally:
            assert src.stop()
    assert "episodes dropped in a row" in message and "max_len=4" in message, message
    assert "sampling.max_dropped_in_a_row" in message and "\n" not in message


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_sigterm_wins_over_a_hanging_env(model, kind):
    """No env timeout, a 600 s take timeout: SIGTERM ends the take within seconds."""
    make = _sync if kind == "sync" else _async
    src = make(model, HangingEnv, timeout=600.0, env_timeout_s=None)
    with checkpointing.GracefulExit() as g:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(stop.StopRequested, match="SIGTERM"):
            src.take(4)
        assert g.requested and time.monotonic() - t0 < SLACK_S
    assert not stop.requested()  # cleared on leaving the block
    assert src.stop(timeout=2 * SLACK_S)


def test_env_calls_pool_gives_up_on_stuck_calls():
    calls = EnvCalls(workers=2, timeout_s=0.05, max_stuck=3, poll_s=0.01)
    for _ in range(4):  # each times out, gives its slot back and keeps running
        c = calls.submit(HangingEnv.release.wait)
        with contextlib.suppress(EnvCallsStuck):
            calls.wait([c])
    with pytest.raises(EnvCallsStuck, match="still running past env_timeout_s=0.05"):
        calls.wait([calls.submit(HangingEnv.release.wait)])
    assert calls.call(lambda x: x + 1, 1) == 2  # slots were given back


# ------------------------------------------------------------------ env calls off the decoder


class GateEnv:
    """Prompt 'p0' waits at its step until `gate` opens; every other prompt is instant."""

    stop_strings = ("a",)
    max_turns = 2
    gate = threading.Event()

    def reset(self, prompt):
        self.uid = prompt.uid
        return prompt.text

    def step(self, action_text):
        if self.uid == "p0":
            self.gate.wait(120)
        return StepResult("", 1.0, True, {"success": True})


def test_a_slow_env_call_does_not_stall_the_other_slots(model):
    src = _async(model, GateEnv, env_timeout_s=None)
    try:
        got = src.take(12)  # p0 is parked in its env call the whole time
        assert "p0" not in {t.prompt_uid for t in got}
        GateEnv.gate.set()
        later = []
        while "p0" not in {t.prompt_uid for t in later}:
            later += src.take(1)
    finally:
        GateEnv.gate.set()
        assert src.stop()


def test_concurrent_env_calls_keep_sync_rollouts_deterministic(model):
    """Env steps of one decode call run in parallel threads, but their results are applied
    in slot order: the same trajectories as one env call at a time."""
    runs = []
    for workers in (1, 8):
        src = _sync(model, GateEnv, env_workers=workers)
        GateEnv.gate.set()
        runs.append(src.take(8))
    for a, b in zip(*runs, strict=True):
        assert a.prompt_uid == b.prompt_uid
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.rollout_logp, b.rollout_logp)


# ------------------------------------------------------------------ the LLM judge


def _style_env(judge):
    return lambda: style.StyleEnv(judge=judge)


def test_judge_refuses_counts_as_env_errors_and_is_named(model):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = J.LLMJudge(f"http://127.0.0.1:{port}/v1", "judge", max_retries=1, backoff_s=0.01)
    with within(SLACK_S), pytest.raises(EnvErrorLimit, match="ConnectionRefusedError") as e:
        _sync(model, _style_env(judge)).take(4)
    assert "env_dropped" in str(e.value)
    src = _async(model, _style_env(judge))
    try:
        with within(SLACK_S), pytest.raises(SamplerError, match="ConnectionRefusedError"):
            src.take(4)
    finally:
        assert src.stop()


@pytest.fixture
def trickle_server():
    """Accepts on 127.0.0.1 and answers every request one byte every 0.2 s, forever."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    done = threading.Event()
    hits = []

    def serve(conn):
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000
        with conn:
            for byte in reply:
                if done.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def accept():
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            hits.append(time.monotonic())
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1], hits
    done.set()
    thread.join(5)
    srv.close()


def test_judge_trickle_is_cut_at_the_total_deadline(trickle_server):
    port, hits = trickle_server
    judge = J.LLMJudge(
        f"http://127.0.0.1:{port}/v1", "judge", timeout_s=1.0, max_retries=10,
        backoff_s=0.01, deadline_s=2.5,
    )  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(J.JudgeError, match=r"deadline_s=2.5\): no complete answer within"):
        judge.score(style.make_prompt(["moon"]), "text", "cute")
    assert time.monotonic() - t0 < 2.5 + 2.0  # the deadline, plus thread wake-ups
    assert 2 <= len(hits) <= 4  # per-attempt bound 1 s: a few attempts fit in 2.5 s


def test_judge_trickle_in_rollouts_ends_with_the_judge_named(model, trickle_server):
    """A judge that trickles: each call is cut at its deadline (1 s), and max_env_errors (3)
    in a row end sync rollouts, async rollouts and an evaluation (which used to run every
    prompt to its deadline first): bound ~ ceil(3 / 4 slots) deadlines each."""
    port, hits = trickle_server
    judge = J.LLMJudge(
        f"http://127.0.0.1:{port}/v1", "judge", timeout_s=0.5, max_retries=0, deadline_s=1.0
    )
    with within(SLACK_S), pytest.raises(EnvErrorLimit, match="no complete answer within"):
        _sync(model, _style_env(judge)).take(4)
    src = _async(model, _style_env(judge))
    try:
        with within(SLACK_S), pytest.raises(SamplerError, match="no complete answer within"):
            src.take(4)
    finally:
        assert src.stop()
    prompts = [Prompt(f"e{i}", "bcd", None, {"topics": ("moon",)}) for i in range(32)]
    ev = Evaluator(
        model[0], FakeTokenizer(), _style_env(judge), prompts, _engine(), sampled=False,
        max_env_errors=3,
    )  # fmt: skip
    before = len(hits)
    with within(SLACK_S), pytest.raises(EnvErrorLimit, match="greedy evaluation: 3 environm"):
        ev(model[1])
    assert len(hits) - before <= 8  # the first slots' calls, not one per prompt (32)


# ------------------------------------------------------------------ the main job

JOB_CONFIG = """
from configs import sao
from sao_jax.config import ConfigDict


def get_config(arg=None):
    c = sao.get_config("smoke")
    c.sampling.max_turn_tokens, c.sampling.max_len = 64, 96
    c.train.eval_every, c.train.total_steps, c.train.log_every = 0, 4, 1
    c.init.kind, c.sft.steps = "random", 0  # no warm start to compile: value pretraining's
    # rollouts call the judge first
    c.env.name = "style"  # the style task: a judge scores it
    c.env.params = ConfigDict(dict(switch_steps=(50, 100)))
    c.env.prompts = ConfigDict(dict(n_topics=(1, 2)))
    c.env.params.judge = dict(base_url="http://127.0.0.1:{port}/v1", model="judge", **{judge})
    c.sampling.env_timeout_s = {env_timeout}
    c.sampling.max_env_errors = 4
    c.env.eval_size = 4
    c.value_pretrain.steps = 1
    c.train.eval_sampled, c.train.report = False, False
    return c
"""


def _job(tmp_path, cache_env, port, judge, env_timeout, log):
    config = tmp_path / "hang_config.py"
    config.write_text(JOB_CONFIG.format(port=port, judge=judge, env_timeout=env_timeout))
    cmd = [sys.executable, "-m", "experiments.train", f"--config={config}"]
    cmd.append(f"--workdir={tmp_path / 'w'}")
    env = {**os.environ, **cache_env, "PYTHONPATH": str(ts.REPO)}
    return subprocess.Popen(cmd, cwd=ts.REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_main_job_with_a_refusing_judge_fails_naming_it(tmp_path, cache_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = dict(timeout_s=1.0, max_retries=1, backoff_s=0.01)
    with (tmp_path / "log.txt").open("w") as log:
        proc = _job(tmp_path, cache_env, port, judge, 5.0, log)
        try:
            rc = proc.wait(timeout=JOB_BOUND_S)
        finally:
            proc.kill()
    out = (tmp_path / "log.txt").read_text()
    assert rc == 2, out[-3000:]
    (fatal,) = [line for line in out.splitlines() if line.startswith("FATAL")]
    assert "EnvErrorLimit" in fatal and "ConnectionRefusedError" in fatal, fatal
    assert "Traceback" not in out


@pytest.mark.slow
def test_main_job_blocked_on_a_silent_judge_honours_sigterm(tmp_path, cache_env):
    """No env timeout, a 600 s judge deadline: only SIGTERM ends it, with exit 0."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held = []
    judge = dict(timeout_s=600.0, deadline_s=600.0, max_retries=0)
    with (tmp_path / "log.txt").open("w") as log:
        proc = _job(tmp_path, cache_env, srv.getsockname()[1], judge, None, log)
        try:
            srv.settimeout(JOB_BOUND_S)
            held.append(srv.accept()[0])  # a judge call is waiting for us: the job is blocked
            time.sleep(1.0)
            assert proc.poll() is None
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=SIGTERM_BOUND_S)
            took = time.monotonic() - t0
        finally:
            proc.kill()
            for c in held:
                c.close()
            srv.close()
    out = (tmp_path / "log.txt").read_text()
    assert rc == 0 and took < SIGTERM_BOUND_S, out[-3000:]
    assert "stop requested (SIGTERM)" in out and "before the first checkpoint" in out
