r"""Score a table's finished runs again on more held-out prompts (evaluation only).

  python -m experiments.rescore --table=table4 --mode=full --heldout=2048
  python -m experiments.rescore --table=table4 --mode=full --rows=sao,moving_average \
      --seeds=0,1,2,3,4,5,6,7,8,9 --heldout=2048

Trains nothing: every point of the table's sweep (its rows x seeds, or those of --rows /
--seeds) must be a finished run in --sweep_dir (run experiments.ablations or
experiments.gae_granularity first). Each run's checkpoint at the table's last budget is
scored by sao_jax/run/rescore.py on --heldout prompts of its held-out split, with the
sampling key its own evaluation used, so the rows of a seed stay paired; the SAO row's
step-0 checkpoint (the shared warm start) gives the starting point. A run's own
evaluation (`env.eval_size` prompts, 512 in full mode) has a binomial SE of ~2 points per
score; on 2048 prompts it is ~1. Writes `<out_dir>/<table report>_rescored.md`: per row
held-out success on the rescored set (primary: the levels weighted alike, as the training
stream draws them, where the task has levels; the raw held-out mix and greedy beside it),
its paired difference from SAO with SE, 95% t interval, Holm-adjusted test over the
table's rows, verdict and detectable difference, beside the same seeds' difference on the
runs' own evaluation (docs/experiments.md, "Statistics"). Scores are kept beside each
run (`<run>/rescore/heldout=<n>,step=<s>.json`) and reused, so adding seeds scores only
the new runs. Flags: see sao_jax/report/experiment.py.
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app, flags
from absl import logging as absl_logging
from sao_jax.experiments.ablations import report as table
from sao_jax.experiments.baseline_ceiling.levels import with_uniform
from sao_jax.experiments.rescore import report

from sao_jax import cli, sweep
from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report import experiment as shared
from sao_jax.run import rescore

shared.flags()  # --mode, --sweep_dir, --out_dir, --seeds, --rows (the table scripts')
TABLE = flags.DEFINE_enum("table", "table4", ["table4", "gae"], "Which table's runs.")
HELDOUT = flags.DEFINE_integer("heldout", 2048, "Held-out prompts per run (one rollout each).")
GREEDY = flags.DEFINE_bool("greedy", True, "Also decode greedily (--nogreedy: half the time).")


def cache_path(workdir: pathlib.Path, heldout: int, step: int) -> pathlib.Path:
    return workdir / "rescore" / f"heldout={heldout},step={step}.json"


def scores(
    rescorer: rescore.Rescorer, workdir: pathlib.Path, heldout: int, step: int
) -> dict[str, float]:
    """The run's checkpoint `step` on `heldout` prompts, from its cache file when it has
    what is asked (a greedy score only when the rescorer decodes greedily)."""
    path = cache_path(workdir, heldout, step)
    if path.is_file():
        cached = json.loads(path.read_text())
        if table.GREEDY in cached or not rescorer.greedy:
            return cached
    out = rescorer(workdir, step)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1, sort_keys=True))
    return out


@cli.guard
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if HELDOUT.value < 1:
        raise app.UsageError(f"--heldout: at least one prompt, got {HELDOUT.value}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax's info logs
    t0 = time.time()
    exp = shared.experiment()
    name = report.TABLES[TABLE.value][0]
    spec = exp.chosen(ablations_cfg.get_sweep(f"table={TABLE.value},mode={exp.mode}"))
    if "sao" not in spec.variants:
        raise app.UsageError("--rows: the differences are taken against 'sao'; include it")
    results = sweep.collect(spec, exp.sweep_path)
    missing = [r for r in results if r.status != "done"]
    if missing:
        raise app.UsageError(
            f"--sweep_dir={exp.sweep_path}: {len(missing)} of {len(results)} runs not "
            f"finished, e.g. {missing[0].point.name} ({missing[0].status}); run "
            f"`python -m experiments.{name}` with the same flags first"
        )
    step = table.eval_steps(spec)[-1]
    rescorer = rescore.Rescorer(HELDOUT.value, greedy=GREEDY.value)
    rescored = {}
    for r in results:
        todo = [(r.point.variant, step)] + ([(report.SFT, 0)] if r.point.variant == "sao" else [])
        for row, at in todo:
            out = with_uniform(scores(rescorer, r.workdir, HELDOUT.value, at))
            rescored[(row, r.point.seed)] = out
            print(f"[rescore] {r.point.name} step {at}: {table.METRIC} {out[table.METRIC]:.4f}")
    text = report.report(
        exp, spec, results, rescored, step, HELDOUT.value, time.time() - t0, TABLE.value
    )
    exp.write(f"{name}_rescored", text)


if __name__ == "__main__":
    app.run(main)
