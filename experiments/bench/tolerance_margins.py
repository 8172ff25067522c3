r"""How much of its tolerance every equivalence test uses, under several CPU settings.

Runs the suite's equivalence tests (sharded, microbatched, packed, stacked, paged, resumed,
multi-process: the test names matching --match) once per setting with
tests/margins_plugin.py, which records for each test the largest observed error as a
fraction of its bound (np.testing.assert_allclose and tests/closeness.py alike), and prints
one row per test: the worst fraction under each setting. A fraction near 1 is a test that
another CPU may fail; docs/testing.md keeps the table.

Settings: XLA's widest vector ISA (`--xla_cpu_max_isa`, the native one, AVX2 and SSE4_2)
x the threads XLA's CPU client sees (1 core via `taskset -c 0`, or all).

  python -m experiments.bench.tolerance_margins --out=/tmp/margins
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from absl import app, flags

FILES = (
    "tests/test_update.py tests/test_packing.py tests/test_stacked_layers.py "
    "tests/test_value_pretrain.py tests/test_model.py tests/test_moe_grouped.py "
    "tests/test_attention.py tests/test_attention_naive.py tests/test_layer_stack.py "
    "tests/test_logprobs.py tests/test_losses.py tests/test_sharded_engine.py "
    "tests/test_stacked_decode.py tests/test_paged_pool.py tests/test_decode_spans.py "
    "tests/test_generate.py tests/test_routing_replay.py tests/test_trajectory.py "
    "tests/test_critic_v0.py tests/test_hf.py tests/test_distributed.py tests/test_train.py"
)
flags.DEFINE_string("out", "/tmp/tolerance_margins", "folder for the per-setting JSONL files")
flags.DEFINE_string("files", FILES, "test files to run (space-separated)")
flags.DEFINE_string(
    "match", "equal or match or same or identical or parity or planted", "pytest -k expression"
)
flags.DEFINE_list("isas", ["native", "AVX2", "SSE4_2"], "--xla_cpu_max_isa values")
flags.DEFINE_list("threads", ["1", "all"], "cores XLA sees: 1 (taskset -c 0) or all")
FLAGS = flags.FLAGS


def run_setting(isa: str, threads: str, out: pathlib.Path) -> pathlib.Path:
    path = out / f"{isa}_{threads}.jsonl"
    path.unlink(missing_ok=True)
    env = dict(os.environ, SAO_TEST_MARGINS=str(path))
    if isa != "native":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_max_isa={isa}".strip()
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "tests.margins_plugin"]
    cmd += ["-k", FLAGS.match, *FLAGS.files.split()]
    if threads == "1":
        cmd = ["taskset", "-c", "0", *cmd]
    print(f"== {isa}, threads {threads}: {' '.join(cmd[-4:])} ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:])
    return path


def main(argv):
    del argv
    out = pathlib.Path(FLAGS.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = [(i, t) for i in FLAGS.isas for t in FLAGS.threads]
    table: dict[str, dict[str, float | None]] = {}
    for isa, threads in settings:
        path = run_setting(isa, threads, out)
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            used = [v for k, v in row.items() if k != "test" and v is not None]
            table.setdefault(row["test"], {})[f"{isa}/{threads}"] = max(used) if used else None
    cols = [f"{i}/{t}" for i, t in settings]
    print("\n| test | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for test, row in sorted(table.items()):
        cells = [("-" if row.get(c) is None else f"{row[c]:.2g}") for c in cols]
        print(f"| {test} | " + " | ".join(cells) + " |")
    worst = max((v for r in table.values() for v in r.values() if v is not None), default=0.0)
    print(f"\nworst fraction of a bound used: {worst:.3g}")


if __name__ == "__main__":
    app.run(main)
