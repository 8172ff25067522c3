r"""Staleness x learning rate: when does training collapse, with and without DIS?

  python -m experiments.staleness_lr --mode=quick
  python -m experiments.staleness_lr --mode=full

Runs the `staleness_lr` sweep of configs/ablations.py: max staleness S (0 = synchronous
rollouts; S > 0 = async sampler up to S versions ahead, older trajectories dropped) x
policy learning rate, for sao (DIS) and vanilla_vapo (PPO clip vs pi_old, no DIS), and
writes `<out_dir>/staleness_lr.md` (collapse step or 'none' within the budget, final
training and held-out success, measured staleness) and `<out_dir>/plots/staleness_lr_*`.
docs/method.md section 7: stale rollouts bias each step by O(S * lr), so collapse should come
earlier with larger S and lr (collapse time ~ 1/lr), and later with DIS.
Flags: see sao_jax/report/experiment.py.
"""

from absl import app
from sao_jax.experiments.staleness_lr import report

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report.experiment import table_main

main = table_main(
    "staleness_lr",
    lambda mode: ablations_cfg.get_sweep(f"table=staleness_lr,mode={mode}"),
    report.report,
)


if __name__ == "__main__":
    app.run(main)
