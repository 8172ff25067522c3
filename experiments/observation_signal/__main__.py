r"""Does skipping observations lose signal when the observation is the signal?

  python -m experiments.observation_signal --mode=quick
  python -m experiments.observation_signal --mode=full

Runs configs/observation_signal.py's two sweeps, one per task, into one sweep dir:
observation-skipping GAE (SAO, `sao`) against GAE through observation tokens with the
same critic (`cross_observation`) on the code-with-hidden-tests task, where the tests'
output decides what to write next, and on the graded calculator task, where results
follow from the call (its points are configs/ablations.py's, shared with Table 5 when the
budgets match). Writes `<out_dir>/observation_signal.md` (held-out success per task, the
paired difference per task with its t interval and Holm over the tasks, the critic's
value change across observations and the share of the return's variance it explains)
and `<out_dir>/plots/observation_signal_*.png`. Flags: see sao_jax/report/experiment.py;
results/observation_signal/PREREGISTRATION.md says what is tested.
"""

from absl import app
from sao_jax.experiments.observation_signal import report

from sao_jax.configs import observation_signal as cfg
from sao_jax.report.experiment import table_main

main = table_main("observation_signal", cfg.sweeps, report.report)


if __name__ == "__main__":
    app.run(main)
