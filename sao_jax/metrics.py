"""Metric writers (JSONL, TensorBoard) and host-side (sum, count) reduction.

The update step returns metrics as name -> (sum, count) pairs of device scalars. They stay
on the device until a log step: `MetricAccumulator` keeps each step's pairs in a list and
pulls them all to the host in one `jax.device_get` inside `result()`, which sums the pairs
over the steps (float64) and reduces them with `reduce_sum_count` (mean = sum / count, plus
the derived standard deviations and explained variances). The means then go to a CLU
`MetricWriter` built by `create_writers`: `workdir/metrics.jsonl` (what `sao_jax.report.run_report`
reads) and TensorBoard event files under `workdir/tensorboard`, and, when asked for
(config train.wandb_project), a Weights & Biases run (`WandbWriter`; the optional `wandb`
package is imported only then).

Non-finite values: JSONL writes them as null (strict JSON, no NaN tokens); TensorBoard
skips them (a gap in the curve) as some readers reject NaN. Resuming at step s drops the
JSONL lines with step > s and purges TensorBoard events with step > s.

clu 0.0.12's `clu.metric_writers` package imports TensorFlow for its SummaryWriter. Without
TensorFlow we register a bare `clu.metric_writers` package holding the TF-free modules
(interface, MultiWriter, LoggingWriter, AsyncWriter), so every writer here, and
`clu.periodic_actions`, are still CLU MetricWriters.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"  # under the workdir; read by sao_jax.report.run_report
TENSORBOARD_DIR = "tensorboard"


def _tensorboardx():
    """tensorboardX, imported without torch. Its writer module imports torch when torch is
    installed (the test and Hugging Face extras install it) only to accept torch tensors,
    which this module never passes: 1-3 s and ~300 MB of every training process. torch is
    hidden for that import only (a None entry in sys.modules makes `import torch` fail),
    so a later `import torch` in the process, by tensorboardX's converters or anyone else,
    is unaffected. Where torch is already imported, nothing is hidden."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None
    try:
        import tensorboardX
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


def _clu_metric_writers():
    """`clu.metric_writers`, or its TF-free modules under that name when TF is missing."""
    try:
        from clu import metric_writers

        return metric_writers
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("tensorflow"):
            raise
    name = "clu.metric_writers"
    clu_dir = importlib.util.find_spec("clu").submodule_search_locations[0]
    pkg_dir = os.path.join(clu_dir, "metric_writers")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(pkg_dir, "__init__.py"), submodule_search_locations=[pkg_dir]
    )
    shim = importlib.util.module_from_spec(spec)  # not executed: its __init__ imports TF
    sys.modules[name] = shim
    sys.modules["clu"].metric_writers = shim
    for module, attrs in [
        ("interface", ["MetricWriter"]),
        ("multi_writer", ["MultiWriter"]),
        ("logging_writer", ["LoggingWriter"]),
        ("async_writer", ["AsyncWriter", "AsyncMultiWriter", "ensure_flushes"]),
    ]:
        mod = importlib.import_module(f"{name}.{module}")
        for attr in attrs:
            setattr(shim, attr, getattr(mod, attr))
    return shim


_mw = _clu_metric_writers()
MetricWriter = _mw.MetricWriter
MultiWriter = _mw.MultiWriter

Scalar = float | int | bool | None


def as_scalar(name: str, value: Any) -> Scalar:
    """A numeric size-1 value as a Python number; None if it is a non-finite float."""
    x = np.asarray(value)
    if x.size != 1:
        raise ValueError(f"metric {name!r}: expected a scalar, got shape {x.shape}")
    if x.dtype.kind == "b":
        return bool(x.item())
    if x.dtype.kind in "iu":
        return int(x.item())
    if x.dtype.kind == "f":
        f = float(x.item())
        return f if math.isfinite(f) else None
    raise TypeError(f"metric {name!r}: expected a number, got {type(value).__name__} ({x.dtype})")


# --------------------------------------------------------------------------- writers


class _ScalarWriter(MetricWriter):
    """A MetricWriter that ignores everything but scalars unless a subclass overrides it;
    `write_summaries` keeps the size-1 values as scalars."""

    def write_summaries(self, step: int, values: Mapping[str, Any], metadata=None):
        self.write_scalars(step, {k: v for k, v in values.items() if np.size(v) == 1})

    def write_images(self, step, images):
        pass

    def write_videos(self, step, videos):
        pass

    def write_audios(self, step, audios, *, sample_rate):
        pass

    def write_texts(self, step, texts):
        pass

    def write_histograms(self, step, arrays, num_buckets=None):
        pass

    def write_hparams(self, hparams):
        pass


