"""Every experiment script end to end in smoke mode: real training processes (tiny model,
2-4 steps, one seed), one shared sweep dir so runs are reused across scripts, and the
session's compilation cache (tests/conftest.py) so programs are compiled once across
sweeps."""

import json

import pytest

from tests.experiment_support import SharedRuns, run_script
from tests.experiment_support import check_report as _check_report
from tests.experiment_support import env as _env
from tests.experiment_support import run_experiment as _experiment

pytestmark = pytest.mark.slow


def test_ablations_gae_and_rescore_share_one_sweep(tmp_path, jax_cache_dir, shared_runs_dir):
    """Table 4, the GAE granularity row and the rescoring of Table 4's runs in one sweep dir
    (the baseline ceiling and the staleness grid: tests/test_smoke_ceiling_staleness.py,
    so the two xdist workers share the scripts)."""
    sweep_dir, out = tmp_path / "sweep", tmp_path / "results"
    # the warm start, SAO and cross-observation runs (all of GAE's smoke rows)
    pooled = ("warm_start__ablations__smoke__seed=0", "ablations__sao__seed=0")
    pooled += ("ablations__cross_observation__seed=0",)
    SharedRuns(shared_runs_dir, jax_cache_dir).copy_into(sweep_dir, *pooled)
    _experiment("ablations", sweep_dir, out, cache=jax_cache_dir)
    text = _check_report(out, "ablations", ["SAO", "GRPO", "SFT warm start (step 0)"])
    assert "Does laptop scale reproduce the paper's ordering?" in text
    assert "| 97.3 | 74.8 |" in text  # the paper's SAO row beside ours

    # the SAO run of the ablations and the cross_observation row (observation_signal's
    # too) are the pool's
    log = _experiment("gae_granularity", sweep_dir, out, cache=jax_cache_dir)
    assert "[sweep] start" not in log
    _check_report(out, "gae_granularity", ["SAO", "cross-observation GAE"])

    # Rescoring on as many prompts as the runs' own evaluation reproduces it exactly (the
    # same prompts and sampling keys); the scores are cached beside each run.
    _experiment(
        "rescore", sweep_dir, out, "--table=table4", "--heldout=8", cache=jax_cache_dir,
        in_process=False,
    )  # fmt: skip
    text = _check_report(out, "ablations_rescored", ["SAO", "GRPO", "SFT warm start (step 0)"])
    for row in ("sao", "grpo"):
        run = sweep_dir / f"ablations__{row}__seed=0"
        own = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        own = [r["eval/sampled_success"] for r in own if "eval/sampled_success" in r]
        cached = json.loads((run / "rescore" / "heldout=8,step=2.json").read_text())
        assert cached["eval/sampled_success"] == own[-1], row
    sft = json.loads(
        (sweep_dir / "ablations__sao__seed=0/rescore/heldout=8,step=0.json").read_text()
    )
    before = json.loads((sweep_dir / "ablations__sao__seed=0/summary.json").read_text())["before"]
    assert sft["eval/greedy_success"] == before["eval/greedy_success"]
    assert "Δ vs SAO" in text and "## By difficulty level" in text


def test_online_shift_tables_and_their_runs_files(tmp_path, jax_cache_dir, shared_runs_dir):
    """The per-user task's main table (payouts only, `--offsets=none`: its warm start and SAO
    run are critic_correction's, from the session's pool, so the first invocation trains
    nothing), a later invocation adding a row (the ceiling: the privileged critic's only
    training run), the table again from its runs file, and the tracking table. The moving
    average rows: the baseline ceiling's smoke trains the moving-average advantage
    (tests/test_smoke_ceiling_staleness.py), tests/test_user_shift_report.py renders the
    window section."""
    sweep_dir, out = tmp_path / "sweep", tmp_path / "results"
    pooled = ("warm_start__online_shift__smoke__seed=0", "online_shift__sao__seed=0")
    SharedRuns(shared_runs_dir, jax_cache_dir).copy_into(sweep_dir, *pooled)
    none = "--offsets=none"
    log = _experiment("online_shift", sweep_dir, out, "--rows=sao", none, cache=jax_cache_dir)
    assert "[sweep] start" not in log  # the warm start and SAO run are the pool's
    runs = out / "online_shift_main_runs.jsonl"
    # A later invocation (a later session) adds the ceiling row to the recorded runs.
    log = _experiment(
        "online_shift", sweep_dir, out, "--rows=ceiling", none, f"--add_to={runs}",
        cache=jax_cache_dir,
    )  # fmt: skip
    assert "start online_shift__ceiling__seed=0" in log and "start online_shift__sao" not in log
    text = _check_report(
        out, "online_shift_main", ["SAO", "ceiling: critic sees the current target"]
    )
    # no preregistration.json in `out`: a pilot, whose family is not tested
    assert "## The main table's family (pilot: not a test)" in text
    assert "## Recovery curves" in text and "## Do the mechanisms fire?" in text
    assert "- adds to the runs of `python -m experiments.online_shift --mode=smoke" in text
    assert "every seed's runs, of every invocation, start from the same tensors" in text
    # The runs file holds what the table reads: the table comes back without training.
    regen = tmp_path / "regen"
    _experiment(
        "online_shift", tmp_path / "no_sweep", regen, f"--from_runs={runs}", none,
        cache=jax_cache_dir,
    )  # fmt: skip
    assert (regen / "online_shift_main.md").read_text() == text
    assert not (tmp_path / "no_sweep").exists()  # nothing ran
    with pytest.raises(AssertionError, match="already in"):  # never a run twice
        _experiment("online_shift", sweep_dir, out, "--rows=sao", none, f"--add_to={runs}")

    log = _experiment("online_shift", sweep_dir, out, "--table=tracking", none, cache=jax_cache_dir)
    assert "start online_shift__sao__seed=0" not in log  # the main table's SAO run is reused
    text = _check_report(out, "online_shift_tracking", ["SAO", "tracking: lr + k"])
    assert "## Main effects on recovering success" in text


def _dry_run(*extra: str) -> tuple[int, str, str]:
    return run_script("ablations", ["--mode=smoke", "--dry_run", *extra], _env())


def test_rows_runs_only_the_chosen_rows(tmp_path):
    # smoke's Table 4 has the rows sao and grpo; --rows keeps one
    code, out, err = _dry_run("--rows=grpo", "--seeds=3,7", f"--sweep_dir={tmp_path}")
    assert code == 0, err[-3000:]
    assert "ablations__grpo__seed=3" in out, out
    assert "ablations__grpo__seed=7" in out and "ablations__sao__" not in out
    assert "seed=0" not in out

    code, _, err = _dry_run("--rows=sao,nope", f"--sweep_dir={tmp_path}")
    assert code != 0
    assert "--rows: nope" in err and "rows sao, grpo" in err  # names the rows
