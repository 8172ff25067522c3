"""BUILD is generated (tests/build_gen.py, `make build-file`) and stays current and true:
the committed file equals a fresh one, and every check of tests/build_checks.py passes on it
(tests/build_rules.py parses BUILD with `ast` and evaluates its globs; nothing is executed).
On tiny repositories: a new module and a new test file get their stanzas, a package reached
through another splits into layers (deps stay acyclic), binaries and tests get the scripts
they run as data, an unpinned or unparsable file is named, and the checker names the fault
and the fix.
"""

import difflib
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
from tests.build_gen import DATA_GLOBS, generate
from tests.build_rules import BuildError, Need, Repo, Sources

ROOT = pathlib.Path(__file__).absolute().parents[1]


@pytest.fixture(scope="module")
def sources():
    return Sources(ROOT)


@pytest.fixture(scope="module")
def fresh(sources):
    return generate(ROOT, sources)


@pytest.fixture(scope="module")
def repo(sources):
    return Repo(ROOT, sources=sources)


def test_build_file_is_current(fresh):
    text, _ = fresh
    committed = (ROOT / "BUILD").read_text()
    if committed != text:
        diff = difflib.unified_diff(committed.splitlines(), text.splitlines(), "BUILD", "fresh")
        pytest.fail(
            "BUILD is out of date: run `make build-file` and commit it\n"
            + "\n".join(list(diff)[:60]),
            pytrace=False,
        )


def test_generator_finds_no_problem(fresh):
    assert fresh[1] == []


def test_declared_data_names_existing_tests():
    missing = [t for t in DATA_GLOBS if not (ROOT / t).is_file()]
    assert not missing, f"tests/build_gen.py DATA_GLOBS names {missing}: drop or rename them"


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_build_file_is_true(repo, check):
    errors = check(repo)
    assert not errors, f"{len(errors)} BUILD problem(s):\n" + "\n".join(errors)


def _write(root: pathlib.Path, files: dict) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _fresh_repo(root: pathlib.Path) -> Repo:
    """`make build-file` there, and every check passes."""
    text, problems = generate(root)
    assert problems == []
    (root / "BUILD").write_text(text)
    repo = Repo(root)
    assert {c.__name__: c(repo) for c in CHECKS} == {c.__name__: [] for c in CHECKS}
    return repo


def _summary(repo: Repo, name: str) -> tuple:
    t = repo.targets[name]
    return (t.kind, t.srcs, t.deps, t.reqs, t.data_targets + t.data_files)


def test_a_new_module_and_a_new_test_get_their_stanzas(tmp_path):
    _write(tmp_path, MINI_FILES)
    repo = _fresh_repo(tmp_path)
    assert _summary(repo, "sao_jax") == (
        "py_library",
        ["sao_jax/__init__.py", "sao_jax/a.py", "sao_jax/b.py"],
        [],
        ["numpy"],
        [],
    )
    assert _summary(repo, "run") == (
        "py_binary",
        ["experiments/run.py"],
        ["experiments", "sao_jax"],
        [],
        [],
    )
    assert _summary(repo, "test_a") == (
        "py_test",
        ["tests/test_a.py"],
        ["sao_jax", "test_support"],
        ["pytest"],
        ["run"],
    )
    assert _summary(repo, "test_support")[-1] == ["pyproject.toml"]

    _write(tmp_path, {
        "sao_jax/c/__init__.py": "",
        "sao_jax/c/d.py": "from sao_jax import b\n",
        "tests/test_d.py": "from sao_jax.c import d\n",
    })  # fmt: skip
    stale = Repo(tmp_path)
    assert check_coverage(stale) == [
        "sao_jax/c/__init__.py is in no target: run `make build-file` (tests/build_gen.py "
        "writes BUILD)",
        "sao_jax/c/d.py is in no target: run `make build-file` (tests/build_gen.py writes BUILD)",
        "tests/test_d.py is run by 0 py_tests, not 1: run `make build-file` (tests/build_gen.py "
        "writes BUILD)",
    ]
    repo = _fresh_repo(tmp_path)
    assert _summary(repo, "c") == (
        "py_library",
        ["sao_jax/c/__init__.py", "sao_jax/c/d.py"],
        ["sao_jax"],
        [],
        [],
    )
    assert _summary(repo, "test_d") == (
        "py_test",
        ["tests/test_d.py"],
        ["c", "sao_jax", "test_support"],  # sao_jax/__init__.py: the package above
        ["pytest"],
        [],
    )
    assert repo.targets["test_d"].attrs == {
        "size": "medium", "args": ["tests/test_d.py"], "main_module": "pytest"
    }  # fmt: skip


