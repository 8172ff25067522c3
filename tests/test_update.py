"""The SAO update step: TTUR, frozen attention, guard, baselines, sharding, microbatching."""

import functools

import jax
import numpy as np
import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.metrics import pair_means as reduce_metrics
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, init_models, policy_def
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import path_str, tree_bytes
from sao_jax.rl import passes as P
from sao_jax.rl import update as update_lib
from sao_jax.rl.optim import critic_frozen_labels
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner, NonFiniteError
from sao_jax.schema import ConfigError
from tests.closeness import assert_steps_close
from tests.learner_variants import CountingLearner

B, T = 8, 24


def _config(aux=0.001, **rl):
    c = base.get_config()
    c.model.update(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, head_dim=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=(0,),
    )  # fmt: skip
    c.model.router_aux_loss_coef = aux
    c.rl.batch_size = B
    c.optim.policy.lr = 1e-3
    c.optim.critic.lr = 1e-3
    c.optim.critic.warmup_steps = 0
    c.rl.update(rl)
    if rl.get("advantage") in ("grpo", "rloo", "drgrpo"):
        c.env.group_size = 2
    return config_lib.validate(c)


def _setup(config, sharder=None):
    sharder = sharder or Sharder()
    models = init_models(ModelConfig.from_config(config.model), sharder, seed=0)
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, sharder)
    state = learner.new_state(models.policy, models.critic, seed=0)
    return learner, state


@pytest.fixture(scope="module")
def default():
    """One learner (compiled once) for the default SAO config; each test gets a fresh state."""
    config = _config(aux=0.0, max_consecutive_skips=2)  # aux loss is per microbatch by design
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    learner = CountingLearner(
        config.rl, config.optim, models.policy_def, models.critic_def, Sharder()
    )
    return learner, lambda: learner.new_state(models.policy, models.critic, seed=0)


def _batch(seed=0, baseline_keys=None, rows=B, **kw):
    batch = synthetic_batch(rows, T, 32, seed=seed, **kw)
    if baseline_keys is not None:  # the keyed moving average's [B] keys
        batch["baseline_keys"] = baseline_keys
    return batch


def _leaf(tree, path):
    for p in path.split("."):
        tree = tree[int(p) if p.isdigit() else p]
    return tree


def _steps(learner, state, n, **kw):
    metrics = None
    for i in range(n):
        batch = _batch(seed=i, version=int(state.step), **kw)
        learner.check_batch(batch)
        state, metrics = learner.update_step(state, batch, jax.random.key(i))
    return state, metrics


def test_update_trains_policy_and_critic_but_not_frozen_attention(default):
    learner, new_state = default
    state = new_state()
    before = jax.tree.map(np.asarray, state)
    state, metrics = _steps(learner, state, 3)
    m = reduce_metrics(metrics)
    assert int(state.step) == 3 and int(state.skipped_steps) == 0
    keys = ("policy/loss", "policy/keep_rate", "critic/value_loss", "critic/ev_pre_update")
    for key in (*keys, "obs/value_jump", "obs/variance_share"):
        assert np.isfinite(m[key]), key
    labels = jax.tree_util.tree_leaves_with_path(learner.critic_frozen)
    frozen = [path_str(p) for p, lab in labels if lab == "frozen"]
    assert "trunk.embed.embedding" in frozen and "trunk.layers.1.attn.q_proj" in frozen
    for path in frozen:  # bit-identical, not p + 0
        np.testing.assert_array_equal(_leaf(state.critic, path), _leaf(before.critic, path))
    moved = lambda a, b: not np.array_equal(np.asarray(a), b)
    assert moved(state.critic["value_head"], before.critic["value_head"])
    e = "trunk.layers.1.mlp.experts.gate_proj"
    assert moved(_leaf(state.critic, e), _leaf(before.critic, e))
    assert moved(
        _leaf(state.policy, "trunk.layers.1.attn.q_proj"),
        _leaf(before.policy, "trunk.layers.1.attn.q_proj"),
    )


