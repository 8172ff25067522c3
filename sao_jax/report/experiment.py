"""How an experiment script runs its sweep and writes its report: `Experiment`, the
command-line flags shared by the table scripts (`flags()`), their main (`table_main`), and
what every report of a sweep says about its runs.

A table script (experiments/<name>/__main__.py) is `main = table_main(name, sweep_of,
write)` and `app.run(main)`; its reading (`write`) lives beside it in experiments/<name>/.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import shlex
import subprocess
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from sao_jax import cli, sweep
from sao_jax.report import audit, tables
from sao_jax.report.audit import warm_start_check
from sao_jax.schema import ConfigError


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Where the runs live, where the report goes, which seeds and rows run, and how."""

    mode: str = "quick"  # smoke | quick | full: the sweep's size
    sweep_dir: str | None = None  # the runs' workdirs (None: workdirs/sweeps/<mode>)
    out_dir: str | None = None  # tables and plots (None: results/<mode>)
    parallel: int = 1  # training runs at the same time
    launcher: str = "local"  # where runs are started (sao_jax.sweep.LAUNCHERS)
    dry_run: bool = False  # print the runs' commands, run nothing
    seeds: Sequence[str] | None = None  # seeds instead of the mode's (as given)
    rows: Sequence[str] | None = None  # rows (the sweep's variants) instead of all
    command: str = ""  # the invocation, as the report header shows it
    # invocations whose recorded runs this one adds to (--add_to), oldest first: each
    # {'command', 'wall_s', 'runs_file'}
    earlier: Sequence[dict[str, Any]] = ()
    # the code the runs were made with, {'sha': `git rev-parse HEAD` or None outside a git
    # checkout, 'dirty': uncommitted changes to tracked files or None}: `git_commit()` at
    # run time; None: not recorded (runs files written before it was)
    commit: dict[str, Any] | None = None
    # where the other committed tables are (None: not looked for) and this table's own
    # runs files, which are not other tables: the header names the tables whose runs
    # share SFT warm starts with these (`audit.shared_warm_starts`)
    results_root: str | None = None
    own_runs: Sequence[str] = ()
    # the table's pre-registration (audit.read_preregistration; None: a pilot), looked for
    # only when `prereg_folder` is set (the folder of its runs file)
    prereg: dict[str, Any] | None = None
    prereg_folder: str | None = None

    def reading(self, results) -> str:
        """'read' (every pre-registered run finished), 'incomplete: not read' (a
        pre-registered run missing or unfinished), 'pilot: not a test' (no
        pre-registration beside the table), or '' (not looked for)."""
        if self.prereg_folder is None:
            return ""
        if self.prereg is None:
            return PILOT
        return INCOMPLETE if audit.unfinished(self.prereg, results) else "read"

    def withheld(self, results) -> str:
        """PILOT or INCOMPLETE where the table's tests are not read: a report prints it in
        every test cell (p, Holm p, verdict) and reading in place of the test; '' else."""
        state = self.reading(results)
        return state if state in (PILOT, INCOMPLETE) else ""

    def _prereg_text(self, results) -> str:
        state = self.reading(results)
        if not state:
            return ""
        if state == PILOT:
            return (
                f"- **{PILOT}**: no pre-registration beside this table (its folder's "
                f"{audit.PREREGISTRATION} names none for it); its tests are not read\n"
            )
        g = self.prereg
        said = (
            f"{g['file']} (commit `{g['commit']}`): seeds {', '.join(map(str, g['seeds']))}; "
            f"rows {', '.join(g['rows'])}; family: {g['family']}"
        )
        if state == INCOMPLETE:
            missing = audit.unfinished(g, results)
            return (
                f"- **{INCOMPLETE}**: {len(missing)} pre-registered run(s) missing or "
                f"unfinished (e.g. {missing[0]}); the tests are read only when every "
                f"pre-registered run finished. Pre-registered: {said}\n"
            )
        return f"- pre-registered: {said}\n"

    def settings(self) -> dict[str, Any]:
        """What decides the sweep and the report's text: mode, seeds, rows, command (a
        table regenerated from its runs file takes these back: sao_jax/report/audit.py)."""
        seeds = None if self.seeds is None else list(self.seeds)
        rows = None if self.rows is None else list(self.rows)
        out = dict(mode=self.mode, seeds=seeds, rows=rows, command=self.command)
        if self.earlier:
            out["earlier"] = [dict(e) for e in self.earlier]
        if self.commit is not None:
            out["commit"] = dict(self.commit)
        return out

    @property
    def sweep_path(self) -> pathlib.Path:
        return pathlib.Path(self.sweep_dir or f"workdirs/sweeps/{self.mode}")

    @property
    def out_path(self) -> pathlib.Path:
        return pathlib.Path(self.out_dir or f"results/{self.mode}")

    def chosen(self, spec: sweep.SweepSpec) -> sweep.SweepSpec:
        """`spec` with the seeds of --seeds and the rows of --rows, where given."""
        if self.seeds:
            try:
                seeds = tuple(int(s) for s in self.seeds)
            except ValueError:
                raise ConfigError(
                    f"flag --seeds: integers separated by commas, got {list(self.seeds)}"
                ) from None
            spec = dataclasses.replace(spec, seeds=seeds)
        if self.rows:
            rows = list(self.rows)
            unknown = [r for r in rows if r not in spec.variants]
            if unknown or len(set(rows)) != len(rows):
                raise ConfigError(
                    f"flag --rows: {', '.join(unknown) or 'a repeated row'} in {rows}; the "
                    f"{spec.name!r} sweep has the rows {', '.join(spec.variants)}"
                )
            spec = dataclasses.replace(spec, variants=tuple(rows))
        return spec

    def run_table(self, spec) -> tuple[list[sweep.PointResult], float, SystemExit | None]:
        """Runs (or resumes) a table's sweep, or its tuple of sweeps; (results, wall s,
        the stop). A signal that stops the sweep (`sweep.SweepStopped`, after the running
        points saved) leaves the results of what finished, the others 'stopped' or
        'missing', so the caller still writes the table of what finished (marked
        incomplete) before it exits."""
        specs = (spec,) if isinstance(spec, sweep.SweepSpec) else tuple(spec)
        collect = lambda: [r for s in specs for r in sweep.collect(s, self.sweep_path)]
        done_before = {r.point.name for r in collect() if r.status == "done"}
        t0 = time.time()
        try:
            how = dict(parallel=self.parallel, launcher=self.launcher, dry_run=self.dry_run)
            results = sweep.run_sweep(specs, self.sweep_path, **how)  # one set of jobs
            return results, time.time() - t0, None
        except sweep.SweepStopped as stop:
            wall_s = time.time() - t0
            results = collect()
            for r in results:
                r.reused = r.point.name in done_before
            return results, wall_s, stop

    def header(self, title: str, spec: sweep.SweepSpec, results, wall_s: float) -> str:
        """The top of a table report: how to regenerate it, what it cost, where and from
        which code its runs came, and whether its tests are read."""
        runs_s = sum(tables.finite((r.summary or {}).get("wall_time_s")) or 0.0 for r in results)
        machine = machine_of(results)
        lines = [
            f"# {title}",
            "",
            f"- command: `{self.command}`",
            f"- mode: {self.mode}; seeds: {', '.join(map(str, spec.seeds))}",
            f"- training runs: {len(results)}, of which {sum(r.reused for r in results)} were "
            "finished by an earlier invocation and reused",
            f"- wall time of this invocation: {wall_s / 60:.1f} min; the runs' own wall times "
            f"add up to {runs_s / 60:.1f} min (shared warm starts not included)",
            *([f"- machine: {machine}"] if machine else []),
        ]
        return (
            "\n".join(lines)
            + "\n"
            + commit_text(self.commit)
            + self._shared_text(results)
            + self._prereg_text(results)
            + _incomplete_text(results)
            + self._earlier_text(results)
        )

    def _shared_text(self, results) -> str:
        """One line naming the other committed tables whose runs start from the same SFT
        policies (warm-start digests) as some of these ('' when none or not looked for)."""
        if self.results_root is None:
            return ""
        shared = audit.shared_warm_starts(results, self.results_root, self.own_runs)
        if not shared:
            return ""
        n = len({r.warm_start["policy"] for r in results if (r.warm_start or {}).get("policy")})
        named = ", ".join(f"{t} ({k} of this table's {n})" for t, k in shared.items())
        return (
            f"- shares SFT warm starts (the same policy digests) with other committed tables: "
            f"{named}; runs that start from the same policy are not independent samples "
            "across these tables\n"
        )

    def _earlier_text(self, results) -> str:
        """The invocations this one added its runs to, and whether each seed's runs of
        them all start from the same warm start (the digests of its tensors)."""
        if not self.earlier:
            return ""
        lines = [
            f"- adds to the runs of `{e['command']}` ({e['wall_s'] / 60:.1f} min; its runs "
            f"as recorded in {e['runs_file']}, reused"
            + (f"; {commit_text(e['commit'])[2:-1]}" if e.get("commit") else "")
            + ")"
            for e in self.earlier
        ]
        differ, unchecked = warm_start_check(results)
        seeds = lambda xs: ", ".join(map(str, xs))
        if differ["policy"]:
            lines.append(
                f"- **warm-start policies differ** within seed(s) {seeds(differ['policy'])}: "
                "their runs from different invocations do not start from the same tensors "
                "(pairs across invocations are not same-start pairs)"
            )
        if differ["critic"]:
            lines.append(
                f"- pretrained critics differ within seed(s) {seeds(differ['critic'])}: value "
                "pretraining, re-created by a later invocation, draws its rollouts from the "
                "asynchronous sampler, so critic rows of different invocations start from "
                "different critics of the same seed (more noise in their pairs, no bias)"
            )
        if unchecked:
            lines.append(
                f"- warm starts not checked for seed(s) {seeds(unchecked)} (a run recorded no "
                "digest)"
            )
        if not any(differ.values()) and not unchecked:
            lines.append(
                "- warm starts: every seed's runs, of every invocation, start from the same "
                "tensors (one digest of the warm start's stored fingerprints per seed)"
            )
        return "\n".join(lines) + "\n"

    def write(self, name: str, text: str) -> pathlib.Path:
        path = self.out_path / f"{name}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(text)
        print(f"wrote {path}")
        return path

    def plot_path(self, name: str) -> pathlib.Path:
        path = self.out_path / "plots" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def machine_of(results: Sequence[sweep.PointResult]) -> str:
    """The machine the finished runs recorded ('' if none did); when they ran on several
    (runs added with --add_to in a later session), each one with its count of runs, in
    the order first seen: XLA:CPU compiles for the host's instruction set, so a reader
    needs to know which runs share a machine."""
    counts = collections.Counter(
        r.summary.get("machine", "") for r in results if r.summary and r.summary.get("machine")
    )
    if len(counts) <= 1:
        return next(iter(counts), "")
    return "; ".join(f"{m} ({n} run{'s' * (n != 1)})" for m, n in counts.items())


