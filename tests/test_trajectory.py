"""Trajectory record, padding and packing into the rl/batch.py format."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.rl.batch import check_batch
from sao_jax.sampling.trajectory import (
    Trajectory,
    pack_batch,
    pack_rows,
    pad_batch,
    unpack,
)
from sao_jax.schema import ConfigError
from tests.sampling_support import MODEL


def make_traj(
    prompt_len, turns, *, terminated=True, uid="u", version=0, trailing_obs=0, seed=0,
    routing=False,
):  # fmt: skip
    """turns = [(action_len, obs_len), ...]; the last turn's obs_len is ignored unless
    trailing_obs is given (a trajectory that ends on observation tokens)."""
    rng = np.random.default_rng(seed)
    action, turn_ids = [False] * prompt_len, [-1] * prompt_len
    for i, (a, o) in enumerate(turns):
        action += [True] * a
        turn_ids += [i] * a
        o = trailing_obs if i == len(turns) - 1 else o
        action += [False] * o
        turn_ids += [-1] * o
    n = len(action)
    action = np.array(action)
    rewards = np.arange(1, len(turns) + 1, dtype=np.float32) * 0.5
    return Trajectory(
        tokens=rng.integers(4, 32, n).astype(np.int32),
        action_mask=action,
        rollout_logp=rng.normal(size=n).astype(np.float32),  # nonzero off actions on purpose
        sampled_logp=rng.normal(size=n).astype(np.float32),
        versions=np.full(n, version, np.int32) - action.astype(np.int32),
        turn_ids=np.array(turn_ids, np.int32),
        turn_rewards=rewards if terminated else rewards[:-1],
        outcome=float(rewards[-1]) if terminated else 0.0,
        terminated=terminated,
        truncated=not terminated,
        prompt_uid=uid,
        experts=rng.integers(0, 4, (n, 1, 2)).astype(np.int32) if routing else None,
    )


def test_pad_batch_fields_and_reward_placement():
    trajs = [
        make_traj(3, [(4, 2), (5, 0)], uid="a"),
        make_traj(2, [(3, 3), (2, 0)], trailing_obs=4, uid="b", seed=1),  # ends on obs
        make_traj(5, [(6, 2), (1, 1), (3, 0)], terminated=False, uid="a", seed=2),
    ]
    batch = pad_batch(trajs, length_bucket=16, num_rows=4, with_groups=True)
    check_batch(batch, need_groups=True)
    b, t = batch["tokens"].shape
    assert (b, t) == (4, 32)
    for r, tr in enumerate(trajs):
        n = tr.length
        np.testing.assert_array_equal(batch["tokens"][r, :n], tr.tokens)
        np.testing.assert_array_equal(batch["positions"][r, :n], np.arange(n))
        np.testing.assert_array_equal(batch["segment_ids"][r], np.arange(t) < n)
        np.testing.assert_array_equal(
            batch["rollout_logp"][r, :n], tr.rollout_logp * tr.action_mask
        )
        np.testing.assert_array_equal(batch["versions"][r, :n], tr.versions)
        assert batch["terminated"][r] == tr.terminated and batch["outcome"][r] == tr.outcome
        rewards = batch["rewards"][r]
        assert np.all(rewards[~batch["action_mask"][r]] == 0), "never on an observation"
        last = [np.flatnonzero(tr.turn_ids == i).max() for i in range(tr.num_turns)]
        np.testing.assert_allclose(rewards[last[: len(tr.turn_rewards)]], tr.turn_rewards)
        assert rewards.sum() == pytest.approx(tr.turn_rewards.sum())
        if tr.terminated:  # the outcome sits on the last action token of the row
            last_action = np.flatnonzero(batch["action_mask"][r]).max()
            assert rewards[last_action] == tr.outcome
    assert not batch["segment_ids"][3].any() and not batch["action_mask"][3].any()
    np.testing.assert_array_equal(batch["group_ids"], [0, 1, 0, -1])
    assert batch["turn_ids"][3].tolist() == [-1] * t


def test_pad_batch_routing_and_length_errors():
    trajs = [make_traj(3, [(4, 2), (3, 0)], routing=True, seed=s) for s in range(2)]
    trajs[0].experts[-1] = -1  # the unfed final token
    batch = pad_batch(trajs, length=16, with_routing=True)
    fe = batch.pop("forced_experts")
    check_batch(batch)
    assert fe.shape == (2, 16, 1, 2) and fe.dtype == np.int32
    np.testing.assert_array_equal(fe[1, : trajs[1].length], trajs[1].experts)
    np.testing.assert_array_equal(fe[0, trajs[0].length - 1], [[0, 1]])  # valid filler
    np.testing.assert_array_equal(fe[0, trajs[0].length :], [[[0, 1]]] * 4)
    with pytest.raises(ValueError, match="length=8"):
        pad_batch(trajs, length=8)
    with pytest.raises(ValueError, match="num_rows"):
        pad_batch(trajs, num_rows=1)
    with pytest.raises(ValueError, match="no routing record"):
        pad_batch([make_traj(2, [(2, 0)])], with_routing=True)


def test_baseline_keys_come_from_the_prompt_meta_in_pad_and_pack():
    levels = [3, 1, 4, 1]
    trajs = [
        dataclasses.replace(
            make_traj(2, [(3, 1), (2, 0)], uid=f"levels:{lv}:{i}", seed=i),
            info={"meta": {"level": lv, "expr": "1+2"}},
        )
        for i, lv in enumerate(levels)
    ]
    batch = pad_batch(trajs, num_rows=6, baseline_key="level", num_keys=5)
    check_batch(batch)
    np.testing.assert_array_equal(batch["baseline_keys"], [3, 1, 4, 1, 0, 0])  # padding: 0
    assert batch["baseline_keys"].dtype == np.int32
    packed, _ = pack_batch(trajs, microbatches=2, baseline_key="level", num_keys=5)
    np.testing.assert_array_equal(packed["baseline_keys"], levels)
    assert "baseline_keys" not in pad_batch(trajs)  # no key field: no keys
    with pytest.raises(ConfigError, match=r"rl.baseline_key: prompt 'levels:4:2' has level=4, "):
        pad_batch(trajs, baseline_key="level", num_keys=4)
    with pytest.raises(ConfigError, match=r"rl.baseline_key: prompt 'levels:3:0' has no meta "):
        pad_batch(trajs, baseline_key="user", num_keys=5)
    bad = [dataclasses.replace(trajs[0], info={"meta": {"level": "3"}})]
    with pytest.raises(ConfigError, match="level='3', not an int in"):
        pad_batch(bad, baseline_key="level", num_keys=5)


def test_trajectory_rejects_bad_records():
    good = make_traj(3, [(2, 1), (2, 0)])
    fields = {f: getattr(good, f) for f in good.__dataclass_fields__}
    cases = [
        (dict(versions=good.versions[:-1]), "versions"),
        (dict(action_mask=np.r_[True, good.action_mask[1:]]), "token 0"),
        (dict(truncated=True), "terminated/truncated"),
        (dict(turn_ids=np.zeros_like(good.turn_ids)), "turn_ids"),
        (dict(turn_rewards=np.ones(5, np.float32)), "turn_rewards"),
    ]
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            Trajectory(**{**fields, **change})


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 30), min_size=1, max_size=12), st.integers(30, 64))
def test_pack_rows_properties(lengths, row_len):
    rows = pack_rows(lengths, row_len)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    fill = [sum(lengths[i] for i in row) for row in rows]
    assert max(fill) <= row_len
    # First fit: no two rows could have been one (each later item did not fit earlier).
    assert all(fill[i] + fill[j] > row_len for i in range(len(rows)) for j in range(i))


def test_packed_rows_give_the_same_model_outputs():
    mdef, params = init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())
    fwd = jax.jit(
        lambda tok, pos, seg, f=None: mdef.bind(params)(tok, pos, seg, forced_experts_btlk=f)
    )
    shapes = [(3, [(5, 2), (4, 0)]), (2, [(3, 0)]), (4, [(2, 3), (2, 2), (3, 0)]), (2, [(6, 0)])]
    trajs = [
        make_traj(p, t, seed=i, terminated=i != 1, routing=True) for i, (p, t) in enumerate(shapes)
    ]
    padded = pad_batch(trajs, length=32)
    packed, placements = pack_batch(trajs, length=32, with_routing=True)
    check_batch(packed)
    rows = ("packed_tokens", "packed_positions", "packed_segment_ids")
    assert packed["packed_tokens"].shape[0] < len(trajs), "something was packed"
    out_pad = fwd(padded["tokens"], padded["positions"], padded["segment_ids"])
    out_pack = fwd(*(packed[k] for k in rows))
    logits = unpack(np.asarray(out_pack.out), placements)
    routes = unpack(np.asarray(out_pack.experts_btlk), placements)
    for i, tr in enumerate(trajs):
        np.testing.assert_allclose(logits[i], np.asarray(out_pad.out)[i, : tr.length], atol=1e-5)
        np.testing.assert_array_equal(routes[i], np.asarray(out_pad.experts_btlk)[i, : tr.length])
        for name in ("action_mask", "rollout_logp", "versions", "rewards", "turn_ids"):
            np.testing.assert_array_equal(packed[name][i], padded[name][i])
    # Routing replay through the packed layout reproduces the recorded experts.
    replay = fwd(*(packed[k] for k in rows), packed["packed_forced_experts"])
    for i, tr in enumerate(trajs):
        np.testing.assert_array_equal(
            unpack(np.asarray(replay.experts_btlk), placements)[i], tr.experts
        )
