"""The main job (sao_jax/train.py): config checks, a smoke run's outputs, deterministic
resume (in process and after a real SIGTERM), counter balance, corrupt-checkpoint
fallback, the workdir guard and init errors.

One completed run is shared (a module fixture): `sync_run` (configs/sao.py:smoke,sync, 6
steps, with its report), whose outputs are checked and which is the uninterrupted
reference of the resume test. Asynchronous rollouts end to end: the main job's processes of
tests/test_own_data_e2e.py and tests/test_distributed.py (the counters at a mid-run save
and after a resume are checked there).
Every compiled program goes to the session's persistent compilation cache (tests/conftest.py),
so later runs only trace.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time

import ml_collections
import pytest

from sao_jax import checkpointing, train
from sao_jax import config as config_lib
from sao_jax.data.prompts import prompt_iterator
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def
from sao_jax.parallel.mesh import sharder_from_config
from sao_jax.rl import optim
from sao_jax.run import accounting, value_pretrain
from sao_jax.sampling import rollouts
from sao_jax.sampling.backend import EngineDied
from sao_jax.sampling.sampler import SamplerError
from sao_jax.schema import ConfigError
from tests import train_support as ts

TOTAL = 4  # RL steps of the finished run that is not run again
SYNC_TOTAL = 6  # RL steps of the sync run, the resume test's reference (0, 2, 4, 6)
# The sync run's settings (every checkpoint kept: the resume test starts from step 0's).
SYNC = dict(train__log_every=1, train__eval_sampled=True, train__keep_checkpoints=4)


@pytest.fixture(scope="module")
def cache_env(jax_cache_dir):
    """The session's compilation cache (tests/conftest.py), in this process too."""
    with ts.persistent_compilation_cache(jax_cache_dir) as env:
        yield env


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, cache_env):
    """(config, workdir, summary) of an uninterrupted sync run, one log record per step,
    with its report (train.report: resumable, so its resumes run without one)."""
    config = ts.small_config(
        "smoke,sync", **SYNC, train__total_steps=SYNC_TOTAL, train__report=True
    )
    workdir = tmp_path_factory.mktemp("sync_run")
    return config, workdir, train.run(config, workdir)


@pytest.fixture(scope="module")
def target(sync_run):
    return ts.restore_target(sync_run[0])


def _forbid_start(monkeypatch):
    """Makes reaching the model build (the first compile) fail the test."""

    def start(*args, **kwargs):
        raise AssertionError("run() got past its config checks")

    monkeypatch.setattr(train, "Run", start)


# ------------------------------------------------------------------- config checks


def _from_dict(config, edit):
    d = config.to_dict()
    edit(d)
    return ml_collections.ConfigDict(d)


