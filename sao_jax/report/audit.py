"""Auditable results: each table's runs, trimmed to what its report reads, in one file.

A table script writes `<out_dir>/<name>.md` from its sweep's runs (sao_jax.sweep
PointResult: the run's `summary.json` and `metrics.jsonl` history). `Recorder` hands the
report the same results with every summary and history record wrapped so that the keys
the report reads are noted; `write_runs` then keeps, per run, only those keys (the step of
each record, the summary's noted top-level entries whole) in `<out_dir>/<name>_runs.jsonl`:
one JSON object per line, the first the invocation's header (`wall_s`), then one per run.
`read_runs` gives the results back, so a reader recomputes every cell of the table
without rerunning anything (`python -m experiments.<script> --from_runs=<file>`; the
sweep is taken back as the file ran it, `recorded_spec`, not as today's config sizes the
mode), and tests/test_audit.py checks that a committed table regenerated from its file is
the same text.

A report that iterates over a record's keys (rather than reading named ones) marks that
kind of record as read whole, so nothing it could have used is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from sao_jax.schema import ConfigError
from sao_jax.sweep.results import PointResult
from sao_jax.sweep.spec import Point, SweepSpec, expand

RUNS_SUFFIX = "_runs.jsonl"
ALL = "*"  # a record kind read whole (its keys were iterated)
STEP = "step"  # every history record keeps its step


class _Noted(dict):
    """A dict that notes which of its keys are read (into the shared set `used`)."""

    def __init__(self, data: dict, used: set[str]):
        super().__init__(data)
        self._used = used

    def __getitem__(self, key):
        self._used.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._used.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._used.add(key)
        return super().__contains__(key)

    def _all(self):
        self._used.add(ALL)

    def keys(self):
        self._all()
        return super().keys()

    def items(self):
        self._all()
        return super().items()

    def values(self):
        self._all()
        return super().values()

    def __iter__(self):
        self._all()
        return super().__iter__()


class Recorder:
    """Wraps results so that the summary and history keys a report reads are noted."""

    def __init__(self) -> None:
        self.summary_keys: set[str] = set()
        self.history_keys: set[str] = set()

    def wrap(self, results: Sequence[PointResult]) -> list[PointResult]:
        return [
            dataclasses.replace(
                r,
                summary=None if r.summary is None else _Noted(r.summary, self.summary_keys),
                history=[_Noted(rec, self.history_keys) for rec in r.history],
            )
            for r in results
        ]


def _trim(record: dict | None, keys: set[str], always: tuple[str, ...] = ()) -> dict | None:
    if record is None:
        return None
    if ALL in keys:
        return dict(dict.items(record))
    return {k: v for k, v in dict.items(record) if k in keys or k in always}


def runs_path(out_dir: str | os.PathLike, name: str) -> pathlib.Path:
    return pathlib.Path(out_dir) / f"{name}{RUNS_SUFFIX}"


class Header(NamedTuple):
    """The first line of a runs file: the invocation's wall time and settings."""

    wall_s: float
    settings: dict[str, Any]  # sao_jax.report.experiment.Experiment.settings()


