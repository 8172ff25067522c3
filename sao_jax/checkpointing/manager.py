"""Checkpointer: keep-last-N asynchronous orbax checkpoints of (TrainState, meta).

One checkpoint = one step directory `<directory>/<step>/` holding three orbax items:
`state` (the TrainState pytree: arrays only, written as OCDBT/zarr by
`StandardCheckpointHandler`), `meta` (a JSON dict: counters, the prompt iterator state,
sampler stats, ...; bytes and integer dict keys are tagged, see checkpointing/meta.py) and
`checksums` (a fingerprint of every tensor, checkpointing/integrity.py), plus, once
committed, `integrity/process_<p>.json` (size and CRC-32 of every file). Orbax writes each
step into `<step>.orbax-checkpoint-tmp` and renames it when every item is committed, so a
crash or a failing write never touches an older step directory. Restore checks the file
digests before reading and the tensor fingerprints after: a damaged step is skipped.

Restore goes into an abstract target (`abstract_like`: ShapeDtypeStructs whose
`.sharding` says where each leaf goes), so the tree structure (integer layer keys,
`optax.MaskedNode`, `EmptyState`, an empty critic `{}`) comes from the code and the
values can land on any mesh or device count. Corruption policy and resume order:
docs/checkpointing.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sao_jax.checkpointing import integrity
from sao_jax.checkpointing.meta import decode_meta, encode_meta
from sao_jax.parallel import distributed
from sao_jax.parallel.partition import path_str
from sao_jax.schema import ConfigError

log = logging.getLogger(__name__)

STATE, META, SUMS = "state", "meta", integrity.CHECKSUMS  # the items of a step directory
CORRUPT_DIR = "corrupt"  # unreadable steps skipped by a fallback restore are moved here
REPLACED_DIR = "replaced"  # a step being re-saved with force=True waits here until committed
# Errors that mean "this step directory is incomplete or unreadable" (tensorstore raises
# ValueError, a missing file OSError / KeyError, a truncated JSON item ValueError).
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError)
_ORBAX_DIR = os.path.dirname(ocp.__file__)


class _QuietOrbaxErrors(logging.Filter):
    """Drops orbax's own ERROR records (each with a background thread's traceback: a full
    disk printed ~200 lines): every failed save or restore is raised by the Checkpointer
    as one CheckpointError naming the step directory, the cause chained."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.pathname.startswith(_ORBAX_DIR))


logging.getLogger("absl").addFilter(_QuietOrbaxErrors())


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read. The message names its directory."""


class _Unreadable(Exception):
    """Internal: one step directory is incomplete or unreadable (cause chained)."""

    def why(self) -> str:
        return _short(self.__cause__) if self.__cause__ is not None else str(self)


def _short(e: BaseException, limit: int = 300) -> str:
    """`Type: message`, cut to `limit` characters (tensorstore errors embed whole specs)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


# ----------------------------------------------------------------------- abstract target


def abstract_like(state_or_shapes, shardings) -> Any:
    """ShapeDtypeStructs with `.sharding`, the restore target of `Checkpointer.restore`.

    Args:
      state_or_shapes: a pytree of arrays or ShapeDtypeStructs (e.g. `learner.abstract_state`).
      shardings: a pytree of `jax.sharding.Sharding` with the same structure (e.g.
        `learner.state_shardings`), one Sharding for every leaf, or None for unsharded
        (every leaf on the first local device).
    """
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        one = shardings
        to_abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
        return jax.tree.map(to_abstract, state_or_shapes)
    try:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state_or_shapes,
            shardings,
        )
    except ValueError as e:
        raise ValueError(f"shardings: structure does not match the state: {e}") from e


def _leaf_table(tree) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(p): (tuple(x.shape), np.dtype(x.dtype)) for p, x in leaves}


def _check_compatible(have, want, where: str) -> None:
    """Raises ConfigError naming the first tensor the checkpoint lacks, has in excess, or
    stores with another shape or dtype than the target (a changed model or optimizer
    config, not a damaged file: no fallback to an older step). Args are `_leaf_table`s.
    Decoder layers saved in the other layout (per layer vs stacked) name model.scan_layers."""
    have_stacked, want_stacked = (any(".stacks." in n for n in t) for t in (have, want))
    have_layers, want_layers = (any(".layers." in n for n in t) for t in (have, want))
    if (have_stacked and want_layers and not want_stacked) or (
        have_layers and want_stacked and not have_stacked
    ):
        saved = "stacked (trunk.stacks)" if have_stacked else "per layer (trunk.layers)"
        raise ConfigError(
            f"config field model.scan_layers: checkpoint {where} holds decoder layers "
            f"{saved}, the target state expects the other layout; restore with "
            f"model.scan_layers={have_stacked}, or convert the params with "
            "sao_jax.models.layer_stack.stack_params"
        )
    for name in sorted(set(have) | set(want)):
        if name not in have:
            raise ConfigError(f"checkpoint {where}: tensor {name} is missing")
        if name not in want:
            raise ConfigError(f"checkpoint {where}: tensor {name} is not in the target state")
        if have[name] != want[name]:
            (hs, hd), (ws, wd) = have[name], want[name]
            raise ConfigError(
                f"checkpoint {where}: tensor {name} is stored as {hd}{list(hs)}, "
                f"the target state expects {wd}{list(ws)}"
            )