@pytest.mark.parametrize(
    "field, make",
    [
        ("rl.nonsense", lambda c: c.rl.__setattr__("nonsense", 1)),
        ("nonsense", lambda c: c.__setattr__("nonsense", 1)),
        (
            "train.total_steps",
            lambda c: _from_dict(c, lambda d: d["train"].update(total_steps="abc")),
        ),
        ("train.report", lambda c: _from_dict(c, lambda d: d["train"].pop("report"))),
        ("rl.k_critic", lambda c: c.rl.__setattr__("k_critic", 0)),
        ("rl.losses.ppo_clip.eps_low", lambda c: c.rl.losses.ppo_clip.update(eps_low=1.5)),
        ("rl.losses.estr.tau", lambda c: c.rl.losses.estr.update(tau=0.0)),
        ("rl.losses.icepop.band_high", lambda c: c.rl.losses.icepop.update(band_high=0.9)),
        ("train.rollouts", lambda c: c.train.__setattr__("rollouts", "later")),
        ("sft.batch_size", lambda c: c.sft.__setattr__("batch_size", 4)),  # 8 devices
        ("rl.batch_size", lambda c: c.rl.__setattr__("batch_size", 12)),
    ],
)
def test_bad_config_fails_before_anything_starts(tmp_path, monkeypatch, field, make):
    config = ts.small_config()
    config = make(config) or config
    _forbid_start(monkeypatch)
    with pytest.raises(ConfigError, match=rf"config field {field}\b"):
        train.run(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_workdir_that_is_a_file_is_named(tmp_path, monkeypatch):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    _forbid_start(monkeypatch)
    with pytest.raises(ConfigError, match=r"flag --workdir: .*a_file exists and is not a dir"):
        train.run(ts.small_config(), path)


def test_missing_hf_checkpoint_is_named(tmp_path, monkeypatch):
    missing = tmp_path / "no_such_checkpoint"
    config = ts.small_config(init__kind="hf", init__hf_path=str(missing))
    _forbid_start(monkeypatch)
    with pytest.raises(ConfigError, match="init.hf_path") as e:
        train.run(config, tmp_path / "w")
    assert str(missing) in str(e.value)
    assert not (tmp_path / "w").exists()  # a corrected retry is not refused


def test_hf_directory_without_config_is_named(tmp_path):
    empty = tmp_path / "empty_checkpoint"
    empty.mkdir()
    config = ts.small_config(init__kind="hf", init__hf_path=str(empty))
    with pytest.raises(ConfigError, match="no config.json") as e:
        train.run(config, tmp_path / "w")
    assert str(empty) in str(e.value)


def test_a_finished_run_is_not_run_again(tmp_path, monkeypatch, caplog):
    """Re-running a finished run: one line, its summary back, not a byte written; a larger
    train.total_steps (or an interrupted run) goes on to build the run."""
    workdir = tmp_path / "w"
    config = train.resolved_config(config_lib.validate(ts.small_config()))
    workdir.mkdir()
    checkpointing.check_workdir_config(workdir, config.to_dict(), overwrite=False)
    done = {"steps": TOTAL, "interrupted": False, "after": {"eval/greedy_success": 0.5}}
    (workdir / accounting.SUMMARY_FILE).write_text(json.dumps(done))
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    _forbid_start(monkeypatch)
    with caplog.at_level(logging.INFO, logger="sao_jax"):
        assert train.run(ts.small_config(train__total_steps=TOTAL), workdir) == done
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before
    assert f"already finished at step {TOTAL} (train.total_steps={TOTAL}): nothing" in caplog.text
    with pytest.raises(AssertionError, match="got past its config checks"):
        train.run(ts.small_config(train__total_steps=TOTAL + 2), workdir)
    (workdir / accounting.SUMMARY_FILE).write_text(json.dumps({**done, "interrupted": True}))
    with pytest.raises(AssertionError, match="got past its config checks"):
        train.run(ts.small_config(train__total_steps=TOTAL), workdir)


# ------------------------------------------------------------------- a finished run


@pytest.mark.slow
def test_smoke_run_writes_every_output(sync_run):
    config, workdir, summary = sync_run
    for name in ("metrics.jsonl", "report.md", "summary.json", "config.json"):
        assert (workdir / name).is_file(), name
    assert any(p.is_file() for p in (workdir / "tensorboard").rglob("events.out.tfevents*"))
    report = (workdir / "report.md").read_text()
    pngs = sorted((workdir / "plots").glob("*.png"))
    assert pngs and all(p.stat().st_size > 0 for p in pngs)
    for png in pngs:
        assert f"plots/{png.name}" in report
    assert ts.saved_steps(workdir) == [0, 2, 4, 6]

    stored = ts.read_strict_json(workdir / "summary.json")  # NaN is written as null
    assert sorted(stored) == sorted(summary) and sorted(stored["last_train"]) == sorted(
        summary["last_train"]
    )
    for key in ("steps", "counters", "before", "after", "interrupted"):
        assert stored[key] == summary[key], key
    assert summary["steps"] == SYNC_TOTAL and summary["interrupted"] is False
    assert accounting.cpu_model() in summary["machine"]  # runs of two CPUs round apart
    for when in ("before", "after"):
        assert 0 <= summary[when]["eval/greedy_success"] <= 1
        assert summary[when]["eval/greedy_episodes"] == config.env.eval_size
    assert summary["counters"]["trained"] == SYNC_TOTAL * config.rl.batch_size
    assert "policy/loss" in summary["last_train"]

    records = ts.read_metrics(workdir)
    train_steps = [r["step"] for r in records if "policy/loss" in r]
    eval_steps = [r["step"] for r in records if "eval/greedy_success" in r]
    assert train_steps == list(range(1, SYNC_TOTAL + 1)) and eval_steps == [0, 2, 4, 6]
    last = [r for r in records if "policy/loss" in r][-1]
    assert last["sampler/taken"] == summary["counters"]["trained"]

    # Value pretraining: its own step counter in the JSONL records (at RL step 0), its
    # own TensorBoard run, the saved critic, a summary and the report's plot and table.
    pre = [r for r in records if value_pretrain.STEP_KEY in r]
    vp = config.value_pretrain
    assert [r[value_pretrain.STEP_KEY] for r in pre] == list(range(vp.steps + 1))
    assert {r["step"] for r in pre} == {0}
    assert all("value_pretrain/heldout/explained_variance" in r for r in (pre[0], pre[-1]))
    assert any((workdir / "tensorboard" / "value_pretrain").glob("events.out.tfevents*"))
    assert ts.saved_steps(workdir, value_pretrain.CRITIC_SUBDIR) == [0]
    assert summary["value_pretrain"]["steps"] == vp.steps
    assert summary["value_pretrain"]["rollouts"] == vp.steps * vp.batch_size
    assert "plots/value_pretrain_ev.png" in report and "## Value pretraining" in report


@pytest.mark.slow
def test_counters_balance_at_every_save(sync_run, target):
    _, workdir, summary = sync_run
    for step in ts.saved_steps(workdir):
        _, meta = ts.restore(target, workdir, step)
        assert ts.unbalanced(meta["counters"]) is None, f"checkpoint {step}"
        assert meta["counters"]["in_flight"] == 0, f"checkpoint {step}"  # sync: none between
    assert ts.unbalanced(summary["counters"]) is None
    assert summary["counters"]["in_flight"] == 0


@pytest.mark.slow
def test_rows_differing_in_rl_time_settings_pretrain_the_same_critic(
    sync_run, tmp_path, monkeypatch
):
    """K=1, a full-parameter RL critic and lam_critic 0.9 leave value pretraining alone:
    the critic at checkpoint 0 is bit-identical to SAO's (before, the K=1 row got half the
    pretraining steps and no_frozen_attention another trainable set). It starts from the
    reference's saved warm start (init.kind='params': the same policy, no SFT again) and
    only its checkpoint 0 is read: the run skips its evaluations and its (empty) RL stage."""
    config, reference, _ = sync_run
    other = ts.small_config(
        "smoke,sync", rl__k_critic=1, rl__lam_critic=0.9, train__total_steps=0,
        optim__critic__freeze_attention=False, init__kind="params",
        init__params_path=str(reference / "warm_start"),
    )  # fmt: skip
    monkeypatch.setattr(train.Run, "evaluate", lambda self, state, step: {})
    monkeypatch.setattr(train, "_rl", lambda *args: dict(steps=0))
    train.run(other, tmp_path / "w")
    ref, _ = ts.restore(ts.restore_target(config), reference, 0)
    got, _ = ts.restore(ts.restore_target(other), tmp_path / "w", 0)
    assert ts.tree_max_diff(got.critic, ref.critic) == 0.0
    assert ts.tree_max_diff(got.policy, ref.policy) == 0.0


@pytest.mark.slow
def test_critic_warm_up_starts_at_the_first_rl_step(sync_run, target):
    """Value pretraining has an optimizer of its own: the RL critic's lr warm-up (10 RL
    steps, counted in RL steps whatever K) begins at RL step 1. Before, the pretraining
    steps used it up and RL began at the full lr."""
    config, workdir, _ = sync_run
    state, _ = ts.restore(target, workdir, 0)
    assert int(optim.update_count(state.critic_opt)) == 0
    lr = {r["step"]: r["critic/lr"] for r in ts.read_metrics(workdir) if "critic/lr" in r}
    peak, warm = config.optim.critic.lr, config.optim.critic.warmup_steps
    assert lr[1] == 0.0 and lr[2] == pytest.approx(peak / warm) and lr[3] < peak


@pytest.mark.slow
def test_a_critic_pretrained_with_other_settings_is_refused(sync_run):
    config, workdir, _ = sync_run
    path = workdir / value_pretrain.CRITIC_SUBDIR
    sharder = sharder_from_config(config)
    cdef = critic_def(ModelConfig.from_config(config.model), sharder)
    k1 = ts.small_config("smoke,sync", rl__k_critic=1)  # an RL-time setting: accepted
    _, meta = value_pretrain.load_critic(path, k1, cdef, sharder)
    assert meta["value_pretrain"]["steps"] == config.value_pretrain.steps
    other = ts.small_config("smoke,sync", value_pretrain__batch_size=16)
    with pytest.raises(ConfigError, match=r"init.critic_path: .* value_pretrain.batch_size = 8"):
        value_pretrain.load_critic(path, other, cdef, sharder)


# ---------------------------------------------------------------------------- resume


def _assert_same_run(target, reference, workdir):
    """Same final TrainState, same metric records (time aside) as the reference run."""
    ref_state, ref_meta = ts.restore(target, reference)
    state, meta = ts.restore(target, workdir)
    assert int(state.step) == int(ref_state.step) == SYNC_TOTAL
    assert ts.tree_max_diff(state, ref_state) <= 1e-6
    assert meta["counters"] == ref_meta["counters"]
    assert ts.timeless(ts.read_metrics(workdir)) == ts.timeless(ts.read_metrics(reference))


def _sigterm_self_after_step(workdir, step: int, done: threading.Event) -> None:
    """Sends SIGTERM to this process once workdir/metrics.jsonl holds a train record of
    `step` or later (a thread's loop; `done` ends it)."""
    deadline = time.monotonic() + 300
    while not done.is_set() and time.monotonic() < deadline:
        try:
            records = ts.read_metrics(workdir)
        except (OSError, ValueError):  # not there yet, or a line half written
            records = []
        if any(r["step"] >= step and "policy/loss" in r for r in records):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.05)


