"""Async sampler (threads, bounded queue, versions, staleness, failures) and engine drops."""

import itertools
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.defaults import sampling_section
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.rl.batch import check_batch
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.generate import GenerateFns
from sao_jax.sampling.sampler import (
    AsyncSampler,
    EnvErrorLimit,
    PromptsExhausted,
    SamplerConfig,
    SamplerError,
    configs_from_section,
)
from sao_jax.schema import ConfigError
from tests.sampling_support import MODEL, FakeTokenizer, TurnEnv

ENGINE = EngineConfig(num_slots=4, max_len=64, max_turn_tokens=8)


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


@pytest.fixture(scope="module")
def fns(model):
    return GenerateFns(model[0], num_slots=4, max_len=64)


def endless(turns=2):
    for i in itertools.count():
        yield Prompt(f"p{i}", "bcd" * (1 + i % 4), None, {"turns": turns})


def sampler_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sao-sampler")]


def make(model, fns, prompts=None, env=TurnEnv, **cfg):
    return AsyncSampler(
        model[0], FakeTokenizer(), env, endless() if prompts is None else prompts,
        engine=ENGINE, config=SamplerConfig(**cfg), fns=fns,
    )  # fmt: skip


def wait_until(cond, timeout=180.0):
    """Poll `cond` until true; the generous bound only matters on a loaded machine (the first
    condition waits for a compile)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_take_versions_batch_and_clean_stop(model, fns):
    params = model[1]
    with make(model, fns, num_workers=2, queue_size=8) as s:
        s.publish(params, 0)
        first = s.take(6, timeout=60)
        s.publish(jax.tree.map(lambda x: x * 1.05, params), 1)
        later = []
        while not any(t.versions[t.action_mask].max() == 1 for t in later):
            later += s.take(2, timeout=60)
        batch, trajs = s.take_batch(4, timeout=60, length_bucket=16)
        check_batch(batch)
        assert batch["tokens"].shape[0] == 4 and batch["tokens"].shape[1] % 16 == 0
        stats = s.stats()
    assert not sampler_threads()
    for t in first + later + trajs:
        assert np.all(np.diff(t.versions) >= 0), "versions never go back along a trajectory"
    assert all(t.versions.max() == 0 for t in first)
    assert stats["taken"] == len(first) + len(later) + 4
    assert sum(stats["staleness"].values()) == stats["taken"]
    assert stats["generated"] >= stats["taken"]


def test_staleness_cap_drops_old_trajectories(model, fns):
    params = model[1]
    with make(model, fns, queue_size=4, max_staleness=1) as s:
        s.publish(params, 0)
        wait_until(lambda: s.stats()["queued"] == 4)  # the worker now blocks on a full queue
        s.publish(params, 5)
        taken = s.take(3, timeout=60)
        stats = s.stats()
    assert stats["dropped"]["stale"] >= 4
    assert all(5 - t.min_version <= 1 for t in taken)
    assert set(stats["staleness"]) <= {0, 1}


def test_model_exception_reaches_the_learner_chained(model, fns):
    bad = jax.tree.map(lambda x: x, model[1])
    emb = bad["trunk"]["embed"]
    emb["embedding"] = emb["embedding"][:, :5]  # wrong width: fails inside the jitted step
    s = make(model, fns).start()
    s.publish(bad, 0)
    t0 = time.monotonic()
    with pytest.raises(SamplerError, match="worker 0 failed") as info:
        s.take(1, timeout=60)
    assert time.monotonic() - t0 < 30
    assert info.value.__cause__ is not None and info.value.__cause__.__traceback__ is not None
    assert s.stop(60) and not sampler_threads()


class FlakyEnv(TurnEnv):
    """Raises inside step for prompts whose uid is in `bad` (all of them if bad is None)."""

    bad: frozenset | None = frozenset({"p1", "p4"})

    def reset(self, prompt):
        self.uid = prompt.uid
        return super().reset(prompt)

    def step(self, action_text):
        if self.bad is None or self.uid in self.bad:
            raise RuntimeError(f"env bug on {self.uid}")
        return super().step(action_text)


class BrokenEnv(FlakyEnv):
    bad = None


def test_env_exceptions_drop_then_repeated_ones_kill(model, fns):
    params = model[1]
    prompts = [Prompt(f"p{i}", "bcd", None, {"turns": 1}) for i in range(8)]
    with make(model, fns, prompts=prompts, env=FlakyEnv) as s:
        s.publish(params, 0)
        got = s.take(6, timeout=60)
        with pytest.raises(PromptsExhausted):
            s.take(1, timeout=60)
        stats = s.stats()
    assert sorted(t.prompt_uid for t in got) == [f"p{i}" for i in (0, 2, 3, 5, 6, 7)]
    assert stats["dropped"] == {"env_error": 2}
    with make(model, fns, env=BrokenEnv, max_env_errors=3) as s:
        s.publish(params, 0)
        with pytest.raises(SamplerError) as info:
            s.take(1, timeout=60)
    assert isinstance(info.value.__cause__, EnvErrorLimit)
    assert isinstance(info.value.__cause__.__cause__, RuntimeError)
    assert not sampler_threads()


def test_backpressure_stop_timeout_and_exhaustion(model, fns):
    params = model[1]
    s = make(model, fns, queue_size=2).start()
    with pytest.raises(TimeoutError):
        s.take(1, timeout=0.3)  # nothing published yet
    s.publish(params, 0)
    wait_until(lambda: s.stats()["queued"] == 2)
    time.sleep(0.2)
    assert s.stats()["generated"] == 2, "a full queue blocks the worker"
    t0 = time.monotonic()
    assert s.stop(60) and time.monotonic() - t0 < 30  # prompt, with slack for a loaded box
    assert not sampler_threads()
    prompts = [Prompt(f"p{i}", "bc", None, {"turns": 1}) for i in range(5)]
    with make(model, fns, prompts=prompts) as s:
        s.publish(params, 0)
        assert len(s.take(3, timeout=60)) == 3
        with pytest.raises(PromptsExhausted, match="2 trajectories left"):
            s.take(3, timeout=60)
        assert len(s.take(2, timeout=60)) == 2


def run_lockstep(model, fns, steps=3, n=4):
    params = model[1]
    out = []
    with make(model, fns, lockstep=n, queue_size=n + 4, seed=11) as s:
        s.publish(params, 0)
        for v in range(1, steps + 1):
            out += s.take(n, timeout=60)
            params = jax.tree.map(lambda x: x * 1.1, params)
            s.publish(params, v)
    return out


def test_lockstep_mode_is_deterministic(model, fns):
    a, b = run_lockstep(model, fns), run_lockstep(model, fns)
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        assert x.prompt_uid == y.prompt_uid
        for name in ("tokens", "versions", "rollout_logp", "sampled_logp"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    assert any(len(set(t.versions[t.action_mask])) > 1 for t in a), "some span versions"
    assert not sampler_threads()


# ---- engine-level bad input -----------------------------------------------------------


class HostileEnv:
    """Behaviour chosen by the prompt text: hang, garbage, huge or non-UTF-8 output."""

    stop_strings = ("a",)
    max_turns = 2

    def reset(self, prompt):
        self.kind = prompt.meta["kind"]
        if self.kind == "reset_raises":
            raise KeyError("no such task")
        return prompt.text

    def step(self, action_text):
        if self.kind == "hang":
            time.sleep(3)
        if self.kind == "garbage":
            return {"observation": "x"}
        if self.kind == "nan_reward":
            return StepResult("", float("nan"), True)
        if self.kind == "huge_obs":
            return StepResult("b" * 1000, 0.0, False)
        if self.kind == "bad_bytes":
            return StepResult(
                "\udcff\x00é" + b"\xff\xfe".decode("utf-8", "surrogateescape"), 0, False
            )
        return StepResult("<ok>", 1.0, False)


def test_engine_bad_inputs_drop_or_truncate_without_hanging(model, fns):
    params = model[1]
    cfg = EngineConfig(num_slots=4, max_len=64, max_turn_tokens=8, env_timeout_s=0.3)
    eng = Engine(fns, FakeTokenizer(), HostileEnv, cfg)
    kinds = ["hang", "garbage", "nan_reward", "huge_obs", "bad_bytes", "ok", "reset_raises"]
    prompts = [Prompt(k, "bcd", None, {"kind": k}) for k in kinds]
    prompts += [Prompt("long", "b" * 80, None, {"kind": "ok"})]
    t0 = time.monotonic()
    trajs, drops = eng.run(params, prompts)
    assert time.monotonic() - t0 < 30
    reasons = {d.prompt_uid: d.reason for d in drops}
    assert reasons == {
        "hang": "env_timeout",
        "garbage": "env_error",
        "nan_reward": "env_error",
        "reset_raises": "env_error",
        "long": "prompt_too_long",
    }
    assert "max_len=64" in str(next(d.error for d in drops if d.prompt_uid == "long"))
    by_uid = {t.prompt_uid: t for t in trajs}
    assert set(by_uid) == {"huge_obs", "bad_bytes", "ok"}
    assert by_uid["huge_obs"].info["truncation"] == "max_len"
    assert by_uid["huge_obs"].num_turns == 1 and by_uid["huge_obs"].truncated
    for uid in ("bad_bytes", "ok"):
        assert by_uid[uid].info["truncation"] == "max_turns" and by_uid[uid].num_turns == 2
    obs = by_uid["bad_bytes"].tokens[~by_uid["bad_bytes"].action_mask]
    assert (obs == FakeTokenizer.unk_id).sum() >= 4
    empty = Engine(fns, FakeTokenizer(), HostileEnv, EngineConfig(max_len=64, add_bos=False))
    _, drops = empty.run(params, [Prompt("e", "", None, {"kind": "ok"})])
    assert [d.reason for d in drops] == ["empty_prompt"]


def test_engine_config_errors_name_the_field(model, fns):
    with pytest.raises(ValueError, match="max_turn_tokens"):
        EngineConfig(max_turn_tokens=0)
    with pytest.raises(ValueError, match="prefill_buckets"):
        EngineConfig(prefill_buckets=(16, 8))
    with pytest.raises(ValueError, match="num_slots"):
        Engine(fns, FakeTokenizer(), TurnEnv, EngineConfig(num_slots=3, max_len=64))
    with pytest.raises(ValueError, match="lockstep"):
        SamplerConfig(lockstep=2, num_workers=2)


def test_sampling_config_section():
    section = sampling_section()
    engine, sampler = configs_from_section(section, seed=5)
    assert engine == EngineConfig() and sampler == SamplerConfig(seed=5)
    section.max_staleness, section.top_p = 2, 0.9
    engine, sampler = configs_from_section(section)
    assert sampler.max_staleness == 2 and engine.top_p == 0.9
    section.top_p = 0.0
    with pytest.raises(ConfigError, match="top_p"):
        configs_from_section(section)
    with pytest.raises(ConfigError, match="sampling.bogus"):
        configs_from_section({"bogus": 1})
    with pytest.raises(ConfigError, match="sampling.queue_size"):
        configs_from_section({"lockstep": 64, "queue_size": 64})
