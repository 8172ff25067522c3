r"""Where a command's CPU goes in JAX's compile pipeline, per process, test and program.

    python -m experiments.bench.compile_profile --out=/tmp/cp -- \
        .venv/bin/python -m pytest -n 2 --dist loadscope tests/test_update.py
    python -m experiments.bench.compile_profile --out=/tmp/cp --report_only

Runs the command with experiments/bench/compile_hook/ on PYTHONPATH, so that every Python
process under it (pytest's workers and the processes the tests start, when they pass
the environment on) records JAX's compile events (sitecustomize.py there); then prints,
from the records in --out: per kind of process (a pytest worker, any other) the CPU
seconds and the seconds spent tracing, lowering and in XLA's backend compile (cache hits
included) with their counts; the programs with the most compile seconds; and per test
module the seconds of programs that compiled in under --small_s on average (op-by-op
eager code). A process killed by a signal writes no record. docs/testing.md ("Where the
suite's CPU goes") has the suite's figures. Not a timed test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys

HOOK = pathlib.Path(__file__).resolve().parent / "compile_hook"
STAGES = {
    "trace": "/jax/core/compile/jaxpr_trace_duration",
    "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile": "/jax/core/compile/backend_compile_duration",
    "cache_read": "/jax/compilation_cache/cache_retrieval_time_sec",
}


def kind(record: dict) -> str:
    """'worker' for a pytest-xdist worker, else 'process' (a test's child, a script)."""
    return "worker" if record.get("xdist_worker") else "process"


def summarise(records: list[dict], small_s: float = 0.1) -> dict:
    """{'kinds': {kind: {'processes', 'cpu', stage: [s, n]}}, 'programs': {(kind,
    program): [s, n]}, 'small': {module: [s, n]}} over the records."""
    kinds: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    programs: dict = collections.defaultdict(lambda: [0.0, 0])
    small: dict = collections.defaultdict(lambda: [0.0, 0])
    for r in records:
        k = kinds[kind(r)]
        k["processes"] += 1
        k["cpu"] += r["cpu"]
        for key, (s, n) in r["events"].items():
            event = key.split("|", 1)[1]
            for stage, name in STAGES.items():
                if event == name:
                    k[stage] += s
                    k[stage + "_n"] += n
        for key, (s, n) in r["programs"].items():
            test, program = key.split("|", 1)
            row = programs[(kind(r), program)]
            row[0] += s
            row[1] += n
            if n and s / n < small_s:
                row = small[test.split("::")[0]]
                row[0] += s
                row[1] += n
    return {"kinds": {k: dict(v) for k, v in kinds.items()}, "programs": programs, "small": small}


def report(summary: dict, top: int) -> str:
    lines = [
        "| processes | n | CPU s | trace s (n) | lower s (n) | compile s (n) | cache read s (n) |"
    ]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for name, k in sorted(summary["kinds"].items()):
        cells = [f"{k.get(s, 0):.1f} ({int(k.get(s + '_n', 0))})" for s in STAGES]
        lines.append(
            f"| {name} | {int(k['processes'])} | {k['cpu']:.1f} | " + " | ".join(cells) + " |"
        )
    lines += ["", "| processes | program | compile s | n |", "|---|---|---:|---:|"]
    ranked = sorted(summary["programs"].items(), key=lambda kv: -kv[1][0])[:top]
    lines += [f"| {k} | `{p}` | {s:.1f} | {n} |" for (k, p), (s, n) in ranked]
    lines += ["", "| test module | small programs' compile s | n |", "|---|---:|---:|"]
    ranked = sorted(summary["small"].items(), key=lambda kv: -kv[1][0])[:top]
    lines += [f"| {m} | {s:.1f} | {n} |" for m, (s, n) in ranked]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the per-process records")
    parser.add_argument("--report_only", action="store_true", help="only summarise --out")
    parser.add_argument("--top", type=int, default=25, help="rows of the ranked tables")
    parser.add_argument(
        "--small_s", type=float, default=0.1, help="mean compile s of a small program"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.report_only:
        if not command:
            parser.error("give the command after --, or --report_only")
        env = dict(os.environ, COMPILE_PROFILE_OUT=str(out))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), env.get("PYTHONPATH")]))
        code = subprocess.run(command, env=env).returncode
        print(f"exit {code}: {' '.join(command)}", file=sys.stderr)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not records:
        parser.error(f"--out: no records in {out}")
    print(report(summarise(records, args.small_s), args.top))


if __name__ == "__main__":
    main()
