"""Episodes as training trajectories (sao_jax/serve/trajectories.py), against hand-written
records: one trajectory per segment, calls as turns, the per-call rewards and the
episode's reward on the right tokens, observation versions filled, dropped -> none."""

import numpy as np

from sao_jax.sampling.trajectory import pad_batch
from sao_jax.serve.trajectories import call_runs, episode_trajectories

N = None
RECORD = {
    "id": "s1",
    "task": {"q": 1},
    "reward": 2.0,
    "dropped": None,
    "turn_rewards": [0.25, 0.5, 1.0],
    "segments": [
        {   # prompt (3), call 0 (2), observation (2), call 1 (1)
            "token_ids": [5, 6, 7, 10, 11, 8, 9, 12],
            "action_mask": [0, 0, 0, 1, 1, 0, 0, 1],
            "logprobs": [N, N, N, -0.5, -1.0, N, N, -2.0],
            "versions": [N, N, N, 3, 3, N, N, 4],
        },
        {   # a fork: prompt (2), call 2 (2)
            "token_ids": [5, 9, 13, 14],
            "action_mask": [0, 0, 1, 1],
            "logprobs": [N, N, -0.1, -0.2],
            "versions": [N, N, 5, 5],
        },
    ],
}  # fmt: skip


def test_call_runs():
    assert call_runs(np.array([0, 1, 1, 0, 0, 1, 0, 1, 1], bool)) == [(1, 3), (5, 6), (7, 9)]
    assert call_runs(np.zeros(3, bool)) == []


def test_segments_become_trajectories():
    a, b = episode_trajectories(RECORD)
    np.testing.assert_array_equal(a.turn_ids, [-1, -1, -1, 0, 0, -1, -1, 1])
    np.testing.assert_array_equal(a.turn_rewards, [0.25, 0.5 + 2.0])
    np.testing.assert_array_equal(a.reward_row(), [0, 0, 0, 0, 0.25, 0, 0, 2.5])
    np.testing.assert_array_equal(b.reward_row(), [0, 0, 0, 3.0])
    np.testing.assert_allclose(a.rollout_logp, [0, 0, 0, -0.5, -1.0, 0, 0, -2.0])
    np.testing.assert_array_equal(a.versions, [3, 3, 3, 3, 3, 3, 3, 4])
    assert (a.outcome, b.outcome, a.terminated, a.min_version, b.min_version) == (
        2.0, 2.0, True, 3, 5)  # fmt: skip
    assert [t.prompt_uid for t in (a, b)] == ["s1/0", "s1/1"]
    batch = pad_batch([a, b], length_bucket=8)
    assert batch["tokens"].shape == (2, 8)


def test_no_turn_rewards_and_dropped():
    record = {**RECORD, "turn_rewards": None}
    a, b = episode_trajectories(record)
    np.testing.assert_array_equal(a.turn_rewards, [0.0, 2.0])
    np.testing.assert_array_equal(b.turn_rewards, [2.0])
    assert episode_trajectories({**RECORD, "reward": None, "dropped": "no_reward"}) == []
