"""Bad input: one line naming the file, line or field, exit 2, no traceback, and no workdir
left behind. The config loading and override errors run in process (the entry points' flag
parser, `cli.parse_config_flags`, on a FlagValues of their own); the real entry point runs
in process too (its flag parser, then train.run under cli.guard), and as a subprocess for
one case of each kind, each case stopping before any model is built."""

import json
import pathlib
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from sao_jax import cli, train
from tests.chat_support import write_jsonl, write_tokenizer

# config_flags loads config files with importlib's deprecated load_module()
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

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
            f"error: config field data.fields.answer: {bad}:2: missing field 'answer'; the row "
            "has ['question']",
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
        "an override of the wrong type": (
            ["--config=configs/sao.py:smoke", "--config.sft.steps=zero"],
            "error: config field sft.steps: cannot set it to 'zero': invalid literal for int()",
        ),
        "tokenizer without a required chat template": (
            ["--config=configs/sao.py:smoke",
             *_dataset(good, root / "plain_tok", "--config.init.chat_template=tokenizer")],
            "error: config field init.chat_template: tokenizer ",
        ),
    }  # fmt: skip


def _entry_point_in_process(capsys, argv, workdir):
    """(exit status, stderr lines) of `python -m experiments.train <argv>` up to where it
    stops, in this process: the entry point's flag parser, then cli.guard around train.run
    (what experiments/train.py's main runs after distributed start-up and logging)."""
    code, lines, fv = _parse(capsys, *argv, f"--workdir={workdir}")
    if code is not None:
        return code, lines
    try:
        cli.guard(lambda _: train.run(fv.config, str(workdir)))([])
        code = None
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.splitlines()


def test_input_errors_are_one_line_exit_2(files, tmp_path, capsys):
    """Every case in process: one line naming the field or file, exit 2, no workdir."""
    for i, (name, (argv, want)) in enumerate(_cases(*files).items()):
        workdir = tmp_path / f"w{i}"
        code, lines = _entry_point_in_process(capsys, argv, workdir)
        assert code == 2, (name, lines)
        assert len(lines) == 1 and "Traceback" not in lines[0], (name, lines)
        assert want in lines[0], (name, lines[0])
        assert not workdir.exists(), name


# One case of each kind as the real entry point, a process: an error of the config flags
# (the flag parser) and one of the inputs (train.run's start-up checks, under cli.guard).
PROCESS_CASES = ("missing config file", "missing field in a row")


def test_the_entry_point_process_exits_2_with_one_line(files, tmp_path):
    cases = _cases(*files)
    procs = {}
    for i, name in enumerate(PROCESS_CASES):
        argv, want = cases[name]
        workdir = tmp_path / f"w{i}"
        cmd = [sys.executable, "-m", "experiments.train", *argv, f"--workdir={workdir}"]
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


# ----------------------------------------------------------- config loading, in process


def _parse(capsys, *argv):
    """(exit status or None, stderr lines, FlagValues) of the entry points' flag parser."""
    fv, argv = flags.FlagValues(), ["train", *argv]
    config_flags.DEFINE_config_file("config", None, "run config", flag_values=fv, sys_argv=argv)
    flags.DEFINE_string("workdir", None, "run directory", flag_values=fv)
    try:
        cli.parse_config_flags(argv, flag_values=fv)
        code = None
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.splitlines(), fv


OVERRIDES = {  # overrides of configs/sao.py:smoke -> the one line they exit 2 with
    ("--config.sft.steps=0", "--config.data.promt_format=x"): (
        "error: config field data.promt_format: unknown field (did you mean data.prompt_format?)"
    ),
    ("--config.rl.nonsense=1", "--config.sft.steps=0", "--config.trian.x=2"): (
        "error: config field rl.nonsense: unknown field; config field trian.x: unknown field "
        "(did you mean train?)"
    ),
    ("--config.sft.steps=zero",): (
        "error: config field sft.steps: cannot set it to 'zero': invalid literal for int() "
        "with base 10: 'zero'"
    ),
    ("--config.sft.steps=3", "--workdirr=x"): "error: flags: Unknown command line flag 'workdirr'",
}


@pytest.mark.parametrize("overrides", list(OVERRIDES), ids=" ".join)
def test_override_errors_name_only_the_bad_overrides(capsys, overrides):
    code, lines, _ = _parse(capsys, "--config=configs/sao.py:smoke", *overrides)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(OVERRIDES[overrides]), lines[0]


def test_good_overrides_parse(capsys):
    code, lines, fv = _parse(capsys, "--config=configs/sao.py:smoke", "--config.sft.steps=3")
    assert code is None and not lines
    assert fv.config.sft.steps == 3


BROKEN_CONFIGS = {  # file text -> the end of the one line (after "error: config file <f>")
    "def get_config(arg=None):\n    return (\n": ":2: does not parse: '(' was never closed",
    "import no_such_module_xyz\n": (
        ":1: does not import: ModuleNotFoundError: No module named 'no_such_module_xyz'"
    ),
    "def get_config(arg=None):\n    raise RuntimeError('boom')\n": (
        ":2: get_config(None) raised: RuntimeError: boom"
    ),
    "def get_config(arg=None):\n    return None\n": (
        ": get_config(None) returned NoneType, not an ml_collections.ConfigDict"
    ),
    "from sao_jax.configs import base\n\n\ndef get_config(arg=None):\n    c = base.get_config()"
    "\n    c.rl.batch_size = 'big'\n    return c\n": (
        ":6: get_config(None) raised: TypeError: Could not override field 'batch_size'"
    ),
}


@pytest.mark.parametrize("text", list(BROKEN_CONFIGS), ids=range(len(BROKEN_CONFIGS)))
def test_a_broken_config_file_is_named_with_its_line(capsys, tmp_path, text):
    path = tmp_path / "mine.py"
    path.write_text(text)
    code, lines, _ = _parse(capsys, f"--config={path}")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: config file {path}{BROKEN_CONFIGS[text]}"), lines[0]