def _learner(config):
    """A Learner from the models' shapes alone: nothing initialised, nothing compiled (its
    optimizers, frozen labels, abstract state and batch checks are all built here)."""
    cfg = ModelConfig.from_config(config.model)
    pdef, cdef = policy_def(cfg, Sharder()), critic_def(cfg, Sharder())
    return Learner(config.rl, config.optim, pdef, cdef, Sharder())


def _critic_config(**critic):
    c = _config()
    c.unlock()
    c.optim.critic.update(critic)
    return config_lib.validate(c)


@pytest.mark.parametrize("trainable", ["moe", "all_but_attention"])
def test_frozen_leaves_get_no_moments(trainable):
    config = _critic_config(trainable=trainable)
    frozen = _learner(config)
    full = _learner(_critic_config(freeze_attention=False))
    assert full.critic_frozen is None  # no frozen attention: everything trains
    critic = frozen.critic_def.shapes()
    pairs = zip(jax.tree.leaves(critic), jax.tree.leaves(frozen.critic_frozen), strict=True)
    frozen_size = sum(x.size * x.dtype.itemsize for x, lab in pairs if lab == "frozen")
    # Abstract states (jax.eval_shape): the bytes an allocation would take, nothing compiled.
    frozen_bytes = tree_bytes(frozen.abstract_state.critic_opt)
    full_bytes = tree_bytes(full.abstract_state.critic_opt)
    print(f"critic optimizer state: {full_bytes} B full, {frozen_bytes} B {trainable}")
    assert full_bytes - frozen_bytes == 2 * frozen_size  # AdamW mu and nu of every frozen leaf


def test_default_trainable_set_is_moe_router_and_value_head():
    """The seed's frozen-attention critic: MoE (and dense-MLP) projections, router and value
    head train; attention, the embedding and every RMSNorm scale do not."""
    critic = _learner(_config()).critic_def.shapes()
    labels = critic_frozen_labels(critic, _config().optim.critic)
    paths = {path_str(p): lab for p, lab in jax.tree_util.tree_leaves_with_path(labels)}
    train = {p for p, lab in paths.items() if lab == "train"}
    assert {"value_head", "value_bias", "trunk.layers.1.mlp.gate.kernel"} <= train
    assert "trunk.layers.1.mlp.experts.gate_proj" in train  # MoE layer
    assert "trunk.layers.0.mlp.gate_proj" in train  # the dense MLP of mlp_only_layers
    for p in ("trunk.embed.embedding", "trunk.final_norm.scale", "trunk.layers.1.input_norm.scale",
              "trunk.layers.1.post_attn_norm.scale", "trunk.layers.1.attn.q_proj"):  # fmt: skip
        assert paths[p] == "frozen", p
    assert all(".mlp." in p or p.startswith("value_") for p in train)
    wide = _critic_config(trainable="all_but_attention")
    labels = critic_frozen_labels(critic, wide.optim.critic)
    paths = {path_str(p): lab for p, lab in jax.tree_util.tree_leaves_with_path(labels)}
    assert paths["trunk.embed.embedding"] == paths["trunk.final_norm.scale"] == "train"
    assert {p for p, lab in paths.items() if lab == "frozen"} == {p for p in paths if ".attn." in p}


def test_empty_frozen_set_is_an_error():
    c = base.get_config()
    c.optim.critic.frozen_patterns = (r"no_such_module",)
    c.rl.batch_size = B
    config = config_lib.validate(c)
    with pytest.raises(ConfigError, match="frozen_patterns"):  # at construction: no compile
        _learner(config)
    c2 = base.get_config()
    c2.optim.critic.frozen_patterns = ()
    with pytest.raises(ConfigError, match="frozen_patterns"):
        config_lib.validate(c2)


