r"""Table 5: advantage granularity (token-level obs-skipping GAE vs one value per turn),
plus GAE through observation tokens, on the embedded agentic task.

  python -m experiments.gae_granularity --mode=quick
  python -m experiments.gae_granularity --mode=full

Runs the `gae` sweep of configs/ablations.py (sao = token-level, step_mean, step_last,
cross_observation; SAO runs already made by experiments/ablations/ in the same sweep
dir are reused) and writes `<out_dir>/gae_granularity.md` and
`<out_dir>/plots/gae_granularity_*.png`. Flags: see sao_jax/report/experiment.py.
"""

from absl import app
from sao_jax.experiments.gae_granularity import report

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report.experiment import table_main

main = table_main(
    "gae_granularity", lambda mode: ablations_cfg.get_sweep(f"table=gae,mode={mode}"), report.table5
)


if __name__ == "__main__":
    app.run(main)
