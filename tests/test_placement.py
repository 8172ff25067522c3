"""The sampler pool on devices of its own: placement by config, weight sync, double buffering.

On the 8 fake CPU devices of tests/conftest.py: a disaggregated run gives 2 devices to
the pool and 6 to the trainer. The weight sync (cast to bf16, reshard onto the pool) must
deliver exactly the bf16 rounding of the trainer's float32 params, on the pool's
devices; the pool must swap versions only once a transfer has landed; and a pool on its
own devices, fed by the weight sync after every update, must generate what the colocated
sampler generates (deterministic modes: sync rollouts and the async sampler's lockstep).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sao_jax import train
from sao_jax.parallel import placement as placement_lib
from sao_jax.parallel.placement import Placement, placement_from_config, trainer_sharder
from sao_jax.parallel.reshard import cast_and_reshard
from sao_jax.sampling.params_store import ParamsStore
from sao_jax.schema import ConfigError
from tests import train_support as ts

# 6 trainer devices: data 3 x fsdp 2 (the smoke model's widths divide by 2), batch 6
SPLIT = {"rl.batch_size": 6, "mesh.shape": (3, 2, 1, 1)}
DISAGGREGATED = {"sampling.placement": "disaggregated", "sampling.pool_devices": 2}


def _config(**overrides):
    fast = {
        "init.kind": "random",
        "sft.steps": 0,
        "value_pretrain.steps": 0,
        "sampling.num_slots": 4,
        **SPLIT,
    }
    return ts.small_config(**{k.replace(".", "__"): v for k, v in {**fast, **overrides}.items()})


# ------------------------------------------------------------------- bad placements


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        ({"sampling.placement": "pooled"}, "sampling.placement", "not one of"),
        ({**DISAGGREGATED, "sampling.pool_devices": 0}, "sampling.pool_devices", ">= 1"),
        ({**DISAGGREGATED, "sampling.pool_devices": 8}, "sampling.pool_devices", "takes all"),
        ({**DISAGGREGATED, "sampling.pool_devices": 9}, "sampling.pool_devices", "takes all"),
        ({**DISAGGREGATED, "sampling.pool_mesh": (3, 1, 1, 1)}, "sampling.pool_mesh", "multiply"),
        ({**DISAGGREGATED, "sampling.pool_mesh": (2, 1)}, "sampling.pool_mesh", "mesh.axes"),
        ({"sampling.pool_devices": 2}, "sampling.pool_devices", "disaggregated"),
        # the trainer's 6 devices do not fit a mesh of 8
        ({**DISAGGREGATED, "mesh.shape": (4, 2, 1, 1)}, "sampling.pool_devices", "mesh.shape"),
        # data axis of 6 (mesh.shape -1) does not divide a batch of 8
        (
            {**DISAGGREGATED, "mesh.shape": (-1, 1, 1, 1), "rl.batch_size": 8},
            "sampling.pool_devices",
            "rl.batch_size",
        ),
    ],
)
def test_bad_placements_fail_at_start_naming_the_field(
    tmp_path, monkeypatch, overrides, field, words
):
    config = _config(**overrides)

    def start(*args, **kwargs):
        raise AssertionError("run() got past its config checks")

    monkeypatch.setattr(train, "Run", start)
    with pytest.raises(ConfigError, match=rf"config field {field}\b.*{words}"):
        train.run(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_split_gives_each_process_last_devices_to_the_pool():
    config = _config(**DISAGGREGATED)
    p = placement_from_config(config)
    devices = jax.devices()
    assert p.disaggregated and p.pool_devices == tuple(devices[6:])
    assert p.trainer_devices == tuple(devices[:6])
    assert dict(p.pool_mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 1}
    sharder = trainer_sharder(config, p)
    assert set(sharder.mesh.devices.flat) == set(devices[:6])
    colocated = placement_from_config(_config())
    assert not colocated.disaggregated and colocated.trainer_devices == tuple(devices)
    assert colocated.pool_sharder(config.mesh.rules) is None
    # two processes of 4 devices each: the pool is each one's last device
    fake = [_FakeDevice(i, i // 4) for i in range(8)]
    trainer, pool = placement_lib.split_devices(1, fake)
    assert [d.id for d in trainer] == [0, 1, 2, 4, 5, 6] and [d.id for d in pool] == [3]


class _FakeDevice:
    def __init__(self, id_, process_index):
        self.id, self.process_index = id_, process_index


# ------------------------------------------------------------------- weight sync


def test_weight_sync_delivers_bit_identical_bf16_params_on_the_pool():
    from sao_jax.models.config import ModelConfig
    from sao_jax.models.factory import init_models

    config = _config(**DISAGGREGATED)
    p = placement_from_config(config)
    sharder = trainer_sharder(config, p)
    models = init_models(ModelConfig.from_config(config.model), sharder, seed=0)
    pool = p.pool_sharder(config.mesh.rules)
    shardings = models.policy_def.shardings(pool)
    synced = cast_and_reshard(models.policy, shardings, jnp.bfloat16)
    want = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), models.policy)
    flat_got = jax.tree_util.tree_leaves_with_path(synced)
    assert len(flat_got) == len(jax.tree.leaves(want))
    for (path, got), w, s in zip(flat_got, jax.tree.leaves(want), jax.tree.leaves(shardings)):
        assert got.dtype == jnp.bfloat16, path
        assert got.sharding == s and got.devices() <= set(p.pool_devices), path
        np.testing.assert_array_equal(  # bit for bit: the same round-to-nearest-even
            np.asarray(got).view(np.uint16), w.view(np.uint16), err_msg=str(path)
        )
    # colocated: the trainer's shardings, new buffers (the learner donates its own)
    x = {"w": jax.device_put(jnp.arange(6.0), sharder.named(("batch",))), "i": jnp.arange(3)}
    same = cast_and_reshard(x, None, jnp.float32)
    assert same["w"].sharding == x["w"].sharding and same["i"].dtype == jnp.int32
    x["w"].delete()
    x["i"].delete()
    np.testing.assert_array_equal(np.asarray(same["w"]), np.arange(6.0))  # still alive
    np.testing.assert_array_equal(np.asarray(same["i"]), np.arange(3))


class _InFlight:
    """A params leaf whose transfer lands when `gate` is set (jax.block_until_ready
    calls its block_until_ready, as it does a jax.Array's)."""

    def __init__(self, value: float, gate: threading.Event):
        self.value, self.gate = value, gate

    def block_until_ready(self):
        assert self.gate.wait(30)
        return self


def _gated(value: float, gate: threading.Event):
    return {"w": _InFlight(value, gate)}


def test_double_buffer_keeps_serving_until_the_next_version_lands():
    store = ParamsStore()
    store.publish({"w": jnp.float32(0)}, 0, copy=False, when_ready=True)
    assert store.wait_landed(10) and store.latest()[0] == 0
    gate = threading.Event()
    store.publish(_gated(1.0, gate), 1, copy=False, when_ready=True)
    assert store.target == 1 and not store.wait_landed(0.3)
    version, params = store.latest()  # the pool still decodes version 0
    assert version == 0 and float(params["w"]) == 0.0
    store.publish(_gated(2.0, gate), 2, copy=False, when_ready=True)  # waits behind 1
    store.publish({"w": jnp.float32(3)}, 3, copy=False, when_ready=True)  # supersedes 2
    assert store.latest()[0] == 0 and store.superseded == 1
    gate.set()
    assert store.wait_landed(10)
    version, params = store.latest()
    assert version == 3 and float(params["w"]) == 3.0 and store.landed == 3  # 0, 1, 3
    with pytest.raises(ValueError, match="does not increase"):
        store.publish({"w": jnp.float32(0)}, 3, when_ready=True)
    store.close()


# ------------------------------------------------- disaggregated == colocated (lockstep)


def _rollouts(run, source, state, steps: int):
    """The RL loop's skeleton: take, update, weight sync; the trajectories it got."""
    got = []
    source.publish(run.sampler_params(state.policy), int(state.step), synced=True)
    source.start()
    try:
        for _ in range(steps):
            trajs = source.take(run.local_batch, 120)
            got += trajs
            key = run._key(int(state.updates))
            state, _ = run.learner.update_step(state, run._batch(trajs), key)
            source.publish(run.sampler_params(state.policy), int(state.step), synced=True)
    finally:
        source.stop()
    return got


def _run_both_modes(config, placement, tmp_path):
    """Sync rollouts, then the async sampler in lockstep, from the same initial state."""
    run = train.Run(config, tmp_path, placement=placement)
    state = run.warm_start()
    out = {"sync": _rollouts(run, run.rollouts(), state, 2)}
    run.config.unlock()
    run.config.train.rollouts = "async"
    run.config.lock()
    state = run.warm_start()
    out["lockstep"] = _rollouts(run, run.rollouts(), state, 2)
    return out


# One program per kind: one prefill width, the whole-cache read, one padded length.
FEW_PROGRAMS = {
    "sampling.max_len": 64,
    "sampling.prefill_buckets": (32,),
    "sampling.span_buckets": (64,),
    "train.length_bucket": 64,
}


@pytest.mark.slow
def test_disaggregated_lockstep_reproduces_colocated(tmp_path, jax_cache_dir):
    lockstep = {"train.rollouts": "sync", "sampling.lockstep": 6, "sampling.queue_size": 16}
    lockstep["rl.advantage"] = "moving_average"  # no critic: the update compiles in half
    dis_config = _config(**DISAGGREGATED, **lockstep, **FEW_PROGRAMS)
    dis = placement_from_config(dis_config)
    # colocated on the same 6 trainer devices, so both runs train bit-identically
    col = Placement("colocated", dis.trainer_devices)
    # the sync engine's and the async sampler's programs are the same: compiled once
    with ts.persistent_compilation_cache(jax_cache_dir):
        got = _run_both_modes(dis_config, dis, tmp_path / "dis")
        ref = _run_both_modes(_config(**lockstep, **FEW_PROGRAMS), col, tmp_path / "col")
    for mode in ("sync", "lockstep"):
        assert len(got[mode]) == len(ref[mode]) == 12, mode
        assert {v for t in ref[mode] for v in t.versions} == {0, 1}, mode  # both versions
        for a, b in zip(got[mode], ref[mode]):
            assert a.prompt_uid == b.prompt_uid, mode
            np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=mode)
            np.testing.assert_array_equal(a.versions, b.versions, err_msg=mode)
            np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, atol=2e-5, err_msg=mode)
