"""Bad input through the real entry point: one line naming the file, line or field, exit 2,
no traceback, and no workdir left behind. Each case stops before any model is built."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests.chat_support import write_jsonl, write_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    good = write_jsonl(root / "good.jsonl", [{"question": "q", "answer": "1"}] * 4)
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n" + '{"question": "q"}\n')
    write_tokenizer(root / "plain_tok", template=None)
    write_tokenizer(root / "chat_tok", template="{{ raise_exception('no user role here') }}")
    return root, good, bad


def _dataset(path, tok="char", *more):
    return [
        f"--config.data.train={path}",
        "--config.data.fields.prompt=question",
        "--config.env.name=answer",
        "--config.sft.steps=0",
        f"--config.init.tokenizer={tok}",
        *more,
    ]


def _cases(root, good, bad):
    return {
        "missing config file": (
            ["--config=configs/no_such.py"],
            "error: config file 'configs/no_such.py' does not exist",
        ),
        "negative learning rate": (
            ["--config=configs/sao.py:smoke", "--config.optim.policy.lr=-1e-3"],
            "error: config field optim.policy.lr: must be > 0, got -0.001",
        ),
        "unknown variant": (
            ["--config=configs/sao.py:smokey"],
            "error: unknown config variant key 'smokey'",
        ),
        "missing field in a row": (
            ["--config=configs/sao.py:smoke", *_dataset(bad)],
            f"error: config field data.train: {bad}:2: missing field 'answer'",
        ),
        "unknown reward": (
            ["--config=configs/sao.py:smoke",
             *_dataset(good, "char", "--config.env.params={'reward': 'mathh'}")],
            "error: config field env.params: unknown reward 'mathh'; known: code_tests",
        ),
        "unknown task": (
            ["--config=configs/sao.py:smoke", "--config.env.name=gsm8k"],
            "error: config field env.name: unknown task 'gsm8k'",
        ),
        "template that fails to render": (
            ["--config=configs/sao.py:smoke", *_dataset(good, root / "chat_tok")],
            "no user role here",
        ),
        "tokenizer without a required chat template": (
            ["--config=configs/sao.py:smoke",
             *_dataset(good, root / "plain_tok", "--config.init.chat_template=tokenizer")],
            "error: config field init.chat_template: tokenizer ",
        ),
    }  # fmt: skip


def test_input_errors_are_one_line_exit_2(files, tmp_path):
    root, good, bad = files
    cases = list(_cases(root, good, bad).items())
    for start in range(0, len(cases), 4):  # 4 processes at a time (memory)
        procs = {}
        for i, (name, (flags, want)) in enumerate(cases[start : start + 4], start):
            workdir = tmp_path / f"w{i}"
            cmd = [sys.executable, "-m", "experiments.train", *flags, f"--workdir={workdir}"]
            pipe = subprocess.PIPE
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=pipe, stderr=pipe, text=True)
            procs[name] = (proc, want, workdir)
        for name, (proc, want, workdir) in procs.items():
            out, err = proc.communicate(timeout=600)
            lines = [line for line in err.splitlines() if line.strip()]
            assert proc.returncode == 2, (name, out, err)
            assert len(lines) == 1 and "Traceback" not in err, (name, err)
            assert want in lines[0], (name, lines[0])
            assert not workdir.exists(), name