def write_runs(
    path: str | os.PathLike,
    results: Sequence[PointResult],
    recorder: Recorder,
    wall_s: float,
    settings: dict[str, Any],
) -> pathlib.Path:
    """`<out_dir>/<name>_runs.jsonl`: the header, then each run trimmed to the noted keys
    (history records that keep nothing but their step are dropped)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"wall_s": wall_s, "settings": settings})]
    for r in results:
        history = [_trim(rec, recorder.history_keys, (STEP,)) for rec in r.history]
        lines.append(
            json.dumps(
                {
                    "point": dataclasses.asdict(r.point),
                    "workdir": str(r.workdir),
                    "status": r.status,
                    "summary": _trim(r.summary, recorder.summary_keys),
                    "history": [h for h in history if set(h) - {STEP}],
                    "error": r.error,
                    "reused": r.reused,
                    "warm_start": r.warm_start,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _point(d: dict[str, Any]) -> Point:
    as_pairs = lambda items: tuple((k, _tuples(v)) for k, v in items)
    return Point(
        d["config"],
        d["variant"],
        d["common_arg"],
        int(d["seed"]),
        as_pairs(d["overrides"]),
        as_pairs(d["fixed"]),
    )


def _tuples(x: Any) -> Any:
    """JSON lists back to the tuples a Point's overrides held."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def read_runs(path: str | os.PathLike) -> tuple[list[PointResult], Header]:
    """(results, header) from a `write_runs` file; ConfigError naming the file and line
    when it is not one (the script exits 2 with that line)."""
    path = pathlib.Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--from_runs: cannot read {path} ({e.strerror})") from None
    results, header = [], None
    for i, line in enumerate(lines, start=1):
        try:
            d = json.loads(line)
            if i == 1:
                header = Header(float(d["wall_s"]), dict(d["settings"]))
                continue
            results.append(
                PointResult(
                    _point(d["point"]),
                    pathlib.Path(d["workdir"]),
                    d["status"],
                    d["summary"],
                    d["history"],
                    d.get("error", ""),
                    bool(d.get("reused", False)),
                    d.get("warm_start"),
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--from_runs: {path}:{i} is not a runs record ({e})") from None
    if header is None:
        raise ConfigError(f"--from_runs: {path} is empty")
    return results, header


def _of_sweep(spec: SweepSpec, results: Sequence[PointResult]) -> list[PointResult]:
    """The results of `spec`'s config and common arg (a script may record several)."""
    return [
        r
        for r in results
        if r.point.config == spec.config and r.point.common_arg == spec.common_arg
    ]


def recorded_spec(spec: SweepSpec, results: Sequence[PointResult]) -> SweepSpec:
    """`spec` as the recorded runs ran it: their rows and seeds (in the order run) and
    their shared overrides (`fixed`: a switch schedule, the step count), so that a table
    regenerated after its config's mode was resized says what was run. Runs of another
    config (a script with several sweeps) are not `spec`'s; with none of its own, `spec`
    comes back unchanged. ConfigError when its runs disagree on the shared overrides."""
    points = [r.point for r in _of_sweep(spec, results)]
    if not points:
        return spec
    fixed = {p.fixed for p in points}
    if len(fixed) > 1:
        raise ConfigError(
            f"--from_runs: the runs of sweep {spec.name!r} were run with different shared "
            f"overrides ({len(fixed)} sets): not one sweep"
        )
    return dataclasses.replace(
        spec,
        variants=tuple(dict.fromkeys(p.variant for p in points)),
        seeds=tuple(dict.fromkeys(p.seed for p in points)),
        fixed=dict(fixed.pop()),
    )


def check_addable(spec: SweepSpec, earlier: Sequence[PointResult], path) -> None:
    """ConfigError unless `spec`'s points can be added to the `earlier` runs of the runs
    file `path` as one sweep: runs of the same config there, the same shared overrides
    (schedule, steps), and no point finished there (a finished run is never run twice;
    one recorded unfinished, by a stopped invocation, is run and replaces it)."""
    mine = [r.point for r in _of_sweep(spec, earlier)]
    if not mine:
        raise ConfigError(f"--add_to: {path} holds no run of sweep {spec.name!r}")
    new = expand(spec)
    if {p.fixed for p in mine} != {p.fixed for p in new}:
        raise ConfigError(
            f"--add_to: the runs in {path} were run with other shared overrides than "
            f"sweep {spec.name!r} sets now ({dict(mine[0].fixed)} vs {dict(new[0].fixed)}): "
            "not one sweep"
        )
    done = {r.point.name for r in earlier if r.status == "done"}
    both = sorted(done & {p.name for p in new})
    if both:
        raise ConfigError(
            f"--add_to: {len(both)} point(s) are already in {path} (e.g. {both[0]}); "
            "choose --rows / --seeds that it does not hold finished"
        )


def add_runs(
    spec: SweepSpec, order: SweepSpec, results: Sequence[PointResult], earlier
) -> tuple[SweepSpec, list[PointResult]]:
    """(the sweep the `earlier` recorded runs and this invocation's `results` of `spec`
    make up, every result in its order): rows and seeds in the order of `order` (the
    mode's whole sweep), the earlier runs marked reused; an earlier unfinished run that
    this invocation ran is replaced by it."""
    known = [dataclasses.replace(r, reused=True) for r in _of_sweep(spec, earlier)]
    runs = {r.point.name: r for r in [*known, *results]}
    pick = lambda have, full: (
        tuple(x for x in full if x in have) + tuple(x for x in dict.fromkeys(have) if x not in full)
    )
    variants = pick([r.point.variant for r in runs.values()], order.variants)
    seeds = pick([r.point.seed for r in runs.values()], order.seeds)
    merged = dataclasses.replace(spec, variants=variants, seeds=seeds)
    return merged, [runs[p.name] for p in expand(merged) if p.name in runs]


def warm_start_check(
    results: Sequence[PointResult],
) -> tuple[dict[str, list[int]], list[int]]:
    """({'policy': seeds, 'critic': seeds} whose runs record different digests of that
    part of their warm start, seeds with a run that records no policy digest): the runs
    of one seed should start from the same tensors. (The SFT policy is re-created bitwise
    by a later invocation; the pretrained critic is not: value pretraining's rollouts come
    from the asynchronous sampler, so its batches depend on timing.)"""
    by_seed: dict[int, list] = {}
    for r in results:
        by_seed.setdefault(r.point.seed, []).append(r.warm_start)
    differ: dict[str, list[int]] = {"policy": [], "critic": []}
    unchecked = []
    for seed, starts in sorted(by_seed.items()):
        if any(not s or s.get("policy") is None for s in starts):
            unchecked.append(seed)
        for part, seeds in differ.items():
            if len({s.get(part) for s in starts if s and s.get(part) is not None}) > 1:
                seeds.append(seed)
    return differ, unchecked


def _policy_digests(path: pathlib.Path) -> set[str]:
    """The SFT warm-start digests (`warm_start['policy']`) the runs of a runs file
    record. `write_runs` writes `warm_start` last on each line, so only each line's tail
    is parsed (the files hold megabytes of history); a line written otherwise is parsed
    whole."""
    out = set()
    for line in path.read_text().splitlines()[1:]:
        at = line.rfind('"warm_start": ')
        try:
            start = json.loads(line[at + len('"warm_start": ') : -1]) if at >= 0 else None
        except ValueError:
            start = json.loads(line).get("warm_start")
        if start and start.get("policy"):
            out.add(start["policy"])
    return out


def shared_warm_starts(
    results: Sequence[PointResult], root: str | os.PathLike, own: Sequence[str | os.PathLike]
) -> dict[str, int]:
    """{table: how many of `results`' SFT warm starts (policy digests) its runs share} for
    every committed table under `root` (each `<name>.md` beside its `<name>_runs.jsonl`)
    whose runs start from a policy these do, but the runs files in `own` (this table's):
    runs that share a warm start are not independent samples of one another's tables."""
    mine = {r.warm_start["policy"] for r in results if r.warm_start and r.warm_start.get("policy")}
    skip = {pathlib.Path(p).resolve() for p in own}
    out = {}
    root = pathlib.Path(root)
    for path in sorted(root.rglob(f"*{RUNS_SUFFIX}")):
        table = path.with_name(path.name[: -len(RUNS_SUFFIX)] + ".md")
        if path.resolve() in skip or not table.exists() or not mine:
            continue
        n = len(mine & _policy_digests(path))
        if n:
            out[str(table)] = n
    return out


PREREGISTRATION = "preregistration.json"


def read_preregistration(folder: str | os.PathLike, name: str) -> dict[str, Any] | None:
    """The pre-registration of table `name` from `<folder>/preregistration.json` ({table
    name: {'file': the PREREGISTRATION*.md, 'commit': the commit that added it, 'seeds',
    'rows', 'family': what is tested, optionally 'tests': 'secondary' for a table made
    under a pre-registration of the main table's other family}); None when the folder has
    none for it (a pilot). ConfigError naming the file when it is malformed."""
    path = pathlib.Path(folder) / PREREGISTRATION
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text()).get(name)
        if entry is None:
            return None
        for key, kind in (("file", str), ("commit", str), ("family", str)):
            if not isinstance(entry[key], kind):
                raise TypeError(f"'{key}' is not a {kind.__name__}")
        entry["seeds"] = [int(s) for s in entry["seeds"]]
        entry["rows"] = [str(r) for r in entry["rows"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{path}: table {name!r} is not a pre-registration entry ({e})") from None
    return entry


def unfinished(prereg: dict[str, Any], results: Sequence[PointResult]) -> list[str]:
    """The pre-registered (row, seed) points of `prereg` without a finished run among
    `results` (or with one of their runs unfinished), as 'row, seed s'."""
    runs: dict[tuple[str, int], list[str]] = {}
    for r in results:
        runs.setdefault((r.point.variant, r.point.seed), []).append(r.status)
    return [
        f"{row}, seed {seed}"
        for row in prereg["rows"]
        for seed in prereg["seeds"]
        if not runs.get((row, seed)) or any(s != "done" for s in runs[(row, seed)])
    ]
