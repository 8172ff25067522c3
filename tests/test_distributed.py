"""Multi-controller JAX: two CPU processes on loopback == one process with 8 devices.

Each worker process has 4 fake CPU devices, joins a 2-process `jax.distributed` run
(gloo collectives), builds the same tiny Learner on the global 8-device mesh and feeds
its half of each synthetic batch (`global_batch`); the parameters after 3 update steps
must equal those of the single-process 8-device run in this test process.

End to end: `python -m experiments.train` as two processes, asynchronous rollouts on a
sampler pool of each host's own device (disaggregated placement); only process 1 gets
SIGTERM: both must leave the loop at the same step (the stop agreement), save that step
together and exit 0; a second launch resumes both from it and finishes.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from sao_jax.parallel import distributed as dist
from sao_jax.schema import ConfigError
from tests.closeness import assert_pass_close, assert_steps_close

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESH = (1, 2, 4, 1)  # fsdp across the two hosts, experts within each host
B, T, STEPS = 8, 24, 3
WORKER_TIMEOUT_S = 480  # a hang detector: the two-process SIGTERM test took over 240 s at load 15
# The compile-speed flags tests/conftest.py sets (its XLA_FLAGS without the device count).
FAST_COMPILE = " ".join(
    f for f in os.environ["XLA_FLAGS"].split() if "xla_force_host_platform_device_count" not in f
)


def _config():
    from configs import base
    from sao_jax import config as config_lib

    c = base.get_config()
    c.model.update(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, head_dim=8, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=16, moe_intermediate_size=8, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=(),
    )  # fmt: skip
    c.rl.batch_size = B
    c.optim.policy.lr = 1e-3
    c.optim.critic.lr = 1e-3
    c.optim.critic.warmup_steps = 0
    c.mesh.shape = MESH
    return config_lib.validate(c)


def _train(config):
    """3 update steps on the global mesh; this process feeds its rows of each batch."""
    from jax.sharding import NamedSharding

    from sao_jax.metrics import pair_means as reduce_metrics
    from sao_jax.models.config import ModelConfig
    from sao_jax.models.factory import init_models
    from sao_jax.parallel.mesh import sharder_from_config
    from sao_jax.rl.synthetic import synthetic_batch
    from sao_jax.rl.update import Learner

    sharder = sharder_from_config(config)
    models = init_models(ModelConfig.from_config(config.model), sharder, seed=0)
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, sharder)
    state = learner.new_state(models.policy, models.critic, seed=0)
    start = dist.gather_to_host({"policy": state.policy, "critic": state.critic})
    start["sampler_logits"] = _sampler_logits(models.cfg, state.policy)
    batch_sh = NamedSharding(sharder.mesh, sharder.spec(("batch",)))
    rows = dist.local_batch_size(B)
    lo = jax.process_index() * rows
    metrics = None
    for i in range(STEPS):
        full = synthetic_batch(B, T, 32, seed=i, version=i, max_lag=1)
        local = {k: v[lo : lo + rows] for k, v in full.items()}
        batch = dist.global_batch(local, batch_sh)
        learner.check_batch(batch)
        state, metrics = learner.update_step(state, batch, jax.random.key(i))
    params = dist.gather_to_host({"policy": state.policy, "critic": state.critic})
    params["sampler_logits"] = _sampler_logits(models.cfg, state.policy)
    params.update(_assembly_checks(batch_sh, rows))
    params["start"] = start
    return params, reduce_metrics(metrics), int(state.step)


def _sampler_logits(cfg, policy) -> np.ndarray:
    """Logits of a host's sampler: a host-local copy of the policy in a model without
    global-mesh constraints, run by this process alone (no collectives)."""
    from flax import nnx

    from sao_jax.models.transformer import Policy
    from sao_jax.parallel.partition import ModelDef

    local = dist.host_local(policy)
    for leaf in jax.tree.leaves(local):
        assert {d.process_index for d in leaf.devices()} == {jax.process_index()}
    sampler_def = ModelDef.of(lambda: Policy(cfg, rngs=nnx.Rngs(0)))
    tokens = np.arange(2 * 6, dtype=np.int32).reshape(2, 6) % cfg.vocab_size
    return np.asarray(jax.jit(lambda p, t: sampler_def.bind(p)(t).out)(local, tokens))


def _assembly_checks(batch_sh, rows) -> dict[str, np.ndarray]:
    """Group ids stay distinct across processes; replicated host data round-trips."""
    groups = np.array([0, 0, 1, -1] * (rows // 4), np.int32)
    got = dist.global_batch({"group_ids": groups}, batch_sh)["group_ids"]
    data = np.arange(2 * B, dtype=np.float32).reshape(B, 2)
    back = dist.gather_to_host(dist.global_from_replicated({"x": data}, batch_sh))["x"]
    np.testing.assert_array_equal(back, data)
    if jax.process_count() > 1:  # the samplers' copy in the compute dtype
        copy = dist.host_local({"x": dist.global_from_replicated(data, batch_sh)}, "bfloat16")
        assert copy["x"].dtype == jax.numpy.bfloat16
        want = data.astype(jax.numpy.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(copy["x"]).astype(np.float32), want)
    return {"group_ids": dist.gather_to_host(got)}


def _worker(process_id: int, num_processes: int, port: int, out: str) -> None:
    """Entry point of one process of the 2-process run (see _spawn); with num_processes=1,
    the single-process reference, run in the test's own process (8 devices)."""
    if num_processes > 1:
        jax.config.update("jax_default_matmul_precision", "highest")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    spec = dist.resolve(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        timeout_s=60,
        env={},
    )
    assert dist.initialize(spec) == (num_processes > 1)
    assert jax.process_count() == num_processes and jax.device_count() == 8
    params, metrics, step = _train(_config())
    name = f"{num_processes}_{process_id}"
    np.savez(f"{out}/params_{name}.npz", **_flat(params))
    with open(f"{out}/info_{name}.json", "w") as f:
        json.dump(dict(metrics=metrics, step=step, agree=dist.agree_max(10 + process_id)), f)
    if num_processes > 1:
        jax.distributed.shutdown()


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path) -> list[subprocess.Popen]:
    """Worker 0 and 1 (4 devices each), at once.

    Both use the test process's XLA flags (tests/conftest.py's compile-speed flags; the
    numerics are those of the same fp32 ops as the reference's, in this process).
    """
    port = _free_port()
    procs = []
    for pid in (0, 1):
        env = dict(os.environ)
        env.update(
            XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
            JAX_PLATFORMS="cpu",
            PYTHONPATH=str(ROOT),
        )
        args = f"{pid}, 2, {port}, {str(tmp_path)!r}"
        code = f"from tests.test_distributed import _worker; _worker({args})"
        log = open(tmp_path / f"log_2_{pid}.txt", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
        )  # fmt: skip
    return procs


