"""Critic targets (sao_jax/rl/critic_targets.py): BRACE against a literal double loop
(tests/rl_reference.py) and hand-checked numbers, its special and edge cases, the
registry's refusals and the config's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.rl import critic_targets as ct
from sao_jax.rl import gae
from sao_jax.schema import ConfigError
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
    # The observation token and rows' padding get 0.
    y, _ = ct.brace_targets(R, V, M, LOG_RATIO, k=2)
    assert float(y[0, 2]) == 0.0


def _random(seed, b=5, t=17):
    rng = np.random.default_rng(seed)
    m = ref.random_turn_mask(rng, b, t)
    m[0] = False  # an all-observation (or all-padding) row
    m[1, -3:] = False  # trailing padding
    v = rng.normal(size=(b, t)).astype(np.float32)
    r = np.where(rng.random((b, t)) < 0.2, rng.normal(size=(b, t)), 0.0).astype(np.float32)
    log_ratio = rng.normal(scale=0.7, size=(b, t)).astype(np.float32)
    last = rng.normal(size=(b,)).astype(np.float32)
    return r, v, m, log_ratio, last


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "k,tail,c_bar,rho_bar",
    [(1, "one", 1.0, 1.0), (3, "one", 1.0, 1.0), (5, "trace", 0.9, 1.5), (10**6, "one", 1.0, 1.0)],
    ids=lambda x: str(x),
)
def test_against_literal_reference(seed, k, tail, c_bar, rho_bar):
    """Jitted, against the double loop; rewards on observations (folded as the GAE folds
    them), an empty row, padding, k = 1 and k >= T (V-trace) included."""
    r, v, m, log_ratio, last = _random(seed)
    gamma = 0.9
    fn = jax.jit(
        lambda *a: ct.brace_targets(
            *a[:4], gamma=gamma, last_value_b=a[4], k=k, c_bar=c_bar, rho_bar=rho_bar, tail=tail
        )[0]
    )
    got = np.asarray(fn(r, v, m, log_ratio, last))
    want = ref.brace_reference(r, v, m, log_ratio, gamma, last, k, c_bar, rho_bar, tail)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[0] == 0.0) and np.all(got[~m] == 0.0)


def test_on_policy_and_k0_are_the_lambda_one_returns_bit_for_bit():
    r, v, m, log_ratio, last = _random(3)
    _, lam1 = gae.skip_observation_gae(r, v, m, gamma=0.9, lam=1.0, last_value_b=last)
    kw = dict(gamma=0.9, last_value_b=last)
    for tail in ct.TAILS:
        y_on, parts = ct.brace_targets(r, v, m, np.zeros_like(log_ratio), k=4, tail=tail, **kw)
        y_k0, _ = ct.brace_targets(r, v, m, log_ratio, k=0, tail=tail, **kw)
        np.testing.assert_array_equal(np.asarray(y_on), np.asarray(lam1))
        np.testing.assert_array_equal(np.asarray(y_k0), np.asarray(lam1))
        np.testing.assert_array_equal(np.asarray(parts["trace_bt"]), m.astype(np.float32))


def test_padding_columns_change_nothing():
    r, v, m, log_ratio, last = _random(4)
    pad = lambda x, value: np.pad(x, ((0, 0), (0, 6)), constant_values=value)
    y, _ = ct.brace_targets(r, v, m, log_ratio, last_value_b=last, k=3)
    y_pad, _ = ct.brace_targets(
        pad(r, 0.0), pad(v, 7.0), pad(m, False), pad(log_ratio, 5.0), last_value_b=last, k=3
    )
    np.testing.assert_allclose(np.asarray(y_pad)[:, :-6], np.asarray(y), atol=1e-6)
    assert np.all(np.asarray(y_pad)[:, -6:] == 0.0)


def test_no_python_loop_over_tokens():
    """The traced program does not grow with T (k fixed below T)."""

    def n_eqns(t):
        r, v, m, log_ratio, _ = _random(0, b=3, t=t)
        fn = lambda *a: ct.brace_targets(*a, k=5)[0]
        return len(jax.make_jaxpr(fn)(r, v, m, log_ratio).eqns)

    assert n_eqns(16) == n_eqns(128)


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
    trace_sum, _ = metrics["target_trace"]  # P_{t,2} = 0.5, 0.5, 1
    assert float(trace_sum) == pytest.approx(2.0, abs=1e-6)
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
    with pytest.raises(ValueError, match="log_ratio_bt: shape"):
        ct.brace_targets(R, V, M, LOG_RATIO[:, :3])


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"rl.critic_target": "vtrace"}, "rl.critic_target: unknown critic target 'vtrace'"),
        ({"rl.critic_target": "brace", "rl.advantage": "grpo"}, "rl.critic_target: .*'gae'"),
        ({"rl.critic_target": "brace", "rl.lam_critic": 0.9}, "rl.lam_critic: must be 1.0"),
        ({"rl.critic_targets.brace.k": -1}, r"rl.critic_targets.brace.k: must be an int >= 0"),
        ({"rl.critic_targets.brace.c_bar": 0.0}, "rl.critic_targets.brace.c_bar: must be"),
        ({"rl.critic_targets.brace.tail": "x"}, "rl.critic_targets.brace.tail: must be one of"),
    ],
    ids=lambda x: ",".join(x) if isinstance(x, dict) else None,
)
def test_config_refusals_name_the_field(fields, match):
    c = base.get_config()
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    if c.rl.advantage == "grpo":
        c.env.group_size = 2
    with pytest.raises(ConfigError, match=match) as e:
        config_lib.validate(c)
    assert "\n" not in str(e.value)


def test_default_config_is_lambda_and_brace_validates():
    c = base.get_config()
    assert c.rl.critic_target == "lambda"
    assert dict(c.rl.critic_targets.brace) == ct.BRACE_PARAMS
    c.rl.critic_target = "brace"
    config_lib.validate(c)
