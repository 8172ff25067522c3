r"""Table 4: SAO against its ablations and baselines on the embedded agentic task.

  python -m experiments.ablations --mode=quick     # one seed, 40 steps
  python -m experiments.ablations --mode=full      # 5 seeds, 60 steps
  python -m experiments.ablations --mode=smoke --sweep_dir=/tmp/s --out_dir=/tmp/r

Runs the `table4` sweep of configs/ablations.py (every row x seed its own process, one
shared SFT warm start per seed, finished runs reused) and writes
`<out_dir>/ablations.md` (held-out sampled success, mean +/- std over seeds, at each
eval step; collapses; the paper's numbers beside) and `<out_dir>/plots/ablations_*.png`.
The flags and main are every table script's (sao_jax/report/experiment.py); the reading is
experiments/ablations/report.py.
"""

from __future__ import annotations

from absl import app
from sao_jax.experiments.ablations import report

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report.experiment import table_main


def table4(exp, spec, results, wall_s: float) -> str:
    return report.ablation_report(
        exp,
        "Table 4 at laptop scale: SAO, its ablations and baselines",
        "ablations",
        spec,
        results,
        wall_s,
        paper=report.PAPER,
        paper_columns=("AIME2025", "BeyondAIME"),
        paper_collapse=report.PAPER_COLLAPSE,
    )


main = table_main(
    "ablations", lambda mode: ablations_cfg.get_sweep(f"table=table4,mode={mode}"), table4
)


if __name__ == "__main__":
    app.run(main)