class JsonlWriter(_ScalarWriter):
    """One JSON object per `write_scalars`: {"step": s, "time": unix seconds, **scalars}.

    Appends to `path` (a resumed run continues the file; call `truncate_after(step)` first)
    and flushes after every write. Non-finite floats are written as null. A torn last line
    (a crash mid-write) is dropped on open. Only scalars are stored: images, videos,
    audios, texts, histograms and hparams are ignored (TensorBoard keeps those).
    """

    def __init__(self, path: str | os.PathLike, *, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        _drop_torn_tail(self.path)
        self._file: TextIO = self.path.open("a", encoding="utf-8")

    def truncate_after(self, step: int) -> int:
        """Drops the lines with step > `step` (resume at `step`); returns how many."""
        self._file.flush()
        return truncate_jsonl(self.path, step)

    def write_scalars(self, step: int, scalars: Mapping[str, Any]):
        reserved = {"step", "time"} & set(scalars)
        if reserved:
            raise ValueError(f"JsonlWriter: metric name {sorted(reserved)[0]!r} is reserved")
        record = {"step": int(step), "time": self._clock()}
        record.update((k, as_scalar(k, v)) for k, v in scalars.items())
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


def truncate_jsonl(path: str | os.PathLike, step: int) -> int:
    """Drops the lines with step > `step` from a metrics file (or workdir/metrics.jsonl)
    in place; returns how many. An open JsonlWriter (append mode) stays valid. When the
    kept lines are a prefix (steps in order) this is one truncate call, else a rewrite."""
    path = Path(path)
    path = path / METRICS_FILE if path.is_dir() else path
    if not path.exists():
        return 0
    _drop_torn_tail(path)
    lines = path.read_bytes().splitlines(keepends=True)
    records = [_parse_line(path, i, line) if line.strip() else None for i, line in enumerate(lines)]
    keep = [r is None or r["step"] <= step for r in records]
    dropped = keep.count(False)
    first_drop = keep.index(False) if dropped else len(keep)
    if not any(keep[first_drop:]):  # the kept lines are a prefix
        os.truncate(path, sum(len(line) for line in lines[:first_drop]))
    else:
        with path.open("r+b") as f:
            f.writelines(line for line, k in zip(lines, keep) if k)
            f.truncate()
    return dropped


def _drop_torn_tail(path: Path) -> None:
    """Cuts a last line that has no newline (a write interrupted by a crash)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in file order (null stays None).

    Blank lines and a torn last line (no newline, not valid JSON) are skipped; any other
    malformed line, or a record without an integer "step", raises ValueError naming it.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    last = len(lines) - 1  # text after the last newline: a line torn by a crash
    return [
        _parse_line(path, i, line)
        for i, line in enumerate(lines)
        if line.strip() and not (i == last and not _is_json(line))
    ]


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _parse_line(path: Path, i: int, line: str | bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from e
    if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
        raise ValueError(f"{path}:{i + 1}: expected an object with an integer 'step'")
    return record


class TensorboardWriter(_ScalarWriter):
    """TensorBoard event files through tensorboardX (no TensorFlow).

    Non-finite scalars are skipped. `purge_step=p` hides events with step >= p left by an
    earlier run (resume). hparams become one markdown text summary; videos and audios are
    ignored.
    """

    def __init__(self, logdir: str | os.PathLike, *, purge_step: int | None = None):
        self.logdir = Path(logdir)
        self._w = _tensorboardx().SummaryWriter(
            logdir=str(self.logdir), purge_step=purge_step, flush_secs=30
        )

    def write_scalars(self, step: int, scalars: Mapping[str, Any]):
        for k, v in scalars.items():
            x = as_scalar(k, v)
            if x is not None:
                self._w.add_scalar(k, float(x), global_step=int(step))

    def write_summaries(self, step: int, values: Mapping[str, Any], metadata=None):
        super().write_summaries(step, values)
        self.write_histograms(step, {k: v for k, v in values.items() if np.size(v) != 1})

    def write_images(self, step, images):
        for k, img in images.items():
            img = np.asarray(img)
            img_nhwc = img[None] if img.ndim == 3 else img
            if img_nhwc.ndim != 4:
                raise ValueError(
                    f"image {k!r}: expected [N, H, W, C] or [H, W, C], got {img.shape}"
                )
            self._w.add_images(k, img_nhwc, global_step=int(step), dataformats="NHWC")

    def write_texts(self, step, texts):
        for k, text in texts.items():
            self._w.add_text(k, str(text), global_step=int(step))

    def write_histograms(self, step, arrays, num_buckets=None):
        for k, x in arrays.items():
            bins = (num_buckets or {}).get(k, "tensorflow")
            self._w.add_histogram(k, np.asarray(x), global_step=int(step), bins=bins)

    def write_hparams(self, hparams):
        rows = "".join(f"| {k} | {v} |\n" for k, v in sorted(hparams.items()))
        self._w.add_text("hparams", "| name | value |\n|---|---|\n" + rows, global_step=0)

    def flush(self):
        self._w.flush()

    def close(self):
        self._w.close()


WANDB_DIR = "wandb"  # <workdir>/wandb: the W&B run's files (offline runs: `wandb sync`)
WANDB_ID_FILE = "sao_run_id"  # <workdir>/wandb/<this>: the run id a resume continues


def import_wandb():
    """The `wandb` module (an optional dependency: `pip install wandb`)."""
    return importlib.import_module("wandb")


class WandbWriter(_ScalarWriter):
    """Scalars to a Weights & Biases run (`wandb.init` / `run.log(..., step=)`).

    One W&B run per workdir: its id is kept in <workdir>/wandb/sao_run_id, so a resumed
    run continues it (`resume="allow"`; W&B ignores a step already logged). Non-finite
    values are left out, as in TensorBoard. `config`: the run config, shown by W&B.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        project: str,
        entity: str = "",
        name: str = "",
        mode: str = "online",
        config: Mapping[str, Any] | None = None,
    ):
        wandb = import_wandb()
        root = Path(workdir) / WANDB_DIR
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / WANDB_ID_FILE
        if not id_file.is_file():
            id_file.write_text(os.urandom(6).hex() + "\n")
        self.run_id = id_file.read_text().strip()
        self._run = wandb.init(
            project=project,
            entity=entity or None,
            name=name or Path(workdir).resolve().name,
            mode=mode,
            dir=str(Path(workdir)),
            id=self.run_id,
            resume="allow",
            config=dict(config or {}),
        )

    def write_scalars(self, step: int, scalars: Mapping[str, Any]):
        row = {k: as_scalar(k, v) for k, v in scalars.items()}
        self._run.log({k: v for k, v in row.items() if v is not None}, step=int(step))

    def flush(self):
        pass  # wandb sends (or, offline, writes) in the background

    def close(self):
        self._run.finish()