def test_no_retrace_across_steps(default):
    learner, new_state = default
    state = new_state()
    state, _ = _steps(learner, state, 1)
    state, _ = learner.value_step(state, _batch(seed=9), jax.random.key(0))
    traces = dict(learner.traces)
    state, _ = _steps(learner, state, 3)
    for i in range(2):
        state, _ = learner.value_step(state, _batch(seed=10 + i), jax.random.key(0))
    assert learner.traces == traces == {"update_step": 1, "value_step": 1}


def test_value_step_leaves_policy_alone(default):
    learner, new_state = default
    state = new_state()
    policy = jax.tree.map(np.asarray, state.policy)
    head = np.asarray(state.critic["value_head"])
    state, metrics = learner.value_step(state, _batch(), jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, state.policy, policy)
    assert not np.array_equal(np.asarray(state.critic["value_head"]), head)
    assert int(state.step) == 0 and int(state.updates) == 1
    assert np.isfinite(reduce_metrics(metrics)["critic/value_loss"])


def test_nonfinite_guard_skips_and_aborts(default):
    learner, new_state = default
    state = new_state()
    good, _ = _steps(learner, state, 1)
    snapshot = jax.tree.map(np.asarray, good)
    bad = _batch(seed=5)
    bad["rewards"] = np.where(bad["action_mask"], np.nan, 0.0).astype(np.float32)
    state, metrics = learner.update_step(good, bad, jax.random.key(0))
    assert reduce_metrics(metrics)["skipped"] == 1.0
    jax.tree.map(np.testing.assert_array_equal, state.policy, snapshot.policy)
    jax.tree.map(np.testing.assert_array_equal, state.critic_opt, snapshot.critic_opt)
    assert int(state.skipped_steps) == 1 and int(state.consecutive_skips) == 1
    learner.raise_if_diverged(state)
    state, _ = learner.update_step(state, bad, jax.random.key(0))
    with pytest.raises(NonFiniteError, match="2 consecutive"):
        learner.raise_if_diverged(state)


