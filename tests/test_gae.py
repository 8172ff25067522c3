"""Observation-skipping GAE, its variants and reward placement against NumPy references."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from sao_jax.rl import gae
from sao_jax.rl import gae_chunked as gc
from sao_jax.rl.checks import checked_mode
from tests import rl_reference as ref

B, T = 5, 24  # one shape for the property tests: one compile per implementation


def _case(seed: int, *, obs_rewards: bool = False):
    rng = np.random.default_rng(seed)
    m = ref.random_turn_mask(rng, B, T)
    r = np.where(m, rng.normal(size=(B, T)) * (rng.random((B, T)) < 0.3), 0.0)
    if obs_rewards:
        r = r + np.where(~m, rng.normal(size=(B, T)) * (rng.random((B, T)) < 0.2), 0.0)
    v = rng.normal(size=(B, T))
    truncated = rng.random(B) < 0.5
    last = np.where(truncated, rng.normal(size=B), 0.0)
    f32 = lambda x: np.asarray(x, np.float32)
    return f32(r), f32(v), m, f32(last)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    gamma=st.sampled_from([1.0, 0.99, 0.5]),
    per_row_lam=st.booleans(),
    obs_rewards=st.booleans(),
)
def test_scan_equals_associative_equals_reference(seed, gamma, per_row_lam, obs_rewards):
    r, v, m, last = _case(seed, obs_rewards=obs_rewards)
    lam = np.random.default_rng(seed + 1).random(B).astype(np.float32) if per_row_lam else 0.95
    lam_b = np.broadcast_to(lam, (B,))
    want_a, want_r = ref.gae_reference(r, v, m, gamma, lam_b, last)
    for impl in gae.GAE_IMPLS:
        a, ret = gae.skip_observation_gae(
            r, v, m, gamma=gamma, lam=jnp.asarray(lam), last_value_b=last, impl=impl
        )
        np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-5, err_msg=impl)
        np.testing.assert_allclose(ret, want_r, rtol=1e-5, atol=1e-5, err_msg=impl)
        assert np.all(np.asarray(a)[~m] == 0) and np.all(np.asarray(ret)[~m] == 0)


@pytest.mark.parametrize("t", [96, 101], ids=["3_blocks", "ragged_tail"])
def test_chunked_across_blocks_equals_reference(t):
    # Several 32-token blocks (the cross-block scan), a padded tail, per-row lambda,
    # rewards on observations, bootstraps; lam = 0 and gamma = 0 rows take the scan.
    rng = np.random.default_rng(t)
    m = ref.random_turn_mask(rng, B, t)
    r = np.where(rng.random((B, t)) < 0.2, rng.normal(size=(B, t)), 0.0).astype(np.float32)
    v = rng.normal(size=(B, t)).astype(np.float32)
    last = rng.normal(size=B).astype(np.float32)
    for gamma, lam in ((0.99, rng.uniform(0.3, 1.0, B)), (1.0, np.ones(B)), (0.9, np.zeros(B))):
        lam = lam.astype(np.float32)
        want_a, want_r = ref.gae_reference(r, v, m, gamma, lam, last)
        a, ret = gae.skip_observation_gae(
            r, v, m, gamma=gamma, lam=lam, last_value_b=last, impl="chunked"
        )
        np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-5, err_msg=f"{gamma}, {lam}")
        np.testing.assert_allclose(ret, want_r, rtol=1e-5, atol=1e-5)
    # lam = 0 went through the scan fallback: the block form alone cannot represent it.
    direct, _ = gc.gae_chunked(r, v, m, 0.9, jnp.zeros(B), last)
    assert not np.allclose(direct, want_a, rtol=1e-3, atol=1e-3)


def test_chunked_block_pieces_against_loops():
    # The bit packing (next-token mask) and the in-block counts, against plain loops.
    rng = np.random.default_rng(1)
    m = rng.random((3, 2 * gc.BLOCK)) < 0.5
    bits = np.asarray(gc.next_action_bits(jnp.asarray(m).reshape(3, 2, gc.BLOCK)))
    e = np.asarray(gc.factors_before(jnp.asarray(bits), gc.BLOCK)).reshape(3, -1)
    mnext = np.pad(m[:, 1:], ((0, 0), (0, 1)))
    for b in range(3):
        for t in range(2 * gc.BLOCK):
            j, i = divmod(t, gc.BLOCK)
            assert (bits[b, j] >> i) & 1 == mnext[b, t]
            assert e[b, t] == mnext[b, j * gc.BLOCK : t].sum()
    w = rng.normal(size=(2, 3, gc.BLOCK)).astype(np.float32)
    want = np.flip(np.cumsum(np.flip(w, -1), -1), -1)
    np.testing.assert_allclose(gc.suffix_sums(jnp.asarray(w)), want, rtol=1e-6, atol=1e-6)


def test_hand_computed_two_turns():
    # tokens: [prompt, a, a, obs, obs, a, a, pad]; turn 0 = tokens 1-2, turn 1 = 5-6.
    # gamma = lam = 0.5 (gamma*lam = 0.25), outcome 1 on token 6; V on obs/pad is junk (9).
    # Action subsequence V = 1, 2, 3, 4; terminated: bootstrap 0.
    #   t=6: delta = 1 + 0.5*0 - 4 = -3                    A = -3
    #   t=5: delta = 0 + 0.5*4 - 3 = -1                    A = -1 + 0.25*(-3)    = -1.75
    #   t=2: delta = 0 + 0.5*3 - 2 = -0.5 (skips the obs)  A = -0.5 + 0.25*(-1.75) = -0.9375
    #   t=1: delta = 0 + 0.5*2 - 1 = 0                     A = 0.25*(-0.9375)    = -0.234375
    # Truncated with V_last = 2: t=6 delta = 1 + 1 - 4 = -2, then A = -1.5, -0.875, -0.21875.
    m = np.array([[0, 1, 1, 0, 0, 1, 1, 0]], bool)
    v = np.array([[9, 1, 2, 9, 9, 3, 4, 9]], np.float32)
    r = np.array([[0, 0, 0, 0, 0, 0, 1, 0]], np.float32)
    for impl in gae.GAE_IMPLS:
        a, ret = gae.skip_observation_gae(r, v, m, gamma=0.5, lam=0.5, impl=impl)
        close = lambda x, y, i=impl: np.testing.assert_allclose(
            x, y, rtol=1e-6, atol=1e-6, err_msg=i
        )
        close(a[0], [0, -0.234375, -0.9375, 0, 0, -1.75, -3, 0])
        close(ret[0], [0, 0.765625, 1.0625, 0, 0, 1.25, 1, 0])
        a, _ = gae.skip_observation_gae(
            r, v, m, gamma=0.5, lam=0.5, last_value_b=np.array([2.0], np.float32), impl=impl
        )
        close(a[0], [0, -0.21875, -0.875, 0, 0, -1.5, -2, 0])


def test_outcome_reward_on_trailing_observation_reaches_advantages_in_full():
    # The pitfall: the last attended token is an observation. place_outcome_reward puts the
    # outcome on the last ACTION token; a reward a caller wrote on the observation anyway is
    # credited to that same token in full (unchecked mode) or rejected (checked mode).
    m = np.array([[0, 1, 1, 0, 1, 1, 0, 0]], bool)
    v = np.zeros((1, 8), np.float32)
    outcome = np.array([1.0], np.float32)
    placed = gae.place_outcome_reward(outcome, m)
    np.testing.assert_array_equal(placed[0], [0, 0, 0, 0, 0, 1, 0, 0])
    on_obs = np.array([[0, 0, 0, 0, 0, 0, 1, 0]], np.float32)
    for impl in gae.GAE_IMPLS:
        a_placed, _ = gae.skip_observation_gae(placed, v, m, gamma=1.0, lam=1.0, impl=impl)
        a_obs, _ = gae.skip_observation_gae(on_obs, v, m, gamma=1.0, lam=1.0, impl=impl)
        np.testing.assert_allclose(a_placed[0], [0, 1, 1, 0, 1, 1, 0, 0])
        np.testing.assert_allclose(a_obs, a_placed)
    with pytest.raises(ValueError, match="rewards_bt: nonzero reward on a non-action token"):
        gae.skip_observation_gae(on_obs, v, m, gamma=1.0, lam=1.0, checked=True)


def test_rows_without_actions_and_leading_observation_rewards():
    m = np.array([[0, 0, 0, 0], [0, 0, 1, 1]], bool)
    r = np.array([[5, 0, 0, 7], [3, 0, 0, 1]], np.float32)  # no action before these obs
    v = np.ones((2, 4), np.float32)
    a, ret = gae.skip_observation_gae(r, v, m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a, [[0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(ret, [[0, 0, 0, 0], [0, 0, 1, 1]])


def test_length_adaptive_lambda_and_decoupled_targets():
    m = np.zeros((4, 10), bool)
    m[1, 3] = True  # l = 1: 1 - 1/1.5 = 1/3
    m[2, 2:8] = True  # l = 6: 1 - 1/9
    m[3, :] = True  # l = 10
    lam = gae.length_adaptive_lambda(m, 1.5)
    np.testing.assert_allclose(lam, ref.adaptive_lambda_reference(m, 1.5), rtol=1e-6)
    np.testing.assert_allclose(gae.length_adaptive_lambda(m, 0.5), [0, 0, 2 / 3, 0.8], rtol=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        gae.length_adaptive_lambda(m, 0.0)
    r, v, mm, last = _case(7)
    out = gae.critic_and_policy_advantages(r, v, mm, gamma=1.0, alpha=1.5, last_value_b=last)
    lam_p = ref.adaptive_lambda_reference(mm, 1.5)
    np.testing.assert_allclose(out.lam_policy_b, lam_p, rtol=1e-6)
    want_a, _ = ref.gae_reference(r, v, mm, 1.0, lam_p, last)
    _, want_ret = ref.gae_reference(r, v, mm, 1.0, np.ones(B), last)
    np.testing.assert_allclose(out.advantages_bt, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.returns_bt, want_ret, rtol=1e-5, atol=1e-5)


def test_place_turn_rewards_on_each_turns_last_action_token():
    rng = np.random.default_rng(3)
    for _ in range(5):
        m = ref.random_turn_mask(rng, B, T)
        start = m & ~np.concatenate([np.zeros((B, 1), bool), m[:, :-1]], axis=1)
        tid = np.where(m, np.cumsum(start, axis=1) - 1, -1).astype(np.int32)
        turn_r = rng.normal(size=(B, 4)).astype(np.float32)  # turns >= 4 get nothing
        got = gae.place_turn_rewards(turn_r, tid, m)
        np.testing.assert_allclose(got, ref.turn_rewards_reference(turn_r, tid, m), rtol=1e-6)
        assert np.all(np.asarray(got)[~m] == 0)
    # Two turns back to back (no observation between) are told apart by their ids.
    m = np.array([[0, 1, 1, 1, 1, 0]], bool)
    tid = np.array([[-1, 0, 0, 1, 1, -1]], np.int32)
    got = gae.place_turn_rewards(np.array([[2.0, 3.0]], np.float32), tid, m)
    np.testing.assert_array_equal(got[0], [0, 0, 2, 0, 3, 0])
    with pytest.raises(ValueError, match="turn_ids_bt: turn index >= N"):
        gae.place_turn_rewards(np.array([[2.0]], np.float32), tid, m, checked=True)


@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_step_level_gae_against_reference(reduce):
    for seed in range(4):
        r, v, m, last = _case(100 + seed, obs_rewards=seed % 2 == 1)
        start = m & ~np.concatenate([np.zeros((B, 1), bool), m[:, :-1]], axis=1)
        tid = np.where(m, np.cumsum(start, axis=1) - 1, -1).astype(np.int32)
        lam = np.full(B, 0.9)
        want_a, want_r = ref.step_gae_reference(r, v, m, tid, 0.95, lam, last, reduce)
        for impl in gae.GAE_IMPLS:
            for ids in (tid, None):
                a, ret = gae.step_level_gae(
                    r, v, m, gamma=0.95, lam=0.9, reduce=reduce, turn_ids_bt=ids,
                    last_value_b=last, impl=impl,
                )  # fmt: skip
                np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(ret, want_r, rtol=1e-5, atol=1e-5)


def test_cross_observation_gae_against_reference():
    for seed in range(4):
        r, v, m, last = _case(200 + seed, obs_rewards=True)
        want_a, want_r = ref.cross_observation_reference(r, v, m, 0.9, np.full(B, 0.8), last)
        for impl in gae.GAE_IMPLS:
            a, ret = gae.cross_observation_gae(
                r, v, m, gamma=0.9, lam=0.8, last_value_b=last, impl=impl
            )
            np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ret, want_r, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument():
    r, v, m, last = _case(1)
    kw = dict(gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="rewards_bt: shape"):
        gae.skip_observation_gae(r[:, :-1], v, m, **kw)
    with pytest.raises(ValueError, match="action_mask_bt: shape"):
        gae.skip_observation_gae(r, v, m[:-1], **kw)
    with pytest.raises(ValueError, match="last_value_b"):
        gae.skip_observation_gae(r, v, m, last_value_b=last[:-1], **kw)
    with pytest.raises(TypeError, match="values_bt: expected a float"):
        gae.skip_observation_gae(r, v.astype(np.int32), m, **kw)
    with pytest.raises(ValueError, match="lam: must be in"):
        gae.skip_observation_gae(r, v, m, gamma=1.0, lam=1.5)
    with pytest.raises(ValueError, match="gamma: must be in"):
        gae.skip_observation_gae(r, v, m, gamma=-0.1, lam=1.0)
    with pytest.raises(ValueError, match="lam: expected a scalar or shape"):
        gae.skip_observation_gae(r, v, m, gamma=1.0, lam=np.ones(B + 1, np.float32))
    with pytest.raises(ValueError, match="impl: unknown GAE implementation"):
        gae.skip_observation_gae(r, v, m, impl="loop", **kw)
    with pytest.raises(ValueError, match="reduce"):
        gae.step_level_gae(r, v, m, reduce="max", **kw)
    # Value checks: only in checked mode (per call or as a context).
    m2 = m.astype(np.float32) * 2
    gae.skip_observation_gae(r, v, m2, **kw)  # unchecked: entries != 0 count as actions
    with pytest.raises(ValueError, match="action_mask_bt: entries must be 0 or 1"):
        gae.skip_observation_gae(r, v, m2, checked=True, **kw)
    lam_bad = np.full(B, 1.2, np.float32)
    gae.skip_observation_gae(r, v, m, gamma=1.0, lam=lam_bad)
    with checked_mode(), pytest.raises(ValueError, match="lam: entries must be in"):
        gae.skip_observation_gae(r, v, m, gamma=1.0, lam=lam_bad)
    with checked_mode(), pytest.raises(ValueError, match="gamma: must be in"):
        gae.skip_observation_gae(r, v, m, gamma=jnp.float32(2.0), lam=1.0)


def test_checked_mode_under_jit_raises_when_the_step_runs():
    r, v, m, _ = _case(2)
    f = jax.jit(lambda m_: gae.skip_observation_gae(r, v, m_, gamma=1.0, lam=1.0, checked=True))
    f(m.astype(np.float32))  # valid values pass
    with pytest.raises(Exception, match="action_mask_bt: entries must be 0 or 1"):
        jax.block_until_ready(f(m.astype(np.float32) * 3))


def test_no_retrace_for_same_shape_calls():
    gae._gae_jit.clear_cache()
    rng = np.random.default_rng(0)
    for i, impl in enumerate(gae.GAE_IMPLS):
        for k in range(3):
            r, v, m, last = _case(300 + k)
            lam = rng.random(B).astype(np.float32) if k % 2 else float(rng.random())
            gamma = float(rng.random())
            gae.skip_observation_gae(
                r, v, m, gamma=gamma, lam=lam, last_value_b=last if k else None, impl=impl
            )
        assert gae._gae_jit._cache_size() == i + 1  # one trace per implementation


def test_default_impl_is_known():
    for backend in ("cpu", "gpu", "tpu", None):
        assert gae.default_gae_impl(backend) in gae.GAE_IMPLS
