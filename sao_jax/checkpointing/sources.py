"""What a workdir keeps of the run's sources, so that it stands alone once they move.

On its first start (after the workdir guard, before anything compiles) a run copies

  <workdir>/tokenizer/  the tokenizer files of init.tokenizer (those of TOKENIZER_FILES
                        it holds; nothing for the built-in 'char' tokenizer)
  <workdir>/hf_base/    config.json and generation_config.json of init.hf_path
                        (init.kind='hf': the checkpoint the run started from)

Export (sao_jax/export.py) reads these copies, and the original folders only for a
workdir written before they were kept, so `sao-export` works after the source folders are
gone. The workdir's config.json still names the original paths. A resume keeps the first
copies (what the run trained with) and fills in only missing files.
"""

from __future__ import annotations

import pathlib
import shutil

import jax

from sao_jax.schema import ConfigDict

TOKENIZER_DIR = "tokenizer"
BASE_DIR = "hf_base"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
BASE_FILES = ("config.json", "generation_config.json")


def _sources(config: ConfigDict) -> list[tuple[pathlib.Path, str, tuple[str, ...]]]:
    """(source folder, workdir subfolder, file names) of the run's sources."""
    out = []
    if config.init.tokenizer != "char":
        out.append((pathlib.Path(config.init.tokenizer), TOKENIZER_DIR, TOKENIZER_FILES))
    if config.init.kind == "hf":
        out.append((pathlib.Path(config.init.hf_path), BASE_DIR, BASE_FILES))
    return out


def keep_sources(workdir: str | pathlib.Path, config: ConfigDict) -> list[pathlib.Path]:
    """Copies the run's tokenizer files and base checkpoint config into `workdir` (the
    primary process; files already there are kept); returns the files copied now."""
    copied = []
    if jax.process_index() != 0:
        return copied
    for src_dir, sub, names in _sources(config):
        for name in names:
            src, dst = src_dir / name, pathlib.Path(workdir) / sub / name
            if src.is_file() and not dst.exists():
                dst.parent.mkdir(exist_ok=True)
                shutil.copyfile(src, dst)
                copied.append(dst)
    return copied


def kept_dir(workdir: str | pathlib.Path, config: ConfigDict, sub: str) -> pathlib.Path | None:
    """The folder to read the run's `sub` (TOKENIZER_DIR or BASE_DIR) files from: the
    workdir's copy, else the original folder (older workdirs); None when the run has none
    (the built-in tokenizer; no base checkpoint)."""
    for src_dir, name, _ in _sources(config):
        if name == sub:
            copy = pathlib.Path(workdir) / sub
            return copy if copy.is_dir() else src_dir
    return None