def git_commit(where: str | pathlib.Path | None = None) -> dict[str, Any]:
    """{'sha': the checkout's `git rev-parse HEAD`, 'dirty': whether tracked files differ
    from it} of the git checkout holding `where` (default: this code's); both None when it
    is not a git checkout (an installed package) or git is missing."""
    where = pathlib.Path(where or pathlib.Path(__file__).parent)
    git = lambda *args: subprocess.run(
        ["git", *args], cwd=where, capture_output=True, text=True, timeout=60
    )
    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    if head.returncode != 0 or status.returncode != 0:
        return {"sha": None, "dirty": None}
    return {"sha": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def commit_text(commit: dict[str, Any] | None) -> str:
    """The header line naming the commit the runs were made at ('' when not recorded)."""
    if commit is None:
        return ""
    if not commit.get("sha"):
        return "- commit: none (the runs were not made from a git checkout)\n"
    dirty = (
        ", with uncommitted changes to tracked files"
        if commit.get("dirty")
        else ", no uncommitted changes"
    )
    return f"- commit: `{commit['sha'][:12]}`{dirty}\n"


def _incomplete_text(results: Sequence[sweep.PointResult]) -> str:
    """A header line when not every run finished (a stopped or failed sweep)."""
    done = sum(r.status == "done" for r in results)
    if done == len(results):
        return ""
    return (
        f"- **incomplete**: {done} of {len(results)} runs finished (the others are listed "
        "under 'Runs that did not finish'); every cell is of the finished runs only\n"
    )


def failures(results: Sequence[sweep.PointResult]) -> str:
    bad = [r for r in results if r.status != "done"]
    if not bad:
        return ""
    lines = ["", "## Runs that did not finish", ""]
    for r in bad:
        last = (r.error.strip().splitlines() or [""])[-1]
        lines.append(f"- `{r.point.name}`: {r.status}. {last}")
    return "\n".join(lines) + "\n"


RESULTS = "results"  # the committed tables, from the repository root
PILOT = "pilot: not a test"  # a table without a pre-registration
INCOMPLETE = "incomplete: not read"  # a table before every pre-registered run finished
_FLAGS: types.SimpleNamespace | None = None


def flags() -> types.SimpleNamespace:
    """The table scripts' shared flags, defined on the first call (a process that only
    reads reports defines none): mode, sweep_dir, out_dir, parallel, launcher, dry_run,
    seeds, from_runs, add_to, rows."""
    global _FLAGS
    if _FLAGS is None:
        from absl import flags as absl_flags

        f = absl_flags
        _FLAGS = types.SimpleNamespace(
            mode=f.DEFINE_enum("mode", "quick", ["smoke", "quick", "full"], "Experiment size."),
            sweep_dir=f.DEFINE_string(
                "sweep_dir", None, "Runs' workdirs (default workdirs/sweeps/<mode>)."
            ),
            out_dir=f.DEFINE_string("out_dir", None, "Tables and plots (default results/<mode>)."),
            parallel=f.DEFINE_integer("parallel", 1, "Training runs at the same time."),
            launcher=f.DEFINE_enum("launcher", "local", sweep.LAUNCHERS, "Where runs are started."),
            dry_run=f.DEFINE_bool("dry_run", False, "Print the runs' commands, run nothing."),
            seeds=f.DEFINE_list(
                "seeds",
                None,
                "Seeds to run instead of the mode's (e.g. 0,1,2); the report says which.",
            ),
            from_runs=f.DEFINE_string(
                "from_runs",
                None,
                "Write the table again from a committed <name>_runs.jsonl "
                "(sao_jax/report/audit.py) instead of running: the same runs and settings, "
                "nothing trained.",
            ),
            add_to=f.DEFINE_string(
                "add_to",
                None,
                "A committed <name>_runs.jsonl whose runs this invocation adds to (rows or "
                "seeds a later session runs, e.g. --rows=<rows it lacks>): the table is "
                "written from its runs and this invocation's, and says whether each seed's "
                "warm start is the same tensors.",
            ),
            rows=f.DEFINE_list(
                "rows",
                None,
                "Rows (the sweep's ':variant's) to run instead of all of them, e.g. "
                "sao,moving_average to add seeds to one comparison; differences are taken "
                "against the 'sao' row.",
            ),
        )
    return _FLAGS


def command() -> str:
    """This invocation as `python -m <module> <flags>` (sys.argv[0] is the file path; a
    package's __main__.py runs as the package)."""
    prog = pathlib.Path(sys.argv[0]).resolve()
    try:
        parts = prog.relative_to(pathlib.Path.cwd().resolve()).with_suffix("").parts
        module = ".".join(parts).removesuffix(".__main__")
    except ValueError:
        module = prog.parent.name if prog.stem == "__main__" else prog.stem
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def experiment() -> Experiment:
    """The experiment settings of the command line."""
    f = flags()
    return Experiment(
        mode=f.mode.value,
        sweep_dir=f.sweep_dir.value,
        out_dir=f.out_dir.value,
        parallel=f.parallel.value,
        launcher=f.launcher.value,
        dry_run=f.dry_run.value,
        seeds=f.seeds.value,
        rows=f.rows.value,
        command=command(),
        commit=git_commit(),
        results_root=RESULTS,
    )


Report = Callable[[Experiment, sweep.SweepSpec, list, float], str]
SweepOf = Callable[[str], sweep.SweepSpec | tuple[sweep.SweepSpec, ...]]


def chosen(exp: Experiment, sweep_of: SweepOf):
    """The mode's sweep (or tuple of sweeps) with the seeds and rows `exp` chose."""
    specs = sweep_of(exp.mode)
    if isinstance(specs, sweep.SweepSpec):
        return exp.chosen(specs)
    return tuple(exp.chosen(s) for s in specs)


def replay(
    name: str, sweep_of: SweepOf, write: Report, runs_file: str, base: Experiment
) -> tuple[Experiment, str]:
    """(settings, text) of table `name` written again from a committed runs file
    (--from_runs): `base` with the file's recorded settings (its commit, or none for runs
    files written before one was recorded), the pre-registration beside the file, and the
    sweep as the file ran it (its rows, seeds, schedule: `audit.recorded_spec`)."""
    results, header = audit.read_runs(runs_file)
    folder = pathlib.Path(runs_file).parent
    exp = dataclasses.replace(
        base,
        **{"commit": None, **header.settings},
        own_runs=(str(runs_file),),
        prereg=audit.read_preregistration(folder, name),
        prereg_folder=str(folder),
    )
    spec = chosen(exp, sweep_of)
    if isinstance(spec, sweep.SweepSpec):
        spec = audit.recorded_spec(spec, results)
    else:
        spec = tuple(audit.recorded_spec(s, results) for s in spec)
    return exp, write(exp, spec, results, header.wall_s)


def table_main(name: str, sweep_of: SweepOf, write: Report):
    """The main of a table script: the sweep of the mode (`sweep_of(mode)`) with the
    command line's seeds and rows, run (or resumed), then `write(...)` as <out>/<name>.md.
    `sweep_of` may return a tuple of sweeps (one per task, each with its own warm starts):
    they run into the one sweep dir as one set of jobs (`sweep.run_sweep`: one task's
    warm starts overlap the other's), `write` gets the tuple and every result. A bad
    flag exits 2 with one line."""
    from absl import app

    f = flags()

    @cli.guard
    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        if f.from_runs.value:  # the committed runs, nothing trained
            exp, text = replay(name, sweep_of, write, f.from_runs.value, experiment())
            exp.write(name, text)
            return
        exp = experiment()
        own = [audit.runs_path(exp.out_path, name), *([f.add_to.value] * bool(f.add_to.value))]
        exp = dataclasses.replace(
            exp,
            own_runs=tuple(map(str, own)),
            prereg=audit.read_preregistration(exp.out_path, name),
            prereg_folder=str(exp.out_path),
        )
        spec = chosen(exp, sweep_of)
        earlier = None
        if f.add_to.value:
            if not isinstance(spec, sweep.SweepSpec):
                raise ConfigError("--add_to: this script runs several sweeps; not supported")
            earlier, before = audit.read_runs(f.add_to.value)
            audit.check_addable(spec, earlier, f.add_to.value)
        results, wall_s, stopped = exp.run_table(spec)
        if earlier is not None and not exp.dry_run:
            spec, results = audit.add_runs(spec, sweep_of(exp.mode), results, earlier)
            prior = [*before.settings.get("earlier", ())]
            prior.append(
                dict(
                    command=before.settings["command"],
                    wall_s=before.wall_s,
                    runs_file=f.add_to.value,
                    **(
                        {"commit": before.settings["commit"]} if "commit" in before.settings else {}
                    ),
                )
            )
            exp = dataclasses.replace(exp, earlier=tuple(prior))
        if not exp.dry_run:
            recorder = audit.Recorder()
            exp.write(name, write(exp, spec, recorder.wrap(results), wall_s))
            path = audit.write_runs(
                audit.runs_path(exp.out_path, name), results, recorder, wall_s, exp.settings()
            )
            print(f"wrote {path}")
        if stopped is not None:  # the table of what finished is written: now exit 0
            raise stopped

    return main
