r"""Trains one run from a config: warm start, value pretraining, async SAO RL, evaluation.

  python -m experiments.train --config=configs/sao.py --workdir=workdirs/sao
  python -m experiments.train --config=configs/sao.py:smoke --workdir=/tmp/smoke
  python -m experiments.train --config=configs/ablations.py:no_frozen_attention \
      --workdir=workdirs/nfa --config.seed=1 --config.train.total_steps=200

A workdir that holds a run resumes it (same config); a different config there is refused
unless --overwrite. SIGTERM/SIGINT saves a checkpoint and exits 0. A bad config or input
file exits 2 with one line naming the field or file; so does a run that cannot go on
(RUN_ERRORS: a missing sandbox, an environment that keeps failing, rollouts that produce
nothing within their bound), with one FATAL line naming the cause.

One process per host (TPU pod, GPU cluster; docs/scaling.md): every host runs the same
command, and jax.distributed connects them before anything else runs. The coordinator
address, process count and id come from --coordinator_address / --num_processes /
--process_id, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else
JAX's cluster detection (--distributed=detect on a TPU pod; see experiments/launch.py):

  python -m experiments.train --config=configs/qwen3_30b_a3b_sao.py --workdir=/mnt/run \
      --coordinator_address=h0:8476 --num_processes=2 --process_id=0   # on host h0
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sao_jax import cli, train
from sao_jax.envs.sandbox import SandboxUnavailable
from sao_jax.parallel import distributed
from sao_jax.sampling.env_calls import EnvCallsStuck
from sao_jax.sampling.sampler import EnvErrorLimit, NoProgress, SamplerError

# Run-time failures whose message says all (the sandbox, the env's last failure, the drops
# of rollouts that produce nothing): one FATAL line, exit 2, as for input errors (a bad
# config field or file: cli.guard's one line).
RUN_ERRORS = (SandboxUnavailable, EnvErrorLimit, EnvCallsStuck, NoProgress, SamplerError)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file[:variant].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, report).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a different run in --workdir.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", distributed.MODES,
    "auto: multi-process when a coordinator/count/id is given (flag or JAX_* env) or a "
    "cluster is visible; detect: always jax.distributed.initialize() (TPU pods); off.",
)  # fmt: skip
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes (hosts) in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, count).")
flags.mark_flags_as_required(["config", "workdir"])


@cli.guard
def main(argv):
    del argv
    spec = distributed.resolve(
        _DISTRIBUTED.value,
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
    )
    distributed.initialize(spec)  # before any JAX computation
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax/jax info logs
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("sao_jax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if distributed.is_primary() else logging.WARNING)
    logger.propagate = False
    try:
        train.run(_CONFIG.value, _WORKDIR.value, overwrite=_OVERWRITE.value)
    except RUN_ERRORS as e:
        cli.input_error_exit(e, f"FATAL {type(e).__name__}")


def cli_main() -> None:
    """The `sao-train` console script."""
    app.run(main, flags_parser=cli.parse_config_flags)


if __name__ == "__main__":
    cli_main()
