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

# docs/method.md section 4 (AIME2025, 400 steps); the paper has no cross-observation row.
PAPER = {"sao": (89.8,), "step_mean": (85.8,), "step_last": (87.3,)}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    spec = abl.chosen(ablations_cfg.get_sweep(f"table=gae,mode={abl.MODE.value}"))
    results, wall_s = abl.run(spec)
    if abl.DRY_RUN.value:
        return
    abl.write(
        "gae_granularity",
        abl.ablation_report(
            "Table 5 at laptop scale: advantage granularity (SAO = token-level)",
            "gae_granularity",
            spec,
            results,
            wall_s,
            paper=PAPER,
            paper_columns=("AIME2025 @400",),
        ),
    )


if __name__ == "__main__":
    app.run(main)
