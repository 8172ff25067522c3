"""experiments/mask_budget/ and experiments/staleness_law/ end to end in smoke mode
(tiny model, 2-3 steps, one seed), sharing one sweep dir and so one warm start; the law's
smoke cells are the staleness grid's, from the session's pool."""

import json

import numpy as np
import pytest

from sao_jax.metrics import read_jsonl
from sao_jax.rl import mask_budget as mb
from sao_jax.run import token_dump
from tests.experiment_support import STALENESS_CELL, SharedRuns
from tests.experiment_support import check_report as _check_report
from tests.experiment_support import run_experiment as _experiment

pytestmark = pytest.mark.slow


def test_mask_budget_and_staleness_law_in_smoke_mode(tmp_path, jax_cache_dir, shared_runs_dir):
    sweep_dir, out = tmp_path / "sweep", tmp_path / "results"
    cells = [f"ablations__{row}__{STALENESS_CELL}" for row in ("sao", "vanilla_vapo")]
    SharedRuns(shared_runs_dir, jax_cache_dir).copy_into(
        sweep_dir, "warm_start__ablations__smoke__seed=0", *cells
    )
    _experiment("mask_budget", sweep_dir, out, cache=jax_cache_dir)
    text = _check_report(out, "mask_budget", [])
    # smoke trains DIS at its calibrated band only; the calibration table lists every rule
    assert "| 5% | DIS, fixed band symmetric in log r | 1/1 |" in text
    assert "| 5% | ESTR, entropy-scaled band |" in text and "## Calibration" in text

    # the calibration masks 5% of the pilot's dumped tokens with every rule
    cal = json.loads((out / "mask_budget_calibration.json").read_text())
    pilot = sweep_dir / (
        "ablations__sao__max_staleness=1__queue_size=16__lr=0.001__token_dump_steps=1-2__seed=0"
    )
    tok = token_dump.read([pilot], [2])
    assert cal["tokens"] == tok.size > 20
    for rule, c in cal["budgets"]["0.05"].items():
        assert c["achieved"] == pytest.approx(round(0.05 * tok.size) / tok.size), rule
        got = mb.masked_fraction(rule, c["params"], tok.log_ratio, tok.entropy)
        assert got == c["achieved"]

    # the dump is what the loss saw at that step: the logged token means agree
    record = next(r for r in read_jsonl(pilot / "metrics.jsonl") if r["step"] == 2)
    assert record["policy/entropy"] == pytest.approx(float(np.mean(tok.entropy)), abs=1e-4)
    assert record["policy/logp_gap"] == pytest.approx(float(np.mean(tok.log_ratio)), abs=1e-5)
    assert 1.0 - record["policy/keep_rate"] == pytest.approx(
        mb.masked_fraction("dis", {"eps_l": 0.3, "eps_h": 5.0}, tok.log_ratio, tok.entropy)
    )

    log = _experiment("staleness_law", sweep_dir, out, cache=jax_cache_dir)
    assert "[sweep] start" not in log  # the staleness grid's cells: its points are pooled
    text = _check_report(out, "staleness_law", [])
    assert "| DIS | 1 | 0.0001 |" in text and "| no DIS | 1 | 0.0001 |" in text
    assert "## Is t_collapse x lr constant?" in text
    assert "not estimable" in text  # one lr, one S and a 3-step budget: nothing to fit

    # both tables regenerate from their committed runs files, nothing trained (the mask
    # budget's calibration is read beside its runs file)
    regen = tmp_path / "regen"
    for name in ("mask_budget", "staleness_law"):
        _experiment(
            name,
            tmp_path / "no_sweep",
            regen,
            f"--from_runs={out / name}_runs.jsonl",
            cache=jax_cache_dir,
        )
        strip = lambda t: [x for x in t.splitlines() if "wall time" not in x and "command" not in x]
        assert strip((regen / f"{name}.md").read_text()) == strip((out / f"{name}.md").read_text())
    assert not (tmp_path / "no_sweep").exists()


def test_full_mode_dry_runs_list_the_pilots_then_the_grid(tmp_path):
    """Full mode, nothing run: the mask budget's pilots (the budget sweep's commands need
    their calibration), and the law's 80 runs; 5 shared warm starts each."""

    def dry(module):
        out = _experiment(module, tmp_path, tmp_path / "out", "--dry_run", mode="full")
        return [x for x in out.splitlines() if "experiments.train" in x]

    pilots = dry("mask_budget")
    assert (
        len(pilots) == 10 and sum("token_dump_steps=(1, 9, 10, 11, 12)" in x for x in pilots) == 5
    )
    law = dry("staleness_law")
    assert len(law) == 85 and sum("--config.train.log_every=1" in x for x in law) == 80