def create_writers(
    workdir: str | os.PathLike,
    *,
    tensorboard: bool = True,
    jsonl: bool = True,
    resume_step: int | None = None,
    primary: bool | None = None,
    wandb: Mapping[str, Any] | None = None,
) -> MetricWriter:
    """A clu MultiWriter over workdir/metrics.jsonl and workdir/tensorboard.

    resume_step: the step restored from a checkpoint; JSONL lines and TensorBoard events
      with a larger step are dropped (-1 drops all). None keeps everything and appends.
    primary: whether this process writes (default: jax.process_index() == 0); the other
      processes get a MultiWriter over no writers.
    wandb: WandbWriter keyword arguments (project, entity, name, mode, config) to log to
      Weights & Biases as well; None: not.
    """
    if primary is None:
        primary = jax.process_index() == 0
    writers = []
    if primary and jsonl:
        writer = JsonlWriter(Path(workdir) / METRICS_FILE)
        if resume_step is not None:
            writer.truncate_after(resume_step)
        writers.append(writer)
    if primary and tensorboard:
        purge = None if resume_step is None else resume_step + 1
        writers.append(TensorboardWriter(Path(workdir) / TENSORBOARD_DIR, purge_step=purge))
    if primary and wandb:
        writers.append(WandbWriter(workdir, **wandb))
    return MultiWriter(writers)