def _wait(procs, tmp_path) -> None:
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * len(procs):
        logs = "\n".join(
            f"--- {f.name} ---\n" + f.read_text()[-3000:] for f in sorted(tmp_path.glob("log_*"))
        )
        pytest.fail(f"distributed workers failed or timed out:\n{logs}")


@pytest.mark.slow
def test_two_processes_match_one_process_with_eight_devices(tmp_path):
    procs = _spawn(tmp_path)
    try:
        _worker(0, 1, 0, str(tmp_path))  # the reference, while the two processes run
    finally:
        _wait(procs, tmp_path)
    ref = dict(np.load(tmp_path / "params_1_0.npz"))
    ref_info = json.loads((tmp_path / "info_1_0.json").read_text())
    assert ref_info["step"] == STEPS
    for pid in range(2):
        got = dict(np.load(tmp_path / f"params_2_{pid}.npz"))
        assert sorted(got) == sorted(ref)
        # 3 Adam steps (and the sampler's logits after them): the k-step bound, each leaf
        # against its displacement from the shared start (tests/closeness.py).
        for name in ref.keys() - {"['group_ids']"} - {k for k in ref if k.startswith("['start']")}:
            start = ref["['start']" + name]
            if name == "['sampler_logits']":  # each host's own pass over its local copy
                assert_pass_close(got["['start']" + name], start, err_msg=name)
            else:  # the same initialisation
                np.testing.assert_array_equal(got["['start']" + name], start, err_msg=name)
            assert_steps_close(got[name], ref[name], start, err_msg=name)
        info = json.loads((tmp_path / f"info_2_{pid}.json").read_text())
        assert info["step"] == STEPS
        assert info["agree"] == 11  # max over the two processes
        for k in ("policy/loss", "critic/value_loss", "batch/action_tokens"):
            np.testing.assert_allclose(  # the last step's sums: one pass on k-step params
                info["metrics"][k], ref_info["metrics"][k], atol=1e-5, rtol=1e-4
            )
    got = dict(np.load(tmp_path / "params_2_0.npz"))
    np.testing.assert_array_equal(
        got["['group_ids']"], [0, 0, 1, -1, 4, 4, 5, -1]
    )  # process 1's groups offset by its 4 rows
    heads = [np.abs(ref[k]).sum() for k in ref if "value_head" in k and "start" not in k]
    assert heads and all(h > 0 for h in heads)  # the critic trained (it starts at zero)


