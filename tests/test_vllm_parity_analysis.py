"""experiments/vllm_parity's analysis against literal cases (no vLLM: the engine side runs
only in the experiment, docs/vllm.md "Parity: where the tail comes from")."""

import numpy as np

from experiments.vllm_parity.__main__ import flip_before, flipped_positions, summary


def test_a_flip_is_a_different_expert_set_in_any_layer():
    own = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]])  # [T=3, L=2, k=2]
    engine = np.array([[[1, 0], [3, 2]], [[0, 2], [2, 3]], [[0, 1], [3, 1]]])
    # position 0: the same sets in another order; 1: layer 0 differs; 2: layer 1 differs
    assert flipped_positions(own, engine).tolist() == [False, True, True]


def test_a_sampled_token_follows_every_flip_at_or_before_its_predicting_position():
    # prompt of 3 (positions 0-2), 3 sampled tokens at positions 3-5; the engine computed
    # positions 0-4 (the last token is never fed back)
    flips = np.array([False, False, False, True, False])
    # token 0 (position 3) is predicted at position 2: no flip yet; tokens 1, 2 follow it
    assert flip_before(flips, 3).tolist() == [False, True, True]
    assert flip_before(np.array([True, False, False, False, False]), 3).tolist() == [True] * 3


def test_the_summary_counts_the_tail_and_dis_keeps_its_band():
    delta = np.array([0.01, -0.02, 0.3, -0.4, np.log(0.5)])  # learner - engine, nats
    s = summary(delta)
    assert s["tail"] == 3 and s["median"] == 0.3 and abs(s["max"] - np.log(2)) < 1e-12
    assert s["keep"] == 0.6  # the ratios exp(-0.4) = 0.67 and 0.50 fall under 0.7