class StageWriter:
    """Metrics of a stage that runs before RL step 0 with a step counter of its own (value
    pretraining), so that they never collide with RL steps nor fall to a resume's purge:

    * workdir/metrics.jsonl: records at step `at_step` (0) carrying `step_key`: k (the
      same file as the run's writer, appended and flushed per record);
    * TensorBoard: scalars at step k under workdir/tensorboard/<subdir>/, a run of its
      own (earlier events there are purged: the stage restarts from k = 0).

    Only the primary process writes (default: jax.process_index() == 0).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        subdir: str,
        step_key: str,
        *,
        at_step: int = 0,
        primary: bool | None = None,
    ):
        primary = jax.process_index() == 0 if primary is None else primary
        self.step_key, self.at_step = step_key, at_step
        self._jsonl = JsonlWriter(Path(workdir) / METRICS_FILE) if primary else None
        logdir = Path(workdir) / TENSORBOARD_DIR / subdir
        self._tb = TensorboardWriter(logdir, purge_step=0) if primary else None

    def write(self, k: int, scalars: Mapping[str, Any]) -> None:
        if self._jsonl is None:
            return
        self._jsonl.write_scalars(self.at_step, {self.step_key: int(k), **scalars})
        self._tb.write_scalars(int(k), scalars)

    def close(self) -> None:
        for w in (self._jsonl, self._tb):
            if w is not None:
                w.close()


# ------------------------------------------------------------------- host reductions


def _float(name: str, value: Any) -> float:
    x = np.asarray(value)
    if x.size != 1 or x.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r}: expected a numeric scalar, got {x.dtype} {x.shape}")
    return float(x.item())


def _pair(name: str, value: Any) -> tuple[Any, Any]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise TypeError(
            f"metric {name!r}: expected a (sum, count) pair, got {type(value).__name__}"
        )
    return value[0], value[1]


def derived_metrics(means: Mapping[str, float]) -> dict[str, float]:
    """Statistics derived from means of x and x^2 (each a (sum, count) mean):

    * `N_std` for each pair `N`, `N_sq`: sqrt(max(E[x^2] - E[x]^2, 0));
    * `P/explained_variance` for each prefix P with value_residual(_sq), returns(_sq):
      EV = 1 - Var(R - V) / Var(R), Var(y) = E[y^2] - E[y]^2, over the tokens counted
      (0 when Var(R) = 0, like `sao_jax.rl.metrics.explained_variance`).
    Float32 device sums lose precision when |mean| >> std; these are diagnostics.
    """
    out = {}
    var = lambda n: max(means[f"{n}_sq"] - means[n] ** 2, 0.0)
    for name in means:
        if name.endswith("_sq") and name[:-3] in means:
            out[f"{name[:-3]}_std"] = math.sqrt(var(name[:-3]))
    for name in means:
        prefix = name.removesuffix("/value_residual")
        keys = [f"{prefix}/{k}" for k in ("value_residual", "returns")]
        if prefix != name and all(k in means and f"{k}_sq" in means for k in keys):
            var_res, var_r = var(keys[0]), var(keys[1])
            ev = 1.0 - var_res / var_r if var_r > 0 else 0.0
            out[f"{prefix}/explained_variance"] = ev if math.isfinite(var_res + var_r) else math.nan
    return out


def pair_means(metrics: Mapping[str, Any]) -> dict[str, float]:
    """name -> (sum, count) pairs (device or host) or plain scalars -> floats: the one host
    reduction of the (sum, count) metrics (sao_jax/rl/metrics.py makes them).

    A pair becomes sum / count (NaN when count is 0); a plain scalar is passed through.
    One `jax.device_get` for the whole mapping.
    """
    out = {}
    for name, value in jax.device_get(dict(metrics)).items():
        if isinstance(value, tuple | list):
            s, c = (_float(name, x) for x in _pair(name, value))
            out[name] = s / c if c > 0 else math.nan
        else:
            out[name] = _float(name, value)
    return out


def reduce_sum_count(metrics: Mapping[str, Any]) -> dict[str, float]:
    """`pair_means`, plus the `derived_metrics` of those means (what a run logs)."""
    out = pair_means(metrics)
    return out | derived_metrics(out)


class MetricAccumulator:
    """Keeps per-step (sum, count) metrics on the device; sums them on the host on demand.

    `add` only appends references (no transfer, no sync). `result()` fetches all held
    steps in one `jax.device_get`, sums each name's pairs over the steps that have it (in
    float64), reduces with `reduce_sum_count` and clears. A NaN sum in any step makes that
    name NaN for the window.
    """

    def __init__(self):
        self._steps: list[dict[str, tuple[Any, Any]]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, metrics: Mapping[str, Any]) -> None:
        self._steps.append({k: _pair(k, v) for k, v in metrics.items()})

    def reset(self) -> None:
        self._steps = []

    def result(self) -> dict[str, float]:
        totals: dict[str, list[float]] = {}
        for step in jax.device_get(self._steps):
            for name, (s, c) in step.items():
                acc = totals.setdefault(name, [0.0, 0.0])
                acc[0] += _float(name, s)
                acc[1] += _float(name, c)
        self.reset()
        return reduce_sum_count({k: tuple(v) for k, v in totals.items()})