def test_a_package_reached_through_another_is_split_into_layers(tmp_path):
    _write(tmp_path, {
        **MINI_FILES,
        "sao_jax/face.py": "from sao_jax.p import q\n",  # sao_jax -> p -> sao_jax
        "sao_jax/p/__init__.py": "",
        "sao_jax/p/q.py": "from sao_jax import b\n",
        # a script that another module imports: a library, and a binary running its module
        "experiments/tool.py": 'import yaml\n\nif __name__ == "__main__":\n    pass\n',
        "tests/test_tool.py": "from experiments import tool\n\n\ndef test_x():\n    pass\n",
        "experiments/pkg/__init__.py": "",  # a script folder: python -m experiments.pkg
        "experiments/pkg/__main__.py": "from experiments.pkg import reading\n" + MAIN,
        "experiments/pkg/reading.py": "from sao_jax import a\n",
        "requirements-dev.txt": "-r requirements.txt\npytest==9.2.0\nPyYAML==6.0\n",
    })  # fmt: skip
    repo = _fresh_repo(tmp_path)
    assert _summary(repo, "p")[2] == ["sao_jax"]
    assert _summary(repo, "sao_jax_1") == (
        "py_library",
        ["sao_jax/face.py"],
        ["p", "sao_jax"],
        [],
        [],
    )
    assert _summary(repo, "tool_lib") == (
        "py_library",
        ["experiments/tool.py"],
        ["experiments"],
        ["pyyaml"],
        [],
    )
    assert 'requirement("PyYAML")' in (tmp_path / "BUILD").read_text()  # spelled as pinned
    assert repo.targets["tool"].attrs == {"main_module": "experiments.tool"}
    assert repo.targets["tool"].deps == ["tool_lib"]
    assert repo.targets["test_tool"].deps == ["experiments", "test_support", "tool_lib"]
    assert _summary(repo, "pkg") == (
        "py_binary",
        ["experiments/pkg/__main__.py"],
        ["experiments", "pkg_reading_lib"],
        [],
        [],
    )
    assert repo.targets["pkg"].attrs == {"main_module": "experiments.pkg"}
    assert _summary(repo, "experiments")[1] == [
        "experiments/__init__.py",
        "experiments/pkg/__init__.py",
    ]


def test_a_binary_gets_the_scripts_its_libraries_run_unless_that_closes_a_cycle(tmp_path):
    sweep = 'TRAIN = "experiments.train"\nLAUNCH = "experiments.launch"\n'  # run by name
    script = "from sao_jax import sweep\n" + MAIN
    _write(tmp_path, {
        **MINI_FILES,
        "sao_jax/sweep.py": sweep,
        "experiments/train.py": script,
        "experiments/launch.py": 'TRAIN = "experiments.train"\n' + script,
        "experiments/table.py": script,
    })  # fmt: skip
    repo = _fresh_repo(tmp_path)
    data = {n: repo.targets[n].data_targets for n in ("launch", "table", "train")}
    assert data == {"launch": ["train"], "table": ["launch", "train"], "train": []}
    assert repo.targets["sao_jax"].data_targets == []  # the library itself: no cycle


def test_a_script_run_by_a_name_gets_its_binary_as_data(tmp_path):
    _write(tmp_path, {
        **MINI_FILES,
        "tests/runner.py": 'import sys\n\n\ndef argv(name):\n    return [sys.executable, "-m", '
        'f"experiments.{name}"]\n',
        "tests/test_b.py": 'from tests import runner\n\nARGV = runner.argv("run")\n',
        "tests/test_c.py": 'import pathlib\n\nfrom tests import runner\n\n'
        'P = pathlib.Path() / "run"\n',
    })  # fmt: skip
    repo = _fresh_repo(tmp_path)
    data = {n: repo.targets[n].data_targets for n in ("runner", "test_b", "test_c")}
    assert data == {"runner": [], "test_b": ["run"], "test_c": []}  # test_c: a path part


def test_a_file_that_does_not_parse_is_named(tmp_path):
    _write(tmp_path, {**MINI_FILES, "sao_jax/b.py": "def (\n"})
    with pytest.raises(BuildError, match=r"^sao_jax/b.py:1: cannot parse \(.*\): fix the file"):
        generate(tmp_path)


def test_an_unpinned_import_is_a_problem_unless_optional(tmp_path):
    _write(tmp_path, {**MINI_FILES, "sao_jax/b.py": "import torch\n"})
    assert generate(tmp_path)[1] == [
        "sao_jax/b.py:1: imports torch (torch), which is not pinned in requirements.txt or "
        "requirements-dev.txt: pin it (or import it in a try that catches ImportError)"
    ]
    optional = "try:\n    import torch\nexcept ImportError:\n    torch = None\n"
    _write(tmp_path, {"sao_jax/b.py": optional})
    assert _summary(_fresh_repo(tmp_path), "sao_jax")[3] == ["numpy"]


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
    _write(root, {**MINI_FILES, **dict(files), "BUILD": build})
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
         "configs/x.py is in no target: run `make build-file`"),
        ([], {"experiments/ablations.py": MAIN}, check_coverage,
         "experiments/ablations.py is in no target: run `make build-file`"),
        ([('["experiments/__init__.py"]', '["experiments/__init__.py", "experiments/x.py"]')],
         {"experiments/x.py": MAIN}, check_coverage,
         "experiments/x.py has a __main__ block but no py_binary runs it"),
        ([], {"tests/test_b.py": ""}, check_coverage, "tests/test_b.py is run by 0 py_tests"),
        ([], {"tests/helpers.py": ""}, check_coverage, "tests/helpers.py is in no target: run"),
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
        ([('data = ["pyproject.toml"]', 'data = ["pyproject.toml"] + glob(["*.toml"])')], {},
         check_labels, ":test_support names pyproject.toml twice in data"),
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
