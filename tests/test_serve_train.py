"""Training SAO on agent harnesses' episodes (sao_jax/serve/source.py, harness.py): the
training-run faults of issue 42 item 11 and the driver's contract, on real processes.

One module-scoped pair of runs of configs/harness.py:smoke (tiny model, batch 2, two
processes of examples/harness/calculator_agent.py at a time, through
tests/harness_faults.py), in this process, with the session's compilation cache:

* run 1 gets SIGTERM (a real signal) after a live client's late reward was trained and
  while a hanging harness holds a live session: it checkpoints, returns (the entry
  point then exits 0, as tests/test_train.py checks for every run), and drops the live
  sessions as `shutdown`, counted;
* run 2 resumes it in the same workdir; its first two harnesses hang after a call (both
  slots: the run can only go on once they are killed at gateway.harness.timeout_s), the
  next one crashes after a call: their episodes are dropped and counted, and the run
  goes on to its last step.

The timeout's process-group kill, the failure streak, the staleness cap and the sandbox
are checked on their own too, without a model; a short run trains on harnesses launched
in the sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import sys
import threading
import time
import types

import openai
import pytest

from sao_jax import train
from sao_jax.config import load_config, validate
from sao_jax.run import accounting
from sao_jax.sampling.sampler import EnvErrorLimit
from sao_jax.sampling.trajectory import Trajectory
from sao_jax.schema import ConfigError
from sao_jax.serve import harness_sandbox
from sao_jax.serve import source as serve_source
from sao_jax.serve.errors import ApiError
from sao_jax.serve.harness import HarnessPool
from sao_jax.serve.settings import HarnessConfig
from sao_jax.serve.source import GatewayRollouts
from tests import train_support as ts
from tests.serve_support import http

REPO = pathlib.Path(__file__).resolve().parents[1]
TOTAL = 7  # RL steps of the pair of runs (run 1 stops at about 4)
SIGTERM_DEADLINE_S = 30.0  # SIGTERM -> run() returned, checkpoint written
STEP_DEADLINE_S = 300.0  # a run step reached (compiles included) on a loaded 2-core box
HARNESS_TIMEOUT_S = 10.0  # gateway.harness.timeout_s: a calculator episode takes 1-5 s here
# (one slower under load is killed and counted too: no assertion counts it out)


def _config(plan_dir: pathlib.Path):
    config = load_config(f"{REPO}/configs/harness.py:smoke")
    # batch 2 over the 8 fake devices (tests/conftest.py): 2-way data, 4-way tensor (the
    # smoke model's 2 kv heads replicated)
    config.mesh.shape = (2, 1, 1, -1)
    config.mesh.rules = tuple(
        (name, None if name in ("kv_heads", "act_kv_heads") else axes)
        for name, axes in config.mesh.rules
    )
    config.train.total_steps = TOTAL
    config.sampling.queue_size = 2
    config.sampling.num_slots = 2  # one per harness process (the live client's call waits)
    config.gateway.harness.timeout_s = HARNESS_TIMEOUT_S
    faults = REPO / "tests" / "harness_faults.py"
    config.gateway.harness.command = (
        f"{{python}} {faults} --plan_dir={plan_dir} --base_url={{base_url}} "
        "--api_key={api_key} --task={task_json}"
    )
    return config


_GIVE_UP = threading.Event()  # run 1 ended before its other thread was done


def _wait(what: str, ok, deadline_s: float = STEP_DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not _GIVE_UP.is_set():
        if value := ok():
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {deadline_s} s: {what}")


def _trained_step(workdir: pathlib.Path) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = [r["step"] for r in ts.read_metrics(workdir) if "policy/loss" in r]
    return max(steps, default=-1)


def _interrupt(box: dict, workdir: pathlib.Path, plan_dir: pathlib.Path, sources: list):
    """Run 1's other thread: a live client's episode with a late reward, then a hanging
    harness, then SIGTERM (to this process; train.run's handler takes it)."""
    try:
        _wait("RL step 1", lambda: _trained_step(workdir) >= 1)
        source = sources[-1]
        g = json.loads((workdir / "gateway.json").read_text())
        _, _, s = http("POST", f"{g['base_url']}/sessions", {"task": {"live": True}}, g["api_key"])
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        client.chat.completions.create(
            model=g["model"], messages=[{"role": "user", "content": "q:2+3"}], max_tokens=8
        )
        called_at = source.stats()["version"]
        _wait("a weight publication after the call", lambda: source._version > called_at)
        status, _, _ = http("POST", f"{s['base_url']}/reward", {"reward": 1.0}, s["api_key"])
        assert status == 200
        box["live"] = (s["id"], called_at)
        _wait("the live episode trained", lambda: any(
            t.info["episode"] == s["id"] for t in source.taken_trajs))  # fmt: skip
        (plan_dir / "armed").touch()  # the next harness to start hangs after one call
        _wait("the hanging harness live", lambda: (plan_dir / "claim-0").exists())
        box["live_at_sigterm"] = source.stats()["live_sessions"]
        box["sigterm_at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
    except BaseException as e:  # the fixture re-raises it
        box["error"] = e


@pytest.fixture(scope="module")
def runs(tmp_path_factory, jax_cache_dir):
    root = tmp_path_factory.mktemp("harness_train")
    workdir, plan_dir = root / "run", root / "plan"
    plan_dir.mkdir()
    (plan_dir / "plan").write_text("hang")
    config = _config(plan_dir)
    sources: list[GatewayRollouts] = []

    class Recording(GatewayRollouts):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.taken_trajs: list[Trajectory] = []
            sources.append(self)

        def take(self, n, timeout=None):
            out = super().take(n, timeout)
            self.taken_trajs += out
            return out

    box: dict = {}
    with ts.persistent_compilation_cache(jax_cache_dir), pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve_source, "GatewayRollouts", Recording)  # train.py imports it per run
        thread = threading.Thread(
            target=_interrupt, args=(box, workdir, plan_dir, sources), daemon=True
        )
        # a SIGTERM that would come after run 1 returned must not end this process
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        thread.start()
        t0 = time.monotonic()
        try:
            first = train.run(config, workdir)
        finally:
            _GIVE_UP.set()
            returned = time.monotonic()
            thread.join(5)
            signal.signal(signal.SIGTERM, previous)
        _GIVE_UP.clear()
        if "sigterm_at" not in box:
            raise AssertionError(
                f"run 1 ended at step {first['steps']} before its SIGTERM"
            ) from box.get("error")
        # run 2: both processes hang after a call (so the run waits for their timeout),
        # then one crashes after a call; the others are well behaved
        (plan_dir / "plan").write_text("hang,hang,crash")
        for claim in plan_dir.glob("claim-*"):
            claim.unlink()
        second = train.run(config, workdir)
    return types.SimpleNamespace(
        config=config, workdir=workdir, first=first, second=second, sources=sources,
        box=box, stop_s=returned - box["sigterm_at"], first_s=returned - t0,
        episodes=[json.loads(line) for line in (workdir / "episodes.jsonl").open()],
    )  # fmt: skip


@pytest.mark.slow
def test_sigterm_with_live_sessions_checkpoints_and_drops_them(runs):
    first, source = runs.first, runs.sources[0]
    assert first["interrupted"] is True and 1 <= first["steps"] < TOTAL
    assert runs.stop_s < SIGTERM_DEADLINE_S, runs.stop_s
    assert ts.saved_steps(runs.workdir)[-1] >= first["steps"]
    assert runs.box["live_at_sigterm"] >= 1  # the hanging harness at least
    shutdown = source.stats()["dropped"]["shutdown"]  # run 1's: the live sessions
    assert shutdown >= 1 and first["counters"]["dropped_episodes"] >= shutdown
    assert sum(e["dropped"] == "shutdown" for e in runs.episodes) >= shutdown + 1  # + run 2's
    assert source.stats()["live_sessions"] == 0 and source.pool.running == []
    assert ts.unbalanced(first["counters"]) is None


@pytest.mark.slow
def test_resume_trains_to_the_last_step(runs):
    second, first = runs.second, runs.first
    assert second["steps"] == TOTAL and second["interrupted"] is False
    assert second["after"]  # the final evaluation ran
    trained = second["counters"]["trained"]
    assert trained == TOTAL * runs.config.rl.batch_size
    assert ts.unbalanced(second["counters"]) is None
    assert second["counters"]["discarded"] >= first["counters"]["in_flight"]
    assert runs.sources[1].stats()["version"] == TOTAL


@pytest.mark.slow
def test_crashed_harness_is_dropped_counted_and_the_run_goes_on(runs):
    source = runs.sources[1]
    crashed = [e for e in runs.episodes if e["dropped"] == "harness_error"]
    assert len(crashed) == 1 and crashed[0]["calls"] == 1
    assert source.stats()["dropped"]["harness_error"] == 1
    assert source.stats()["harness_failed"] == 1
    kept = list((runs.workdir / "harness").glob(f"*-{crashed[0]['id']}"))
    assert len(kept) == 1 and (kept[0] / "stderr.txt").exists()  # its logs are kept
    assert runs.second["steps"] == TOTAL


@pytest.mark.slow
def test_hanging_harnesses_are_killed_dropped_counted_and_the_run_goes_on(runs):
    source = runs.sources[1]
    by_id = {e["id"]: e for e in runs.episodes}
    hung = [d for d in (runs.workdir / "harness").iterdir()
            if (d / "stdout.txt").read_text().startswith("fault: hang")]  # fmt: skip
    reasons = sorted(by_id[d.name.split("-", 1)[1]]["dropped"] for d in hung)
    assert reasons == ["harness_timeout", "harness_timeout", "shutdown"]  # run 2's, run 1's
    assert source.stats()["dropped"]["harness_timeout"] >= 2
    assert source.stats()["harness_timed_out"] >= 2
    assert runs.second["steps"] == TOTAL


@pytest.mark.slow
def test_trained_rows_are_the_recorded_episodes(runs):
    """Every trained row is a segment of an episodes.jsonl record, token for token, with
    its recorded log-probs and versions; the learner's staleness is measured from them."""
    by_id = {e["id"]: e for e in runs.episodes}
    taken = [t for s in runs.sources for t in s.taken_trajs]
    assert len(taken) >= TOTAL * runs.config.rl.batch_size
    for t in taken:
        seg = by_id[t.info["episode"]]["segments"][t.info["segment"]]
        assert t.tokens.tolist() == seg["token_ids"]
        assert t.action_mask.astype(int).tolist() == seg["action_mask"]
        acts = [i for i, m in enumerate(seg["action_mask"]) if m]
        assert [float(t.rollout_logp[i]) for i in acts] == pytest.approx(
            [seg["logprobs"][i] for i in acts], abs=1e-6
        )
        assert [int(t.versions[i]) for i in acts] == [seg["versions"][i] for i in acts]
    stale = runs.second["staleness_hist"]
    assert sum(stale.values()) > 0


@pytest.mark.slow
def test_a_live_sessions_late_reward_is_trained(runs):
    """Serve with training on: an outside client's session, its reward posted after a
    weight publication, is trained with its staleness measured from its oldest token."""
    sid, called_at = runs.box["live"]
    ep = next(e for e in runs.episodes if e["id"] == sid)
    assert ep["reward"] == 1.0 and ep["dropped"] is None
    versions = [v for v in ep["segments"][0]["versions"] if v is not None]
    assert max(versions) <= called_at
    trajs = [t for t in runs.sources[0].taken_trajs if t.info["episode"] == sid]
    assert len(trajs) == 1 and trajs[0].min_version == min(versions)


# ------------------------------------------------------------- without a model


class _Chat:
    template = None


def _source(**kw) -> GatewayRollouts:
    section = validate(load_config(f"{REPO}/configs/harness.py:smoke")).gateway
    args = dict(policy_def=None, tokenizer=None, chat=_Chat(), engine_cfg=None, prompts=None,
                workdir=pathlib.Path("/nonexistent"), seed=0, queue_size=4, max_env_errors=3,
                take_timeout_s=5.0)  # fmt: skip
    return GatewayRollouts(section, **{**args, **kw})


def _record(sid: str, versions: list[list[int]], reward: float = 1.0) -> dict:
    """An episodes.jsonl record with one segment per entry: 2 observation tokens, then
    one action token per version."""
    segments = [
        {"token_ids": [1, 2, *range(3, 3 + len(v))], "action_mask": [0, 0] + [1] * len(v),
         "logprobs": [None, None] + [-0.5] * len(v), "versions": [None, None, *v]}
        for v in versions
    ]  # fmt: skip
    return {"id": sid, "reward": reward, "dropped": None, "turn_rewards": None,
            "segments": segments, "task": None}  # fmt: skip


def test_staleness_cap_drops_whole_episodes_when_taken():
    source = _source()
    source.max_staleness = 2
    source._on_episode(_record("old", [[1, 3], [4]]))  # oldest token: version 1
    source._on_episode(_record("new", [[4], [5]]))
    source._on_episode({"id": "x", "dropped": "harness_timeout", "segments": []})
    source.publish(None, 4)  # oldest 1: lag 3 > 2 -> dropped whole, when taken
    got = source.take(1, timeout=1)
    assert [t.info["episode"] for t in got] == ["new"]
    stats = source.stats()
    assert stats["dropped"] == {"stale": 2, "harness_timeout": 1}
    assert stats["queued"] == 1 and stats["staleness"] == {0: 1}
    source.publish(None, 7)  # the rest of an accepted episode is not checked again
    assert [t.info["segment"] for t in source.take(1, timeout=1)] == [1]
    source.give_back(got)
    assert source.stats()["taken"] == 1 and source.take(1, timeout=1)[0].info["episode"] == "new"
    counters = accounting.counters(accounting.resume_counters({}), source.stats())
    assert ts.unbalanced(counters) is None


def test_harness_failures_in_a_row_stop_the_take_naming_the_last():
    source = _source()
    for i in range(3):
        source._on_failure("harness_error", f"harness {i} exited with status 3")
    with pytest.raises(EnvErrorLimit, match="3 harness failures in a row.*harness 2 exited"):
        source.take(1, timeout=1)


def test_hanging_harness_is_killed_with_its_process_group(tmp_path):
    """A harness past gateway.harness.timeout_s is killed (its child too: the group) and
    its episode dropped; the pool goes on launching."""
    ended, failures = [], []
    pids = tmp_path / "pids"
    script = (  # a harness whose child would outlive it without the group kill
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pids)!r}, 'a').write(str(p.pid) + ' '); time.sleep(60)"
    )
    cfg = HarnessConfig(command=("{python}", "-c", script), processes=1, timeout_s=1.0)
    prompts = iter(
        [types.SimpleNamespace(uid=f"p{i}", text="q", answer=1, meta={}) for i in range(2)]
    )
    sessions = iter(range(10))

    def open_session(task, base_url):
        return {"id": f"s{next(sessions)}", "base_url": "u", "api_key": "k"}

    pool = HarnessPool(
        cfg, prompts, open_session=open_session,
        end_session=lambda sid, reason: ended.append((sid, reason)),
        workdir=tmp_path, on_failure=lambda reason, msg: failures.append(reason),
    )  # fmt: skip
    t0 = time.monotonic()
    pool.start()
    _wait("two harnesses timed out", lambda: len(ended) == 2, deadline_s=30)
    pool.stop()
    assert time.monotonic() - t0 < 15  # 2 x (1 s timeout + kill) with slack
    assert ended == [("s0", "harness_timeout"), ("s1", "harness_timeout")]
    assert failures == ["harness_timeout"] * 2 and pool.counters["timed_out"] == 2
    for pid in map(int, pids.read_text().split()):  # the grandchildren are gone too
        _wait(f"pid {pid} gone", lambda pid=pid: not pathlib.Path(f"/proc/{pid}").exists()
              or "Z" in pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2], 10)  # fmt: skip


