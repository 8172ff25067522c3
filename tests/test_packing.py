"""Packing: several trajectories per row for the model passes, the same update as padding.

A packed batch runs every model pass on packed rows and gathers the per-token outputs back
to the padded [N, T] layout, so GAE, rewards, losses and metrics see the padded batch:
the update (params, optimizer states, metrics) must equal the padded one within float32
reduction-order noise, with microbatching, data-parallel sharding, routing replay and a
critic-free group estimator.
"""

import jax
import numpy as np
import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.metrics import pair_means as reduce_metrics
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.rl import packing
from sao_jax.rl.batch import check_batch
from sao_jax.sampling.trajectory import Trajectory, pack_batch, pad_batch, padding_fraction
from sao_jax.schema import ConfigError
from tests.closeness import assert_steps_close
from tests.learner_variants import CountingLearner

B, T, VOCAB, EXPERTS, TOP_K = 8, 32, 32, 8, 2


def random_trajectories(n, seed, *, routing=False, group_size=1, max_len=T):
    """n multi-turn trajectories of varied length (4..max_len), some truncated, some
    ending on an observation; routing records drawn at random (distinct experts)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        cap = int(rng.integers(4, max_len + 1))
        action, turn_ids = [False] * int(rng.integers(1, min(4, cap - 1))), []
        turn = 0
        while len(action) < cap - 1 and turn < 4:
            a = min(int(rng.integers(1, 7)), cap - len(action))
            action += [True] * a
            turn_ids += [turn] * a
            o = min(int(rng.integers(0, 5)), cap - len(action))
            action += [False] * o
            turn += 1
        action = np.array(action)
        m = len(action)
        ids = np.full(m, -1, np.int32)
        ids[action] = turn_ids
        terminated = bool(rng.uniform() < 0.7)
        turns = int(ids.max()) + 1
        rewards = rng.normal(size=turns if terminated else turns - 1).astype(np.float32)
        experts = None
        if routing:
            experts = np.stack(  # [m, L_moe = 1, k]
                [[rng.permutation(EXPERTS)[:TOP_K]] for _ in range(m)]
            ).astype(np.int32)
            experts[-1] = -1  # the final token is never fed to the sampler
        out.append(
            Trajectory(
                tokens=rng.integers(1, VOCAB, m).astype(np.int32),
                action_mask=action,
                rollout_logp=np.where(action, -rng.uniform(0.5, 4.0, m), 0.0).astype(np.float32),
                sampled_logp=np.zeros(m, np.float32),
                versions=np.zeros(m, np.int32),
                turn_ids=ids,
                turn_rewards=rewards,
                outcome=float(rewards[-1]) if terminated and turns else 0.0,
                terminated=terminated,
                truncated=not terminated,
                prompt_uid=f"g{i // group_size}",
                experts=experts,
            )
        )
    return out


def _config(rows=B, **rl):
    c = base.get_config()
    c.model.update(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, head_dim=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=(0,),
    )  # fmt: skip
    c.rl.batch_size = rows
    c.optim.policy.lr = 1e-3
    c.optim.critic.lr = 1e-3
    c.optim.critic.warmup_steps = 0
    c.rl.update(rl)
    if rl.get("routing_replay"):
        c.sampling.record_routing = True
    if rl.get("advantage") == "grpo":
        c.env.group_size = 2
    return config_lib.validate(c)


def _batches(learner, *, replay, groups, max_len):
    """(padded, packed) batches of the same trajectories, packed for this learner into a
    common number of rows (one shape: one compilation)."""
    n = learner.rl.batch_size
    trajs = [
        random_trajectories(n, s, routing=replay, group_size=1 + groups, max_len=max_len)
        for s in range(3)
    ]
    kw = dict(
        length=T,
        with_routing=replay,
        with_groups=groups,
        microbatches=learner.rl.microbatches,
        shards=learner.sharder.axis_size("batch"),
    )
    rows = max(pack_batch(t, **kw)[0]["packed_tokens"].shape[0] for t in trajs)
    out = []
    for t in trajs:
        padded = pad_batch(t, length=T, with_routing=replay, with_groups=groups)
        packed, _ = pack_batch(t, packed_rows=rows, **kw)
        learner.check_batch(padded)
        learner.check_batch(packed)
        out.append((padded, packed))
    return out


def _run(learner, state, batches):
    """An update step on each batch."""
    metrics = []
    for i, b in enumerate(batches):
        state, m = learner.update_step(state, b, jax.random.key(i))
        metrics.append(reduce_metrics(m))
    return jax.tree.map(np.asarray, state), metrics


@pytest.mark.parametrize(
    "rl,mesh",
    [  # each compiles two update steps: options that don't interact share a case
        (dict(advantage="grpo", policy_loss="ppo_clip", routing_replay=True), None),
        # 2 microbatches x 4 shards of 2 (short) trajectories, packed into one row each;
        # critic_first: V0 and the values after the critic's K steps, both on packed rows;
        # values at observation tokens are read too
        (dict(advantage="cross_observation", microbatches=2, rows=16), (1, 2, 2, 2)),
    ],
    ids=["grpo-replay-ppo", "sharded-microbatches-cross-observation"],
)
def test_packed_update_equals_padded(rl, mesh):
    """Three update steps per layout. The critic-only value step is the update step's
    critic half (`Learner._value_step`: the same `initial_values`, `critic_steps` and
    guard), so packed == padded for the update step covers it without two more programs
    to compile per case."""
    config = _config(**rl)
    rl = {k: v for k, v in rl.items() if k != "rows"}
    sharder = Sharder(build_mesh(mesh)) if mesh else Sharder()
    models = init_models(ModelConfig.from_config(config.model), sharder, seed=0)
    learner = CountingLearner(
        config.rl, config.optim, models.policy_def, models.critic_def, sharder
    )
    replay, groups = bool(rl.get("routing_replay")), rl.get("advantage") == "grpo"
    pairs = _batches(learner, replay=replay, groups=groups, max_len=T // 2 if mesh else T)
    padded, packed = [p for p, _ in pairs], [q for _, q in pairs]
    rows = config.rl.batch_size
    assert all(q["packed_tokens"].shape[0] < rows for q in packed), "something was packed"
    fresh = lambda: learner.new_state(models.policy, models.critic, seed=0)
    ref_state, ref_metrics = _run(learner, fresh(), padded)
    got_state, got_metrics = _run(learner, fresh(), packed)
    assert learner.traces == {"update_step": 2, "value_step": 0}  # one trace per layout
    assert int(ref_state.step) == 3 and int(ref_state.skipped_steps) == 0
    assert np.isfinite(ref_metrics[-1]["policy/loss"])
    if groups:  # the group estimator (tests/test_update.py's variants run the others)
        assert learner.uses_critic is False and ref_state.critic == {}
    # three update steps: the k-step bound from the shared start
    assert_steps_close(got_state, ref_state, jax.tree.map(np.asarray, fresh()))
    for got, ref in zip(got_metrics, ref_metrics, strict=True):
        assert got.keys() == ref.keys()
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=2e-4, atol=2e-5, err_msg=k)


def test_pack_batch_layout_respects_microbatches_and_shards():
    trajs = random_trajectories(16, 3, routing=True, max_len=20)
    m, d = 2, 2
    batch, placements = pack_batch(
        trajs, length=24, microbatches=m, shards=d, rows_multiple=3, with_routing=True
    )
    check_batch(batch)
    padded = pad_batch(trajs, length=24)
    for k in padded:
        np.testing.assert_array_equal(batch[k], padded[k], err_msg=k)
    assert "forced_experts" not in batch
    r = batch["packed_tokens"].shape[0]
    r_g = r // (m * d)
    assert r % (m * d) == 0 and r_g % 3 == 0
    per = 16 // (m * d)
    for p in placements:
        tr, g = trajs[p.index], p.index // per
        assert g * r_g <= p.row < (g + 1) * r_g, "a trajectory stays in its group's rows"
        sl = slice(p.start, p.start + p.length)
        np.testing.assert_array_equal(batch["packed_tokens"][p.row, sl], tr.tokens)
        np.testing.assert_array_equal(batch["packed_positions"][p.row, sl], np.arange(p.length))
        assert (batch["packed_segment_ids"][p.row, sl] == p.segment).all()
        rec = tr.experts >= 0
        np.testing.assert_array_equal(
            batch["packed_forced_experts"][p.row, sl][rec], tr.experts[rec]
        )
        # Index map: row within the microbatch, i.e. global row minus the microbatch offset.
        assert batch["pack_row"][p.index] == p.row - (g // d) * d * r_g
        assert batch["pack_start"][p.index] == p.start
    used = sum(t.length for t in trajs)
    assert (batch["packed_segment_ids"] != 0).sum() == used
    assert padding_fraction(batch["packed_segment_ids"]) < padding_fraction(padded["segment_ids"])


def test_gather_back_equals_literal_reference():
    trajs = random_trajectories(6, 4, max_len=12)
    batch, placements = pack_batch(trajs, length=16)
    rng = np.random.default_rng(0)
    x_rl = rng.normal(size=batch["packed_tokens"].shape).astype(np.float32)
    got = np.asarray(packing.to_trajectories(batch, x_rl))
    last = np.asarray(packing.at_last_token(batch, x_rl))
    for p in placements:
        want = np.zeros(16, np.float32)
        for t in range(1, p.length):
            want[t] = x_rl[p.row, p.start + t]
        np.testing.assert_array_equal(got[p.index], want)
        assert last[p.index] == x_rl[p.row, p.start + p.length - 1]


def test_bad_packed_batches_named():
    trajs = random_trajectories(8, 5)
    batch, _ = pack_batch(trajs, length=T)
    broken = {k: v for k, v in batch.items() if k != "pack_start"}
    with pytest.raises(ConfigError, match="pack_start"):
        check_batch(broken)
    with pytest.raises(ValueError, match="divisible"):
        pack_batch(trajs, length=T, microbatches=3)
    with pytest.raises(ValueError, match="row length"):
        pack_batch(trajs, length=T, row_length=3)
    with pytest.raises(ValueError, match="packed_rows"):
        pack_batch(trajs, length=T, packed_rows=1)
    c = base.get_config()
    c.train.pack, c.train.pack_length = True, c.sampling.max_len - 1
    with pytest.raises(ConfigError, match="train.pack_length"):
        config_lib.validate(c)
    c.train.pack_length, c.train.pack_rows_multiple = 0, 0
    with pytest.raises(ConfigError, match="train.pack_rows_multiple"):
        config_lib.validate(c)
