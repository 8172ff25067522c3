"""The reports of experiments/staleness_law/ and experiments/mask_budget/ on synthetic
histories, and the censored-time statistics they rest on
(experiments/staleness_law/survival.py)."""

import math

import numpy as np
import pytest
from sao_jax.experiments.mask_budget import report as mbr
from sao_jax.experiments.staleness_law import report as law
from sao_jax.experiments.staleness_law import survival
from scipy import optimize
from scipy import stats as sp_stats

from sao_jax import sweep
from sao_jax.report.experiment import Experiment


def test_km_median_by_hand():
    # S: 5/6 at 2, x 4/5 at 3 (the censored 3 still at risk), x 2/3 at 5 = 4/9 <= 1/2
    assert survival.km_median([2, 3, 3, 5, 8, 9], [1, 1, 0, 1, 0, 1]) == 5.0
    assert survival.km_median([2, 9, 9, 9], [1, 0, 0, 0]) == math.inf


def test_lognormal_regression_is_the_censored_mle():
    rng = np.random.default_rng(1)
    lr = np.repeat([5e-4, 1e-3, 2e-3, 4e-3], 10)
    s = np.tile(np.repeat([2.0, 8.0], 5), 4)
    t = np.exp(np.log(0.02) - np.log(lr) + rng.normal(0, 0.4, lr.size))
    obs = t <= 40
    tc = np.minimum(t, 40)
    x = np.column_stack([np.ones(lr.size), np.log(lr), np.log(s)])
    fit = survival.lognormal_regression(x, tc, obs, ("a", "b", "c"))

    def nll(p):  # the same likelihood, written with scipy, minimised by BFGS
        z = (np.log(tc) - x @ p[:3]) / math.exp(p[3])
        return -(np.sum(sp_stats.norm.logpdf(z[obs]) - p[3]) + np.sum(sp_stats.norm.logsf(z[~obs])))

    ref = optimize.minimize(nll, np.r_[fit.coef, 0.0], method="BFGS", options={"gtol": 1e-9})
    np.testing.assert_allclose(fit.coef, ref.x[:3], atol=1e-5)
    assert fit.sigma == pytest.approx(math.exp(ref.x[3]), rel=1e-5)
    # the observed-information SE against a finite-difference Hessian of scipy's nll
    h, p0, k = 1e-4, ref.x, len(ref.x)
    hess = np.zeros((k, k))
    for i in range(k):
        for j in range(k):
            e_i, e_j = np.eye(k)[i] * h, np.eye(k)[j] * h
            hess[i, j] = (
                nll(p0 + e_i + e_j)
                - nll(p0 + e_i - e_j)
                - nll(p0 - e_i + e_j)
                + nll(p0 - e_i - e_j)
            ) / (4 * h * h)
    se_ref = np.sqrt(np.diag(np.linalg.inv(hess)))[:3]
    np.testing.assert_allclose([fit.se(n) for n in "abc"], se_ref, rtol=1e-3)
    lo, hi = fit.interval("b")
    assert lo < -1 < hi and fit.events == int(obs.sum()) and fit.df == fit.events - 3


def test_lognormal_regression_without_censoring_is_least_squares():
    rng = np.random.default_rng(2)
    x = np.column_stack([np.ones(12), rng.normal(size=12)])
    y = 1.0 + 0.5 * x[:, 1] + rng.normal(0, 0.3, 12)
    fit = survival.lognormal_regression(x, np.exp(y), [True] * 12, ("a", "b"))
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    np.testing.assert_allclose(fit.coef, beta, atol=1e-8)
    assert fit.sigma == pytest.approx(np.sqrt(np.mean((y - x @ beta) ** 2)), rel=1e-6)
    with pytest.raises(ValueError, match="events"):
        survival.lognormal_regression(x[:2], [1.0, 2.0], [True, False], ("a", "b"))