# -------------------------------------- asynchronous rollouts across processes, end to end

# configs/sao.py:smoke as two processes of 4 fake devices: each gives its last device to
# its sampler pool (pools on every host) and 3 to the 6-device trainer mesh (data axis,
# 3 rows per process); async rollouts with a staleness cap; few programs to compile.
ASYNC_RUN = {
    "init.kind": "random",
    "sft.steps": 0,
    "value_pretrain.steps": 0,
    "train.rollouts": "async",
    "sampling.placement": "disaggregated",
    "sampling.pool_devices": 1,
    "sampling.max_staleness": 1,
    "rl.batch_size": 6,
    "rl.advantage": "moving_average",  # no critic: half the update step to compile
    "sampling.num_slots": 4,
    "sampling.max_len": 64,
    "sampling.prefill_buckets": (32,),
    "sampling.span_buckets": (64,),
    "train.length_bucket": 64,
    "env.eval_size": 2,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.checkpoint_every": 0,
    "train.total_steps": 6,
}


def _launch(workdir, flags, port, env, tag):
    """Both processes of `python -m experiments.train` on loopback."""
    from tests import train_support as ts

    procs = []
    for pid in (0, 1):
        log = open(workdir.parent / f"log_{tag}_{pid}.txt", "w")  # noqa: SIM115
        dist_flags = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                      f"--process_id={pid}"]  # fmt: skip
        procs.append(ts.entry_point([*flags, *dist_flags], workdir, env, log))
    return procs


def _finish(procs) -> list[int]:
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    except subprocess.TimeoutExpired:
        return [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _logs(tmp_path, tag) -> str:
    return "\n".join(
        f"--- {f.name} ---\n" + f.read_text()[-3000:] for f in sorted(tmp_path.glob(f"log_{tag}_*"))
    )


@pytest.mark.slow
def test_two_process_async_disaggregated_run_stops_and_resumes(tmp_path, jax_cache_dir):
    """experiments.train as two processes, async rollouts on each host's own pool device:
    SIGTERM to process 1 after step 2 stops both at one step (saved together, exit 0); a
    second launch resumes there, each host from its own prompt position, and finishes."""
    from tests import train_support as ts

    workdir = tmp_path / "run"
    overrides = {k.replace(".", "__"): v for k, v in ASYNC_RUN.items()}
    flags = ts.flags_of("smoke", **overrides)
    fake4 = f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}"
    with ts.persistent_compilation_cache(jax_cache_dir) as cache_env:
        env = {**cache_env, "XLA_FLAGS": fake4, "JAX_PLATFORMS": "cpu"}
        procs = _launch(workdir, flags, _free_port(), env, "first")
        try:
            ts.sigterm_after_step(procs[1], workdir, 2, WORKER_TIMEOUT_S)  # process 1 only
        finally:
            codes = _finish(procs)
        assert codes == [0, 0], _logs(tmp_path, "first")
        first = ts.read_strict_json(workdir / "summary.json")
        stopped = first["steps"]
        assert first["interrupted"] and 2 <= stopped < ASYNC_RUN["train.total_steps"], first
        step_dir = workdir / "checkpoints" / str(stopped)
        for pid in (0, 1):  # both processes committed their part of the same step
            assert (step_dir / f"integrity.process_{pid}.json").exists(), sorted(step_dir.iterdir())
        target = ts.restore_target(ts.small_config(**overrides))  # onto this process's mesh
        _, meta = ts.restore(target, workdir, step=stopped)
        assert len(meta["prompts_by_process"]) == 2  # each host's own prompt position
        assert ts.unbalanced(meta["counters"]) is None  # a save with rollouts in flight

        procs = _launch(workdir, flags, _free_port(), env, "second")
        codes = _finish(procs)
        assert codes == [0, 0], _logs(tmp_path, "second")
    log0 = (tmp_path / "log_second_0.txt").read_text()
    assert f"resumed from step {stopped}" in log0, log0[-3000:]
    done = ts.read_strict_json(workdir / "summary.json")
    assert done["steps"] == ASYNC_RUN["train.total_steps"] and not done["interrupted"]
    c = done["counters"]  # process 0's; what was in flight at the stop counts as discarded
    assert ts.unbalanced(c) is None
    stop = meta["counters"]
    assert c["discarded"] == stop["discarded"] + stop["in_flight"], (stop, c)
    assert c["trained"] == ASYNC_RUN["train.total_steps"] * ASYNC_RUN["rl.batch_size"] // 2
    assert max(int(k) for k in done["staleness_hist"]) <= ASYNC_RUN["sampling.max_staleness"]
    steps = [r["step"] for r in ts.read_metrics(workdir) if "policy/loss" in r]
    assert steps == list(range(1, ASYNC_RUN["train.total_steps"] + 1)), steps


