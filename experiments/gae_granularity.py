r"""Table 5: advantage granularity (token-level obs-skipping GAE vs one value per turn),
plus GAE through observation tokens, on the embedded agentic task.

  python -m experiments.gae_granularity --mode=quick
  python -m experiments.gae_granularity --mode=full

Runs the `gae` sweep of configs/ablations.py (sao = token-level, step_mean, step_last,
cross_observation; SAO runs already made by experiments/ablations.py in the same sweep
dir are reused) and writes `<out_dir>/gae_granularity.md` and
`<out_dir>/plots/gae_granularity_*.png`. Flags: see experiments/ablations.py.
"""

from absl import app

from sao_jax.configs import ablations as ablations_cfg
from sao_jax.experiments import ablations as abl
from sao_jax.report import ablations as report

# docs/method.md section 4 (AIME2025, 400 steps); the paper has no cross-observation row.
PAPER = {"sao": (89.8,), "step_mean": (85.8,), "step_last": (87.3,)}


def table5(exp, spec, results, wall_s: float) -> str:
    return report.ablation_report(
        exp,
        "Table 5 at laptop scale: advantage granularity (SAO = token-level)",
        "gae_granularity",
        spec,
        results,
        wall_s,
        paper=PAPER,
        paper_columns=("AIME2025 @400",),
    )


main = abl.table_main(
    "gae_granularity", lambda mode: ablations_cfg.get_sweep(f"table=gae,mode={mode}"), table5
)


if __name__ == "__main__":
    app.run(main)
