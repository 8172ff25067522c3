"""experiments/baseline_ceiling/ and experiments/staleness_lr/ end to end in smoke mode: real
training processes in one sweep dir that starts with the session's shared SFT warm start,
SAO and staleness-grid runs (tests/experiment_support.py SharedRuns), so each script trains
only its own rows. Split from tests/test_experiments_smoke.py so the two xdist workers
share the table scripts."""

import pytest

from tests.experiment_support import STALENESS_CELL, SharedRuns
from tests.experiment_support import check_report as _check_report
from tests.experiment_support import run_experiment as _experiment

pytestmark = pytest.mark.slow


def test_baseline_ceiling_and_staleness_lr_reuse_the_shared_runs(
    tmp_path, jax_cache_dir, shared_runs_dir
):
    sweep_dir, out = tmp_path / "sweep", tmp_path / "results"
    pooled = ("warm_start__ablations__smoke__seed=0", "ablations__sao__seed=0")
    pooled += tuple(f"ablations__{row}__{STALENESS_CELL}" for row in ("sao", "vanilla_vapo"))
    SharedRuns(shared_runs_dir, jax_cache_dir).copy_into(sweep_dir, *pooled)
    log = _experiment(
        "baseline_ceiling", sweep_dir, out, cache=jax_cache_dir
    )  # + the keyed moving average only
    assert "start ablations__sao__seed=0" not in log
    assert "start ablations__moving_average_per_level__seed=0" in log
    oracle = "oracle: per-level moving average, 128 per level"
    text = _check_report(out, "baseline_ceiling", ["SAO", oracle])
    assert "## How much of the oracle's gain SAO recovers" in text

    log = _experiment("staleness_lr", sweep_dir, out, cache=jax_cache_dir)
    assert "[sweep] start" not in log  # both grid cells are the pool's
    text = _check_report(out, "staleness_lr", [])
    assert "DIS: collapsed runs" in text and "no DIS: collapsed runs" in text
    assert "DIS: keep rate % (min)" in text
    assert text.count("| 1 | 0.0001 |") == 1  # one grid row: S=1, lr=1e-4
