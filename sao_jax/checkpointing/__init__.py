"""Checkpoints and run guards for the training loop (docs/checkpointing.md).

- `Checkpointer`: keep-last-N asynchronous orbax checkpoints of (TrainState, meta dict),
  restored onto any mesh through `abstract_like`, verified (`integrity`: tensor
  fingerprints and file digests), falling back past damaged steps.
- `check_workdir_config`: a resumed run must use the config it started with.
- `GracefulExit`: SIGTERM / SIGINT -> `requested`, so the loop saves and exits 0.
- `keep_sources`: the tokenizer files and base checkpoint config copied into the workdir.
"""

from sao_jax.checkpointing import integrity
from sao_jax.checkpointing.manager import (
    CORRUPT_DIR,
    REPLACED_DIR,
    Checkpointer,
    CheckpointError,
    abstract_like,
)
from sao_jax.checkpointing.meta import decode_meta, encode_meta
from sao_jax.checkpointing.signals import GracefulExit
from sao_jax.checkpointing.sources import keep_sources
from sao_jax.checkpointing.workdir import (
    CONFIG_FILE,
    RESUMABLE_FIELDS,
    check_workdir_config,
    config_differences,
)

__all__ = [
    "CONFIG_FILE",
    "CORRUPT_DIR",
    "REPLACED_DIR",
    "RESUMABLE_FIELDS",
    "CheckpointError",
    "Checkpointer",
    "GracefulExit",
    "abstract_like",
    "check_workdir_config",
    "config_differences",
    "decode_meta",
    "encode_meta",
    "integrity",
    "keep_sources",
]