# ------------------------------------------------------------------- single-process API


def test_resolve_from_flags_env_and_modes():
    assert dist.resolve(env={}).kind == "single"
    spec = dist.resolve(
        env={"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    )
    assert (spec.kind, spec.coordinator_address, spec.num_processes, spec.process_id) == (
        "explicit", "h0:1234", 4, 2,
    )  # fmt: skip
    flags_win = dist.resolve(
        coordinator_address="h1:1", num_processes=2, process_id=1,
        env={"JAX_COORDINATOR_ADDRESS": "h0:1234", "JAX_NUM_PROCESSES": "4"},
    )  # fmt: skip
    assert (flags_win.coordinator_address, flags_win.num_processes) == ("h1:1", 2)
    assert dist.resolve(num_processes=1, env={}).kind == "single"
    assert dist.resolve(env={"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}).kind == "detect"
    assert dist.resolve(env={"TPU_WORKER_HOSTNAMES": "w0"}).kind == "single"
    assert dist.resolve(env={"SLURM_NTASKS": "2"}).kind == "detect"
    assert dist.resolve("detect", env={}).kind == "detect"
    assert dist.resolve("off", env={"SLURM_NTASKS": "2"}).kind == "single"
    ids = dist.resolve("detect", env={"JAX_LOCAL_DEVICE_IDS": "0,1"}).local_device_ids
    assert ids == (0, 1)
    assert not dist.initialize(dist.resolve(env={}))  # single process: a no-op


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_processes=2, process_id=0), "--coordinator_address"),
        (dict(coordinator_address="h:1", num_processes=2), "--process_id"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), "--process_id"),
        (dict(num_processes=0), "--num_processes"),
        (dict(mode="off", num_processes=2), "--distributed=off"),
        (dict(mode="cluster"), "--distributed"),
        (dict(process_id="x"), "--process_id"),
    ],
)
def test_resolve_errors_name_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        dist.resolve(**kwargs, env={})


def test_single_process_helpers_are_identities():
    assert dist.local_batch_size(8) == 8 and dist.agree_max(7) == 7
    local = {"x": np.arange(4)}
    assert dist.global_batch(local, None)["x"] is local["x"]
    tree = {"a": jax.numpy.ones(3)}
    assert dist.host_local(tree)["a"] is tree["a"]
    assert dist.host_local(tree, jax.numpy.float32)["a"] is tree["a"]  # already that dtype
    mixed = dist.host_local({"w": tree["a"], "i": jax.numpy.arange(3)}, jax.numpy.bfloat16)
    assert mixed["w"].dtype == jax.numpy.bfloat16 and mixed["i"].dtype == jax.numpy.int32
    assert dist.global_from_replicated(tree, None) is tree
    assert dist.is_primary()


def test_take_or_stop_gives_back_what_it_took_when_another_process_stops(monkeypatch):
    """Another process was signalled: this one's take is undone (in flight again, or a
    sync take replayed on resume), not counted as trained."""
    from sao_jax import train

    class Source:
        given = None

        def take(self, n, timeout):
            return ["t"] * n

        def give_back(self, trajs):
            self.given = trajs

    class Stopper:
        requested = False

    source = Source()
    assert train.take_or_stop(source, 2, 1.0, Stopper()) == ["t", "t"] and source.given is None
    monkeypatch.setattr(dist, "agree_stop", lambda local: True)  # another process stops
    assert train.take_or_stop(source, 2, 1.0, Stopper()) is None and source.given == ["t", "t"]
