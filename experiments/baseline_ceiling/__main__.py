r"""SAO's critic against its ceiling on the graded task: the oracle per-level baseline.

  python -m experiments.baseline_ceiling --mode=quick   # one seed, 40 steps
  python -m experiments.baseline_ceiling --mode=full    # 10 seeds, 60 steps
  python -m experiments.baseline_ceiling --mode=smoke --sweep_dir=/tmp/s --out_dir=/tmp/r

Runs the `baseline_ceiling` sweep of configs/ablations.py (SAO, the global moving average
over 128 and 160 outcomes, the oracle per-level moving average; one shared SFT warm start
per seed, finished runs reused: the SAO and moving-average runs of Table 4's sweep dir
are the same points) and writes `<out_dir>/baseline_ceiling.md`
(experiments/baseline_ceiling/report.py: the training-mix score first, the raw held-out mix
beside it, Holm within each, and the share of the oracle's gain over the moving average
that SAO recovers, with Fieller's interval). Flags: see sao_jax/report/experiment.py.
"""

from __future__ import annotations

from absl import app
from sao_jax.experiments.baseline_ceiling.report import ceiling_report

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report.experiment import table_main

main = table_main(
    "baseline_ceiling",
    lambda mode: ablations_cfg.get_sweep(f"table=baseline_ceiling,mode={mode}"),
    ceiling_report,
)


if __name__ == "__main__":
    app.run(main)
