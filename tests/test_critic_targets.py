"""Critic targets (sao_jax/rl/critic_targets.py): BRACE against a literal double loop and
hand-checked numbers, its special cases, and the registry's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.rl import critic_targets as ct
from sao_jax.rl import gae
from tests import rl_reference as ref

# One row: a0 a1 | o | a2, outcome 1 on a2; rho = 2, 0.5, 1 on the actions.
M = np.array([[True, True, False, True]])
V = np.array([[0.5, 0.6, 0.9, 0.8]], np.float32)
R = np.array([[0.0, 0.0, 0.0, 1.0]], np.float32)
LOG_RATIO = np.log(np.array([[2.0, 0.5, 1.0, 1.0]], np.float32))


def _brace(k, tail="one", **kw):
    y, _ = ct.brace_targets(R, V, M, LOG_RATIO, gamma=1.0, k=k, tail=tail, **kw)
    return np.asarray(y)[0, [0, 1, 3]]


def test_hand_checked_numbers():
    # delta = 0.1, 0.2, 0.2 on the compacted actions; c = w = 1, 0.5, 1 (caps 1).
    np.testing.assert_allclose(_brace(1), [1.0, 0.9, 1.0], atol=1e-6)
    np.testing.assert_allclose(_brace(2), [0.9, 0.8, 1.0], atol=1e-6)
    np.testing.assert_allclose(_brace(2, "trace"), [0.8, 0.8, 1.0], atol=1e-6)
    np.testing.assert_allclose(_brace(3), [0.8, 0.8, 1.0], atol=1e-6)  # = V-trace
    np.testing.assert_allclose(_brace(0), [1.0, 1.0, 1.0], atol=1e-6)  # = MC return


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k,tail,c_bar,rho_bar", [(3, "one", 1.0, 1.0), (2, "trace", 0.9, 1.5)])
def test_against_literal_reference(seed, k, tail, c_bar, rho_bar):
    rng = np.random.default_rng(seed)
    b, t = 5, 17
    m = ref.random_turn_mask(rng, b, t)
    v = rng.normal(size=(b, t)).astype(np.float32)
    r = np.where(rng.random((b, t)) < 0.2, rng.normal(size=(b, t)), 0.0).astype(np.float32)
    log_ratio = rng.normal(scale=0.7, size=(b, t)).astype(np.float32)
    last = rng.normal(size=(b,)).astype(np.float32)
    gamma = 0.9
    fn = jax.jit(
        lambda *a: ct.brace_targets(
            *a[:4], gamma=gamma, last_value_b=a[4], k=k, c_bar=c_bar, rho_bar=rho_bar, tail=tail
        )[0]
    )
    got = fn(r, v, m, log_ratio, last)
    want = ref.brace_reference(r, v, m, log_ratio, gamma, last, k, c_bar, rho_bar, tail)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_on_policy_and_k0_equal_the_lambda_one_returns():
    rng = np.random.default_rng(3)
    m = ref.random_turn_mask(rng, 4, 12)
    v = rng.normal(size=m.shape).astype(np.float32)
    r = np.where(rng.random(m.shape) < 0.3, 1.0, 0.0).astype(np.float32) * m
    _, lam1 = gae.skip_observation_gae(r, v, m, gamma=1.0, lam=1.0)
    zeros = np.zeros(m.shape, np.float32)
    y_on, _ = ct.brace_targets(r, v, m, zeros, k=4)
    y_k0, _ = ct.brace_targets(r, v, m, rng.normal(size=m.shape).astype(np.float32), k=0)
    np.testing.assert_allclose(np.asarray(y_on), np.asarray(lam1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(y_k0), np.asarray(lam1), atol=1e-5)


def test_registry_call_metrics_and_refusals():
    lam = lambda: jnp.asarray(R)
    y, metrics = ct.critic_targets("lambda", rewards_bt=R, values_bt=V, action_mask_bt=M,
                                   lambda_returns=lam)  # fmt: skip
    assert metrics == {} and np.asarray(y)[0, 3] == 1.0
    y, metrics = ct.critic_targets(
        "brace", rewards_bt=R, values_bt=V, action_mask_bt=M, log_ratio_bt=LOG_RATIO, k=2
    )
    np.testing.assert_allclose(np.asarray(y)[0, [0, 1, 3]], [0.9, 0.8, 1.0], atol=1e-6)
    shift_sum, n = metrics["target_shift"]
    assert float(n) == 3 and float(shift_sum) == pytest.approx(-0.3, abs=1e-6)
    with pytest.raises(ValueError, match="unknown critic target 'vtrace'; known: brace, lambda"):
        ct.critic_targets("vtrace", rewards_bt=R, values_bt=V, action_mask_bt=M)
    with pytest.raises(ValueError, match="needs log_ratio_bt"):
        ct.critic_targets("brace", rewards_bt=R, values_bt=V, action_mask_bt=M)
    with pytest.raises(TypeError, match="unexpected parameter"):
        ct.critic_targets("brace", rewards_bt=R, values_bt=V, action_mask_bt=M,
                          log_ratio_bt=LOG_RATIO, horizon=3)  # fmt: skip
    with pytest.raises(ValueError, match="k: must be an int >= 0"):
        ct.brace_targets(R, V, M, LOG_RATIO, k=-1)
    with pytest.raises(ValueError, match="tail: one of"):
        ct.brace_targets(R, V, M, LOG_RATIO, tail="geometric")
