r"""The staleness-learning-rate law: is t_collapse x lr constant, and how far does DIS move it?

  python -m experiments.staleness_law --mode=quick
  python -m experiments.staleness_law --mode=full

Runs the `staleness_law` sweep of configs/ablations.py: max staleness S x policy learning
rate (several, up to where runs collapse within the budget) for sao (DIS) and
vanilla_vapo (PPO clip vs pi_old, no DIS), every step logged, and writes
`<out_dir>/staleness_law.md`: the collapse time of every run in policy versions (censored
where it did not collapse), Kaplan-Meier medians and median x lr per cell, and a censored
log-normal regression of log t_collapse on log lr and log S whose slope on log lr is -1
when the product is constant (experiments/staleness_law/report.py). Flags: see
experiments/ablations/.
"""

from __future__ import annotations

from absl import app
from sao_jax.experiments.staleness_law import report as staleness_law

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report.experiment import table_main

main = table_main(
    "staleness_law",
    lambda mode: ablations_cfg.get_sweep(f"table=staleness_law,mode={mode}"),
    staleness_law.report,
)


if __name__ == "__main__":
    app.run(main)