@pytest.mark.parametrize(
    "field, value",
    [
        ("gateway.mode", "sometimes"),
        ("gateway.harness.command", "agent --url={base}"),
        ("gateway.harness.command", ""),
        ("gateway.harness.processes", 0),
        ("gateway.max_staleness", -1),
        ("gateway.mode", "harness"),
    ],
)
def test_bad_gateway_fields_are_named(field, value):
    config = load_config(f"{REPO}/configs/harness.py:smoke")
    *path, leaf = field.split(".")
    node = config
    for p in path:
        node = node[p]
    node[leaf] = value
    if field == "gateway.mode" and value == "harness":
        config.env.group_size = 2
        config.rl.batch_size = 2
    with pytest.raises(ConfigError, match=f"config field {field}"):
        validate(config)


@pytest.mark.skipif(bool(harness_sandbox.unavailable()), reason="bubblewrap unavailable")
def test_sandboxed_harness_reaches_only_the_gateway(tmp_path):
    """Inside the sandbox the harness's base_url (the forwarder on its own loopback)
    reaches the gateway's Unix socket; the host's TCP addresses do not exist there."""
    from sao_jax.serve.app import start_server
    from tests.serve_support import ScriptedBackend, serve, tokenizer

    tok = tokenizer(tmp_path)
    backend = ScriptedBackend(tok)
    server, gateway = serve(backend, tok, tmp_path)
    sock_dir = tmp_path / "s"
    sock_dir.mkdir()
    unix = start_server(gateway, "127.0.0.1", 0, sock_dir / harness_sandbox.SOCKET_NAME)
    try:
        code = (
            "import os, socket, urllib.request\n"
            "r = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/models',"
            " headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})\n"
            "print(urllib.request.urlopen(r, timeout=10).read().decode())\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {server.port}), timeout=2)\n"
            "    print('host reachable')\n"
            "except OSError as e:\n"
            "    print('host unreachable', type(e).__name__)\n"
        )
        session = gateway.new_session(
            None, None, f"http://127.0.0.1:{harness_sandbox.FORWARD_PORT}"
        )
        work = tmp_path / "w"
        work.mkdir()
        env = {"OPENAI_BASE_URL": session["base_url"], "OPENAI_API_KEY": session["api_key"],
               "PATH": "/usr/bin:/bin", "HOME": str(work)}  # fmt: skip
        argv = harness_sandbox.command([sys.executable, "-c", code], workdir=work,
                                       socket_dir=sock_dir, read_only=(), env=env)  # fmt: skip
        import subprocess

        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert json.loads(lines[0])["data"][0]["id"] == gateway.cfg.model_name
        assert lines[1].startswith("host unreachable"), lines
    finally:
        unix.stop()
        server.stop()
        backend.close()