def _damage(workdir, step: int) -> None:
    """Overwrites the array data of checkpoint `step` (a death while writing it)."""
    for f in (workdir / "checkpoints" / str(step) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data
            f.write_bytes(b"\0" * 16)


@pytest.mark.slow
# After reading a damaged file tensorstore may report "Event loop is closed" (harmless,
# docs/checkpointing.md).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_resume_more_steps_and_sigterm_match_uninterrupted(
    sync_run, target, tmp_path, caplog, monkeypatch
):
    """One run resumed four times, each the same as the uninterrupted reference: after a
    death while writing checkpoint 2 (the reference's workdir without its later
    checkpoints, checkpoint 2's data damaged: it falls back to checkpoint 0), to
    train.total_steps=2 (finished); with more steps, until a real SIGTERM to this process
    after step 3 (train.run's handler: it saves and returns); until the generation engine
    dies at a take (the last completed step saved, the error raised); to the end. The entry
    point's exit 0 after SIGTERM, as a process: tests/test_distributed.py (two processes,
    one signalled, a second launch resumes) and tests/test_hangs.py (before the first
    checkpoint)."""
    config, reference, summary = sync_run
    workdir = tmp_path / "w"
    shutil.copytree(reference, workdir)
    (workdir / accounting.SUMMARY_FILE).unlink()  # died (a finished run is not run again)
    for step in ts.saved_steps(workdir)[2:]:
        shutil.rmtree(workdir / "checkpoints" / str(step))
    assert ts.saved_steps(workdir) == [0, 2]
    _damage(workdir, 2)
    with caplog.at_level(logging.INFO):
        first = train.run(ts.small_config("smoke,sync", **SYNC, train__total_steps=2), workdir)
    (line,) = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert line.startswith("checkpoint step 2 is damaged (state/") and "restored step 0" in line
    (resumed,) = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert (
        resumed == "resumed from step 0 (checkpoint 0, the newest readable; checkpoint 2 was not)"
    )
    assert (workdir / "checkpoints" / checkpointing.CORRUPT_DIR / "2").is_dir()
    assert first["steps"] == 2 and not first["interrupted"] and ts.saved_steps(workdir) == [0, 2]

    caplog.clear()
    done = threading.Event()
    thread = threading.Thread(target=_sigterm_self_after_step, args=(workdir, 3, done))
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # one after run() returned
    thread.start()
    try:
        with caplog.at_level(logging.INFO):
            more = ts.small_config("smoke,sync", **SYNC, train__total_steps=100)
            stopped = train.run(more, workdir)
    finally:
        done.set()
        thread.join(5)
        signal.signal(signal.SIGTERM, previous)
    assert "resumed from step 2" in caplog.text  # a finished run, more steps
    assert "received SIGTERM" in caplog.text
    assert stopped["interrupted"] is True and 3 <= stopped["steps"] < SYNC_TOTAL, stopped
    assert json.loads((workdir / accounting.SUMMARY_FILE).read_text())["interrupted"] is True
    assert ts.saved_steps(workdir)[-1] == stopped["steps"]

    # the generation engine dies at a take (issue 44 item 7): the last completed step is
    # checkpointed, the error ends the run, and the checkpoint resumes exactly
    caplog.clear()
    takes, die_at = [], 2 if stopped["steps"] + 1 < SYNC_TOTAL else 1
    real_take = train.take_or_stop

    def dying_take(*args):
        takes.append(1)
        if len(takes) == die_at:  # before the source is asked: as a take that failed
            raise SamplerError("the generation engine died: test") from EngineDied("test")
        return real_take(*args)

    monkeypatch.setattr(train, "take_or_stop", dying_take)
    with caplog.at_level(logging.INFO), pytest.raises(SamplerError, match="engine died"):
        train.run(config, workdir)
    monkeypatch.setattr(train, "take_or_stop", real_take)
    died_at = stopped["steps"] + die_at - 1
    assert f"the generation engine died: checkpoint of step {died_at}" in caplog.text
    assert ts.saved_steps(workdir)[-1] == died_at

    resumed = train.run(config, workdir)  # total_steps is resumable
    stored = json.loads((workdir / checkpointing.CONFIG_FILE).read_text())
    assert stored["train"]["total_steps"] == SYNC_TOTAL
    assert resumed["steps"] == SYNC_TOTAL and resumed["interrupted"] is False
    # the same state, counters and metric records (the damaged run's after step 0 replaced)
    _assert_same_run(target, reference, workdir)
    assert ts.timeless([resumed["after"]]) == ts.timeless([summary["after"]])


