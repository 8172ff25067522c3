"""How closely two computations of the same thing must agree: tolerances that follow from
what a test compares, not from one CPU's rounding (docs/testing.md, "Tolerances").

Two float programs that compute the same math with their sums split differently (over
shards, microbatches, packed rows, stacked layers, blocks) round differently, and so do
two CPUs running the same program: XLA picks vector widths and reduction trees per ISA
and per thread count, so an AMD and an Intel box sum in different orders. Three kinds of
comparison, each with its own bound:

- **exact** (`np.testing.assert_array_equal`): the same ops on the same inputs (a copy, a
  replay, a frozen leaf, an integer counter, a sampled token from identical logits).
- **one pass** (`assert_pass_close`): one forward and/or backward pass computed two ways.
  Each output carries fp32 rounding of order eps * sqrt(terms) relative to the size of
  the values it sums, so the bound is relative to the array's scale (its largest
  magnitude), `PASS_RTOL` = 1e-5: about 80 ulps of the largest value, an order of
  magnitude above the ~1e-6 the rounding of these tiny models' sums reaches.
- **k optimizer steps** (`assert_steps_close`): two runs of k updates from the same start.
  Adam divides by the root of the second moment, so a coordinate whose gradient is near
  zero turns rounding noise into an update of order the learning rate: one coordinate in a
  thousand can move by ~1% of a step on another CPU (issue 41: 2.8e-5 after three steps of
  lr 1e-3). A per-coordinate absolute bound is then either loose enough to miss a dropped
  microbatch or tight enough to fail on another CPU. The bound is on each leaf's
  displacement instead: ||got - want|| <= `STEPS_RTOL` * ||want - start|| (1e-2), with a
  leaf that did not move in the reference required to stay exactly where it started. A
  dropped microbatch, an off-by-one pad or a wrong shard order changes most coordinates'
  updates and moves that ratio to order 1 (tests/test_update.py
  `test_step_tolerance_sees_planted_mistakes`).
"""

from __future__ import annotations

import jax
import numpy as np

PASS_RTOL = 1e-5
STEPS_RTOL = 1e-2


def _pairs(got, want):
    gl, gdef = jax.tree.flatten_with_path(got)
    wl, wdef = jax.tree.flatten_with_path(want)
    assert [p for p, _ in gl] == [p for p, _ in wl], f"tree structures differ: {gdef} vs {wdef}"
    for (path, g), (_, w) in zip(gl, wl, strict=True):
        yield jax.tree_util.keystr(path), np.asarray(g), np.asarray(w)


def pass_error(got, want) -> float:
    """max |got - want| / max |want| over one array (0 when both are 0)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want), initial=0.0))
    err = float(np.max(np.abs(got - want), initial=0.0))
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def assert_pass_close(got, want, rtol: float = PASS_RTOL, err_msg: str = ""):
    """One pass computed two ways: every leaf within `rtol` of its own largest magnitude;
    integer and boolean leaves exactly equal."""
    for path, g, w in _pairs(got, want):
        assert g.shape == w.shape, f"{err_msg}{path}: shape {g.shape} != {w.shape}"
        if not np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_array_equal(g, w, err_msg=f"{err_msg}{path}")
            continue
        e = pass_error(g, w)
        _record("pass", e / rtol)
        assert e <= rtol, (
            f"{err_msg}{path}: max |got - want| = {e:.3g} x max |want|, over the one-pass "
            f"bound {rtol:g} (tests/closeness.py)"
        )


def steps_error(got, want, start) -> float:
    """||got - want|| / ||want - start|| over one array; 0 when the leaf did not move in
    either run, inf when it moved in `got` only."""
    got, want, start = (np.asarray(x, np.float64) for x in (got, want, start))
    moved = float(np.linalg.norm((want - start).ravel()))
    err = float(np.linalg.norm((got - want).ravel()))
    return err / moved if moved > 0 else (0.0 if err == 0 else float("inf"))


def assert_steps_close(got, want, start, rtol: float = STEPS_RTOL, err_msg: str = ""):
    """Two runs of k optimizer steps from `start` (a tree of the same structure, e.g. the
    initial TrainState): each float leaf's difference within `rtol` of its displacement in
    the reference run, a leaf the reference left unmoved exactly unmoved, integer leaves
    (step counters, baseline counts) exactly equal."""
    for (path, g, w), (_, s, _) in zip(_pairs(got, want), _pairs(start, want), strict=True):
        assert g.shape == w.shape == s.shape, f"{err_msg}{path}: shapes differ"
        if not np.issubdtype(w.dtype, np.inexact):
            np.testing.assert_array_equal(g, w, err_msg=f"{err_msg}{path}")
            continue
        e = steps_error(g, w, s)
        _record("steps", e / rtol)
        assert e <= rtol, (
            f"{err_msg}{path}: ||got - want|| = {e:.3g} x ||want - start||, over the "
            f"k-step bound {rtol:g} (tests/closeness.py)"
        )


# The margins this session's comparisons used (observed error / bound), for
# experiments/bench/tolerance_margins.py; a no-op unless $SAO_TEST_MARGINS names a file.
_MARGINS: list[tuple[str, float]] = []


def _record(kind: str, fraction: float) -> None:
    _MARGINS.append((kind, fraction))


def take_margins() -> list[tuple[str, float]]:
    """The (kind, error / bound) pairs recorded since the last call, then forgotten."""
    out = list(_MARGINS)
    _MARGINS.clear()
    return out
