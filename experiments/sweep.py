r"""Runs a sweep from a config file's `get_sweep(arg)`: every point its own process.

  python -m experiments.sweep --config=configs/ablations.py:table=gae,mode=quick \
      --sweep_dir=workdirs/sweeps/quick --parallel=1
  python -m experiments.sweep --config=configs/ablations.py:table=table4,mode=full \
      --sweep_dir=workdirs/sweeps/full --dry_run          # print the commands only
  python -m experiments.sweep --config=... --launcher=tpu  # each point via launch.py

Finished points (summary.json) are skipped, so rerunning resumes. The table of every
point (status, held-out success before/after, collapse, wall time) goes to stdout and,
with --out, to a markdown file.
"""

import pathlib

from absl import app, flags
from sao_jax.experiments.ablations import collapse

from sao_jax import sweep
from sao_jax.config import ConfigError

_CONFIG = flags.DEFINE_string("config", None, "Config file with get_sweep(arg), as file[:arg].")
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", None, "Directory of the points' workdirs.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Points run at the same time.")
_LAUNCHER = flags.DEFINE_enum("launcher", "local", sweep.LAUNCHERS, "Where points run.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")
_OUT = flags.DEFINE_string("out", None, "Also write the points table (markdown) here.")
flags.mark_flags_as_required(["config", "sweep_dir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        spec = sweep.load_sweep(_CONFIG.value)
    except ConfigError as e:
        raise app.UsageError(str(e)) from e
    results = sweep.run_sweep(
        spec,
        _SWEEP_DIR.value,
        parallel=_PARALLEL.value,
        launcher=_LAUNCHER.value,
        dry_run=_DRY_RUN.value,
    )
    if _DRY_RUN.value:
        return
    table = collapse.points_table(results)
    print(table)
    if _OUT.value:
        out = pathlib.Path(_OUT.value)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# Sweep {spec.name}\n\n{table}")


def cli_main() -> None:
    """The `sao-sweep` console script."""
    app.run(main)


if __name__ == "__main__":
    cli_main()