@pytest.mark.skipif(bool(harness_sandbox.unavailable()), reason="bubblewrap unavailable")
def test_driver_runs_the_calculator_agent_in_the_sandbox(tmp_path):
    """The driver's sandboxed launch (gateway.harness.sandbox): the unmodified calculator
    agent, with the real `openai` client, runs inside bubblewrap, reaches the gateway only
    through its Unix socket, executes the policy's tool call and posts its own reward
    (a scripted backend stands for the policy: a random one never writes the call)."""
    import asyncio

    from sao_jax.serve.app import start_server
    from tests.serve_support import ScriptedBackend, episodes, serve, tokenizer

    tok = tokenizer(tmp_path)
    backend = ScriptedBackend(tok)
    call = json.dumps({"name": "calculator", "arguments": {"expression": "12 + 30"}})
    backend.script = [f"<tool_call>\n{call}\n</tool_call><|im_end|>", "It is 42.<|im_end|>"]
    server, gateway = serve(backend, tok, tmp_path)
    sock_dir = tmp_path / "s"
    sock_dir.mkdir()
    unix = start_server(gateway, "127.0.0.1", 0, sock_dir / harness_sandbox.SOCKET_NAME)
    agent = REPO / "examples" / "harness" / "calculator_agent.py"
    words = ("{python}", str(agent), "--base_url={base_url}", "--api_key={api_key}",
             "--task={task_json}")  # fmt: skip
    cfg = HarnessConfig(command=words, processes=1, timeout_s=60.0, sandbox=True,
                        sandbox_paths=(str(agent.parent),))  # fmt: skip
    ended, failures = [], []

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, server.loop).result(30)

    async def new(task, base_url):
        return gateway.new_session(task, None, base_url)

    def end(sid, reason):
        ended.append((sid, reason))
        with contextlib.suppress(ApiError):  # the agent posted its reward: ended
            on_loop(gateway.end(sid, None, None, reason))

    prompt = types.SimpleNamespace(uid="t1", text="what is 12 + 30?", answer=42, meta={})
    pool = HarnessPool(
        cfg, iter([prompt]), open_session=lambda task, base: on_loop(new(task, base)),
        end_session=end, workdir=tmp_path, on_failure=lambda r, m: failures.append(m),
        socket_dir=sock_dir,
    )  # fmt: skip
    try:
        pool.start()
        _wait("the sandboxed agent's episode", lambda: ended, deadline_s=60)
        pool.stop()
        assert failures == [] and ended[0][1] is None, failures
        (ep,) = episodes(tmp_path)
        assert ep["reward"] == 1.0 and ep["calls"] == 2 and ep["task"]["answer"] == 42
        seg = ep["segments"][0]
        obs = [t for t, m in zip(seg["token_ids"], seg["action_mask"], strict=True) if not m]
        assert "<tool_response>\n42\n</tool_response>" in tok.decode(obs)
    finally:
        pool.stop()
        unix.stop()
        server.stop()
        backend.close()


