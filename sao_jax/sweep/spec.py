"""Sweep specs: variants x grid levels x seeds -> named points, and the shared warm start.

A `SweepSpec` (a config file's `get_sweep(arg)`, read by `load_sweep`) expands into
`Point`s named `<config stem>__<variant>__<field>=<value>...__seed=<n>`; each seed's points
share one warm-start run (`warm_start_point`, `warm_start_name`): SFT and value pretraining.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sao_jax.cli import entry_module
from sao_jax.config import config_module
from sao_jax.run.settings import PRETRAIN_IGNORES, PRETRAIN_READS
from sao_jax.schema import ConfigDict, ConfigError

TRAIN_MODULE = entry_module("experiments.train")  # installed: sao_jax.experiments.train
WARM_START_PREFIX = "warm_start__"
# Overrides of the shared warm-start run: SFT and value pretraining, no RL, a small
# evaluation, no report. Its <workdir>/warm_start (policy) and, when its config pretrains
# a critic, <workdir>/warm_start_critic are what the seed's points start from.
WARM_START_OVERRIDES = {
    "train.total_steps": 0,
    "env.eval_size": 8,
    "train.eval_every": 0,
    "train.report": False,
    "train.progress": False,
}
WARM_START_SECTIONS = ("model", "sft", "init", "mesh", "env")
WARM_START_SUBDIR = "warm_start"  # where sao_jax.train saves the SFT policy

Level = Mapping[str, Any]  # one grid level: dotted config field -> value


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """A product of variants x grid levels x seeds over one config file."""

    name: str  # label of the sweep (logs, tables)
    config: str  # config file, e.g. 'configs/ablations.py'
    variants: tuple[str, ...]  # the ':variant' of each row, e.g. ('sao', 'grpo')
    seeds: tuple[int, ...]
    grid: tuple[tuple[Level, ...], ...] = ()  # product axes; each a tuple of levels
    fixed: Level = dataclasses.field(default_factory=dict)  # overrides of every point
    common_arg: str = ""  # appended to every ':variant' (e.g. 'smoke')
    warm_start: bool = True  # one shared SFT warm start per seed
    base_variant: str = ""  # ':variant' of the warm-start run ('' = the file's default)
    entry: str = TRAIN_MODULE  # module run per point (`python -m <entry>`)

    def __post_init__(self):
        if not self.variants:
            raise ValueError(f"SweepSpec {self.name!r}: variants must not be empty")
        if not self.seeds:
            raise ValueError(f"SweepSpec {self.name!r}: seeds must not be empty")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"SweepSpec {self.name!r}: repeated seeds {self.seeds}")
        for i, levels in enumerate(self.grid):
            if not levels:
                raise ValueError(f"SweepSpec {self.name!r}: grid axis {i} has no levels")
            if isinstance(levels, Mapping) or not all(isinstance(x, Mapping) for x in levels):
                raise ValueError(
                    f"SweepSpec {self.name!r}: grid axis {i} must be a sequence of mappings "
                    f"(field -> value), got {levels!r}"
                )
        for field in self.fixed:
            _check_field(field, f"SweepSpec {self.name!r}: fixed")


def load_sweep(path: str) -> SweepSpec:
    """`get_sweep(arg)` of a config file given as ``file[:arg]``."""
    module, arg = config_module(path, "get_sweep")
    spec = module.get_sweep(arg)
    if not isinstance(spec, SweepSpec):
        raise ConfigError(f"{path}: get_sweep returned {type(spec).__name__}, not a SweepSpec")
    return spec


def axis(field: str, values: Sequence[Any]) -> tuple[Level, ...]:
    """One grid axis over a single field: axis('optim.policy.lr', [1e-4, 1e-3])."""
    return tuple({field: v} for v in values)


@dataclasses.dataclass(frozen=True)
class Point:
    """One training run of a sweep."""

    config: str  # config file
    variant: str  # ':variant' of the row
    common_arg: str
    seed: int
    overrides: tuple[tuple[str, Any], ...]  # grid overrides (part of the name)
    fixed: tuple[tuple[str, Any], ...]  # shared overrides (not in the name)

    @property
    def row(self) -> str:
        """The row label: variant and grid overrides, seed left out (seeds aggregate)."""
        parts = [self.variant or "default"]
        parts += [f"{_short(k)}={_slug(v)}" for k, v in self.overrides]
        return "__".join(parts)

    @property
    def name(self) -> str:
        """Directory name under the sweep dir: `<config stem>__<row>__seed=<n>` (sweeps of
        several config files may share a sweep dir)."""
        return f"{pathlib.Path(self.config).stem}__{self.row}__seed={self.seed}"

    @property
    def config_path(self) -> str:
        arg = ",".join(a for a in (self.variant, self.common_arg) if a)
        return f"{self.config}:{arg}" if arg else self.config

    def all_overrides(self) -> dict[str, Any]:
        return {**dict(self.fixed), **dict(self.overrides)}


def expand(spec: SweepSpec) -> list[Point]:
    """Every point of `spec`: variants x grid levels x seeds, in that nesting order.

    Raises ValueError when two points would get one name, or a grid field is also fixed.
    """
    fixed = tuple(spec.fixed.items())
    points = []
    for variant in spec.variants:
        for levels in itertools.product(*spec.grid):
            merged: dict[str, Any] = {}
            for level in levels:
                for field, value in level.items():
                    _check_field(field, f"SweepSpec {spec.name!r}: grid")
                    if field in merged or field in spec.fixed:
                        raise ValueError(
                            f"SweepSpec {spec.name!r}: field {field!r} set twice in one point"
                        )
                    merged[field] = value
            for seed in spec.seeds:
                points.append(
                    Point(spec.config, variant, spec.common_arg, seed, tuple(merged.items()), fixed)
                )
    names = [p.name for p in points]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"SweepSpec {spec.name!r}: points share names {dupes}")
    return points


def warm_start_point(spec: SweepSpec, seed: int) -> Point:
    """The SFT-only run whose `<workdir>/warm_start` policy the seed's points load.

    It keeps the spec's fixed overrides that shape the warm start (`affects_warm_start`)
    and drops the rest, so sweeps of one config with other RL budgets share it.
    """
    shaping = {k: v for k, v in spec.fixed.items() if affects_warm_start(k)}
    fixed = {**shaping, **WARM_START_OVERRIDES}
    return Point(spec.config, spec.base_variant, spec.common_arg, seed, (), tuple(fixed.items()))


def affects_warm_start(field: str) -> bool:
    """Whether a fixed override can change the warm start: the SFT policy (model, SFT,
    init, mesh, and the task: env.* except the evaluation size and the RL group size) or
    the value-pretrained critic (what sao_jax.run.settings.PRETRAIN_READS lists)."""
    section = field.split(".", 1)[0]
    if section in WARM_START_SECTIONS and field not in ("env.eval_size", "env.group_size"):
        return True
    read = any(field == r or (r.endswith(".") and field.startswith(r)) for r in PRETRAIN_READS)
    return read and field not in PRETRAIN_IGNORES


def warm_start_name(spec: SweepSpec, seed: int) -> str:
    stem = pathlib.Path(spec.config).stem
    arg = _slug(spec.common_arg) if spec.common_arg else "default"
    return f"{WARM_START_PREFIX}{stem}__{arg}__seed={seed}"


def set_field(config: ConfigDict, field: str, value: Any) -> None:
    """config['a']['b'] = value for field 'a.b'; ConfigError if the field does not exist."""
    *path, last = field.split(".")
    node = config
    for part in path:
        if part not in node:
            raise ConfigError(f"config field {field}: no section {part!r}")
        node = node[part]
    if last not in node:
        raise ConfigError(f"config field {field}: no such field")
    node[last] = value


def flag_value(value: Any) -> str:
    """Text of a `--config.<field>=` override: strings raw, bools lower-case, else repr."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, tuple, list)) or value is None:
        return repr(tuple(value) if isinstance(value, list) else value)
    raise TypeError(f"override value {value!r}: expected str, bool, number, tuple or None")


# --------------------------------------------------------------------------- names

_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _check_field(field: str, where: str) -> None:
    if not isinstance(field, str) or not _FIELD_RE.match(field):
        raise ValueError(f"{where}: {field!r} is not a dotted config field name")
    if field == "seed":
        raise ValueError(f"{where}: 'seed' is a sweep axis of its own (SweepSpec.seeds)")


def _short(field: str) -> str:
    """A field's name in a point name: its last part ('optim.policy.lr' -> 'lr')."""
    return field.rsplit(".", 1)[-1]


def _slug(value: Any) -> str:
    """A value as file-name-safe text: (40, 80) -> '40-80', 'a,b' -> 'a,b'."""
    text = value if isinstance(value, str) else flag_value(value)
    text = re.sub(r",\s*", "-", text.strip("()[]"))
    return re.sub(r"[^A-Za-z0-9._=+,-]", "", text) or "none"
