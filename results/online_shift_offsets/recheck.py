"""The figures results/online_shift_offsets/README.md quotes that its generated tables do not
print (every MDD is a cell of a table's MDD column), recomputed from the committed runs
files alone (nothing trained):

    PYTHONPATH=. python results/online_shift_offsets/recheck.py   # from the repository root

Definitions (docs/results.md, "How to read these tables"): power of a paired difference
over n seeds at an effect delta, two-sided alpha (0.05, or alpha / m at Holm's first step
over a family of m tests), is the noncentral t's (scipy, installed with jax); a share of
two paired means gets Fieller's interval (experiments/baseline_ceiling/share.py
paired_ratio).
"""

import pathlib

from sao_jax.experiments.baseline_ceiling.share import paired_ratio
from scipy import stats as scipy_stats

from sao_jax.report import audit, compare
from sao_jax.run.accounting import ENV_PREFIX

HERE = pathlib.Path(__file__).resolve().parent
PRIMARY = "success_recovering"  # the online shift's primary metric (its report's PRIMARY)


def pooled(history: list[dict], name: str) -> float | None:
    """sum / count of `env/<name>` over the run's logged steps, as the online shift's
    report pools it: each step's mean times its `env/<name>/count`."""
    key, count = ENV_PREFIX + name, f"{ENV_PREFIX}{name}/count"
    rows = [(r[key], r[count]) for r in history if r.get(key) is not None and r.get(count)]
    total = sum(n for _, n in rows)
    return sum(v * n for v, n in rows) / total if total else None


MAIN = HERE / "online_shift_main_runs.jsonl"
SECONDARY = HERE / "secondary" / "online_shift_main_runs.jsonl"


def by_row(path: pathlib.Path, metric: str = PRIMARY) -> tuple[dict, dict]:
    """{variant: {seed: pooled metric}} of the finished runs, and {seed: warm start}."""
    results, _ = audit.read_runs(path)
    out, warm = {}, {}
    for r in results:
        if r.status == "done":
            out.setdefault(r.point.variant, {})[r.point.seed] = pooled(r.history, metric)
            warm[r.point.seed] = (r.warm_start or {}).get("policy")
    return out, warm


def power(d: compare.Difference, effect: float, alpha: float) -> float:
    crit, nc = scipy_stats.t.ppf(1 - alpha / 2, d.dof), effect / d.se
    return float(scipy_stats.nct.sf(crit, d.dof, nc) + scipy_stats.nct.cdf(-crit, d.dof, nc))


def line(name: str, d: compare.Difference, m: int) -> str:
    lo, hi = d.interval()
    return (
        f"{name}: {100 * d.diff:+.2f} ± {100 * d.se:.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}], "
        f"p {d.p:.3f} (a family of {m})"
    )


def gain(by: dict, row: str, ref: str) -> dict:
    return {s: by[row][s] - by[ref][s] for s in by[ref]}


def main() -> None:
    by, warm_main = by_row(MAIN)
    pd = compare.paired_difference
    sao_ma, ceil_ma = pd(by["sao"], by["moving_average"]), pd(by["ceiling"], by["moving_average"])
    print("== main table (Holm over 3)")
    print(line("SAO - moving average", sao_ma, 3))
    print(line("ceiling - moving average", ceil_ma, 3))
    print(line("per-user oracle - SAO", pd(by["moving_average_per_user"], by["sao"]), 1))
    for alpha, what in ((0.05, "alpha 0.05"), (0.025, "alpha 0.05/2"), (0.05 / 3, "alpha 0.05/3")):
        print(f"power of SAO - MA at the ceiling's +{100 * ceil_ma.diff:.2f}, {what}: "
              f"{power(sao_ma, ceil_ma.diff, alpha):.2f}")  # fmt: skip
    share = paired_ratio(gain(by, "sao", "moving_average"), gain(by, "ceiling", "moving_average"))
    print(f"SAO's share of the ceiling's gain: {share.ratio:.2f} [{share.lo:.2f}, {share.hi:.2f}]")
    for metric in ("success_initial", PRIMARY, "success_settled"):
        phase, _ = by_row(MAIN, metric)
        for row in ("sao", "ceiling", "moving_average_per_user"):
            print(
                line(
                    f"{metric}: {row} - moving average", pd(phase[row], phase["moving_average"]), 1
                )
            )

    sec, warm_sec = by_row(SECONDARY)
    print("== secondary table (Holm over 6)")
    for row in ("moving_average_w1", "moving_average_w8", "moving_average_w32"):
        print(line(f"{row} - SAO", pd(sec[row], sec["sao"]), 6))
    print(line("per-user oracle - SAO", pd(sec["moving_average_per_user"], sec["sao"]), 6))
    share = paired_ratio(
        gain(sec, "moving_average_per_user", "moving_average"), gain(sec, "sao", "moving_average")
    )
    print(
        f"per-user oracle's share of SAO's edge: {share.ratio:.2f} [{share.lo:.2f}, {share.hi:.2f}]"
    )
    print(line("SAO - moving average (rerun)", pd(sec["sao"], sec["moving_average"]), 1))
    same = [s for s in warm_main if warm_main[s] == warm_sec.get(s)]
    print(f"seeds whose SFT policy digest is the main table's: {same}")
    a = [by["sao"][s] - by["moving_average"][s] for s in sorted(by["sao"])]
    b = [sec["sao"][s] - sec["moving_average"][s] for s in sorted(by["sao"])]
    print(
        f"per-seed correlation of SAO - MA, main vs secondary: {scipy_stats.pearsonr(a, b)[0]:.2f}"
    )


if __name__ == "__main__":
    main()
