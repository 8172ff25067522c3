"""Mask-budget calibration (sao_jax/rl/mask_budget.py) against literal keep rules, and the
token dump it reads (sao_jax/run/token_dump.py)."""

import math

import numpy as np
import pytest

from sao_jax.rl import mask_budget as mb
from sao_jax.run import token_dump
from sao_jax.schema import ConfigError

ESTR_EPS = 1e-6


def literal_masked(rule: str, params: dict, log_ratio, entropy) -> int:
    """Tokens the rule masks, one token at a time, written from the losses' docstrings."""
    n = 0
    for lr, h in zip(log_ratio.tolist(), entropy.tolist(), strict=True):
        r = math.exp(lr)
        if rule == "dis":
            keep = 1 - params["eps_l"] < r < 1 + params["eps_h"]
        elif rule == "estr":
            keep = abs(lr) <= math.sqrt(params["tau"] * (max(h, 0.0) + ESTR_EPS))
        else:
            keep = params["band_low"] <= r <= params["band_high"]
        n += not keep
    return n


def test_hand_worked_four_tokens():
    # half of 4 tokens masked: each rule's two largest scores go
    lr = np.array([0.1, -0.5, 0.3, 2.0])
    h = np.array([0.04, 1.0, 0.01, 4.0])
    dis = mb.calibrate("dis", lr, h, 0.5)  # |log r| = .1 .5 .3 2: masks 2 and -.5
    assert dis.threshold == pytest.approx(0.4)
    assert dis.params == {"eps_l": 0.3297, "eps_h": 0.4918}  # 1 - e^-.4, e^.4 - 1
    estr = mb.calibrate("estr", lr, h, 0.5)  # lr^2 / H = .25 .25 9 1: masks .3 (low H) and 2
    assert estr.threshold == pytest.approx(0.625, rel=1e-5)
    assert estr.params == {"tau": 0.625}
    ice = mb.calibrate("icepop", lr, h, 0.5)  # .1/ln5, -.5/ln.5, .3/ln5, 2/ln5
    c = 0.5 * (0.5 / math.log(2) + 0.3 / math.log(5))
    assert ice.threshold == pytest.approx(c)
    assert ice.params == {"band_low": mb.round_sig(0.5**c), "band_high": mb.round_sig(5**c)}
    for cal in (dis, estr, ice):
        assert cal.achieved == 0.5 and cal.tokens == 4
        assert literal_masked(cal.rule, cal.params, lr, h) == 2
    assert estr.overrides() == {"rl.losses.estr.tau": 0.625}
    assert set(ice.overrides()) == {"rl.losses.icepop.band_low", "rl.losses.icepop.band_high"}


@pytest.mark.parametrize("rule", sorted(mb.RULES))
@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.2])
def test_calibrated_rule_masks_the_budget_on_random_tokens(rule, fraction):
    rng = np.random.default_rng(7)
    n = 4000
    lr = rng.normal(0.0, 0.15, n) * rng.exponential(1.0, n)  # heavy-tailed drift
    h = rng.exponential(0.6, n)
    cal = mb.calibrate(rule, lr, h, fraction)
    want = round(fraction * n)
    assert literal_masked(rule, cal.params, lr, h) == want  # the literal rule agrees
    assert cal.achieved == pytest.approx(want / n, abs=1e-12)  # so does the loss itself
    # a bisection on the loss's own parameter lands on the same count
    lo, hi = 0.0, 50.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        masked = literal_masked(rule, mb.RULES[rule].params(mid), lr, h)
        lo, hi = (mid, hi) if masked > want else (lo, mid)
    assert literal_masked(rule, mb.RULES[rule].params(hi), lr, h) == want
    assert cal.threshold == pytest.approx(hi, rel=0.05) or lo <= cal.threshold <= hi * 1.05


def test_masked_fraction_is_the_loss_keep_rate_at_default_bands():
    lr = np.log(np.array([0.69, 0.71, 5.9, 6.1, 0.49, 5.01, 1.0, 1.0]))
    h = np.ones(8)
    # (0.7, 6.0) masks 0.69, 6.1 and 0.49; [0.5, 5.0] masks 5.9, 6.1, 0.49 and 5.01
    assert mb.masked_fraction("dis", {"eps_l": 0.3, "eps_h": 5.0}, lr, h) == 3 / 8
    assert mb.masked_fraction("icepop", {"band_low": 0.5, "band_high": 5.0}, lr, h) == 4 / 8


def test_no_drift_means_no_budget():
    lr = np.zeros(1000)
    lr[:5] = 0.3  # 5 tokens drifted: a 1% budget (10 tokens) cannot be set
    with pytest.raises(ValueError, match="means nothing"):
        mb.calibrate("dis", lr, np.ones(1000), 0.01)
    assert mb.calibrate("dis", lr, np.ones(1000), 0.005).achieved == pytest.approx(0.005)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        mb.calibrate("estr", lr, np.ones(1000), 0.0)
    with pytest.raises(ValueError, match="mask rule"):
        mb.rule("ppo")


def test_calibration_file_round_trip_gives_one_level_per_budget(tmp_path):
    rng = np.random.default_rng(0)
    lr, h = rng.normal(0, 0.2, 500), rng.exponential(0.5, 500)
    cals = [mb.calibrate(r, lr, h, f) for f in (0.01, 0.05) for r in mb.RULES]
    path = mb.write_calibration(tmp_path / "cal.json", cals, {"tokens": 500})
    levels = mb.read_levels(path, (0.05, 0.01))
    assert levels[0]["rl.losses.estr.tau"] == cals[4].params["tau"]
    assert levels[1]["rl.losses.dis.eps_l"] == cals[0].params["eps_l"]
    assert all(len(level) == 5 for level in levels)  # eps_l, eps_h, tau, band_low, band_high
    with pytest.raises(ConfigError, match="budget 0.1 needs the rules"):
        mb.read_levels(path, (0.1,))
    with pytest.raises(ConfigError, match="not readable"):
        mb.read_levels(tmp_path / "none.json", (0.01,))


def test_token_dump_keeps_action_tokens_in_row_order(tmp_path):
    mask = np.array([[0, 1, 1, 0], [0, 0, 1, 1]], bool)
    probe = {
        "log_ratio": np.arange(8, dtype=np.float32).reshape(2, 4),
        "entropy": -np.arange(8, dtype=np.float32).reshape(2, 4),
        "staleness": np.full((2, 4), 3),
    }
    token_dump.write(tmp_path / "a", 9, probe, mask)
    token_dump.write(tmp_path / "b", 9, probe, mask)
    got = token_dump.read([tmp_path / "a", tmp_path / "b"], [9])
    assert got.log_ratio.tolist() == [1, 2, 6, 7] * 2
    assert got.entropy.tolist() == [-1, -2, -6, -7] * 2
    assert got.staleness.dtype == np.int32 and got.size == 8
    with pytest.raises(ConfigError, match="step=10.npz: missing"):
        token_dump.read([tmp_path / "a"], [10])


@pytest.mark.parametrize("bad", [(0,), (2, -1), (1.5,), (True,)])
def test_bad_token_dump_steps_name_the_field(bad):
    from configs import sao
    from sao_jax import config as config_lib

    c = sao.get_config("smoke")
    c.train.token_dump_steps = bad
    with pytest.raises(ConfigError, match="train.token_dump_steps"):
        config_lib.validate(c)
