r"""A stale-critic correction: BRACE-style critic targets against lambda = 1 targets.

  python -m experiments.critic_correction --mode=quick   # the graded task's S = 8 cells only
  python -m experiments.critic_correction --mode=full --parallel=2

Runs two sweeps into one sweep dir: configs/ablations.py's `brace_staleness` (rows `sao`
and `sao_brace` on the staleness grid: max staleness S = 0 (synchronous, the control) and
8 x policy lr 1e-4 and 1e-3 on the graded task; its `sao` points are the staleness grid's,
so a sweep dir shared with experiments/staleness_lr/ reuses them and their warm starts)
and configs/online_shift.py's `brace` table (the same rows on the per-user online task;
its `sao` points are the main table's). `sao_brace` is `sao` with rl.critic_target =
'brace' (docs/method.md section 8). Writes `<out_dir>/critic_correction.md`: per cell,
paired by seed, BRACE minus lambda in the critic's EV before its update (over the run
and over its stale records), success (held-out on the graded task, recovering on the
online task), DIS keep rate, staleness trained on and the step-time ratio, Holm within
the EV family and within the success family (experiments/critic_correction/report.py).
Flags: see sao_jax/report/experiment.py; results/critic_correction/PREREGISTRATION.md says
what is tested.
"""

from __future__ import annotations

from absl import app
from sao_jax.experiments.critic_correction import report

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.configs import online_shift as shift_cfg
from sao_jax.report.experiment import table_main


def sweeps(mode: str):
    """The graded task's staleness-grid sweep, then the online task's; quick mode, a
    15-minute check that the grid runs, leaves the online task out (its warm start alone
    takes ~12 minutes here; smoke mode runs it end to end, full mode in full)."""
    graded = ablations_cfg.get_sweep(f"table=brace_staleness,mode={mode}")
    if mode == "quick":
        return (graded,)
    # the per-user design it was pre-registered on: payouts only, no offsets
    return (graded, shift_cfg.get_sweep(f"table=brace,mode={mode},offsets=none"))


main = table_main("critic_correction", sweeps, report.report)


if __name__ == "__main__":
    app.run(main)
