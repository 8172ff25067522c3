r"""Trains one run from a config: warm start, value pretraining, async SAO RL, evaluation.

  python -m experiments.train --config=configs/sao.py --workdir=workdirs/sao
  python -m experiments.train --config=configs/sao.py:smoke --workdir=/tmp/smoke
  python -m experiments.train --config=configs/ablations.py:no_frozen_attention \
      --workdir=workdirs/nfa --config.seed=1 --config.train.total_steps=200

A workdir that holds a run resumes it (same config); a different config there is refused
unless --overwrite. SIGTERM/SIGINT saves a checkpoint and exits 0.
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from sao_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file[:variant].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, report).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a different run in --workdir.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax/jax info logs
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("sao_jax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    train.run(_CONFIG.value, _WORKDIR.value, overwrite=_OVERWRITE.value)


if __name__ == "__main__":
    app.run(main)