@pytest.mark.skipif(bool(harness_sandbox.unavailable()), reason="bubblewrap unavailable")
def test_a_training_run_trains_on_sandboxed_harnesses(tmp_path, jax_cache_dir, monkeypatch):
    """gateway.harness.sandbox in a training run (configs/harness.py's `sandbox`): every
    harness is the unmodified calculator agent launched inside bubblewrap, reaching the
    gateway through the run's Unix socket only, and the run trains its steps on their
    episodes (the smoke geometry of the module's runs: their compiled programs)."""
    config = _config(tmp_path)
    smoke = load_config(f"{REPO}/configs/harness.py:smoke,sandbox").gateway.harness
    config.gateway.harness.update(
        command=smoke.command, sandbox=True, sandbox_paths=smoke.sandbox_paths, timeout_s=60.0
    )
    config.train.total_steps = 2
    launches = []
    command = harness_sandbox.command

    def recorded(*args, **kwargs):
        launches.append(kwargs)
        return command(*args, **kwargs)

    monkeypatch.setattr(harness_sandbox, "command", recorded)
    workdir = tmp_path / "run"
    with ts.persistent_compilation_cache(jax_cache_dir):
        out = train.run(config, workdir)
    assert out["steps"] == 2 and _trained_step(workdir) == 2
    episodes = [json.loads(line) for line in (workdir / "episodes.jsonl").open()]
    done = [e for e in episodes if e["dropped"] is None]
    assert len(done) >= 2 * config.rl.batch_size and len(launches) >= len(done)
    assert all(k["socket_dir"] is not None for k in launches)  # the run's Unix socket
    assert all(e["calls"] >= 1 and e["segments"] for e in done)
