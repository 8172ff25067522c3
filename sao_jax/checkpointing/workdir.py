"""The workdir guard: a resumed run must use the config it started with.

The first run writes `<workdir>/config.json`. A later run in the same workdir compares
its config with it, field by field (dotted names, lists compared whole), ignoring the
fields matched by `RESUMABLE_FIELDS` (fnmatch patterns: loop length, logging, eval and
checkpoint cadence, the mesh and the sampler pool placement). The first other difference
raises ConfigError naming the field, unless the run never committed a checkpoint (it
failed or stopped before one: nothing to resume), which the corrected config replaces,
with a log line. `overwrite=True`
starts fresh: every entry of the workdir moves into `<workdir>/previous-<UTC time>/`
(nothing is deleted, nothing is mixed); so does a replaced run without checkpoints.
"""

from __future__ import annotations

import datetime
import fnmatch
import itertools
import json
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from sao_jax.checkpointing.meta import encode_meta
from sao_jax.schema import ConfigError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
PREVIOUS_PREFIX = "previous-"  # folders of moved-aside runs (never moved again)

# Config fields that may differ between a run and its resume: loop length, logging,
# evaluation and checkpoint cadence, the bounds of waits, and the mesh (restore re-shards
# onto any mesh).
RESUMABLE_FIELDS = (
    "train.total_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_sampled",
    "train.eval_sampled_repeats",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.async_checkpoints",
    "train.take_timeout_s",
    "sampling.max_dropped_in_a_row",
    "train.report",
    "train.progress",
    "train.samples_per_log",
    "train.wandb_*",
    "mesh.*",
    "sampling.placement",  # where the pool runs: the checkpoint restores onto any mesh
    "sampling.pool_devices",
    "sampling.pool_mesh",
)

_ABSENT = object()
_BARRIERS = itertools.count()  # barrier names must be unique


def flatten_config(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}, 'c': [1]} -> {'a.b': 1, 'c': [1]}; an empty dict stays a leaf."""
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_config(v, name + "."))
        else:
            out[name] = v
    return out


def _flat_json(config_dict: dict) -> dict[str, Any]:
    """A config as config.json stores it (encoded, through JSON), flattened."""
    return flatten_config(json.loads(json.dumps(encode_meta(dict(config_dict), "config"))))


def config_differences(
    old: dict,
    new: dict,
    resumable: Sequence[str] = RESUMABLE_FIELDS,
    defaults: dict | None = None,
) -> tuple[list[str], list[str]]:
    """(fields that differ and block a resume, resumable fields that differ), sorted.

    With `defaults` (the config's defaults, sao_jax/defaults.py), a field the stored config
    lacks (written by an older sao_jax) counts as holding its default value: a field added
    later, left at its default, does not block resuming an older run (new fields default to
    the behaviour that existed before them)."""
    a, b = flatten_config(old), flatten_config(new)
    base = _flat_json(defaults or {})
    blocking, allowed = [], []
    for name in sorted(set(a) | set(b)):
        before = a.get(name, base.get(name, _ABSENT))
        if before == b.get(name, _ABSENT):
            continue
        ok = any(fnmatch.fnmatchcase(name, p) for p in resumable)
        (allowed if ok else blocking).append(name)
    return blocking, allowed


def check_workdir_config(
    workdir,
    config_dict: dict,
    *,
    overwrite: bool,
    resumable: Sequence[str] = RESUMABLE_FIELDS,
    defaults: dict | None = None,
) -> None:
    """Writes `<workdir>/config.json` on a first run; on a resume checks it matches (a
    field missing from the stored file counts as `defaults`' value: `config_differences`).

    Raises:
      ConfigError: naming the first field (outside `resumable`) whose value differs from
        the stored config, or when the workdir holds files but no config.json; neither
        when `overwrite`, which moves the previous run aside instead.
      TypeError: a config value that is not JSON-serialisable (named).
    """
    workdir = pathlib.Path(workdir)
    path = workdir / CONFIG_FILE
    new = json.loads(json.dumps(encode_meta(dict(config_dict), "config")))
    entries = _run_entries(workdir)
    if entries and overwrite:
        moved = _move_previous_run(workdir, entries)
        log.warning("overwrite: moved the previous run in %s to %s", workdir, moved)
        _write_json(path, new)
    elif entries and not path.exists():
        raise ConfigError(
            f"workdir {workdir} holds {sorted(e.name for e in entries)[:5]} but no "
            f"{CONFIG_FILE}; use an empty workdir, or pass overwrite=True (--overwrite) to "
            f"move its contents aside"
        )
    elif entries:
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"workdir config {path}: unreadable ({e})") from e
        blocking, allowed = config_differences(old, new, resumable, defaults)
        if blocking and not _has_checkpoint(workdir):
            moved = _move_previous_run(workdir, entries)
            log.warning(
                "the run in %s has no checkpoint (it stopped before its first one): starting "
                "afresh with the changed config (%s); its files moved to %s",
                workdir, ", ".join(blocking[:5]), moved,
            )  # fmt: skip
            _write_json(path, new)
        elif blocking:
            name = blocking[0]
            base = _flat_json(defaults or {})
            absent = f"(absent: default {base[name]!r})" if name in base else "(absent)"
            before = flatten_config(old).get(name, absent)
            after = flatten_config(new).get(name, "(absent)")
            raise ConfigError(
                f"config field {name}: the run in {workdir} used {before!r}, this config has "
                f"{after!r} ({len(blocking)} non-resumable field(s) differ); resume with the "
                f"same config, or pass overwrite=True (--overwrite) to move the old run aside"
            )
        added = sorted(set(flatten_config(new)) - set(flatten_config(old)))
        if added:  # not blocking, so at their defaults: recorded from now on
            more = " ..." if len(added) > 8 else ""
            log.info("resuming %s: fields new since its config.json, at their defaults: %s",
                     workdir, ", ".join(added[:8]) + more)  # fmt: skip
        if allowed or added:
            if allowed:
                log.info("resuming %s with changed fields %s", workdir, allowed)
            _write_json(path, new)
    else:
        _write_json(path, new)
    # Other processes continue once the primary one has moved / written the files.
    ocp.multihost.sync_global_processes(f"sao_jax_check_workdir_config_{next(_BARRIERS)}")


def _has_checkpoint(workdir: pathlib.Path) -> bool:
    """Whether the run committed a checkpoint (checkpoints/<step>/, the Checkpointer's layout)."""
    ckpts = workdir / "checkpoints"
    return ckpts.is_dir() and any(p.name.isdigit() and p.is_dir() for p in ckpts.iterdir())


def _run_entries(workdir: pathlib.Path) -> list[pathlib.Path]:
    if not workdir.is_dir():
        return []
    return [e for e in workdir.iterdir() if not e.name.startswith(PREVIOUS_PREFIX)]


def _move_previous_run(workdir: pathlib.Path, entries: list[pathlib.Path]) -> pathlib.Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    dst = workdir / f"{PREVIOUS_PREFIX}{stamp}"
    n = 1
    while dst.exists():
        dst, n = workdir / f"{PREVIOUS_PREFIX}{stamp}.{n}", n + 1
    if jax.process_index() == 0:
        dst.mkdir()
        for e in entries:
            os.replace(e, dst / e.name)
    return dst


def _write_json(path: pathlib.Path, data: Any) -> None:
    """Atomic (write a sibling, then rename), on the primary process only."""
    if jax.process_index() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
