r"""Online learning with a moving target: SAO vs the moving-average baseline.

  python -m experiments.online_shift --mode=quick                   # per-user offsets design
  python -m experiments.online_shift --mode=full --table=tracking   # critic-tracking sweep
  python -m experiments.online_shift --mode=quick --offsets=none    # per-user, payouts only

Runs a sweep of configs/online_shift.py and writes `<out_dir>/<table>.md` with its plots and
`<out_dir>/<table>_runs.jsonl` (every run's logged numbers the table reads:
`--from_runs=<that file>` writes the table again without training). Each user switches its
target style at its own steps (sao_jax/envs/user_style.py); tables `main`
(`online_shift_main.md`: every row, the pre-registered family, the moving average's window
against the paper's 128 rewards, recovery curves; experiments/online_shift/report.py) and
`tracking` (`online_shift_tracking.md`: the critic-tracking half fraction and its main
effects). Other flags: see sao_jax/report/experiment.py. The trainer moves the task's schedule
to the policy step after every update (sao_jax.envs.registry.env_factory), so each run is a
plain `experiments.train` run.
"""

from __future__ import annotations

from absl import app
from absl import flags as absl_flags
from sao_jax.experiments.online_shift import report as user_shift

from sao_jax.configs import online_shift as shift_cfg
from sao_jax.report.experiment import flags, table_main

flags()  # the table scripts' shared flags, before absl parses (table_main is built in main)
TABLE = absl_flags.DEFINE_enum(
    "table",
    "main",
    [t for t in shift_cfg.TABLES if t != "brace"],  # brace: experiments/critic_correction/
    "Table.",
)
OFFSETS = absl_flags.DEFINE_enum(
    "offsets",
    None,
    list(shift_cfg.OFFSET_SETS),
    f"Users' reward offsets: spread (every user its own; unset: {shift_cfg.DEFAULT_OFFSETS}) "
    "or none (payouts only: the first per-user design).",
)


def main(argv):
    name = f"online_shift_{TABLE.value}"
    report = user_shift.tracking_report if TABLE.value == "tracking" else user_shift.main_report
    arg = f"table={TABLE.value},offsets={OFFSETS.value or shift_cfg.DEFAULT_OFFSETS}"
    sweep_of = lambda mode: shift_cfg.get_sweep(f"{arg},mode={mode}")
    return table_main(name, sweep_of, report)(argv)


if __name__ == "__main__":
    app.run(main)
