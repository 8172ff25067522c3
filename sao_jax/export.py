"""Export a run's policy as a Hugging Face Qwen3-MoE checkpoint with its tokenizer files.

    result = export_run("workdirs/run", "exports/run", step=None)   # newest checkpoint
    result.step, result.files

The run's own config (`<workdir>/config.json`) rebuilds the model and the learner's state
layout; the TrainState of checkpoint `step` is restored (onto the run's mesh when this
host has its devices, else onto one device) and its policy is written with
`sao_jax.models.hf.save_hf_checkpoint` (config.json + safetensors, per-expert layout).
The run's tokenizer files (tokenizer.json, tokenizer_config.json, chat template,
vocab/merges, special_tokens_map.json) and the base checkpoint's generation_config.json
are copied beside it, so `transformers.AutoModelForCausalLM` and
`AutoTokenizer.from_pretrained(out)` load it. With init.kind='hf' the config.json keeps
every field of the base checkpoint's that the model does not define (eos/pad/bos token
ids, max_position_embeddings, ...). All of these come from the workdir's own copies
(sao_jax/checkpointing/sources.py), so a run exports after its source folders moved.
`sao_export.json` records the workdir and the step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
from typing import Any

import jax

from sao_jax import checkpointing
from sao_jax import config as config_lib
from sao_jax.checkpointing import sources
from sao_jax.models import hf
from sao_jax.models.config import ModelConfig, run_overrides
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel.mesh import Sharder, sharder_from_config
from sao_jax.rl.update import Learner
from sao_jax.schema import ConfigDict, ConfigError

log = logging.getLogger("sao_jax")
EXPORT_FILE = "sao_export.json"


@dataclasses.dataclass(frozen=True)
class ExportResult:
    step: int  # the policy step of the exported checkpoint
    out: pathlib.Path
    files: list[str]  # every file written
    tokenizer: bool  # Hugging Face tokenizer files were copied


def _tuples(x: Any) -> Any:
    """config.json stores tuples as lists; configs use tuples."""
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    return x


def run_config(workdir: pathlib.Path) -> ConfigDict:
    """The validated config a run in `workdir` was started with."""
    path = workdir / checkpointing.CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"workdir {workdir}: no {checkpointing.CONFIG_FILE} (not a run)")
    try:
        data = checkpointing.decode_meta(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable: {e}") from None
    return config_lib.validate(ConfigDict(_tuples(data)))


def base_config(workdir: pathlib.Path, config: ConfigDict) -> dict[str, Any] | None:
    """The config.json of the checkpoint an init.kind='hf' run started from (the workdir's
    copy; the original for older workdirs); None for other runs."""
    base = sources.kept_dir(workdir, config, sources.BASE_DIR)
    if base is None:
        return None
    path = base / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"config field init.hf_path: the run started from {config.init.hf_path!r}, whose "
            f"config.json gives the model's shapes; neither {workdir / sources.BASE_DIR} nor "
            "that folder holds it now"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable: {e}") from None


def model_config(config: ConfigDict, workdir: pathlib.Path) -> ModelConfig:
    """The policy's ModelConfig: the base checkpoint's config.json for init.kind='hf'."""
    base = base_config(workdir, config)
    if base is None:
        return ModelConfig.from_config(config.model)
    return ModelConfig.from_hf(base, **run_overrides(config.model))


def _sharder(config: ConfigDict) -> Sharder:
    try:
        return sharder_from_config(config)
    except (ConfigError, ValueError) as e:  # the run's mesh needs more devices than here
        log.warning("export: restoring onto one device (the run's mesh does not fit: %s)", e)
        return Sharder()


def restore_policy(workdir: pathlib.Path, config: ConfigDict, step: int | None):
    """(policy params, step, ModelConfig) of checkpoint `step` (None: the newest)."""
    cfg = model_config(config, workdir)
    sharder = _sharder(config)
    learner = Learner(
        config.rl, config.optim, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder
    )
    shardings = learner.state_shardings if sharder.mesh is not None else None
    target = checkpointing.abstract_like(learner.abstract_state, shardings)
    with checkpointing.Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        if not ckpt.all_steps():
            raise ConfigError(f"workdir {workdir}: no checkpoint to export")
        state, _ = ckpt.restore(target, step=step)
        restored = ckpt.restored_step
    return state.policy, int(restored), cfg


def copy_tokenizer(workdir: pathlib.Path, config: ConfigDict, out: pathlib.Path) -> list[str]:
    """Copies the run's tokenizer files (and the base checkpoint's generation config)."""
    copied = []
    files = []
    tok = sources.kept_dir(workdir, config, sources.TOKENIZER_DIR)
    if tok is not None:
        files += [tok / f for f in sources.TOKENIZER_FILES]
    base = sources.kept_dir(workdir, config, sources.BASE_DIR)
    if base is not None:
        files.append(base / "generation_config.json")
    for src in files:
        if src.is_file():
            shutil.copyfile(src, out / src.name)
            copied.append(str(out / src.name))
    return copied


def export_run(
    workdir: str | pathlib.Path,
    out: str | pathlib.Path,
    *,
    step: int | None = None,
    dtype: str | None = None,
) -> ExportResult:
    """Writes the policy of checkpoint `step` of the run in `workdir` to `out`."""
    workdir, out = pathlib.Path(workdir), pathlib.Path(out)
    if not workdir.is_dir():
        raise ConfigError(f"workdir {str(workdir)!r} is not a directory")
    if any(out.glob("*.safetensors")) or (out / hf.INDEX_FILE).exists():
        raise ConfigError(f"--out: {out} already holds safetensors files; choose an empty one")
    config = run_config(workdir)
    policy, restored, cfg = restore_policy(workdir, config, step)
    try:
        files = hf.save_hf_checkpoint(
            str(out), cfg, policy, dtype=dtype, base_config=base_config(workdir, config)
        )
    except FileExistsError as e:
        raise ConfigError(f"--out: {e}; choose an empty directory") from None
    files = [str(out / "config.json"), *files]
    tok_files = []
    if jax.process_index() == 0:
        tok_files = copy_tokenizer(workdir, config, out)
        record = {"workdir": str(workdir.resolve()), "step": restored, "dtype": dtype}
        (out / EXPORT_FILE).write_text(json.dumps(record, indent=2) + "\n")
        files += [*tok_files, str(out / EXPORT_FILE)]
    return ExportResult(restored, out, files, bool(tok_files))
