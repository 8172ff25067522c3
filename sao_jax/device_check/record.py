"""The device check's record and clock: phases with time caps, progress lines, a JSON
rewritten after every phase, a Markdown table, and a watchdog for the whole budget.

A phase runs as `Record.run(name, cap_s, work)`. Its cap is what it may spend: work that
has not started when the cap (or the whole budget) is spent is skipped and recorded as
such (`Phase.time_left`, `Phase.skip`); a compile in flight cannot be interrupted, so the
watchdog thread ends the process when the whole budget is gone, after writing the JSON
with the running phase marked 'timeout'. So a run killed from outside, or by the
watchdog, still leaves every finished phase's results on disk.

Statuses: ok, failed (a check out of tolerance, or an error), skipped (nothing to check
on this device, e.g. weight sync with one device), incomplete (the cap or budget ran out
before all of its work), timeout (the budget ran out inside it). Exit codes: 0 every
phase ok or skipped; 1 a phase failed (the first one is named); 3 a phase incomplete or
timed out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

JSON_NAME, MD_NAME = "device_check.json", "device_check.md"
EXIT_OK, EXIT_FAILED, EXIT_INCOMPLETE = 0, 1, 3


@dataclasses.dataclass
class Phase:
    """One phase's results, checks and time."""

    name: str
    cap_s: float
    started: float  # time.monotonic() at its start
    deadline: float  # time.monotonic() after which no new work starts
    status: str = "running"
    seconds: float = 0.0
    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    skipped_work: list[str] = dataclasses.field(default_factory=list)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def skip(self, what: str) -> None:
        """Records work not started because the cap or the budget is spent."""
        self.skipped_work.append(what)

    def check(self, name: str, error: float, tolerance: float) -> bool:
        """Records `error <= tolerance` (a non-finite error fails)."""
        ok = bool(math.isfinite(error) and error <= tolerance)
        self.checks.append(dict(name=name, error=float(error), tolerance=tolerance, ok=ok))
        return ok

    def note(self, text: str) -> None:
        self.notes.append(text)

    def summary(self) -> str:
        """One line of the key figures: checks, then results."""
        parts = [f"{c['name']} {c['error']:.2e} (tol {c['tolerance']:.0e})" for c in self.checks]
        for k, v in self.results.items():
            items = v.items() if isinstance(v, dict) else [("", v)]
            parts += [f"{k}{'.' if sub else ''}{sub}={_short(x)}" for sub, x in items]
        parts += [f"skipped: {w}" for w in self.skipped_work] + self.notes
        return "; ".join(parts)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class Record:
    """The results of one device check run (module docstring)."""

    def __init__(self, out_dir: str | os.PathLike, budget_s: float, meta: dict[str, Any]):
        self.out_dir = pathlib.Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.meta = dict(meta)
        self.phases: list[Phase] = []
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    # ------------------------------------------------------------------------ clock

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def start_watchdog(self, grace_s: float = 5.0) -> None:
        """Ends the process (status 3) `grace_s` after the budget, JSON written first."""

        def watch():
            while time.monotonic() < self.deadline + grace_s:
                time.sleep(0.5)
            running = next((p for p in self.phases if p.status == "running"), None)
            with self._lock:
                if running is not None:
                    running.status = "timeout"
                    running.seconds = time.monotonic() - running.started
                self._write()
                (self.out_dir / MD_NAME).write_text(self.markdown())
            name = running.name if running else "-"
            print(f"[device_check] budget of {self.budget_s:.0f} s spent in {name}", flush=True)
            os._exit(EXIT_INCOMPLETE)

        self._watchdog = threading.Thread(target=watch, name="device_check_watchdog", daemon=True)
        self._watchdog.start()

    # ----------------------------------------------------------------------- phases

    def run(self, name: str, cap_s: float, work: Callable[[Phase], None]) -> Phase:
        """Runs `work(phase)`: progress lines, its status from what happened (an exception
        is a failed phase, not a crashed check), the JSON rewritten after."""
        start = time.monotonic()
        p = Phase(name, cap_s, start, min(start + cap_s, self.deadline))
        with self._lock:
            self.phases.append(p)
        print(
            f"[device_check] {name}: start (cap {cap_s:.0f} s, {self.time_left():.0f} s of "
            f"the budget left)",
            flush=True,
        )
        try:
            if p.time_left() <= 0:
                p.skip("all (budget spent)")
            else:
                work(p)
        except Exception as e:
            p.status = "failed"
            p.note(f"error: {type(e).__name__}: {e}")
            traceback.print_exc()
        with self._lock:
            p.seconds = time.monotonic() - start
            if p.status == "running":
                p.status = self._status(p)
            self._write()
        print(f"[device_check] {name}: {p.status} in {p.seconds:.1f} s: {p.summary()}", flush=True)
        return p

    @staticmethod
    def _status(p: Phase) -> str:
        if any(not c["ok"] for c in p.checks):
            return "failed"
        if p.skipped_work:
            return "incomplete"
        if not p.checks and not p.results:
            return "skipped"
        return "ok"

    # ---------------------------------------------------------------------- outputs

    def first_problem(self) -> tuple[int, str | None]:
        """(exit code, the first failed phase, else the first incomplete one)."""
        for p in self.phases:
            if p.status == "failed":
                failed = [c["name"] for c in p.checks if not c["ok"]]
                why = f"{p.name} ({', '.join(failed)})" if failed else f"{p.name} ({p.notes[-1]})"
                return EXIT_FAILED, why
        for p in self.phases:
            if p.status in ("incomplete", "timeout"):
                return EXIT_INCOMPLETE, f"{p.name} ({p.status})"
        return EXIT_OK, None

    def as_dict(self) -> dict[str, Any]:
        code, problem = self.first_problem()
        return dict(
            **self.meta,
            budget_s=self.budget_s,
            elapsed_s=round(self.elapsed(), 2),
            exit_code=code,
            first_problem=problem,
            phases={p.name: dataclasses.asdict(p) for p in self.phases},
        )

    def _write(self) -> None:
        data = self.as_dict()
        for p in data["phases"].values():
            p.pop("started"), p.pop("deadline")
        tmp = self.out_dir / (JSON_NAME + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out_dir / JSON_NAME)

    def markdown(self) -> str:
        """The table of phases: status, seconds and key figures."""
        head = [
            f"# Device check: {self.meta.get('device_kind', '?')} ({self.meta.get('mode', '?')})",
            "",
            f"{len(self.phases)} phases in {self.elapsed():.1f} s of a {self.budget_s:.0f} s "
            f"budget; exit code {self.first_problem()[0]}.",
            "",
            "| phase | status | s | figures |",
            "|---|---|---:|---|",
        ]
        rows = [
            f"| {p.name} | {p.status} | {p.seconds:.1f} | {p.summary().replace('|', '/')} |"
            for p in self.phases
        ]
        return "\n".join(head + rows) + "\n"

    def finish(self) -> int:
        """Writes the JSON and the Markdown table; prints and returns the exit code."""
        with self._lock:
            self._write()
            (self.out_dir / MD_NAME).write_text(self.markdown())
        code, problem = self.first_problem()
        where = self.out_dir / JSON_NAME
        if problem:
            print(f"[device_check] FIRST PROBLEM: {problem}; results in {where}", file=sys.stderr)
        else:
            print(f"[device_check] all phases passed; results in {where}", flush=True)
        return code


def timed(call: Callable[[], Any], repeats: int, phase: Phase | None = None) -> dict[str, Any]:
    """Runs `call()` once (compile + warm-up) then `repeats` times, each to completion:
    {'first_s', 'median_s', 'times_s', 'out'} (`out`: the last result). With `phase`, a
    repeat that would end after its cap is not started (noted; one always runs)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(call())
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats):
        if times and phase is not None and phase.time_left() < 2 * times[-1]:
            phase.note(f"{i} of {repeats} timed repeats (cap)")
            break
        t0 = time.perf_counter()
        out = jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    times = times or [first]
    return dict(first_s=first, median_s=float(np.median(times)), times_s=times, out=out)
