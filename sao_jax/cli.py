"""What the entry points share: one-line input errors, shipped config paths, module names.

Input errors (a bad config field, a missing file, a malformed dataset row, an unknown
task, an unreadable checkpoint) end a command with ONE line on stderr and exit status 2,
never a traceback: `guard(main)` wraps an absl main, `input_error_exit(e)` prints one.
`parse_config_flags` is the flag parser of the entry points with a `--config`: a config
file that is missing, does not parse or import, or whose get_config fails (named with its
file and line), an override of a field the config lacks (each bad one named, and only
those) and a value that does not convert all exit 2 in one line before anything runs.

Shipped configs are found in a checkout (the top-level configs/ folder) and in an
installed package (`sao_jax/configs/`) alike: `--config=configs/sao.py:smoke` names the
shipped file when no such file exists under the working directory.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import pathlib
import re
import sys
from collections.abc import Callable
from typing import NoReturn

from sao_jax.config import resolve_config_path
from sao_jax.schema import ConfigDict, ConfigError

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


def config_argv(argv: list[str], flag: str = "config") -> tuple[list[str], ConfigDict | None]:
    """(argv with `--config=<spec>` resolved (shipped configs), the config it loads): a
    missing file, one that does not parse, import or return a config, or a variant error
    exits 2 with one line before absl parses anything. None: no --config given."""
    from sao_jax import config as config_lib

    out, config = list(argv), None
    for i, a in enumerate(out):
        if a.startswith(f"--{flag}="):
            spec = resolve_config_path(a.split("=", 1)[1])
        elif a == f"--{flag}" and i + 1 < len(out):
            spec = resolve_config_path(out[i + 1])
        else:
            continue
        try:
            config = config_lib.load_config(spec)
        except ConfigError as e:
            input_error_exit(e)
        if a == f"--{flag}":
            out[i + 1] = spec
        else:
            out[i] = f"--{flag}={spec}"
    return out, config


def unknown_overrides(config: ConfigDict, argv: list[str], flag: str = "config") -> list[str]:
    """One 'config field <path>: unknown field (did you mean ...?)' per `--config.<path>=...`
    override in argv whose path the loaded config does not have (config_flags would refuse
    it), in argv order."""
    bad = []
    for a in argv:
        m = re.match(rf"-{{1,2}}(no)?{flag}\.([^=]+)", a)  # as config_flags finds them
        if m is None:
            continue
        path = m.group(2)
        node, parts = config, path.split(".")
        for depth, part in enumerate(parts):
            if isinstance(node, (ConfigDict, dict)) and part in node:
                node = node[part]
                continue
            keys = list(node.keys()) if isinstance(node, (ConfigDict, dict)) else []
            close = difflib.get_close_matches(part, keys, n=1)
            hint = f" (did you mean {'.'.join([*parts[:depth], close[0]])}?)" if close else ""
            bad.append(f"config field {path}: unknown field{hint}")
            break
    return bad


def flag_error(e: Exception, flag: str = "config") -> str:
    """One line for absl's flag parsing error `e`, naming the config field of an
    override that does not convert (--config.sft.steps=zero)."""
    message = " ".join(str(e).split())
    m = re.match(rf"flag --{flag}\.([^=\s]+)=(.*?): (.*)$", message)
    if m:
        path, value, why = m.groups()
        return f"config field {path}: cannot set it to {value!r}: {why}"
    return f"flags: {message}"


def parse_config_flags(argv: list[str], flag: str = "config", flag_values=None) -> list[str]:
    """absl's flag parsing for an entry point with a config_flags `--config`, every input
    error one line and exit 2: the config file (`config_argv`), overrides of fields the
    config lacks (each one named, and only those), values that do not convert, and any
    other bad flag. `--config=configs/<name>.py` also finds the shipped config outside a
    checkout. Returns the remaining argv, as `app.parse_flags_with_usage` does.
    `flag_values`: absl's FlagValues to parse into (default the global `flags.FLAGS`)."""
    from absl import flags

    argv, config = config_argv(argv, flag)
    bad = unknown_overrides(config, argv, flag) if config is not None else []
    if bad:
        input_error_exit("; ".join(bad))
    try:
        return (flags.FLAGS if flag_values is None else flag_values)(argv)
    except flags.Error as e:
        input_error_exit(flag_error(e, flag))