def _history(steps: int, *, collapse: int | None, lag: float, entropy_low_from=None):
    """Train success 0.4, falling to 0.05 from step `collapse` on; staleness `lag`."""
    out = [{"step": 0, "eval/greedy_success": 0.3}]
    for s in range(1, steps + 1):
        low = collapse is not None and s >= collapse
        h = 0.01 if entropy_low_from is not None and s >= entropy_low_from else 0.5
        out.append(
            {
                "step": s,
                "train/success": 0.05 if low else 0.4,
                "train/staleness": lag,
                "policy/entropy": h,
            }
        )
    out.append({"step": steps, "eval/greedy_success": 0.3})
    return out


def test_collapse_time_in_policy_versions():
    t = law.collapse_time(_history(20, collapse=10, lag=6.0))
    assert (t.value, t.observed, t.step, t.reason) == (4.0, True, 10, "success")
    t = law.collapse_time(_history(20, collapse=None, lag=6.0))  # last start 18, less lag 6
    assert (t.value, t.observed) == (12.0, False)
    t = law.collapse_time(_history(20, collapse=None, lag=6.0, entropy_low_from=7))
    assert (t.value, t.reason) == (7.0, "entropy")  # the learner's policy: no lag
    assert law.fmt_time(t) == "7e" and law.fmt_time(law.CollapseTime(12, False, None, "")) == ">12"
    assert law.collapse_time(_history(2, collapse=None, lag=0.0)) is None


def _point(variant, seed, overrides):
    return sweep.Point("configs/ablations.py", variant, "", seed, tuple(overrides.items()), ())


def _result(variant, seed, overrides, history, after):
    summary = {"after": {"eval/sampled_success": after}, "wall_time_s": 60.0}
    return sweep.PointResult(_point(variant, seed, overrides), None, "done", summary, history)


def test_staleness_law_report_recovers_a_planted_law(tmp_path):
    rng = np.random.default_rng(0)
    results, total = [], 40
    for variant, const in (("sao", 0.04), ("vanilla_vapo", 0.02)):
        for s in (2, 8):
            for lr in (5e-4, 1e-3, 2e-3, 4e-3):
                for seed in range(5):
                    v = const / lr * math.exp(rng.normal(0, 0.3))  # versions
                    lag = 0.8 * s
                    step = math.ceil(v + lag)
                    hist = _history(total, collapse=step if step <= total - 2 else None, lag=lag)
                    ov = {"sampling.max_staleness": s, "optim.policy.lr": lr}
                    results.append(_result(variant, seed, ov, hist, 0.3))
    times = law.cell_times(results)
    fits = {
        "no DIS": law.fit(
            {k: v for k, v in times.items() if k[0] == "vanilla_vapo"}, with_dis=False
        )
    }
    lo, hi = fits["no DIS"].interval("log lr")
    assert lo < -1 < hi and hi - lo < 0.6
    joint = law.fit(times, with_dis=True)
    lo, hi = joint.interval("DIS")
    assert lo < math.log(2) < hi  # DIS doubles the collapse time here
    spec = sweep.SweepSpec(
        "staleness_law",
        "configs/ablations.py",
        ("sao",),
        tuple(range(5)),
        fixed={"train.total_steps": total},
    )
    exp = Experiment(mode="full", out_dir=str(tmp_path), command="python -m experiments.x")
    text = law.report(exp, spec, results, 60.0)
    assert "| no DIS | 8 | 0.004 | 5/5 |" in text
    assert "DIS multiplies the collapse time" in text and "Holm p" in text
    assert (tmp_path / "plots" / "staleness_law_sao.png").is_file()


