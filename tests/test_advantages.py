"""Advantage estimators by name against NumPy references; registry errors; purity."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.rl import advantages as adv
from sao_jax.rl import gae
from tests import rl_reference as ref

B, T = 8, 16


def _batch(seed: int, b: int = B):
    rng = np.random.default_rng(seed)
    m = ref.random_turn_mask(rng, b, T, p_empty=0.2)
    outcome = rng.integers(0, 3, size=b).astype(np.float32)  # ties within groups happen
    start = m & ~np.concatenate([np.zeros((b, 1), bool), m[:, :-1]], axis=1)
    return dict(
        rewards_bt=np.asarray(gae.place_outcome_reward(outcome, m)),
        outcome_b=outcome,
        action_mask_bt=m,
        values_bt=rng.normal(size=(b, T)).astype(np.float32),
        turn_ids_bt=np.where(m, np.cumsum(start, axis=1) - 1, -1).astype(np.int32),
        group_ids_b=rng.integers(0, 3, size=b).astype(np.int32),
    )


def test_registry_names_and_needs():
    assert adv.ESTIMATORS.names() == sorted(
        ["gae", "step_mean", "step_last", "cross_observation", "grpo", "rloo", "drgrpo",
         "moving_average"]
    )  # fmt: skip
    for name in ("gae", "step_mean", "step_last", "cross_observation"):
        assert adv.estimator(name).needs_values
    for name in ("grpo", "rloo", "drgrpo", "moving_average"):
        assert not adv.estimator(name).needs_values
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; known: cross_obs"):
        adv.compute_advantages(
            "ppo", rewards_bt=None, outcome_b=None, action_mask_bt=np.ones((1, 2))
        )


@pytest.mark.parametrize(
    "name, missing",
    [("gae", "values_bt"), ("grpo", "group_ids_b"), ("moving_average", "baseline_state")],
)
def test_missing_arguments_are_named(name, missing):
    b = _batch(0)
    b.pop(missing, None)
    with pytest.raises(ValueError, match=f"needs {missing}, got None"):
        adv.compute_advantages(name, **b)


def test_unexpected_parameter_and_bad_shapes():
    b = _batch(0)
    with pytest.raises(TypeError, match=r"got unexpected parameter\(s\) \['window'\]"):
        adv.compute_advantages("grpo", window=3, **b)
    with pytest.raises(ValueError, match="outcome_b"):
        adv.compute_advantages("grpo", **{**b, "outcome_b": b["outcome_b"][:-1]})
    with pytest.raises(TypeError, match="group_ids_b: expected an int"):
        adv.compute_advantages("rloo", **{**b, "group_ids_b": b["group_ids_b"] * 1.0})
    with pytest.raises(ValueError, match="action_mask_bt: entries must be 0 or 1"):
        adv.compute_advantages(
            "grpo", checked=True, **{**b, "action_mask_bt": b["action_mask_bt"] * 2}
        )
    with pytest.raises(TypeError, match="baseline_state: expected a MovingAverageState"):
        adv.compute_advantages("moving_average", baseline_state=(1, 2), **b)
    with pytest.raises(ValueError, match="window"):
        adv.init_moving_average_state(0)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_against_reference(name):
    for seed in range(5):
        b = _batch(seed)
        out = adv.compute_advantages(name, **b)
        valid = b["action_mask_bt"].any(axis=1)
        want_b = ref.group_reference(b["outcome_b"], b["group_ids_b"], valid, name)
        want = np.where(b["action_mask_bt"], want_b[:, None], 0.0)
        np.testing.assert_allclose(out.advantages_bt, want, rtol=1e-5, atol=1e-5)
        assert out.returns_bt is None
        s, c = out.metrics["rows_without_actions"]
        assert (float(s), float(c)) == (float(np.sum(~valid)), float(B))


@pytest.mark.parametrize("name", ["gae", "step_mean", "step_last", "cross_observation"])
def test_critic_estimators_match_their_functions(name):
    b = _batch(1)
    last = np.linspace(0, 1, B).astype(np.float32)
    out = adv.compute_advantages(name, gamma=0.9, lam=0.8, last_value_b=last, **b)
    r, v, m, tid = b["rewards_bt"], b["values_bt"], b["action_mask_bt"], b["turn_ids_bt"]
    lam = np.full(B, 0.8)
    if name == "gae":
        want = ref.gae_reference(r, v, m, 0.9, lam, last)
    elif name == "cross_observation":
        want = ref.cross_observation_reference(r, v, m, 0.9, lam, last)
    else:
        want = ref.step_gae_reference(r, v, m, tid, 0.9, lam, last, name.split("_")[1])
    np.testing.assert_allclose(out.advantages_bt, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.returns_bt, want[1], rtol=1e-5, atol=1e-5)
    s, c = out.metrics["advantage"]
    np.testing.assert_allclose(float(s), np.sum(want[0]), rtol=1e-4, atol=1e-4)
    assert float(c) == np.sum(m)


def test_moving_average_matches_a_deque_over_several_calls():
    window = 5
    state = adv.init_moving_average_state(window)
    deque_ref = ref.MovingAverageReference(window)
    jitted = jax.jit(
        chex.assert_max_traces(
            lambda st, o, m: adv.compute_advantages(
                "moving_average", rewards_bt=None, outcome_b=o, action_mask_bt=m,
                baseline_state=st,
            ),
            n=1,
        )
    )  # fmt: skip
    for call in range(6):
        b = _batch(50 + call)  # 8 rows > window: only the last 5 valid ones survive
        before = jax.tree.map(np.array, state)
        out = jitted(state, b["outcome_b"], b["action_mask_bt"])
        # Pure: the input state is untouched, and the eager call gives the same result.
        chex.assert_trees_all_equal(before, jax.tree.map(np.array, state))
        eager = adv.compute_advantages(
            "moving_average", rewards_bt=None, outcome_b=b["outcome_b"],
            action_mask_bt=b["action_mask_bt"], baseline_state=state,
        )  # fmt: skip
        chex.assert_trees_all_close(eager.baseline_state, out.baseline_state)
        valid = b["action_mask_bt"].any(axis=1)
        want_b, base = deque_ref(b["outcome_b"], valid)
        want = np.where(b["action_mask_bt"], want_b[:, None], 0.0)
        np.testing.assert_allclose(out.advantages_bt, want, rtol=1e-5, atol=1e-6)
        s, c = out.metrics["baseline"]
        assert float(c) == valid.sum()
        np.testing.assert_allclose(float(s), base * valid.sum(), rtol=1e-5, atol=1e-5)
        state = out.baseline_state
    assert int(state.count) == sum(
        int(_batch(50 + c)["action_mask_bt"].any(axis=1).sum()) for c in range(6)
    )


def _keyed(state, b, keys, **kw):
    return adv.compute_advantages(
        "moving_average", rewards_bt=None, outcome_b=b["outcome_b"],
        action_mask_bt=b["action_mask_bt"], baseline_state=state, baseline_keys_b=keys, **kw,
    )  # fmt: skip


def test_keyed_moving_average_matches_one_deque_per_key():
    """K = 3 histories of W = 4: rows of one key in a batch, more than W outcomes of a key
    in one batch (call 2: every row key 1), keys never seen (key 2 until call 3: empty
    history, baseline 0), rows without action tokens (p_empty 0.2, ignored whatever key)."""
    window, k = 4, 3
    state = adv.init_moving_average_state(window, keys=k)
    assert state.rewards_w.shape == (k, window) and state.count.shape == (k,)
    keyed_ref = ref.KeyedMovingAverageReference(window)
    jitted = jax.jit(chex.assert_max_traces(_keyed, n=1))
    rng = np.random.default_rng(0)
    pushed = np.zeros(k, int)
    for call in range(7):
        b = _batch(70 + call)
        keys = rng.integers(0, 2 if call < 3 else k, size=B).astype(np.int32)
        if call == 2:
            keys[:] = 1
        out = jitted(state, b, keys)
        eager = _keyed(state, b, keys, checked=True)
        chex.assert_trees_all_close(eager.baseline_state, out.baseline_state)
        valid = b["action_mask_bt"].any(axis=1)
        want_b, base_b = keyed_ref(b["outcome_b"], valid, keys)
        want = np.where(b["action_mask_bt"], want_b[:, None], 0.0)
        np.testing.assert_allclose(out.advantages_bt, want, rtol=1e-5, atol=1e-6)
        s, c = out.metrics["baseline"]
        np.testing.assert_allclose(float(s), np.sum(base_b[valid]), rtol=1e-5, atol=1e-5)
        assert float(c) == valid.sum()
        np.add.at(pushed, keys[valid], 1)
        state = out.baseline_state
    np.testing.assert_array_equal(np.asarray(state.count), pushed)


def test_keyed_moving_average_with_one_key_is_the_global_one():
    glob, keyed = adv.init_moving_average_state(5), adv.init_moving_average_state(5, keys=2)
    zeros = np.zeros(B, np.int32)
    for call in range(4):
        b = _batch(90 + call)
        g = adv.compute_advantages(
            "moving_average", rewards_bt=None, outcome_b=b["outcome_b"],
            action_mask_bt=b["action_mask_bt"], baseline_state=glob,
        )  # fmt: skip
        k = _keyed(keyed, b, zeros)
        np.testing.assert_array_equal(np.asarray(g.advantages_bt), np.asarray(k.advantages_bt))
        glob, keyed = g.baseline_state, k.baseline_state
        np.testing.assert_array_equal(np.asarray(keyed.rewards_w[0]), np.asarray(glob.rewards_w))
        assert int(keyed.count[0]) == int(glob.count) and int(keyed.count[1]) == 0
    assert adv.init_moving_average_state(5, keys=1).rewards_w.shape == (5,)  # 0/1: global


def test_keyed_moving_average_errors_name_the_argument():
    b = _batch(0)
    keyed, glob = adv.init_moving_average_state(4, keys=3), adv.init_moving_average_state(4)
    keys = np.zeros(B, np.int32)
    with pytest.raises(ValueError, match="baseline_keys_b: a keyed moving-average state"):
        _keyed(keyed, b, None)
    with pytest.raises(ValueError, match="baseline_keys_b: given, but baseline_state is global"):
        _keyed(glob, b, keys)
    with pytest.raises(TypeError, match="baseline_keys_b: expected an int"):
        _keyed(keyed, b, keys * 1.0)
    with pytest.raises(ValueError, match=r"baseline_keys_b: expected shape \[B\]"):
        _keyed(keyed, b, keys[:-1])
    bad = keys.copy()
    bad[np.flatnonzero(b["action_mask_bt"].any(axis=1))[0]] = 3
    with pytest.raises(ValueError, match=r"keys of rows with action tokens must be in \[0, 3\)"):
        _keyed(keyed, b, bad, checked=True)
    with pytest.raises(ValueError, match="keys: must be an int >= 0"):
        adv.init_moving_average_state(4, keys=-1)


def test_whitening_over_action_tokens():
    b = _batch(3)
    a = np.asarray(adv.compute_advantages("gae", **b).advantages_bt)
    m = b["action_mask_bt"]
    w = np.asarray(adv.whiten_advantages(a, m, eps=0.0))
    np.testing.assert_allclose(np.mean(w[m]), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.std(w[m]), 1.0, rtol=1e-4)
    assert np.all(w[~m] == 0)
    w2 = np.asarray(adv.whiten_advantages(a, m, eps=0.0, shift_mean=False))
    np.testing.assert_allclose(w2[m], a[m] / np.std(a[m]), rtol=1e-4)


def test_compute_advantages_jits_without_retrace():
    b = _batch(4)
    fn = jax.jit(
        chex.assert_max_traces(
            lambda x, lam: adv.compute_advantages("gae", lam=lam, **x).advantages_bt, n=1
        )
    )
    x = {k: jnp.asarray(v) for k, v in b.items()}
    fn(x, jnp.full((B,), 0.5))
    fn(x, jnp.full((B,), 0.9))
    fn({**x, "values_bt": x["values_bt"] + 1}, jnp.full((B,), 0.9))


def test_estimator_parameters_have_registry_defaults():
    b = _batch(5)
    assert adv.estimator("gae").params == {"impl": "auto"} and adv.estimator("grpo").params == {}
    auto = adv.compute_advantages("gae", **b).advantages_bt
    np.testing.assert_array_equal(auto, adv.compute_advantages("gae", impl=None, **b)[0])
    scan = adv.compute_advantages("gae", impl="scan", **b).advantages_bt
    np.testing.assert_allclose(scan, auto, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown GAE implementation 'loop'"):
        adv.compute_advantages("gae", impl="loop", **b)
