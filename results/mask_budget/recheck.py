"""The minimum detectable differences of mask_budget.md's held-out success column, which
the table does not print, recomputed from the committed runs file alone (nothing trained):

    PYTHONPATH=. python results/mask_budget/recheck.py   # from the repository root

MDD (80% power, two-sided alpha 0.05, unadjusted; docs/results.md, "How to read these
tables") = (t_{0.975, n-1} + t_{0.8, n-1}) * SE of the paired difference over the n seeds,
the rows grouped by budget as the report groups them (a run belongs to the budget whose
calibrated parameters its overrides hold).
"""

import collections
import pathlib

from sao_jax.report import audit, compare
from sao_jax.rl import mask_budget as mb

HERE = pathlib.Path(__file__).resolve().parent
BUDGETS = (0.01, 0.05)
METRIC = "eval/sampled_success"  # held-out sampled success after the last step


def budget_of(overrides: dict, levels: dict) -> float | None:
    """The budget whose calibrated parameters the run's overrides hold (None: none)."""
    for budget, level in levels.items():
        if all(overrides.get(k) == v for k, v in level.items()):
            return budget
    return None


def main() -> None:
    results, _ = audit.read_runs(HERE / "mask_budget_runs.jsonl")
    levels = dict(
        zip(BUDGETS, mb.read_levels(HERE / "mask_budget_calibration.json", BUDGETS), strict=True)
    )
    finals = collections.defaultdict(dict)
    for r in results:
        value = ((r.summary or {}).get("after") or {}).get(METRIC)
        if r.status == "done" and value is not None:
            budget = budget_of(dict(r.point.overrides), levels)
            finals[(budget, r.point.variant)][r.point.seed] = value
    for budget in BUDGETS:
        for row in ("estr", "icepop"):
            d = compare.paired_difference(finals[(budget, row)], finals[(budget, "sao")])
            print(
                f"{budget:.0%} {row} - DIS: {100 * d.diff:+.2f} ± {100 * d.se:.2f} points "
                f"(n {d.n}), MDD {100 * d.mdd:.2f}"
            )


if __name__ == "__main__":
    main()
