"""The batch schema (sao_jax/batch_schema.py) is what every batch builder makes and what the
checks read: padded, packed, synthetic, empty and abstract batches hold exactly the fields
their needs ask for, with the declared dtypes, shapes and padding."""

import numpy as np
import pytest

from sao_jax.batch_schema import BATCH_FIELDS, NEEDS, abstract_batch, empty_batch, fields_for
from sao_jax.rl.batch import check_batch
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.sampling.trajectory import Trajectory, pack_batch, pad_batch
from sao_jax.schema import ConfigError

L_MOE, K = 2, 3


def _traj(n_prompt: int, n_action: int, uid: str, group: int) -> Trajectory:
    n = n_prompt + n_action
    action = np.arange(n) >= n_prompt
    return Trajectory(
        tokens=np.arange(1, n + 1, dtype=np.int32),
        action_mask=action,
        rollout_logp=np.where(action, -1.0, 0.0).astype(np.float32),
        sampled_logp=np.where(action, -1.0, 0.0).astype(np.float32),
        versions=np.zeros(n, np.int32),
        turn_ids=np.where(action, 0, -1).astype(np.int32),
        turn_rewards=np.array([1.0], np.float32),
        outcome=1.0,
        terminated=True,
        truncated=False,
        prompt_uid=uid,
        info={"meta": {"user": group}},
        experts=np.full((n, L_MOE, K), 1, np.int32),
    )


TRAJS = [_traj(3, 4, "a", 0), _traj(2, 6, "b", 1), _traj(4, 2, "a", 0), _traj(1, 3, "c", 1)]


def _dtype_kind(f):
    return np.dtype(f.dtype).kind


def test_every_field_has_a_declared_shape_dtype_and_known_needs():
    for name, f in BATCH_FIELDS.items():
        assert f.name == name and f.needs <= set(NEEDS), name
        assert _dtype_kind(f) in "ifb", name
    assert fields_for() == (
        "tokens", "positions", "segment_ids", "action_mask", "rollout_logp", "versions",
        "rewards", "outcome", "terminated", "turn_ids",
    )  # fmt: skip
    with pytest.raises(ValueError, match="unknown 'nope'"):
        fields_for({"nope"})


def test_empty_batch_is_padding_and_matches_the_abstract_batch():
    sizes = dict(B=4, T=5, R=2, Lp=7, L=L_MOE, K=K)
    names = tuple(BATCH_FIELDS)
    batch = empty_batch(names, sizes)
    check_batch(batch, needs=set(NEEDS))
    abstract = abstract_batch(names, sizes)
    for name in names:
        assert (
            batch[name].shape == abstract[name].shape and batch[name].dtype == abstract[name].dtype
        )
    np.testing.assert_array_equal(batch["turn_ids"], -1)
    np.testing.assert_array_equal(batch["terminated"], True)
    np.testing.assert_array_equal(batch["group_ids"], -1)
    np.testing.assert_array_equal(batch["forced_experts"][1, 2, 1], np.arange(K))
    np.testing.assert_array_equal(batch["packed_forced_experts"][0, 6, 0], np.arange(K))


@pytest.mark.parametrize(
    "kw, needs",
    [
        ({}, set()),
        ({"with_groups": True}, {"groups"}),
        ({"with_routing": True}, {"routing"}),
        ({"baseline_key": "user", "num_keys": 2}, {"baseline_keys"}),
        ({"critic_tokens": [t.tokens for t in TRAJS]}, {"critic_tokens"}),
    ],
    ids=lambda x: ",".join(x) if isinstance(x, dict) else None,
)
def test_padded_and_packed_batches_hold_the_fields_of_their_needs(kw, needs):
    padded = pad_batch(TRAJS, length_bucket=8, num_rows=6, **kw)
    assert set(padded) == set(fields_for(needs))
    check_batch(padded, needs=needs)
    for name, x in padded.items():  # rows beyond the trajectories are padding
        f = BATCH_FIELDS[name]
        assert x.dtype == f.dtype, name
        sizes = dict(zip(f.axes, x.shape, strict=True))
        np.testing.assert_array_equal(x[4:], empty_batch([name], sizes)[name][4:])
    packed, _ = pack_batch(TRAJS, length=8, microbatches=2, **kw)
    assert set(packed) == set(fields_for(needs | {"packed"}))
    check_batch(packed, needs=needs | {"packed"})


def test_synthetic_batch_holds_the_always_present_fields():
    batch = synthetic_batch(4, 16, 32, groups=2)
    assert set(batch) == set(fields_for({"groups"}))
    for name, x in batch.items():
        assert x.dtype == BATCH_FIELDS[name].dtype, name


def test_checks_name_the_field():
    batch = pad_batch(TRAJS, length_bucket=8)
    with pytest.raises(ConfigError, match=r"missing field 'group_ids' \(an estimator"):
        check_batch(batch, needs={"groups"})
    with pytest.raises(
        ConfigError, match=r"missing field 'pack_row' \(model passes on packed rows"
    ):
        check_batch(batch, needs={"packed"})
    bad = dict(batch, outcome=np.zeros(3, np.float32))
    with pytest.raises(ConfigError, match=r"batch field 'outcome': batch size 3 != 4"):
        check_batch(bad)
    bad = dict(batch, turn_ids=batch["turn_ids"][:, :5])
    with pytest.raises(ConfigError, match=r"batch field 'turn_ids': length 5 != 8"):
        check_batch(bad)


def test_the_first_bad_field_in_declaration_order_is_named():
    batch = pad_batch(TRAJS, length_bucket=8)
    bad = dict(batch, rewards=batch["rewards"].astype(np.int32))  # and group_ids missing
    with pytest.raises(ConfigError, match=r"batch field 'rewards': dtype int32 is not float"):
        check_batch(bad, needs={"groups"})
    packed, _ = pack_batch(TRAJS, length=8)
    with pytest.raises(ConfigError, match=r"packed field 'pack_row' given but missing field"):
        check_batch({k: v for k, v in packed.items() if k != "packed_positions"})
