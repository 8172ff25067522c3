"""The online-shift report's per-phase numbers against literal loops over the records."""

import itertools
import math

import numpy as np

from experiments import online_shift as shift

SWITCHES, TOTAL = (20, 40), 60


def _history(metric: str, steps, values) -> list[dict]:
    return [{"step": int(s), metric: float(v)} for s, v in zip(steps, values, strict=True)]


def _slow_mean(records, metric, lo, hi):
    vals = [r[metric] for r in records if lo <= r["step"] < hi and metric in r]
    return sum(vals) / len(vals) if vals else None


def test_phase_ev_splits_each_phase_into_early_and_rest():
    rng = np.random.default_rng(0)
    steps = np.arange(0, TOTAL + 1, 2)
    hist = _history(shift.EV_METRIC, steps, rng.normal(size=steps.size))
    got = shift.phase_ev(hist, SWITCHES, TOTAL)
    edges = [0, 20, 40, TOTAL + 1]
    want = []
    for a, b in itertools.pairwise(edges):
        e = min(a + shift.EARLY_STEPS, b)
        want += [_slow_mean(hist, shift.EV_METRIC, a, e), _slow_mean(hist, shift.EV_METRIC, e, b)]
    assert len(got) == 6
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_phase_ev_is_none_where_nothing_was_logged():
    hist = _history(shift.EV_METRIC, [0, 2], [0.5, 0.1])  # phase 0's early steps only
    got = shift.phase_ev(hist, SWITCHES, TOTAL)
    assert math.isclose(got[0], 0.3) and got[1:] == [None] * 5


def test_phase_means_and_score_match_a_loop():
    steps = np.arange(0, TOTAL + 1)
    reward = np.where(steps < 20, 0.8, np.where(steps < 40, 0.2, 0.5))
    hist = _history(shift.METRIC, steps, reward)
    np.testing.assert_allclose(shift.phase_means(hist, SWITCHES, TOTAL), [0.8, 0.2, 0.5])
    assert math.isclose(shift.recovery_score(hist, SWITCHES, TOTAL), 0.35)


def test_verdict_states_direction_interval_and_power():
    from sao_jax.compare import Difference

    # d = moving average - SAO, in reward fractions.
    opposite = shift.shift_verdict(Difference(0.060, 0.023, 5, True))
    assert opposite.startswith("**No, the opposite**")
    assert "[-10.6, -1.4] points" in opposite and "detects differences of 4.6" in opposite
    yes = shift.shift_verdict(Difference(-0.05, 0.01, 5, True))
    assert yes.startswith("**Yes**") and "5.0 ± 1.0" in yes
    assert shift.shift_verdict(Difference(0.01, 0.02, 5, True)).startswith("**Not shown**")
    assert shift.shift_verdict(Difference(0.01, math.nan, 1, True)).startswith("**Not decidable")
    assert shift.shift_verdict(None).startswith("**Not decidable")
