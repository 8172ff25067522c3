r"""Fixed band vs entropy-scaled band at a matched mask budget: DIS, ESTR and IcePop.

  python -m experiments.mask_budget --mode=quick
  python -m experiments.mask_budget --mode=full

1. Runs the `mask_pilot` sweep of configs/ablations.py (DIS at its default band, one run
   per seed of the mode, at the staleness grid's S and high lr), which dumps the action
   tokens of its first batches at full staleness (sao_jax/run/token_dump.py).
2. Calibrates each keep rule (DIS with a band symmetric in log r, ESTR's tau, IcePop's
   band scaled in log) to mask each budget's share of those pooled tokens
   (sao_jax/rl/mask_budget.py) and writes `<out_dir>/mask_budget_calibration.json`; the
   same pilot runs always give the same file, so a rerun reuses every finished point.
3. Runs the `mask_budget` sweep (each rule at each calibrated budget, same cell) and
   writes `<out_dir>/mask_budget.md` (experiments/mask_budget/report.py): achieved mask
   share, keep rate, entropy of masked and kept tokens, collapse, held-out success, each
   rule's paired difference from DIS with Holm within the table.
The pilots use the mode's seeds whatever --seeds says, so that added seeds run at the same
calibrated parameters. --dry_run prints the pilots' commands, or the budget sweep's once a
calibration file exists in --out_dir. --from_runs=<out>/mask_budget_runs.jsonl rebuilds
the report from committed runs and the calibration file beside them, training nothing.
Flags: see sao_jax/report/experiment.py.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from absl import app
from sao_jax.experiments.mask_budget import report as mask_budget

from sao_jax import sweep
from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report.experiment import experiment, flags, table_main
from sao_jax.rl import mask_budget as mb

CALIBRATION_FILE = "mask_budget_calibration.json"  # under --out_dir


def pilot_workdirs(exp, mode: str) -> list:
    spec = ablations_cfg.get_sweep(f"table=mask_pilot,mode={mode}")
    return [exp.sweep_path / p.name for p in sweep.expand(spec)]


def calibration_path(exp) -> pathlib.Path:
    """The calibration file: beside the runs file a table is regenerated from
    (--from_runs), else in --out_dir."""
    if flags().from_runs.value:
        return pathlib.Path(flags().from_runs.value).parent / CALIBRATION_FILE
    return exp.out_path / CALIBRATION_FILE


def sweep_of(mode: str) -> sweep.SweepSpec:
    """Runs (or reuses) the pilots, calibrates, returns the budget sweep (step 3); with
    --from_runs, only the budget sweep of the committed calibration (nothing runs)."""
    exp = experiment()
    path = calibration_path(exp)
    if flags().from_runs.value:
        return ablations_cfg.get_sweep(f"table=mask_budget,mode={mode},calibration={path}")
    pilot = ablations_cfg.get_sweep(f"table=mask_pilot,mode={mode}")
    if exp.dry_run:  # the pilots' commands; the budget sweep's if a calibration exists
        if path.is_file():
            return ablations_cfg.get_sweep(f"table=mask_budget,mode={mode},calibration={path}")
        logging.info("dry run: the budget sweep's commands follow from the pilots' calibration")
        return pilot
    results, _, stop = dataclasses.replace(exp, seeds=None, rows=None).run_table(pilot)
    if stop is not None:  # a signal stopped the pilots: nothing to calibrate yet
        raise stop
    bad = [r.point.name for r in results if r.status != "done"]
    if bad:
        raise RuntimeError(f"mask_budget: pilot runs did not finish: {bad}")
    mask_budget.calibrate_pilots(
        pilot_workdirs(exp, mode),
        ablations_cfg.calibration_steps(mode),
        ablations_cfg.MASK_BUDGETS[mode],
        path,
        dict(mode=mode, seeds=list(pilot.seeds)),
    )
    return ablations_cfg.get_sweep(f"table=mask_budget,mode={mode},calibration={path}")


def write(exp, spec, results, wall_s: float) -> str:
    path = calibration_path(exp)
    budgets = ablations_cfg.MASK_BUDGETS[exp.mode]
    levels = mb.read_levels(path, budgets)
    return mask_budget.report(
        exp,
        spec,
        results,
        wall_s,
        calibration=mb.read_calibration(path),
        levels=dict(zip(budgets, levels, strict=True)),
        calibration_steps=ablations_cfg.calibration_steps(exp.mode),
    )


main = table_main("mask_budget", sweep_of, write)


if __name__ == "__main__":
    app.run(main)
