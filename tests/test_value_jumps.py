"""The critic's value change across observation spans and its share of the return's
variance (sao_jax/rl/value_jumps.py), against a literal loop and numbers worked by hand."""

import itertools

import numpy as np
import pytest

from sao_jax.metrics import pair_means as reduce_metrics
from sao_jax.rl import gae
from sao_jax.rl import value_jumps as J
from sao_jax.rl.synthetic import synthetic_batch


def _reference(values, mask, returns, outcome):
    """The module docstring's definitions, one row and one token at a time."""
    b, t = mask.shape
    jumps, rows = [], []  # (row, dV) per span; per valid row (G, sum of dV^2, spans)
    for i in range(b):
        idx = [k for k in range(t) if mask[i, k]]
        if not idx:
            continue
        sq, spans = 0.0, 0
        for a, c in itertools.pairwise(idx):
            if c > a + 1:  # non-action tokens between two action tokens: a span
                dv = float(values[i, c] - values[i, a])
                jumps.append((i, dv))
                sq += dv * dv
                spans += 1
        rows.append((float(returns[i, idx[0]]), sq, spans))
    g = np.array([r[0] for r in rows])
    var = float(np.mean((g - g.mean()) ** 2))
    dv = np.array([d for _, d in jumps])
    win = np.array([outcome[i] > 0 for i, _ in jumps], bool)
    mean = lambda x: float(np.mean(x)) if len(x) else float("nan")
    return {
        "value_jump": mean(dv),
        "value_jump_abs": mean(np.abs(dv)),
        "value_jump_success": mean(dv[win]),
        "value_jump_failure": mean(dv[~win]),
        "spans": mean([r[2] for r in rows]),
        "value_jump_sq": mean([r[1] for r in rows]),
        "return_var": var,
        "variance_share": float(np.mean([r[1] for r in rows]) / var) if var > 0 else 0.0,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_the_literal_reference(seed):
    batch = synthetic_batch(8, 40, 32, seed=seed, turns=4)
    rng = np.random.default_rng(seed)
    values = rng.normal(size=batch["action_mask"].shape).astype(np.float32)
    values[0, :] = 0.0
    batch["action_mask"][1, :] = False  # a row without actions counts nowhere
    returns = np.asarray(gae.monte_carlo_returns(batch["rewards"], batch["action_mask"], 1.0))
    got = reduce_metrics(
        J.value_jump_metrics(values, batch["action_mask"], returns, batch["outcome"])
    )
    want = _reference(values, batch["action_mask"], returns, batch["outcome"])
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_hand_worked_rows():
    # row 0: prompt, action, obs, obs, action, obs, action -> 2 spans
    # row 1: prompt, action, action, obs (trailing: no span), pad
    mask = np.array([[0, 1, 0, 0, 1, 0, 1], [0, 1, 1, 0, 0, 0, 0]], bool)
    values = np.array([[9, 0.5, 7, 7, 0.9, 7, 1.0], [9, 0.5, 0.2, 7, 7, 7, 7]], np.float32)
    jump, end = J.value_jumps(values, mask)
    np.testing.assert_array_equal(end, [[0, 1, 0, 0, 1, 0, 0], [0] * 7])
    np.testing.assert_allclose(jump[0], [0, 0.4, 0, 0, 0.1, 0, 0], atol=1e-6)
    returns = np.where(mask, np.array([[1.0] * 7, [0.0] * 7]), 0.0)  # G = 1 and 0
    m = reduce_metrics(J.value_jump_metrics(values, mask, returns, np.array([1.0, 0.0])))
    assert m["spans"] == 1.0 and np.isnan(m["value_jump_failure"])
    np.testing.assert_allclose(m["value_jump"], 0.25, atol=1e-6)
    np.testing.assert_allclose(m["value_jump_sq"], (0.16 + 0.01) / 2, atol=1e-6)
    np.testing.assert_allclose(m["return_var"], 0.25, atol=1e-6)  # G in {1, 0}
    np.testing.assert_allclose(m["variance_share"], 0.085 / 0.25, atol=1e-5)


def test_an_exact_critic_of_an_observation_that_decides_explains_all_the_variance():
    # A fair coin shown in the observation decides the outcome: V = 0.5 before it, then
    # the outcome itself. Martingale increments at the observation carry all of Var(G).
    mask = np.array([[0, 1, 0, 1]] * 4, bool)
    g = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
    values = np.stack([np.array([0, 0.5, 0, gi], np.float32) for gi in g])
    returns = np.where(mask, g[:, None], 0.0)
    m = reduce_metrics(J.value_jump_metrics(values, mask, returns, g))
    np.testing.assert_allclose(m["variance_share"], 1.0, atol=1e-6)
    np.testing.assert_allclose([m["value_jump_success"], m["value_jump_failure"]], [0.5, -0.5])
    # An observation that tells nothing (V does not move) explains none of it.
    flat = np.where(mask, 0.5, 0.0).astype(np.float32)
    m = reduce_metrics(J.value_jump_metrics(flat, mask, returns, g))
    assert m["variance_share"] == 0.0 and m["value_jump_abs"] == 0.0


def test_constant_returns_give_share_zero():
    mask = np.array([[0, 1, 0, 1]], bool)
    values = np.array([[0, 0.1, 0, 0.9]], np.float32)
    m = reduce_metrics(J.value_jump_metrics(values, mask, np.where(mask, 1.0, 0.0), np.ones(1)))
    assert m["return_var"] == 0.0 and m["variance_share"] == 0.0
