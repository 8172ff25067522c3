"""The reading of experiments/gae_granularity (Table 5): the ablation table
(experiments/ablations/report.py) with the paper's Table 5 rows beside it."""

from sao_jax.experiments.ablations import report

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
