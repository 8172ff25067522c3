"""One short run on one accelerator: every accelerator path against its CPU-verified
reference, then the update step's MFU, decode against the HBM roofline, weight sync.

    python -m experiments.device_check --out=workdirs/device_check        # <= 8 min wall
    python -m experiments.device_check --smoke --out=/tmp/device_check    # CPU, seconds

What each phase checks and measures, and its tolerances: sao_jax/device_check/ (runner.py
lists the phases; shapes.py the shapes and per-phase time caps, which sum to the budget).
Progress goes to stdout phase by phase; <out>/device_check.json is rewritten after every
phase (a timeout still leaves what finished), <out>/device_check.md at the end. Exit
status: 0 every path passed, 1 a path failed (named on the last line), 3 out of time.
The RL and optimizer settings of the update steps come from --config (the 30B recipe's by
default). Unless set, XLA_PYTHON_CLIENT_MEM_FRACTION is raised to 0.95 (the update-step
phase needs ~100 GiB of an H200's 141 GB).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # before jax starts

import sys

from absl import app, flags
from ml_collections import config_flags

from sao_jax import cli
from sao_jax.device_check.runner import PHASES, run

DEFAULT_CONFIG = "configs/qwen3_30b_a3b_sao.py"
_CONFIG = config_flags.DEFINE_config_file("config", None, f"run config (default {DEFAULT_CONFIG})")
_SMOKE = flags.DEFINE_bool("smoke", False, "tiny shapes, on any backend (the CI check)")
_OUT = flags.DEFINE_string("out", "workdirs/device_check", "directory for the JSON and table")
_BUDGET = flags.DEFINE_float("budget_s", None, "whole-run budget in s (default: sum of caps)")
_PHASES = flags.DEFINE_list("phases", list(PHASES), "phases to run, in their fixed order")


@cli.guard
def main(argv):
    del argv
    mode = "smoke" if _SMOKE.value else "full"
    sys.exit(
        run(
            _CONFIG.value,
            mode=mode,
            out_dir=_OUT.value,
            budget_s=_BUDGET.value,
            phases=_PHASES.value,
        )
    )


def cli_main() -> None:
    argv = (
        sys.argv
        if any(a.startswith("--config") for a in sys.argv)
        else [*sys.argv, f"--config={DEFAULT_CONFIG}"]
    )
    app.run(main, flags_parser=cli.parse_config_flags, argv=argv)


if __name__ == "__main__":
    cli_main()
