"""Policy and value losses against NumPy references: values, gradients, masks, metrics."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.rl import losses
from tests import rl_reference as ref

B, T = 4, 12


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    m = ref.random_turn_mask(rng, B, T, p_empty=0.25)
    rollout = -rng.random((B, T)) * 3
    # log-ratios from -3 to 3: plenty of tokens on both sides of every band
    logp = rollout + rng.uniform(-3, 3, size=(B, T))
    f32 = lambda x: np.asarray(x, np.float32)
    return dict(
        logp_bt=f32(np.where(m, logp, 0.0)),
        rollout_logp_bt=f32(np.where(m, rollout, 0.0)),
        advantages_bt=f32(np.where(m, rng.normal(size=(B, T)), 0.0)),
        action_mask_bt=m,
        old_logp_bt=f32(np.where(m, rollout + rng.uniform(-1.5, 1.5, size=(B, T)), 0.0)),
        entropy_bt=f32(rng.random((B, T)) * 4),
        staleness_bt=rng.integers(0, 12, size=(B, T)).astype(np.int32),
    )


def _loss_and_grad(name, b, **params):
    def f(logp):
        return losses.policy_loss(name, **{**b, "logp_bt": logp}, **params)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(b["logp_bt"]))
    return float(loss), np.asarray(grad), metrics


def _denom(m):
    return max(int(np.sum(m)), 1)


def test_dis_loss_and_gradient_against_reference():
    for seed in range(4):
        b = _batch(seed)
        loss, grad, metrics = _loss_and_grad("dis", b)
        m = b["action_mask_bt"]
        want_loss, want_grad = ref.dis_reference(
            b["logp_bt"], b["rollout_logp_bt"], b["advantages_bt"], m, 0.3, 5.0, _denom(m)
        )
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
        r = np.exp(b["logp_bt"] - b["rollout_logp_bt"])
        kept = m & (r > 0.7) & (r < 6.0)
        s, c = metrics["keep_rate"]
        assert (float(s), float(c)) == (float(kept.sum()), float(m.sum()))


def test_dis_out_of_band_tokens_have_zero_gradient_and_stay_in_the_denominator():
    m = np.ones((1, 4), bool)
    rollout = np.zeros((1, 4), np.float32)
    logp = np.log(np.array([[0.5, 1.0, 7.0, 1.2]], np.float32))  # r = 0.5, 1, 7, 1.2
    for sign in (1.0, -1.0):
        a = np.full((1, 4), sign, np.float32)
        b = dict(logp_bt=logp, rollout_logp_bt=rollout, advantages_bt=a, action_mask_bt=m)
        loss, grad, _ = _loss_and_grad("dis", b)
        assert grad[0, 0] == 0 and grad[0, 2] == 0  # out of band, whatever the sign
        np.testing.assert_allclose(grad[0, [1, 3]], [-sign / 4, -sign * 1.2 / 4], rtol=1e-6)
        np.testing.assert_allclose(loss, -sign * 1.2 * np.log(1.2) / 4, rtol=1e-5)
    # Non-finite log-probs off the action mask or out of band never leak NaN.
    b["logp_bt"] = np.array([[-np.inf, 0.0, 30.0, 0.1]], np.float32)
    b["action_mask_bt"] = np.array([[0, 1, 1, 1]], bool)
    loss, grad, _ = _loss_and_grad("dis", b)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_microbatches_with_the_global_denominator_equal_the_full_batch():
    b = _batch(5)
    n = _denom(b["action_mask_bt"])
    for name in ("dis", "ppo_clip", "icepop", "icepop_mask", "estr", "positive_nll"):
        full, full_grad, _ = _loss_and_grad(name, b)
        parts = [_loss_and_grad(name, {k: v[i : i + 2] for k, v in b.items()}, denominator=n)
                 for i in (0, 2)]  # fmt: skip
        np.testing.assert_allclose(sum(p[0] for p in parts), full, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), full_grad, rtol=1e-5)


def test_ppo_clip_and_icepop_against_reference():
    for seed in range(3):
        b = _batch(10 + seed)
        m, adv, old = b["action_mask_bt"], b["advantages_bt"], b["old_logp_bt"]
        rollout = b["rollout_logp_bt"]
        # ppo_clip: pi_old = the behaviour policy (the rollout engine's log-probs)
        loss, grad, metrics = _loss_and_grad("ppo_clip", {**b, "old_logp_bt": None}, eps_high=0.3)
        want = ref.ppo_reference(b["logp_bt"], rollout, adv, m, 0.2, 0.3, _denom(m))
        np.testing.assert_allclose(loss, want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, want[1], rtol=1e-5, atol=1e-6)
        rho = np.exp(b["logp_bt"] - rollout)
        low = np.sum(m & (rho < 0.8) & (adv < 0))
        high = np.sum(m & (rho > 1.3) & (adv > 0))
        assert float(metrics["ppo_clip_low"][0]) == low
        assert float(metrics["ppo_clip_high"][0]) == high
        assert float(metrics["clip_frac"][0]) == low + high > 0
        # icepop: PPO against the training engine's pi_old, weighted by k = train / infer
        k = np.exp(old - rollout)
        band = (k >= 0.5) & (k <= 5.0)
        for name, weight in (("icepop", np.where(band, k, 0.0)), ("icepop_mask", None)):
            loss, grad, metrics = _loss_and_grad(name, b)
            want = ref.ppo_reference(
                b["logp_bt"], old, adv, m, 0.2, 0.28, _denom(m), keep=band, weight=weight
            )
            np.testing.assert_allclose(loss, want[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(grad, want[1], rtol=1e-5, atol=1e-6)
            assert float(metrics["keep_rate"][0]) == np.sum(m & band)
            w = np.where(band, k if weight is not None else 1.0, 0.0)
            np.testing.assert_allclose(metrics["icepop_weight"][0], np.sum(w[m]), rtol=1e-5)


def test_icepop_weights_kept_tokens_by_the_train_inference_ratio():
    """Published IcePop: a kept token's gradient is k times PPO's; out-of-band tokens get
    none. (The mask-only form, today's `icepop_mask`, gave every kept token weight 1.)"""
    m = np.ones((1, 4), bool)
    rollout = np.zeros((1, 4), np.float32)
    old = np.log(np.array([[0.4, 0.8, 2.0, 6.0]], np.float32))  # k = 0.4, 0.8, 2, 6
    b = dict(
        logp_bt=old.copy(),  # the first minibatch step: rho = 1, no clip
        rollout_logp_bt=rollout,
        old_logp_bt=old,
        advantages_bt=np.ones((1, 4), np.float32),
        action_mask_bt=m,
    )
    _, grad_ppo, _ = _loss_and_grad("ppo_clip", {**b, "rollout_logp_bt": old})
    _, grad, _ = _loss_and_grad("icepop", b)
    np.testing.assert_allclose(grad, grad_ppo * np.array([[0.0, 0.8, 2.0, 0.0]]), rtol=1e-6)
    _, grad_mask, _ = _loss_and_grad("icepop_mask", b)
    np.testing.assert_allclose(grad_mask, grad_ppo * np.array([[0.0, 1.0, 1.0, 0.0]]), rtol=1e-6)


def test_estr_and_positive_nll_against_reference():
    b = _batch(20)
    m = b["action_mask_bt"]
    loss, grad, _ = _loss_and_grad("estr", b, tau=0.5)
    want = ref.estr_reference(
        b["logp_bt"], b["rollout_logp_bt"], b["advantages_bt"], m, b["entropy_bt"], 0.5, 1e-6,
        _denom(m),
    )  # fmt: skip
    np.testing.assert_allclose(loss, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want[1], rtol=1e-5, atol=1e-6)
    loss, grad, _ = _loss_and_grad("positive_nll", b)
    pos = m & (b["advantages_bt"] > 0)
    np.testing.assert_allclose(loss, -np.sum(b["logp_bt"][pos]) / _denom(m), rtol=1e-5)
    np.testing.assert_allclose(grad, np.where(pos, -1.0 / _denom(m), 0.0), rtol=1e-6)


def test_metrics_entropy_kl_and_staleness_buckets():
    b = _batch(30)
    m, h, lag = b["action_mask_bt"], b["entropy_bt"], b["staleness_bt"]
    _, _, metrics = _loss_and_grad("dis", b)
    r = np.exp(b["logp_bt"] - b["rollout_logp_bt"])
    kept = m & (r > 0.7) & (r < 6.0)
    np.testing.assert_allclose(metrics["masked_entropy"][0], np.sum(h[m & ~kept]), rtol=1e-5)
    assert float(metrics["masked_entropy"][1]) == np.sum(m & ~kept)
    np.testing.assert_allclose(metrics["kept_entropy"][0], np.sum(h[kept]), rtol=1e-5)
    np.testing.assert_allclose(metrics["approx_kl"][0], np.sum((r - 1 - np.log(r))[m]), rtol=1e-4)
    for suffix, *_ in losses.STALENESS_BUCKETS:
        in_bucket = m & (np.vectorize(ref.staleness_bucket)(lag) == suffix)
        s, c = metrics[f"keep_rate_stale_{suffix}"]
        assert (float(s), float(c)) == (float(np.sum(kept & in_bucket)), float(in_bucket.sum()))
    b2 = {k: v for k, v in b.items() if k not in ("entropy_bt", "staleness_bt")}
    _, _, metrics = _loss_and_grad("dis", b2)
    assert "masked_entropy" not in metrics and "keep_rate_stale_0" not in metrics


def test_value_loss_against_reference():
    b = _batch(40)
    m = b["action_mask_bt"]
    rng = np.random.default_rng(0)
    v, ret, old = (rng.normal(size=(B, T)).astype(np.float32) for _ in range(3))
    loss, metrics = losses.value_loss(v, ret, m)
    np.testing.assert_allclose(loss, ref.value_reference(v, ret, m), rtol=1e-5)
    loss, metrics = losses.value_loss(v, ret, m, old_values_bt=old, clip_eps=0.2, denominator=7)
    np.testing.assert_allclose(loss, ref.value_reference(v, ret, m, old, 0.2, 7), rtol=1e-5)
    assert 0 <= float(metrics["value_clip_frac"][0]) <= float(metrics["value_clip_frac"][1])
    g = jax.grad(lambda x: losses.value_loss(x, ret, m)[0])(jnp.asarray(v))
    np.testing.assert_allclose(g, np.where(m, (v - ret) / _denom(m), 0.0), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="needs old_values_bt"):
        losses.value_loss(v, ret, m, clip_eps=0.2)
    with pytest.raises(ValueError, match="returns_bt: shape"):
        losses.value_loss(v, ret[:, 1:], m)


def test_registry_and_bad_inputs():
    b = _batch(0)
    assert set(losses.LOSSES.names()) == {
        "dis", "ppo_clip", "icepop", "icepop_mask", "estr", "positive_nll", "value_mse",
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown loss 'grpo'; known: dis, estr, "):
        losses.policy_loss("grpo", **b)
    with pytest.raises(ValueError, match="value_mse' is a value loss"):
        losses.policy_loss("value_mse", **b)
    with pytest.raises(TypeError, match=r"unexpected parameter\(s\) \['eps_low'\]"):
        losses.policy_loss("dis", eps_low=0.1, **b)
    with pytest.raises(ValueError, match="needs old_logp_bt"):
        losses.policy_loss("icepop", **{**b, "old_logp_bt": None})
    with pytest.raises(ValueError, match="needs entropy_bt"):
        losses.policy_loss("estr", **{**b, "entropy_bt": None})
    with pytest.raises(ValueError, match="advantages_bt: shape"):
        losses.policy_loss("dis", **{**b, "advantages_bt": b["advantages_bt"][:, 1:]})
    with pytest.raises(TypeError, match="staleness_bt: expected an int"):
        losses.policy_loss("dis", **{**b, "staleness_bt": b["staleness_bt"] * 1.0})
    with pytest.raises(ValueError, match="eps_h: must be >= 0"):
        losses.policy_loss("dis", eps_h=-1.0, **b)
    with pytest.raises(ValueError, match="denominator: must be > 0"):
        losses.policy_loss("dis", denominator=0, **b)
    with pytest.raises(ValueError, match="action_mask_bt: entries must be 0 or 1"):
        losses.policy_loss("dis", checked=True, **{**b, "action_mask_bt": b["action_mask_bt"] * 2})
    with pytest.raises(ValueError, match="staleness_bt: must be >= 0"):
        losses.policy_loss("dis", checked=True, **{**b, "staleness_bt": -b["staleness_bt"] - 1})


def test_losses_jit_and_grad_without_retrace():
    b = {k: jnp.asarray(v) for k, v in _batch(1).items()}

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(x):
        return jax.value_and_grad(lambda lp: losses.policy_loss("dis", **{**x, "logp_bt": lp})[0])(
            x["logp_bt"]
        )

    step(b)
    step({**b, "advantages_bt": -b["advantages_bt"]})
    step({**b, "logp_bt": b["logp_bt"] * 0.5})