@pytest.mark.parametrize(
    "rl",
    [  # each compile is expensive on CPU: options that don't interact share a variant
        dict(k_critic=1, order="policy_first", policy_loss="estr", advantage="step_mean"),
        dict(
            advantage="moving_average",
            policy_loss="icepop",
            moving_average_keys=3,
            baseline_key="level",
        ),  # keyed: one window per key; the global one is a K = 1
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_variants_run(rl):
    """Two updates of each variant run finite without a skip. GRPO with the PPO clip (and
    routing replay): tests/test_packing.py `[grpo-replay-ppo]`, three updates per layout;
    the PPO clip with a critic: this module's PPO loop."""
    learner, state = _setup(_config(**rl))
    kw = {}
    keys = np.array([0, 2, 2, 1, 2, 0, 2, 2], np.int32)
    if rl.get("baseline_key"):
        with pytest.raises(ConfigError, match="missing field 'baseline_keys'"):
            learner.check_batch(_batch())
        kw["baseline_keys"] = keys
    state, metrics = _steps(learner, state, 2, max_lag=2, **kw)
    m = reduce_metrics(metrics)
    assert int(state.step) == 2 and int(state.skipped_steps) == 0
    assert np.isfinite(m["policy/loss"])
    if rl.get("advantage") == "moving_average":
        np.testing.assert_array_equal(state.baseline.count, 2 * np.bincount(keys))
        assert "critic/value_loss" not in m  # no critic involved


def test_bad_inputs_named():
    learner = _learner(_config(advantage="grpo"))  # nothing compiled
    with pytest.raises(ConfigError, match="group_ids"):
        learner.check_batch(_batch())
    bad = _batch()
    bad["rewards"] = bad["rewards"].astype(np.int32)
    with pytest.raises(ConfigError, match="'rewards'"):
        learner.check_batch(bad)
    for field, value in (("k_critic", 0), ("microbatches", 3)):
        c = base.get_config()
        c.rl.batch_size = B
        c.rl[field] = value
        with pytest.raises(ConfigError, match=f"rl.{field}"):
            config_lib.validate(c)
    c = base.get_config()
    c.optim.critic.lr = 0.0
    with pytest.raises(ConfigError, match="optim.critic.lr"):
        config_lib.validate(c)


def _three_steps(config, sharder=None, **kw):
    learner, state = _setup(config, sharder)
    state, metrics = _steps(learner, state, 3, rows=config.rl.batch_size, **kw)
    return jax.tree.map(np.asarray, state), reduce_metrics(metrics)


@pytest.fixture(scope="module")
def start(default):
    """The state every three-step run here starts from (seed 0, any sharding)."""
    _, new_state = default
    return jax.tree.map(np.asarray, new_state())


@pytest.fixture(scope="module")
def reference(default):
    """Three updates of the default learner, unsharded and without microbatching."""
    learner, new_state = default
    state, _ = _steps(learner, new_state(), 3, max_lag=1)
    return jax.tree.map(np.asarray, state)


def _planted(batch_fn, default):
    """Three steps of the default learner on batches a planted mistake changed."""
    learner, new_state = default
    state = new_state()
    for i in range(3):
        batch = batch_fn(_batch(seed=i, version=int(state.step), max_lag=1))
        state, _ = learner.update_step(state, batch, jax.random.key(i))
    return jax.tree.map(np.asarray, state)


def _drop_rows(batch, rows):
    mask = np.array(batch["action_mask"])
    mask[rows] = 0
    return dict(batch, action_mask=mask)


def _one_pad_short(batch):
    """Off by one pad: each row's last real token is taken for padding."""
    mask = np.array(batch["action_mask"])
    last = np.asarray(batch["segment_ids"]).astype(bool).sum(axis=1) - 1
    mask[np.arange(len(mask)), last] = 0
    return dict(batch, action_mask=mask)


def test_step_tolerance_sees_planted_mistakes(default, reference, start):
    """The k-step bound (tests/closeness.py) passes CPU-to-CPU rounding but not a mistake
    of any family: a dropped microbatch (rows 0-1 of 4 microbatches of 2), an off-by-one
    pad (each row's last token lost) and a wrong shard order (a leaf's two halves swapped,
    as a misassembled tensor-parallel gather would leave them). Same shapes as the
    reference: no new compile."""
    dropped = _planted(lambda b: _drop_rows(b, [0, 1]), default)
    short = _planted(_one_pad_short, default)
    flip = lambda x: np.concatenate(np.split(x, 2)[::-1]) if x.ndim and len(x) % 2 == 0 else x
    swapped = reference.replace(policy=jax.tree.map(flip, reference.policy))
    for name, got in (("dropped", dropped), ("short", short), ("swapped", swapped)):
        with pytest.raises(AssertionError, match="k-step bound"):
            assert_steps_close(got, reference, start, err_msg=f"{name}: ")


# ------------------------------------------------------- PPO rows: epochs x minibatches


@functools.cache
def _policy_logp(learner):
    """The learner's policy pass as one jitted program (op by op it took ~3 s of CPU per
    batch shape, compiling each primitive; jitted, ~0.4 s)."""
    return jax.jit(lambda p, b: P.policy_pass(learner.policy_def.bind(p), b, replay=False)["logp"])


def _logp(learner, policy, batch):
    """The policy's log-probs of the batch's tokens (what a rollout engine would record)."""
    out = _policy_logp(learner)(policy, batch)
    return np.where(batch["action_mask"], np.asarray(out), 0.0).astype(np.float32)


def test_ppo_clip_binds_with_minibatch_steps_on_stale_data(ppo_reference):
    """pi_old = the behaviour log-probs: on data sampled 3 versions ago the ratio is off 1
    and the clip binds; several minibatch steps make it bind even on fresh data. (Before
    this, pi_old was the policy at the step's start and one step was taken: exactly 0.)
    The PPO loop's reference learner (compiled once): 2 epochs x 2 minibatches, lr 1e-2."""
    learner, new_state, _ = ppo_reference
    state = new_state()
    start = jax.tree.map(np.asarray, state.policy)
    state, _ = _steps(learner, state, 3, rows=PPO_ROWS)  # the learner moves on: version 3
    clip = {}
    for name, policy, version in (("stale", start, 0), ("fresh", state.policy, 3)):
        batch = _batch(seed=7, version=version, rows=PPO_ROWS)
        batch["rollout_logp"] = _logp(learner, policy, batch)
        _, metrics = learner.update_step(
            jax.tree.map(jax.numpy.array, state), batch, jax.random.key(1)
        )
        m = reduce_metrics(metrics)
        clip[name] = m["policy/clip_frac"]
        assert (
            0 <= m["policy/ppo_clip_low"] + m["policy/ppo_clip_high"] == pytest.approx(clip[name])
        )
    print(f"2 epochs x 2 minibatches: clip fraction {clip}")
    assert clip["stale"] > 0.05 and clip["fresh"] > 0.0


def test_minibatch_indices_are_per_epoch_permutations():
    idx = np.asarray(update_lib.minibatch_indices(jax.random.key(3), 8, 2, 4))
    assert idx.shape == (8, 2)
    for epoch in (idx[:4], idx[4:]):
        assert sorted(epoch.ravel()) == list(range(8))
    assert not np.array_equal(idx[:4], idx[4:])


@pytest.fixture(scope="module")
def ppo_reference():
    """The PPO loop's learner (ppo_clip, 2 epochs x 2 minibatches, policy lr 1e-2: large
    enough that the clip binds on fresh data), unsharded, whole minibatches, compiled once:
    (learner, new state, three updates' (final state, last metrics)). The icepop loss:
    test_variants_run."""
    config = _ppo_config()
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, Sharder())
    new_state = lambda: learner.new_state(models.policy, models.critic, seed=0)
    state, metrics = _steps(learner, new_state(), 3, max_lag=1, rows=PPO_ROWS)
    return learner, new_state, (jax.tree.map(np.asarray, state), reduce_metrics(metrics))


PPO_ROWS = 32  # minibatches of 16: 2 microbatches x 8 shards of 1 row


def _ppo_config(**rl):
    config = _config(
        aux=0.0, policy_loss="ppo_clip", ppo_epochs=2, minibatches=2, batch_size=PPO_ROWS,
        lam_mode="fixed", whiten_advantages=True, value_clip=0.2, **rl,
    )  # fmt: skip
    config.unlock()
    config.optim.policy.lr = 1e-2
    return config


@pytest.mark.slow  # a module with one starts early (tests/conftest.py)
def test_ppo_loop_sharded_and_microbatched_equals_unsharded(ppo_reference, start):
    """Sharded and microbatched in one run (one program to compile, not two): batch and
    experts over 8 devices (one expert each), each minibatch of 16 rows in 2 microbatches
    of 8 (one row per device), against whole minibatches on one device. (Data x fsdp x
    expert: test_brace_sharded_and_microbatched_equal_unsharded; tensor parallel:
    tests/test_packing.py's sharded case, tests/test_value_pretrain.py.)"""
    _, _, (ref, ref_metrics) = ppo_reference
    assert int(ref.step) == 3 and int(ref.skipped_steps) == 0  # fixed lambda, whitened,
    assert np.isfinite(ref_metrics["critic/value_loss"])  # clipped values: finite, no skip
    config = _ppo_config(microbatches=2)
    got, metrics = _three_steps(config, Sharder(build_mesh((1, 1, 8, 1))), max_lag=1)
    assert_steps_close(got, ref, start)
    assert metrics["policy/keep_rate"] == pytest.approx(ref_metrics["policy/keep_rate"])


# -------------------------------------------- rl.critic_target = 'brace' (stale critics)


BRACE_ROWS = 16  # 2 microbatches x 8 shards of 1 row


def _brace_config(**rl):
    return _config(aux=0.0, critic_target="brace", batch_size=BRACE_ROWS, **rl)


@pytest.fixture(scope="module")
def brace():
    """The default SAO learner with the BRACE critic target (compiled once)."""
    config = _brace_config()
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    learner = CountingLearner(
        config.rl, config.optim, models.policy_def, models.critic_def, Sharder()
    )
    return learner, lambda: learner.new_state(models.policy, models.critic, seed=0)


@pytest.fixture(scope="module")
def brace_reference(brace):
    """Three BRACE updates on stale batches (versions lag up to 4), unsharded, without
    microbatching: the final state and the last step's metrics."""
    learner, new_state = brace
    state, metrics = _steps(learner, new_state(), 3, max_lag=4, rows=BRACE_ROWS)
    return jax.tree.map(np.asarray, state), reduce_metrics(metrics)


def test_brace_update_runs_finite_without_retrace(brace, brace_reference):
    learner, _ = brace
    state, m = brace_reference
    assert learner.traces["update_step"] == 1  # three steps, one trace
    assert int(state.step) == 3 and int(state.skipped_steps) == 0
    for name in ("policy/loss", "critic/value_loss", "critic/target_shift", "critic/lr"):
        assert np.isfinite(m[name]), name
    assert 0.0 < m["critic/target_trace"] < 1.0  # random rollout log-probs: ratios off 1
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.critic))


