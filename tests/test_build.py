"""BUILD stays true without Bazel: every check of tests/build_checks.py passes on this checkout
(tests/build_rules.py parses BUILD with `ast` and evaluates its globs; nothing is executed),
and the checker names the fault and the fix in a tiny repository with one fault at a time.
"""

import pathlib

import pytest

from tests.build_checks import (
    CHECKS,
    check_coverage,
    check_cycles,
    check_entry_points,
    check_imports,
    check_labels,
    check_parse,
)
from tests.build_rules import Need, Repo

ROOT = pathlib.Path(__file__).absolute().parents[1]


@pytest.fixture(scope="module")
def repo():
    return Repo(ROOT)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_build_file_is_true(repo, check):
    errors = check(repo)
    assert not errors, f"{len(errors)} BUILD problem(s):\n" + "\n".join(errors)


# The checker itself, on a tiny repository with one known fault at a time.
MINI_BUILD = """
load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")
load("@pip//:requirements.bzl", "requirement")

py_library(name = "b", srcs = ["sao_jax/__init__.py", "sao_jax/b.py"])
py_library(
    name = "a",
    srcs = glob(["sao_jax/**/*.py"], exclude = ["sao_jax/__init__.py", "sao_jax/b.py"]),
    deps = [":b", requirement("numpy")],
)
py_library(name = "experiments", srcs = ["experiments/__init__.py"])
py_binary(name = "run", srcs = ["experiments/run.py"], main = "experiments/run.py",
          deps = [":a", ":experiments"])
py_library(name = "test_support", testonly = True, srcs = ["tests/__init__.py",
           "tests/conftest.py"], data = ["pyproject.toml"])
py_test(name = "test_a", size = "small", srcs = ["tests/test_a.py"], args = ["tests/test_a.py"],
        main_module = "pytest", data = [":run"],
        deps = [":a", ":test_support", requirement("pytest")])
"""
MINI_FILES = {
    "sao_jax/__init__.py": "",
    "sao_jax/b.py": "X = 1\n",
    "sao_jax/a.py": "import numpy\n\n\ndef f():\n    from sao_jax import b\n\n    return b.X\n",
    "experiments/__init__.py": "",
    "experiments/run.py": 'from sao_jax import a\n\nif __name__ == "__main__":\n    a.f()\n',
    "tests/__init__.py": "",
    "tests/conftest.py": "",
    "tests/test_a.py": "import sys\n\nfrom sao_jax import a\n\n"
    'CMD = [sys.executable, "-m", "experiments.run"]\n',  # runs :run, so needs it as data
    "requirements.txt": "numpy==2.4.6  # runtime\n",
    "requirements-dev.txt": "-r requirements.txt\npytest==9.2.0\n",
    "pyproject.toml": "",
}
MAIN = 'if __name__ == "__main__":\n    pass\n'


def _mini_repo(root: pathlib.Path, edits=(), files=()) -> Repo:
    build = MINI_BUILD
    for old, new in edits:
        assert old in build, old
        build = build.replace(old, new)
    for rel, text in [*MINI_FILES.items(), *dict(files).items(), ("BUILD", build)]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return Repo(root)


def test_checker_passes_a_true_build_and_evaluates_globs_like_bazel(tmp_path):
    repo = _mini_repo(
        tmp_path, files={"sao_jax/sub/c.py": "from .. import b\n", "sao_jax/d.txt": ""}
    )
    assert [c(repo) for c in CHECKS] == [[]] * len(CHECKS)
    assert Need(1, "sao_jax.b", "sao_jax/b.py") in repo.needs("sao_jax/sub/c.py")
    assert repo.targets["a"].srcs == ["sao_jax/a.py", "sao_jax/sub/c.py"]
    assert repo.targets["a"].reqs == ["numpy"] and repo.pins == {"numpy", "pytest"}
    assert repo.reach("run") == (
        {"sao_jax/__init__.py", "sao_jax/a.py", "sao_jax/b.py", "sao_jax/sub/c.py",
         "experiments/__init__.py", "experiments/run.py"},
        {"numpy"},
    )  # fmt: skip


@pytest.mark.parametrize(
    "edits, files, check, message",
    [
        ([('name = "b", srcs', 'name = "b", deps = [":a"], srcs')], {}, check_cycles,
         "dependency cycle :b -> :a -> :b"),
        ([], {"configs/x.py": ""}, check_coverage,
         'configs/x.py is in no target: add py_library(name = "configs"'),
        ([], {"experiments/ablations.py": MAIN}, check_coverage,
         "experiments/ablations.py is in no target: add it to a py_binary"),
        ([('["experiments/__init__.py"]', '["experiments/__init__.py", "experiments/x.py"]')],
         {"experiments/x.py": MAIN}, check_coverage,
         "experiments/x.py has a __main__ block: add it to a py_binary"),
        ([], {"tests/test_b.py": ""}, check_coverage, "tests/test_b.py is run by 0 py_tests"),
        ([], {"tests/helpers.py": ""}, check_coverage,
         "tests/helpers.py is in no target: add it to the srcs of :test_support"),
        ([('deps = [":b", requirement', "deps = [requirement")], {}, check_imports,
         ":a cannot reach sao_jax/__init__.py, sao_jax/b.py: add :b to its deps (used at "
         "sao_jax/a.py:0 (its package), sao_jax/a.py:5 (sao_jax.b))"),
        ([('":b", requirement("numpy")', '":b"')], {}, check_imports,
         ':a cannot reach numpy: add requirement("numpy") to its deps (used at sao_jax/a.py:1'),
        ([], {"sao_jax/b.py": "import torch\n"}, check_imports,
         ":b cannot reach torch (not pinned): pin it first (used at sao_jax/b.py:1 (torch))"),
        ([], {"sao_jax/b.py": "import ml_dtypes\n"}, check_imports,
         ':b cannot reach ml-dtypes (not pinned): add requirement("jax") to its deps'),
        ([('("numpy")]', '("numpy"), requirement("torch")]')], {}, check_labels,
         'requirement("torch"), which is not pinned'),
        ([('":experiments"]', '":experiments", ":nope"]')], {}, check_labels,
         "depends on :nope, which does not exist"),
        ([('deps = [":b"', 'deps = [":test_support", ":b"')], {}, check_labels,
         ":a uses testonly :test_support"),
        ([], {"experiments/run.py": "from sao_jax import a\n"}, check_entry_points,
         ":run runs experiments/run.py, which must be in srcs (or named by main_module)"),
        ([('main_module = "pytest", ', "")], {}, check_entry_points,
         'must run main_module = "pytest"'),
        ([('data = ["pyproject.toml"]', "")], {}, check_entry_points, "needs pyproject.toml"),
        ([('data = [":run"],', "")], {}, check_imports,
         ":test_a cannot reach experiments/run.py: add :run to its data (used at tests/test_a"),
        ([("\npy_library(", '\ncc_library(name = "c")\npy_library(')], {}, check_parse,
         "cc_library() is not loaded"),
        ([('["experiments/__init__.py"]', '[s for s in ["experiments/__init__.py"]]')], {},
         check_parse, "unsupported expression"),
        ([("exclude =", "exclude_files =")], {}, check_parse,
         "BUILD:8: glob() got an unexpected keyword argument 'exclude_files'"),
        ([('glob(["sao_jax/**/*.py"]', 'glob(["sao_jax/*.txt"]')], {}, check_parse,
         "matches no file"),
    ],
)  # fmt: skip
def test_checker_names_the_fault_and_the_fix(tmp_path, edits, files, check, message):
    errors = check(_mini_repo(tmp_path, edits, files))
    assert any(message in e for e in errors), errors
