"""A pytest plugin that records how much of its tolerance each comparison used.

Loaded only by experiments/bench/tolerance_margins.py (`-p tests.margins_plugin`), never by
the suite: it wraps `np.testing.assert_allclose` to measure max |a - b| / (atol + rtol |b|)
before the real check runs, collects tests/closeness.py's own (error / bound) figures, and
appends one JSON line per test to $SAO_TEST_MARGINS: {"test", "allclose", "pass", "steps"},
each the largest fraction of its bound that test used (null when it made no such
comparison).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests import closeness

_real_allclose = np.testing.assert_allclose
_used: list[float] = []


def _recording_allclose(actual, desired, rtol=1e-7, atol=0, *args, **kwargs):
    try:
        a = np.asarray(actual, np.float64)
        d = np.asarray(desired, np.float64)
        bound = atol + rtol * np.abs(d)
        diff = np.abs(a - d)
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(bound > 0, diff / bound, np.where(diff > 0, np.inf, 0.0))
        finite = np.isfinite(a) & np.isfinite(d)
        if finite.any():
            _used.append(float(np.max(frac[finite])))
    except (TypeError, ValueError):  # shapes that broadcast oddly: the real check reports
        pass
    return _real_allclose(actual, desired, rtol, atol, *args, **kwargs)


def pytest_configure(config):
    np.testing.assert_allclose = _recording_allclose


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _used.clear()
    closeness.take_margins()
    yield
    kinds = {"allclose": _used[:], "pass": [], "steps": []}
    for kind, frac in closeness.take_margins():
        kinds[kind].append(frac)
    row = {"test": item.nodeid, **{k: (max(v) if v else None) for k, v in kinds.items()}}
    path = os.environ.get("SAO_TEST_MARGINS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