@pytest.mark.slow  # a module with one starts early (tests/conftest.py)
def test_brace_sharded_and_microbatched_equal_unsharded(brace_reference, start):
    """Sharded over 8 devices (data x fsdp x expert) and 2 microbatches of 8 rows (one per
    device) in one run (one program to compile, not two), against the whole batch on one
    device. Also the default learner's sharded and microbatched checks: BRACE's targets
    are the lambda = 1 returns plus a correction."""
    ref, ref_m = brace_reference
    config = _brace_config(microbatches=2)
    learner, state = _setup(config, Sharder(build_mesh((2, 2, 2, 1))))
    state, metrics = _steps(learner, state, 3, max_lag=4, rows=BRACE_ROWS)
    assert_steps_close(jax.tree.map(np.asarray, state), ref, start)
    m = reduce_metrics(metrics)
    for name in ("critic/target_shift", "critic/target_trace"):
        assert m[name] == pytest.approx(ref_m[name], abs=1e-5), name


def test_brace_target_equals_lambda_on_policy_and_moves_on_stale_data(default, brace):
    """rl.critic_target='brace' (sao_jax/rl/critic_targets.py): on a batch whose recorded
    log-probs are the learner's own (ratio 1) the critic regresses the lambda = 1 returns,
    so its K steps match the default's; on the synthetic batch's random log-probs (ratios
    far from 1) the targets move off the Monte-Carlo returns. (value_step: the critic's
    half of update_step, which reads the same targets.)"""
    learner, new_state = default
    brace, _ = brace
    state = new_state()
    batch = _batch(seed=5)
    on_policy = dict(batch, rollout_logp=_logp(learner, state.policy, batch))
    want, _ = learner.value_step(new_state(), on_policy, jax.random.key(0))
    got, m = brace.value_step(new_state(), on_policy, jax.random.key(0))
    start = jax.tree.map(np.asarray, new_state().critic)
    assert_steps_close(jax.tree.map(np.asarray, got.critic), want.critic, start)
    m = reduce_metrics(m)
    assert abs(m["critic/target_shift"]) < 1e-5 and m["critic/target_trace"] == pytest.approx(1.0)
    _, m = brace.value_step(new_state(), batch, jax.random.key(0))
    m = reduce_metrics(m)
    assert abs(m["critic/target_shift"]) > 1e-3 and m["critic/target_trace"] < 0.9