def _check_abstract(abstract) -> None:
    for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        if getattr(x, "sharding", None) is None:
            raise TypeError(
                f"abstract_state: leaf {path_str(p)} has no sharding; build the target "
                "with checkpointing.abstract_like(shapes, shardings)"
            )


# -------------------------------------------------------------------------- Checkpointer


class Checkpointer:
    """Keep-last-N asynchronous orbax checkpoints of (TrainState, meta) in one directory.

    `save` returns once the arrays are copied to the host; the write continues in a
    background thread and its failure is raised (as CheckpointError naming the
    directory, the OSError chained) by the next `save`, `wait`, `restore` or `close`.
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: must be an int >= 1, got {keep!r}")
        self.directory = pathlib.Path(directory).absolute()
        self.async_save = bool(async_save)
        self.restored_step: int | None = None  # the step the last restore() read
        self._pending: tuple[int, pathlib.Path | None] | None = None
        self._closed = False
        self._barriers = itertools.count()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=self.async_save,
            cleanup_tmp_directories=True,  # tmp dirs of crashed saves
            create=True,
        )
        handlers = {
            STATE: ocp.StandardCheckpointHandler(),
            META: ocp.JsonCheckpointHandler(),
            SUMS: ocp.JsonCheckpointHandler(),
        }
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def latest_step(self) -> int | None:
        """The newest committed step (it may still turn out unreadable: see restore)."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    def save(self, step: int, state, meta: dict, *, force: bool = False) -> bool:
        """Starts writing checkpoint `step`; returns False if `step` is already saved.

        `force=True` re-saves an existing `step` (the old copy is kept under
        `replaced/` until the new one is committed, and put back if the save fails).
        A step older than the latest checkpoint raises: it would mix two runs.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step: must be an int >= 0, got {step!r}")
        step = int(step)
        if not isinstance(meta, dict):
            raise TypeError(f"meta: must be a dict, got {type(meta).__name__}")
        payload = encode_meta(meta)
        self._finish_pending()
        latest = self.latest_step()
        replaced = None
        if latest is not None and step <= latest:
            if step < latest:
                raise CheckpointError(
                    f"step {step} is older than the latest checkpoint {latest} in "
                    f"{self.directory}; saving it would mix two runs (use another workdir)"
                )
            if not force:
                return False
            replaced = self._move_aside(step, REPLACED_DIR)
        sums = integrity.checksums_payload(state)  # on device, before the buffers move on
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                META: ocp.args.JsonSave(payload),
                SUMS: ocp.args.JsonSave(sums),
            }
        )
        try:
            self._mgr.save(step, args=args, force=True)
        except Exception as e:
            self._put_back(step, replaced)
            raise self._save_error(step, e) from e
        self._pending = (step, replaced)
        if not self.async_save:
            self._finish_pending()
        return True

    def wait(self) -> None:
        """Blocks until the last save is committed; raises CheckpointError if it failed."""
        self._finish_pending()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            self._mgr.close()

    def restore(self, abstract_state, *, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of checkpoint `step`, or of the newest readable one if None.

        With `step=None`, unreadable newer steps are skipped with a warning naming each,
        and moved to `<directory>/corrupt/` once an older one restores (so the run can
        save those step numbers again). An explicit unreadable `step` raises
        CheckpointError naming its directory. A target whose tensors differ from the
        checkpoint's (names, shapes, dtypes) raises ConfigError naming the tensor.
        """
        _check_abstract(abstract_state)
        self._finish_pending()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"no checkpoint for step {step} in {self.directory}; available steps: {steps}"
                )
            try:
                out = self._restore_step(step, abstract_state)
            except _Unreadable as e:
                raise CheckpointError(
                    f"checkpoint {self.step_dir(step)} is incomplete or unreadable "
                    f"({e.why()}); restore(step=None) falls back to the newest "
                    f"readable one (available steps: {steps})"
                ) from e.__cause__
            self.restored_step = step
            return out
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        bad: list[tuple[int, _Unreadable]] = []
        for s in reversed(steps):
            try:
                out = self._restore_step(s, abstract_state)
            except _Unreadable as e:
                bad.append((s, e))
                continue
            for b, e in bad:
                self._quarantine(b, e.why(), restored=s)
            self.restored_step = s
            return out
        detail = "; ".join(f"{self.step_dir(s)} ({e.why()})" for s, e in bad)
        raise CheckpointError(f"no readable checkpoint in {self.directory}: {detail}") from (
            bad[0][1].__cause__
        )

    # ------------------------------------------------------------------------- helpers

    def _restore_step(self, step: int, abstract) -> tuple[Any, dict]:
        """(state, meta) of one step, verified; _Unreadable naming the damaged file or
        tensor. With several processes the verdict is agreed (all skip, or none)."""
        where = str(self.step_dir(step))
        has_digests, problem = integrity.check_digests(  # first: it names the damaged file
            self.step_dir(step), jax.process_index(), jax.process_count()
        )
        _agreed_ok(step, problem)
        try:
            stored = self._mgr.item_metadata(step)[STATE]
            if stored is None:
                raise FileNotFoundError(f"{where}/{STATE}: no readable tree metadata")
            stored = _leaf_table(stored)
        except _READ_ERRORS as e:
            raise _Unreadable(where) from e
        _check_compatible(stored, _leaf_table(abstract), where)
        has_sums = (self.step_dir(step) / SUMS).is_dir()
        items = {STATE: ocp.args.StandardRestore(abstract), META: ocp.args.JsonRestore()}
        if has_sums:
            items[SUMS] = ocp.args.JsonRestore()
        problem, out = None, None
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**items))
            if not isinstance(out[META], dict):
                raise ValueError(f"{where}/{META}: not a JSON object")
            meta = decode_meta(out[META])
        except Exception as e:  # tensorstore raises bare Exceptions for damaged chunks
            problem = _short(e)
        _agreed_ok(step, problem)  # before the fingerprints: a collective program
        if has_sums:
            _agreed_ok(step, integrity.first_mismatch(out[SUMS], out[STATE]))
        if not (has_digests and has_sums):
            log.warning(
                "checkpoint %s has no %s: restored without verifying it (written by an "
                "older version)",
                where,
                "checksums" if not has_sums else "file digests",
            )
        return out[STATE], meta

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        step, replaced = self._pending
        self._pending = None
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            self._put_back(step, replaced)
            raise self._save_error(step, e) from e
        if replaced is not None and jax.process_index() == 0:
            shutil.rmtree(replaced, ignore_errors=True)
        try:  # the step is committed and intact without them (restore then warns)
            integrity.write_digests(self.step_dir(step), jax.process_index())
        except OSError as e:
            log.warning("checkpoint %s: could not write its file digests (%s)", step, e)

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        self._mgr.reload()
        latest = self.latest_step()
        kept = f"checkpoint {latest} is intact" if latest is not None else "no older checkpoint"
        return CheckpointError(
            f"saving checkpoint step {step} to {self.step_dir(step)} failed ({_short(e)}); {kept}"
        )

    def _quarantine(self, step: int, why: str, *, restored: int) -> None:
        """Moves damaged `step` to corrupt/ so that the resumed run can save it again; one
        log line names the step, what is damaged (the file or tensor) and the fallback."""
        try:
            moved = self._move_aside(step, CORRUPT_DIR)
        except OSError as e:
            log.warning(
                "checkpoint step %d in %s is damaged (%s); restored step %d; could not "
                "move it aside (%s): saving step %d again will fail",
                step, self.step_dir(step), why, restored, e, step,
            )  # fmt: skip
            return
        log.warning(
            "checkpoint step %d is damaged (%s); moved %s to %s; restored step %d",
            step, why, self.step_dir(step), moved, restored,
        )  # fmt: skip

    def _move_aside(self, step: int, folder: str) -> pathlib.Path:
        """Renames step directory `step` into `<directory>/<folder>/` (never deletes)."""
        src = self.step_dir(step)
        dst = self.directory / folder / src.name
        n = 1
        while dst.exists():
            dst, n = self.directory / folder / f"{src.name}.{n}", n + 1
        if jax.process_index() == 0:
            dst.parent.mkdir(exist_ok=True)
            os.replace(src, dst)
        self._sync(f"move_{folder}_{step}")
        return dst

    def _put_back(self, step: int, replaced: pathlib.Path | None) -> None:
        """After a failed forced re-save: the old copy of `step` returns to its place."""
        if replaced is None:
            return
        if jax.process_index() == 0 and not self.step_dir(step).exists():
            os.replace(replaced, self.step_dir(step))
        self._sync(f"put_back_{step}")

    def _sync(self, what: str) -> None:
        """Barrier after a primary-process rename (names must be unique), then re-list."""
        ocp.multihost.sync_global_processes(f"sao_jax_checkpoint_{what}_{next(self._barriers)}")
        self._mgr.reload()


def _agreed_ok(step: int, problem: str | None) -> None:
    """Raises _Unreadable when this process (or, agreed by an all-reduce, another one)
    found `step` damaged, so that every process skips the same steps."""
    anywhere = problem is not None
    if jax.process_count() > 1:
        anywhere = distributed.agree_max(int(anywhere)) > 0
    if anywhere:
        raise _Unreadable(problem or f"step {step} is damaged on another process")
