r"""Table 4: SAO against its ablations and baselines on the embedded agentic task.

  python -m experiments.ablations --mode=quick     # one seed, 40 steps
  python -m experiments.ablations --mode=full      # 5 seeds, 60 steps
  python -m experiments.ablations --mode=smoke --sweep_dir=/tmp/s --out_dir=/tmp/r

Runs the `table4` sweep of configs/ablations.py (every row x seed its own process, one
shared SFT warm start per seed, finished runs reused) and writes
`<out_dir>/ablations.md` (held-out sampled success, mean +/- std over seeds, at each
eval step; collapses; the paper's numbers beside) and `<out_dir>/plots/ablations_*.png`.
The flags defined here are shared by the other experiment scripts (`experiment()`), and so
is their main (`table_main`); the report is sao_jax/report/ablations.py.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shlex
import sys
from collections.abc import Callable

from absl import app, flags

from sao_jax import cli, sweep
from sao_jax.configs import ablations as ablations_cfg
from sao_jax.report import ablations as report
from sao_jax.report import audit
from sao_jax.report.experiment import Experiment
from sao_jax.schema import ConfigError

MODE = flags.DEFINE_enum("mode", "quick", ["smoke", "quick", "full"], "Experiment size.")
SWEEP_DIR = flags.DEFINE_string(
    "sweep_dir", None, "Runs' workdirs (default workdirs/sweeps/<mode>)."
)
OUT_DIR = flags.DEFINE_string("out_dir", None, "Tables and plots (default results/<mode>).")
PARALLEL = flags.DEFINE_integer("parallel", 1, "Training runs at the same time.")
LAUNCHER = flags.DEFINE_enum("launcher", "local", sweep.LAUNCHERS, "Where runs are started.")
DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the runs' commands, run nothing.")
SEEDS = flags.DEFINE_list(
    "seeds", None, "Seeds to run instead of the mode's (e.g. 0,1,2); the report says which."
)
FROM_RUNS = flags.DEFINE_string(
    "from_runs",
    None,
    "Write the table again from a committed <name>_runs.jsonl (sao_jax/report/audit.py) "
    "instead of running: the same runs and settings, nothing trained.",
)
ADD_TO = flags.DEFINE_string(
    "add_to",
    None,
    "A committed <name>_runs.jsonl whose runs this invocation adds to (rows or seeds a "
    "later session runs, e.g. --rows=<rows it lacks>): the table is written from its runs "
    "and this invocation's, and says whether each seed's warm start is the same tensors.",
)
ROWS = flags.DEFINE_list(
    "rows",
    None,
    "Rows (the sweep's ':variant's) to run instead of all of them, e.g. sao,moving_average "
    "to add seeds to one comparison; differences are taken against the 'sao' row.",
)


def command() -> str:
    """This invocation as `python -m <module> <flags>` (sys.argv[0] is the file path)."""
    prog = pathlib.Path(sys.argv[0]).resolve()
    try:
        module = ".".join(prog.relative_to(pathlib.Path.cwd().resolve()).with_suffix("").parts)
    except ValueError:
        module = prog.stem
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def experiment() -> Experiment:
    """The experiment settings of the command line."""
    return Experiment(
        mode=MODE.value,
        sweep_dir=SWEEP_DIR.value,
        out_dir=OUT_DIR.value,
        parallel=PARALLEL.value,
        launcher=LAUNCHER.value,
        dry_run=DRY_RUN.value,
        seeds=SEEDS.value,
        rows=ROWS.value,
        command=command(),
    )


Report = Callable[[Experiment, sweep.SweepSpec, list, float], str]


def table_main(
    name: str,
    sweep_of: Callable[[str], sweep.SweepSpec | tuple[sweep.SweepSpec, ...]],
    write: Report,
):
    """The main of a table script: the sweep of the mode (`sweep_of(mode)`) with the
    command line's seeds and rows, run (or resumed), then `write(...)` as <out>/<name>.md.
    `sweep_of` may return a tuple of sweeps (one per task, each with its own warm starts):
    they run into the one sweep dir as one set of jobs (`sweep.run_sweep`: one task's
    warm starts overlap the other's), `write` gets the tuple and every result. A bad
    flag exits 2 with one line."""

    def chosen(exp: Experiment):
        """The mode's sweep (or tuple of sweeps) with the seeds and rows `exp` chose."""
        specs = sweep_of(exp.mode)
        if isinstance(specs, sweep.SweepSpec):
            return exp.chosen(specs)
        return tuple(exp.chosen(s) for s in specs)

    @cli.guard
    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        if FROM_RUNS.value:  # the committed runs, nothing trained
            results, header = audit.read_runs(FROM_RUNS.value)
            exp = dataclasses.replace(experiment(), **header.settings)
            spec = chosen(exp)  # then as the file ran it (its rows, seeds, schedule)
            if isinstance(spec, sweep.SweepSpec):
                spec = audit.recorded_spec(spec, results)
            else:
                spec = tuple(audit.recorded_spec(s, results) for s in spec)
            exp.write(name, write(exp, spec, results, header.wall_s))
            return
        exp = experiment()
        spec = chosen(exp)
        earlier = None
        if ADD_TO.value:
            if not isinstance(spec, sweep.SweepSpec):
                raise ConfigError("--add_to: this script runs several sweeps; not supported")
            earlier, before = audit.read_runs(ADD_TO.value)
            audit.check_addable(spec, earlier, ADD_TO.value)
        results, wall_s, stopped = exp.run_table(spec)
        if earlier is not None and not exp.dry_run:
            spec, results = audit.add_runs(spec, sweep_of(exp.mode), results, earlier)
            prior = [*before.settings.get("earlier", ())]
            prior.append(
                dict(
                    command=before.settings["command"], wall_s=before.wall_s, runs_file=ADD_TO.value
                )
            )
            exp = dataclasses.replace(exp, earlier=tuple(prior))
        if not exp.dry_run:
            recorder = audit.Recorder()
            exp.write(name, write(exp, spec, recorder.wrap(results), wall_s))
            path = audit.write_runs(
                audit.runs_path(exp.out_path, name), results, recorder, wall_s, exp.settings()
            )
            print(f"wrote {path}")
        if stopped is not None:  # the table of what finished is written: now exit 0
            raise stopped

    return main


def table4(exp: Experiment, spec: sweep.SweepSpec, results, wall_s: float) -> str:
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
