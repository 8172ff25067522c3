"""Checkpointer (round trip, keep-last-N, corruption, failed saves, other meshes) and the
tensor fingerprints (the workdir guard and GracefulExit: tests/test_workdir_guard.py).

Damage goes where the arrays live: the largest file of a step's `state` item (today
`state/ocdbt.process_0/d/<hash>`, found by size, not by name), truncated or overwritten
in place."""

import errno
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint import handlers as ocp_handlers

from configs import base
from sao_jax import checkpointing as ckpt
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.rl.update import Learner
from sao_jax.schema import ConfigError

abstract_like = ckpt.abstract_like

# ------------------------------------------------------------------------------ helpers


def _tiny_config(**rl):
    c = base.get_config()
    c.model.update(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, head_dim=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=(0,),
    )  # fmt: skip
    c.rl.batch_size = 8
    c.rl.update(rl)
    return config_lib.validate(c)


def _randomise(state, seed):
    """Every leaf replaced by random values of its dtype, on its sharding."""
    rng = np.random.default_rng(seed)

    def fill(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            v = rng.standard_normal(x.shape).astype(x.dtype)
        else:
            v = rng.integers(0, 1000, x.shape).astype(x.dtype)
        return jax.device_put(v, x.sharding)

    return jax.tree.map(fill, state)


def _assert_same(a, b):
    """Same tree structure (int keys, MaskedNode, EmptyState, {}) and bit-equal leaves."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _small(seed):
    """A TrainState-like tree: int keys, MaskedNode, EmptyState, an empty dict."""
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return {
        "layers": {0: {"w": w(4, 3), "frozen": optax.MaskedNode()}, 1: {"w": w(4, 3)}},
        "opt": (optax.EmptyState(), {"count": jnp.int32(seed)}),
        "critic": {},
        "rng": jnp.asarray(rng.integers(0, 2**32, (2,)), jnp.uint32),
        "big": w(64, 64),  # random floats: the largest file of the step holds them
    }


def _ckpt(path, **kw):
    return ckpt.Checkpointer(path / "checkpoints", **kw)


def _save_steps(ck, steps):
    for s in steps:
        assert ck.save(s, _small(s), {"step": s})
    ck.wait()


def _restore(ck, **kw):
    return ck.restore(abstract_like(_small(0), None), **kw)


def array_file(step_dir) -> pathlib.Path:
    """The file holding the array bytes: the largest one of the state item."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def overwrite(path, offset, n=64):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(n))


def _damage(step_dir, how):
    if how == "truncate_data":
        path = array_file(step_dir)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "overwrite_data":
        path = array_file(step_dir)
        overwrite(path, os.path.getsize(path) // 10)
    elif how == "delete_tree_metadata":
        (step_dir / "state" / "_METADATA").unlink()
    elif how == "delete_meta_item":
        shutil.rmtree(step_dir / "meta")
    elif how == "truncate_meta_json":
        (step_dir / "meta" / "metadata").write_text('{"ste')
    else:
        raise ValueError(how)


# A restore that fails on a truncated data file leaves tensorstore callbacks aimed at
# orbax's closed event loop ("Exception ignored ... Event loop is closed"): harmless.
_LOOP_CLOSED = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
DAMAGE = [
    "truncate_data",
    "overwrite_data",
    "delete_tree_metadata",
    "delete_meta_item",
    "truncate_meta_json",
]


# ------------------------------------------------------------------- real TrainState


def _params(model_def, sharder, seed):
    """Random parameters of `model_def`, placed as the sharder says (no init compile)."""
    shapes = model_def.shapes()
    return _randomise(abstract_like(shapes, model_def.shardings(sharder)), seed)


@pytest.fixture(scope="module")
def sharded():
    """A randomised TrainState of the tiny model on a (2, 2, 2, 1) mesh of 8 devices."""
    config = _tiny_config()
    sharder = Sharder(build_mesh((2, 2, 2, 1)))
    cfg = ModelConfig.from_config(config.model)
    defs = policy_def(cfg, sharder), critic_def(cfg, sharder)
    learner = Learner(config.rl, config.optim, *defs, sharder)
    state = learner.new_state(_params(defs[0], sharder, 1), _params(defs[1], sharder, 2), seed=0)
    return config, defs, learner, _randomise(state, seed=3)


META = {
    "prompts": b"\x00\xffgrain-state",
    "counters": {"trajectories": 12, "staleness": {0: 3, np.int32(5): 1}},
    "config": "sao",
    "stats": [1.5, None, True, (2, 3)],
    "np": np.int64(7),
}
META_BACK = dict(META, stats=[1.5, None, True, [2, 3]], np=7)


def test_train_state_round_trip(sharded, tmp_path):
    _, _, learner, state = sharded
    assert 0 in state.policy["trunk"]["layers"]  # integer layer keys
    masked = lambda x: isinstance(x, optax.MaskedNode)
    assert any(map(masked, jax.tree.leaves(state.critic_opt, is_leaf=masked)))
    with _ckpt(tmp_path) as ck:
        assert ck.save(5, state, META)
        ck.wait()
        abstract = abstract_like(learner.abstract_state, learner.state_shardings)
        restored, meta = ck.restore(abstract)
    _assert_same(restored, state)
    assert meta == META_BACK and ck.restored_step == 5
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert x.sharding == y.sharding


@pytest.mark.parametrize("keys", [0, 5])  # the global window; one window per level
def test_state_without_critic_round_trips(sharded, tmp_path, keys):
    _, defs, learner, _ = sharded
    keyed = dict(moving_average_keys=keys, baseline_key="level") if keys else {}
    config = _tiny_config(advantage="moving_average", **keyed)
    nc = Learner(config.rl, config.optim, defs[0], None, learner.sharder)
    state = _randomise(nc.new_state(_params(defs[0], learner.sharder, 1), None, seed=3), seed=4)
    assert state.critic == {}
    assert state.baseline.rewards_w.shape == ((keys, 128) if keys else (128,))
    with _ckpt(tmp_path, async_save=False) as ck:
        ck.save(1, state, {})
        restored, meta = ck.restore(abstract_like(nc.abstract_state, nc.state_shardings))
    _assert_same(restored, state)
    assert meta == {}


@pytest.mark.parametrize("devices", [4, 1])
def test_restore_onto_fewer_devices_is_bit_exact(sharded, tmp_path, devices):
    config, defs, _, state = sharded
    with _ckpt(tmp_path) as ck:
        ck.save(2, state, {"n": 1})
    mesh = build_mesh((1, 2, 2, 1), devices=jax.devices()[:4]) if devices == 4 else None
    target = Learner(config.rl, config.optim, *defs, Sharder(mesh))
    abstract = abstract_like(target.abstract_state, target.state_shardings)
    with _ckpt(tmp_path) as ck:
        restored, _ = ck.restore(abstract)
    _assert_same(restored, state)
    for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
        assert x.sharding == want.sharding and len(x.sharding.device_set) <= devices
    e = restored.policy["trunk"]["layers"][1]["mlp"]["experts"]["gate_proj"]
    assert len(e.sharding.device_set) == devices  # really spread over the new mesh


# ------------------------------------------------------------------------- mechanics


def test_keep_last_n_and_save_rules(tmp_path):
    with _ckpt(tmp_path, keep=2) as ck:
        _save_steps(ck, [1, 2, 3, 4])
        assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
        assert sorted(p.name for p in ck.directory.iterdir() if p.name.isdigit()) == ["3", "4"]
        assert not ck.save(4, _small(9), {})  # already saved
        with pytest.raises(ckpt.CheckpointError, match="older than the latest"):
            ck.save(3, _small(9), {})
        assert ck.save(4, _small(9), {"again": True}, force=True)  # replaced
        ck.wait()
        state, meta = _restore(ck)
    _assert_same(state, _small(9))
    assert meta == {"again": True}
    assert not list((ck.directory / ckpt.REPLACED_DIR).iterdir())


@_LOOP_CLOSED
@pytest.mark.parametrize("how", DAMAGE)
def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog, how):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2, 3])
    _damage(ck.step_dir(3), how)
    with _ckpt(tmp_path) as ck, caplog.at_level(logging.WARNING):
        state, meta = _restore(ck)
        _assert_same(state, _small(2))
        assert meta == {"step": 2} and ck.restored_step == 2
        (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
        assert line.startswith("checkpoint step 3 is damaged (") and "restored step 2" in line
        if how.endswith("_data"):  # the file is named
            assert array_file(ck.directory / ckpt.CORRUPT_DIR / "3").name in line
        assert (ck.directory / ckpt.CORRUPT_DIR / "3").is_dir()  # kept for inspection
        assert ck.all_steps() == [1, 2]
        assert ck.save(3, _small(33), {"step": 3})  # the step number is free again
        ck.wait()
        _assert_same(_restore(ck)[0], _small(33))


def test_tmp_dir_of_crashed_save_is_ignored(tmp_path, caplog):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
    shutil.copytree(ck.step_dir(2), ck.directory / "3.orbax-checkpoint-tmp")
    _damage(ck.directory / "3.orbax-checkpoint-tmp", "truncate_data")
    with _ckpt(tmp_path) as ck, caplog.at_level(logging.WARNING):
        assert ck.latest_step() == 2
        state, _ = _restore(ck)
        assert ck.save(3, _small(3), {})
    _assert_same(state, _small(2))
    assert "unreadable" not in caplog.text


@_LOOP_CLOSED
def test_explicit_corrupt_step_raises_naming_directory(tmp_path):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
        _damage(ck.step_dir(2), "truncate_data")
        with pytest.raises(ckpt.CheckpointError, match=f"{ck.step_dir(2)} is incomplete"):
            _restore(ck, step=2)
        with pytest.raises(ckpt.CheckpointError, match=r"available steps: \[1, 2\]"):
            _restore(ck, step=7)
        _assert_same(_restore(ck, step=1)[0], _small(1))
        assert ck.all_steps() == [1, 2]  # an explicit restore moves nothing
        _damage(ck.step_dir(1), "delete_meta_item")
        with pytest.raises(ckpt.CheckpointError, match="no readable checkpoint"):
            _restore(ck)
        assert ck.all_steps() == [1, 2]


def test_incompatible_target_names_the_tensor(tmp_path):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
        abstract = abstract_like(_small(0), None)
        abstract["layers"][1]["w"] = jax.ShapeDtypeStruct(
            (5, 3), jnp.float32, sharding=abstract["rng"].sharding
        )
        with pytest.raises(ConfigError, match=r"layers\.1\.w is stored as float32\[4, 3\]"):
            ck.restore(abstract)
        abstract["layers"][1]["w"] = abstract["layers"][0]["w"]
        del abstract["rng"]
        with pytest.raises(ConfigError, match="tensor rng is not in the target"):
            ck.restore(abstract)
        with pytest.raises(TypeError, match="has no sharding"):
            ck.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
        assert ck.all_steps() == [1]


def _disk_full(monkeypatch, where):
    def fail(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def fail_async(*a, **k):
        fail()

    if where == "meta_commit":  # in the background commit of the JSON item
        monkeypatch.setattr(ocp_handlers.JsonCheckpointHandler, "_save_fn", fail_async)
    else:  # while starting the array write
        monkeypatch.setattr(ocp_handlers.StandardCheckpointHandler, "async_save", fail_async)


@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.parametrize("where", ["meta_commit", "state_start"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, async_save, where):
    with _ckpt(tmp_path, keep=1, async_save=async_save) as ck:
        _save_steps(ck, [1])
        _disk_full(monkeypatch, where)
        with pytest.raises(ckpt.CheckpointError) as err:
            ck.save(2, _small(2), {"step": 2})
            ck.wait()
        monkeypatch.undo()
        assert isinstance(err.value.__cause__, OSError)
        assert err.value.__cause__.errno == errno.ENOSPC
        assert str(ck.step_dir(2)) in str(err.value) and "checkpoint 1 is intact" in str(err.value)
        assert ck.all_steps() == [1]
        state, meta = _restore(ck)
        _assert_same(state, _small(1))
        assert meta == {"step": 1}
        _save_steps(ck, [3])  # the manager still works
        assert ck.all_steps() == [3]


_CRASH = """
import os, sys
import jax.numpy as jnp
from orbax.checkpoint import handlers
from sao_jax.checkpointing import Checkpointer

async def die(*a, **k):  # killed while the step is being committed
    os._exit(3)

ck = Checkpointer(sys.argv[1], async_save=True)
ck.save(1, {"w": jnp.ones(3)}, {"step": 1})
ck.wait()
handlers.JsonCheckpointHandler._save_fn = die
ck.save(2, {"w": jnp.full(3, 2.0)}, {"step": 2})
ck.wait()
"""


def test_process_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    root = pathlib.Path(__file__).parents[1]
    run = subprocess.run(
        [sys.executable, "-c", _CRASH, str(tmp_path)], cwd=root, env=env, capture_output=True
    )
    assert run.returncode == 3, run.stderr.decode()[-2000:]
    assert [p.name for p in tmp_path.iterdir() if "tmp" in p.name] == ["2.orbax-checkpoint-tmp"]
    with ckpt.Checkpointer(tmp_path) as ck:
        assert ck.all_steps() == [1]
        abstract = abstract_like({"w": jax.ShapeDtypeStruct((3,), jnp.float32)}, None)
        state, meta = ck.restore(abstract)
        np.testing.assert_array_equal(state["w"], np.ones(3))
        assert meta == {"step": 1}
        assert ck.save(2, {"w": jnp.full(3, 2.0)}, {"step": 2})
        ck.wait()
        assert ck.all_steps() == [1, 2]
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]  # cleaned up on open


_DISK_FULL = """
import errno, sys
import jax.numpy as jnp
from orbax.checkpoint import handlers
from sao_jax.checkpointing import Checkpointer, CheckpointError

async def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")

ck = Checkpointer(sys.argv[1], async_save=True)
ck.save(1, {"w": jnp.ones(3)}, {"step": 1})
ck.wait()
handlers.JsonCheckpointHandler._save_fn = full
ck.save(2, {"w": jnp.full(3, 2.0)}, {"step": 2})
try:
    ck.wait()
except CheckpointError as e:
    print("ONE LINE:", e)
ck.close()
"""


def test_a_full_disk_prints_no_orbax_thread_tracebacks(tmp_path):
    """orbax logs each failed background write with its thread's traceback (~200 lines for
    one save); the Checkpointer's CheckpointError says it all, so those records are
    dropped: nothing on stderr but what the program prints itself."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    root = pathlib.Path(__file__).parents[1]
    run = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(tmp_path)], cwd=root, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (line,) = run.stdout.splitlines()
    assert line.startswith("ONE LINE: saving checkpoint step 2 to ") and "Errno 28" in line
    assert "checkpoint 1 is intact" in line
    assert "Traceback" not in run.stderr and "ERROR" not in run.stderr, run.stderr[-2000:]


def test_failed_forced_resave_puts_old_copy_back(tmp_path, monkeypatch):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
        _disk_full(monkeypatch, "meta_commit")
        with pytest.raises(ckpt.CheckpointError, match="No space left"):
            ck.save(1, _small(5), {}, force=True)
            ck.wait()
        monkeypatch.undo()
        assert ck.all_steps() == [1]
        _assert_same(_restore(ck)[0], _small(1))


def test_meta_codec():
    assert ckpt.decode_meta(json.loads(json.dumps(ckpt.encode_meta(META)))) == META_BACK
    with pytest.raises(TypeError, match=r"meta\['counters'\]\['bad'\]: set"):
        ckpt.encode_meta({"counters": {"bad": {1}}})
    with pytest.raises(TypeError, match="dict key 1.5"):
        ckpt.encode_meta({"h": {1.5: 2}})
    with pytest.raises(ValueError, match="reserved"):
        ckpt.encode_meta({"x": {"__bytes__": "AA=="}})


# ------------------------------------------------------------------- verification


def test_array_file_is_where_the_arrays_live(tmp_path):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
    path = array_file(ck.step_dir(1))
    assert path.parent.name == "d" and path.parent.parent.name.startswith("ocdbt.process_")


@_LOOP_CLOSED
def test_checksums_catch_an_overwrite_that_tensorstore_misses(tmp_path, caplog):
    """Some in-place overwrites of the array file restore silently without our checks
    (a changed tensor, issue 15); with them, every one is caught and named."""
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
    good = tmp_path / "good2"
    shutil.copytree(ck.step_dir(2), good)
    size = array_file(good).stat().st_size

    def damaged(offset, *strip):  # step 2 afresh, overwritten at offset, checks removed
        shutil.rmtree(ck.step_dir(2), ignore_errors=True)
        shutil.rmtree(ck.directory / ckpt.CORRUPT_DIR, ignore_errors=True)
        shutil.copytree(good, ck.step_dir(2))
        overwrite(array_file(ck.step_dir(2)), offset)
        for name in strip:
            for p in ck.step_dir(2).glob(name):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        caplog.clear()
        with _ckpt(tmp_path) as again, caplog.at_level(logging.WARNING):
            state, _ = _restore(again)
            return again.restored_step, state

    silent = None
    for offset in range(0, size - 64, max(size // 16, 64)):  # find a silent one
        step, state = damaged(offset, "integrity.*", "checksums")
        if step == 2 and not np.array_equal(state["big"], _small(2)["big"]):
            silent = offset
            break
    assert silent is not None, "no silent overwrite found: tensorstore now checks the data"
    for strip, named in (("integrity.*", "tensor big does not match"), ("none", "CRC-32")):
        step, state = damaged(silent, strip)  # file digests are checked first
        assert step == 1, strip
        _assert_same(state, _small(1))
        assert named in caplog.text, caplog.text


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint32, jnp.int8, jnp.bool_]
)
def test_fingerprint_matches_the_slow_reference(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 7)) * 100).astype(dtype)
    got = ckpt.integrity.fingerprint({"x": x})["x"]
    assert got == list(ckpt.integrity.leaf_fingerprint_reference(np.asarray(x)))


def test_fingerprint_sharded_equals_unsharded_and_sees_one_word(sharded):
    state = sharded[3]
    on_mesh = ckpt.integrity.fingerprint(state.policy)
    local = jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), state.policy)
    assert on_mesh == ckpt.integrity.fingerprint(local)
    name, leaf = next(
        (n, x) for n, x in jax.tree_util.tree_flatten_with_path(local)[0] if x.size > 1
    )
    flat = np.asarray(leaf).copy().reshape(-1)
    flat[flat.size // 2] = np.nextafter(flat[flat.size // 2], np.float32(np.inf))  # one ulp
    changed = jnp.asarray(flat.reshape(leaf.shape))
    a = ckpt.integrity.fingerprint({"x": leaf})["x"]
    b = ckpt.integrity.fingerprint({"x": changed})["x"]
    assert a[0] != b[0] and a[1] != b[1], name
