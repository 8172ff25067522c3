"""One validated config: ':arg' variant parsing and up-front validation.

Configs are Python files under `configs/` exposing `get_config(arg=None)` that returns an
`ml_collections.ConfigDict` (big_vision style). Variants come through the `:arg` suffix of
the config path (`configs/sao.py:smoke,seed=3`), parsed by `parse_arg`, which rejects keys
the config file did not declare. Command-line overrides (`--config.rl.k_critic=1`) are
applied by `ml_collections.config_flags`, which already rejects unknown fields and wrong
types. `validate` then checks ranges and cross-field constraints once, before anything
compiles, and names the offending field.

Every field's name and type is checked against `sao_jax.defaults.default_config()` (the
one place every default is written, which configs/base.py starts from). Each section owns
its range checks: a validator is registered per top-level section with
`sao_jax.schema.register_validator`, next to the code that consumes that section.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import traceback
from typing import Any

from sao_jax.schema import VALIDATORS, ConfigDict, ConfigError

__all__ = ["ConfigDict", "ConfigError", "load_config", "parse_arg", "validate"]


def parse_arg(arg: str | None, **spec: Any) -> ConfigDict:
    """Parses a variant string like ``"smoke,k=3,name=x"`` against declared defaults.

    Args:
      arg: the text after ':' in a config path, or None/"" for all defaults.
      **spec: every accepted key with its default; the default's type converts the value
        (bool keys may be given bare: ``smoke`` means ``smoke=True``).

    Returns:
      A locked ConfigDict holding every key of `spec`.

    Raises:
      ConfigError: a key that `spec` does not declare, or a value that does not convert.
    """
    out = ConfigDict(dict(spec))
    for item in filter(None, (s.strip() for s in (arg or "").split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if key not in spec:
            raise ConfigError(f"unknown config variant key {key!r}; accepted keys: {sorted(spec)}")
        default = spec[key]
        if not eq:
            if not isinstance(default, bool):
                raise ConfigError(f"config variant key {key!r} needs a value ({key}=...)")
            out[key] = True
            continue
        out[key] = _convert(key, text.strip(), default)
    out.lock()
    return out


def _convert(key: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"config variant {key}={text!r}: expected a boolean")
    if isinstance(default, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"config variant {key}={text!r}: not a literal") from e
    if default is not None and not isinstance(value, type(default)):
        if isinstance(default, float) and isinstance(value, int):
            return float(value)
        raise ConfigError(
            f"config variant {key}={text!r}: expected {type(default).__name__}, "
            f"got {type(value).__name__}"
        )
    return value


def configs_dir() -> pathlib.Path:
    """The folder of the shipped configs (checkout: configs/, installed: sao_jax/configs/)."""
    return pathlib.Path(importlib.import_module("sao_jax.configs").__path__[0])


def resolve_config_path(spec: str) -> str:
    """`file[:arg]` with `file` made to point at a shipped config when it does not exist
    under the working directory and reads 'configs/<name>.py'; other specs unchanged."""
    file, colon, arg = spec.partition(":")
    p = pathlib.Path(file)
    if p.is_file() or p.is_absolute() or not p.parts or p.parts[0] != "configs":
        return spec
    shipped = configs_dir().joinpath(*p.parts[1:])
    return f"{shipped}{colon}{arg}" if shipped.is_file() else spec


def config_module(path: str, function: str) -> tuple[Any, str | None]:
    """(module, arg) of a config file given as ``file[:arg]``; the module must define
    `function` (get_config, get_sweep). ConfigError names a missing file or function, and
    a file that does not parse or import (with the line). 'configs/<name>.py' that is not
    under the working directory is the shipped config (resolve_config_path), in a checkout
    and an installed package alike."""
    file, _, arg = resolve_config_path(path).partition(":")
    p = pathlib.Path(file)
    if not p.is_file():
        raise ConfigError(f"config file {file!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_sao_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # the file itself, or a module it imports
        where = _where(p, e.filename, e.lineno)
        raise ConfigError(f"config file {where}: does not parse: {e.msg}") from None
    except Exception as e:
        raise ConfigError(f"config file {_failure(e, p, 'does not import')}") from None
    if not hasattr(module, function):
        raise ConfigError(f"config file {file!r} defines no {function}(arg)")
    return module, arg or None


def _where(file: pathlib.Path, filename: str | None, lineno: int | None) -> str:
    """'file:line' when the line is in the config file, else 'file (at other:line)'."""
    if not filename or lineno is None:
        return str(file)
    if pathlib.Path(filename).resolve() == file.resolve():
        return f"{file}:{lineno}"
    return f"{file} (at {filename}:{lineno})"


def _failure(e: BaseException, file: pathlib.Path, what: str) -> str:
    """'<where>: <what>: <Type>: <message>' of an exception raised while running a config
    file; where: the innermost traceback frame in the config's folder (the file, or a
    config it builds on), else the innermost frame."""
    frames = traceback.extract_tb(e.__traceback__)
    folder = file.resolve().parent
    ours = [f for f in frames if pathlib.Path(f.filename).resolve().is_relative_to(folder)]
    frame = (ours or frames)[-1] if frames else None
    where = _where(file, frame and frame.filename, frame and frame.lineno)
    message = " ".join(str(e).split())
    return f"{where}: {what}: {type(e).__name__}" + (f": {message}" if message else "")


def load_config(path: str) -> ConfigDict:
    """Loads ``path[:arg]`` (a configs/*.py file) the way `config_flags` does.

    Raises:
      ConfigError: the file is missing, does not parse or import, its get_config raises
        (a ConfigError as it is; anything else named with the file and line) or returns
        something other than a ConfigDict.
    """
    module, arg = config_module(path, "get_config")
    file = resolve_config_path(path).partition(":")[0]
    try:
        config = module.get_config(arg)
    except ConfigError:
        raise
    except Exception as e:  # e.g. a wrongly typed value: "Could not override field ..."
        failure = _failure(e, pathlib.Path(file), f"get_config({arg!r}) raised")
        raise ConfigError(f"config file {failure}") from None
    if not isinstance(config, ConfigDict):
        raise ConfigError(
            f"config file {file}: get_config({arg!r}) returned {type(config).__name__}, "
            "not an ml_collections.ConfigDict"
        )
    return config


def validate(config: ConfigDict) -> ConfigDict:
    """Runs every registered section validator present in `config`; returns it locked.

    First every field's name and type against the sections' defaults (`check_fields`),
    then each section's ranges. Sections are validated only when present, so partial
    configs (a model-only config for the memory plan, say) validate too.
    """
    check_fields(config)
    _import_validators()
    for section, fn in VALIDATORS.items():
        if section in config:
            fn(config)
    config.lock()
    return config


def _import_validators() -> None:
    # Importing these modules registers their sections' validators.
    import sao_jax.models.config
    import sao_jax.parallel.mesh
    import sao_jax.rl.optim
    import sao_jax.rl.settings
    import sao_jax.run.settings
    import sao_jax.sampling.sampler
    import sao_jax.serve.settings  # noqa: F401


def _type_ok(value: Any, default: Any) -> bool:
    """bool/str exact; int not bool; float accepts int; tuple and list interchangeable."""
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (tuple, list)):
        return isinstance(value, (tuple, list))
    return isinstance(value, type(default))


def _check_section(values: dict, reference: dict, prefix: str) -> None:
    for key in sorted(values):
        if key not in reference:
            raise ConfigError(
                f"config field {prefix}{key}: unknown field; known: {sorted(reference)}"
            )
    for key, default in reference.items():
        name, value = prefix + key, values.get(key, _MISSING)
        if value is _MISSING:
            raise ConfigError(f"config field {name}: missing (default {default!r})")
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"config field {name}: expected a section, got {value!r}")
            _check_section(value, default, name + ".")
        elif not _type_ok(value, default):
            raise ConfigError(
                f"config field {name}: expected {type(default).__name__}, got "
                f"{type(value).__name__} {value!r}"
            )


_MISSING = object()


def check_fields(config: ConfigDict) -> None:
    """Raises ConfigError naming the first unknown, missing or mistyped field. Top-level
    sections may be absent (partial configs); a present section must be complete."""
    from sao_jax import defaults

    reference = defaults.reference()
    values = config.to_dict()
    unknown = sorted(set(values) - set(reference))
    if unknown:
        raise ConfigError(f"config field {unknown[0]}: unknown field; known: {sorted(reference)}")
    _check_section(values, {k: v for k, v in reference.items() if k in values}, "")