def test_mask_budget_run_values_by_hand():
    hist = [
        {
            "step": 9,
            "policy/keep_rate": 0.9,
            "train/action_tokens": 10.0,
            "policy/masked_entropy": 2.0,
            "policy/kept_entropy": 0.5,
        },
        {
            "step": 10,
            "policy/keep_rate": 0.5,
            "train/action_tokens": 20.0,
            "policy/masked_entropy": 1.0,
            "policy/kept_entropy": 0.25,
        },
        {
            "step": 11,
            "policy/keep_rate": 1.0,
            "train/action_tokens": 20.0,
            "policy/kept_entropy": 0.1,
        },  # nothing masked: the masked entropy is null
    ]
    # masked tokens per record 1, 10, 0: (1 x 2 + 10 x 1) / 11
    assert mbr.weighted_entropy(hist, mbr.MASKED_H, masked=True) == pytest.approx(12 / 11)
    # kept 9, 10, 20: (9 x .5 + 10 x .25 + 20 x .1) / 39
    assert mbr.weighted_entropy(hist, mbr.KEPT_H, masked=False) == pytest.approx(9 / 39)
    assert mbr.achieved(hist, [9, 10]) == pytest.approx(0.3)
    assert mbr.achieved(hist, [30]) is None


def test_mask_budget_report_pairs_rules_with_dis_per_budget(tmp_path):
    levels = {
        0.01: {"rl.losses.dis.eps_l": 0.1, "rl.losses.estr.tau": 2.0},
        0.05: {"rl.losses.dis.eps_l": 0.05, "rl.losses.estr.tau": 0.5},
    }
    base = {"sampling.max_staleness": 8, "optim.policy.lr": 1e-3}
    results = []
    for f, level in levels.items():
        for row, h_masked, gain in (("sao", 2.0, 0.0), ("estr", 0.5, 0.02), ("icepop", 1.8, 0.0)):
            for seed in range(5):
                hist = [
                    {
                        "step": s,
                        "policy/keep_rate": 1 - f,
                        "train/action_tokens": 30.0,
                        "policy/masked_entropy": h_masked + 0.01 * seed,
                        "policy/kept_entropy": 0.4,
                        "train/success": 0.4,
                    }
                    for s in range(1, 13)
                ]
                after = 0.3 + gain + 0.01 * seed + (0.003 if row == "estr" and seed % 2 else 0)
                results.append(_result(row, seed, {**base, **level}, hist, after))
    cal = {
        "budgets": {
            key: {
                r: {"params": {"x": 1.0}, "achieved": f, "masked_entropy": 1.0, "kept_entropy": 0.5}
                for r in ("dis", "estr", "icepop")
            }
            for key, f in (("0.01", 0.01), ("0.05", 0.05))
        },
        "defaults": {"dis": {"params": {"eps_l": 0.3, "eps_h": 5.0}, "fraction": 0.07}},
        "tokens": 1000,
        "steps": [9, 10, 11, 12],
        "pilots": ["a"],
        "seeds": [0],
        "mean_staleness": 7.1,
        "mean_abs_log_ratio": 0.02,
        "mean_entropy": 0.6,
        "step_one": {"tokens": 900, "max_abs_log_ratio": 1e-6, "share_above_1e3": 0.0},
    }
    assert mbr.budget_of(results[0], levels) == 0.01 and mbr.budget_of(results[-1], levels) == 0.05
    spec = sweep.SweepSpec(
        "mask_budget",
        "configs/ablations.py",
        ("sao", "estr", "icepop"),
        tuple(range(5)),
        grid=((base,),),
        fixed={"train.total_steps": 12},
    )
    exp = Experiment(mode="full", out_dir=str(tmp_path), command="python -m experiments.x")
    text = mbr.report(
        exp, spec, results, 60.0, calibration=cal, levels=levels, calibration_steps=[9, 10]
    )
    assert "test (Holm over 4)" in text  # ESTR and IcePop vs DIS at two budgets
    assert "| 1% | DIS, fixed band symmetric in log r | 5/5 | 1.00 ± 0.00 |" in text
    estr = next(x for x in text.splitlines() if x.startswith("| 5% | ESTR"))
    assert "-1.500 ± 0.000" in estr  # masked entropy 0.5 vs DIS's 2.0, every seed
    assert "+2.1 ± 0.1" in estr  # held-out: +2 points, + 0.3 more on seeds 1 and 3
    assert "## Calibration" in text and "| default | DIS |" in text