# ------------------------------------------------------------------------ the workdir


@pytest.mark.slow
def test_workdir_of_another_config_is_refused_unless_overwrite(sync_run, tmp_path, monkeypatch):
    _, finished, _ = sync_run
    workdir = tmp_path / "w"
    shutil.copytree(finished, workdir)
    other = ts.small_config("smoke,sync", rl__k_critic=1)
    with pytest.raises(ConfigError, match=r"config field rl\.k_critic"):
        train.run(other, workdir)
    assert ts.saved_steps(workdir) == [0, 2, 4, 6]

    _forbid_start(monkeypatch)
    with pytest.raises(AssertionError, match="past its config checks"):
        train.run(other, workdir, overwrite=True)
    (moved,) = workdir.glob("previous-*")
    assert ts.saved_steps(moved) == [0, 2, 4, 6]
    stored = json.loads((workdir / checkpointing.CONFIG_FILE).read_text())
    assert stored["rl"]["k_critic"] == 1


# --------------------------------------------------------------- rollout bookkeeping


def _prompts(seed=0):
    return prompt_iterator("arithmetic", "train", seed=seed, eval_fraction=0.1)


def _uids(it, n):
    return [next(it).uid for _ in range(n)]


@pytest.mark.parametrize("emitted", [0, 3, 4, 5])
def test_repeat_prompts_restores_at_the_next_group(emitted):
    """A state saved at a group boundary resumes exactly; inside a group, at the next one
    (the rest of that group is skipped: its rollouts in flight are discarded anyway)."""
    g = 2
    it = rollouts.RepeatPrompts(_prompts(), g)
    _uids(it, emitted)
    restored = rollouts.RepeatPrompts(_prompts(), g)
    restored.set_state(it.get_state())
    _uids(it, -emitted % g)
    got = _uids(restored, 3 * g)
    assert got == _uids(it, 3 * g)
    assert got[0::2] == got[1::2] and len(set(got)) == 3


class _FakeTrajectory:
    def __init__(self, uid):
        self.prompt_uid = uid


class _FakeSampler:
    """Stands in for AsyncSampler: hands out scripted trajectories, counts like it."""

    def __init__(self, *args, **kwargs):
        self.script = [_FakeTrajectory(u) for u in "aabcbcdd"]
        self.taken = 0

    def take(self, n, timeout=None):
        out, self.script = self.script[:n], self.script[n:]
        self.taken += len(out)
        return out

    def stats(self):
        return dict(generated=8, taken=self.taken, dropped={}, queued=len(self.script), version=0)


def test_async_group_counters_balance(monkeypatch):
    monkeypatch.setattr(rollouts, "AsyncSampler", _FakeSampler)
    source = rollouts.AsyncRollouts(None, None, None, _prompts(), None, None, group_size=2)
    base = accounting.resume_counters({})
    got = [t.prompt_uid for t in source.take(4)]  # a, a then b, c open, then b
    assert got[:2] == ["a", "a"] and sorted(got[2:]) == ["b", "b"]
    counters = accounting.counters(base, source.stats())
    assert counters["trained"] == 4 and counters["in_flight"] == 4  # c open; c, d, d queued
    assert ts.unbalanced(counters) is None
