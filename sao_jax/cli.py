"""What the entry points share: one-line input errors, shipped config paths, module names.

Input errors (a bad config field, a missing file, a malformed dataset row, an unknown
task, an unreadable checkpoint) end a command with ONE line on stderr and exit status 2,
never a traceback: `guard(main)` wraps an absl main, `input_error_exit(e)` prints one.

Shipped configs are found in a checkout (the top-level configs/ folder) and in an
installed package (`sao_jax/configs/`) alike: `--config=configs/sao.py:smoke` names the
shipped file when no such file exists under the working directory.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import sys
from collections.abc import Callable
from typing import NoReturn

from sao_jax.config import resolve_config_path
from sao_jax.schema import ConfigError

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
EXIT_INPUT_ERROR = 2


def input_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input (imported lazily: this module stays light)."""
    from sao_jax.checkpointing import CheckpointError

    return (ConfigError, CheckpointError)


def input_error_exit(e: BaseException, prefix: str = "error") -> NoReturn:
    """Prints `prefix: message` (newlines folded) to stderr and exits 2."""
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"{prefix}: {message}", file=sys.stderr)
    sys.exit(EXIT_INPUT_ERROR)


def guard(main: Callable) -> Callable:
    """An absl `main(argv)` whose input errors exit 2 with one line."""

    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except input_errors() as e:
            input_error_exit(e)

    return wrapped


def in_checkout() -> bool:
    """True when sao_jax runs from a source checkout: its sao_jax/configs/ holds only the
    pointer to the top-level configs/ folder (an installed package holds the configs)."""
    return not (PACKAGE_DIR / "configs" / "base.py").is_file()


def entry_module(name: str) -> str:
    """`python -m` name of an entry point: 'experiments.train' in a checkout (run from its
    root, as the docs do), 'sao_jax.experiments.train' in an installed package."""
    if in_checkout() and importlib.util.find_spec(name.partition(".")[0]) is not None:
        return name
    return f"sao_jax.{name}"


def config_argv(argv: list[str], flag: str = "config") -> list[str]:
    """argv with `--config=<spec>` resolved (shipped configs) and loaded once: a missing
    file or a variant error exits 2 with one line before absl parses anything."""
    from sao_jax import config as config_lib

    out = list(argv)
    for i, a in enumerate(out):
        if a.startswith(f"--{flag}="):
            spec = resolve_config_path(a.split("=", 1)[1])
        elif a == f"--{flag}" and i + 1 < len(out):
            spec = resolve_config_path(out[i + 1])
        else:
            continue
        try:
            config_lib.load_config(spec)
        except ConfigError as e:
            input_error_exit(e)
        if a == f"--{flag}":
            out[i + 1] = spec
        else:
            out[i] = f"--{flag}={spec}"
    return out
