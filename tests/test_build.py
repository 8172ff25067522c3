"""BUILD stays true without Bazel: parse it with `ast`, evaluate its globs, check every target.

Starlark BUILD files are Python expressions, so `ast.parse` reads them; nothing is executed.
Checked against the sources found on disk (so files added later are covered too):
- every module under sao_jax/, configs/, experiments/ is in the srcs of exactly one target,
  every tests/test_*.py is run by one py_test, every other tests/*.py is in some target;
- every ':name' dep exists, every requirement("x") is pinned in requirements*.txt, no cycle;
- every import (found with `ast` anywhere in the file) resolves to a module the target reaches
  through its deps (or data), every third-party import to a requirement() it reaches; so do
  `[sys.executable, "-m", "<module>"]` runs, exact file paths ("configs/sao.py") outside test
  files, and `--config=<file>` launch lines of py_binary mains;
- py_binary mains have a `__main__` block; py_tests run pytest on their file with the config.
"""

import ast
import collections
import dataclasses
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).absolute().parents[1]
FIRST_PARTY = ("sao_jax", "configs", "experiments", "tests")
RULES_BZL = "@rules_python//python:defs.bzl"
PIP_BZL = "@pip//:requirements.bzl"
PY_RULES = ("py_library", "py_binary", "py_test")
NATIVE = ("package", "exports_files", "filegroup", "licenses")
SIZES = ("small", "medium", "large", "enormous")
# Import name -> pip distribution where they differ (normalised names; dotted keys first).
# fmt: off
IMPORT_TO_PIP = {
    "google.protobuf": "protobuf", "absl": "absl-py", "ml_collections": "ml-collections",
    "orbax": "orbax-checkpoint", "PIL": "pillow", "yaml": "pyyaml", "attr": "attrs",
    "sklearn": "scikit-learn", "cv2": "opencv-python", "dateutil": "python-dateutil",
    "xdist": "pytest-xdist", "_pytest": "pytest",
}
# Unpinned distributions that a pinned one installs: importing them needs one of these.
PROVIDED_BY = {
    "ml-dtypes": ("jax",), "opt-einsum": ("jax",), "scipy": ("jax",), "jaxlib": ("jax",),
    "etils": ("orbax-checkpoint", "clu"), "msgpack": ("flax", "orbax-checkpoint"),
    "pyyaml": ("flax", "orbax-checkpoint"), "treescope": ("flax",),
    "typing-extensions": ("flax", "orbax-checkpoint", "clu"),
}
# fmt: on


class BuildError(ValueError):
    """A BUILD construct this checker (or Bazel) does not accept."""


@dataclasses.dataclass(frozen=True)
class Req:
    """`requirement("name")`, name normalised."""

    name: str


@dataclasses.dataclass
class Target:
    kind: str
    name: str
    line: int
    srcs: list[str]
    deps: list[str]  # target names
    reqs: list[str]  # normalised pip names
    data_files: list[str]
    data_targets: list[str]
    attrs: dict


def normalise(name: str) -> str:
    """PEP 503 name: runs of '-', '_', '.' -> '-', lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _label(value, where: str) -> str | None:
    """':name' or '//:name' -> 'name'; a file path -> None."""
    if not isinstance(value, str):
        raise BuildError(f"{where}: expected a string, got {value!r}")
    if value.startswith(("@", "//")) and not value.startswith("//:"):
        raise BuildError(f"{where}: {value!r}: use ':name' (one package) or requirement()")
    return value.rpartition(":")[2] if ":" in value else None


class _Evaluator:
    """Evaluates the literal subset of Starlark a BUILD file uses; never calls `eval`."""

    def __init__(self, root: pathlib.Path, loaded: dict):
        self.root, self.loaded, self.env = root, loaded, {}

    def __call__(self, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str | int | bool | None):
            return node.value
        if isinstance(node, ast.List | ast.Tuple):
            return [self(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self(k): self(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self(node.left), self(node.right)
            if type(left) is type(right) and isinstance(left, list | str):
                return left + right
        if isinstance(node, ast.Name) and node.id in self.env:
            return self.env[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args[1:]:
            kw = {k.arg: self(k.value) for k in node.keywords}
            args = [self(a) for a in node.args]
            if node.func.id == "glob":
                try:
                    return self.glob(*args, **kw, line=node.lineno)
                except TypeError as e:
                    raise BuildError(f"BUILD:{node.lineno}: {e}".replace("_Evaluator.", "")) from e
            loaded = self.loaded.get(node.func.id)
            if (
                node.func.id == "requirement"
                and loaded == PIP_BZL
                and [type(a) for a in args] == [str]
            ):
                return Req(normalise(args[0]))
        raise BuildError(f"BUILD:{node.lineno}: unsupported expression {ast.unparse(node)!r}")

    def glob(self, include, exclude=(), allow_empty=False, line=0):
        """Bazel glob: files only, '**' spans zero or more directories, minus `exclude`."""
        patterns = [*include, *exclude] if isinstance(include, list) else [include]
        if isinstance(exclude, str) or not all(
            isinstance(p, str) and p and not p.startswith("/") and ".." not in p for p in patterns
        ):
            raise BuildError(f"BUILD:{line}: glob() takes lists of relative patterns")

        def match(patterns):
            return {
                p.relative_to(self.root).as_posix()
                for pat in patterns
                for p in self.root.glob(pat)
                if p.is_file() and "__pycache__" not in p.parts
            }

        files = sorted(match(include) - match(exclude))
        if not files and not allow_empty:
            raise BuildError(f"BUILD:{line}: glob({include}) matches no file (Bazel rejects it)")
        return files


def parse_build(root: pathlib.Path) -> tuple[dict[str, Target], list[str]]:
    """Targets of root/BUILD by name, and the errors found while reading them."""
    tree = ast.parse((root / "BUILD").read_text(), filename="BUILD")
    loaded, targets, errors = {}, {}, []
    ev = _Evaluator(root, loaded)
    for stmt in tree.body:
        try:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                ev.env[stmt.targets[0].id] = ev(stmt.value)
                continue
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                raise BuildError(f"BUILD:{stmt.lineno}: only load(), rule calls and NAME = value")
            fn = call.func.id
            if fn == "load":
                bzl, *symbols = [ev(a) for a in call.args]
                loaded.update({s: bzl for s in symbols})
                loaded.update({k.arg: bzl for k in call.keywords})
            elif fn in PY_RULES and loaded.get(fn) == RULES_BZL:
                if call.args:
                    raise BuildError(f"BUILD:{stmt.lineno}: {fn} takes keyword arguments only")
                t = _target(root, fn, stmt.lineno, {k.arg: ev(k.value) for k in call.keywords})
                if t.name in targets:
                    raise BuildError(f"BUILD:{t.line}: target :{t.name} defined twice")
                targets[t.name] = t
            elif fn not in NATIVE:
                raise BuildError(f"BUILD:{stmt.lineno}: {fn}() is not loaded from {RULES_BZL}")
        except BuildError as e:
            errors.append(str(e))
    return targets, errors


def _target(root, kind, line, attrs) -> Target:
    name = attrs.pop("name", None)
    where = f"BUILD:{line}: :{name}"
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise BuildError(f"BUILD:{line}: {kind} needs a plain name, got {name!r}")
    srcs = attrs.pop("srcs", [])
    for s in srcs:
        if _label(s, where) is not None or not (root / s).is_file() or not s.endswith(".py"):
            raise BuildError(f"{where}: srcs entry {s!r} is not an existing .py file")
    deps, reqs = [], []
    for d in attrs.pop("deps", []):
        if isinstance(d, Req):
            reqs.append(d.name)
        else:
            deps.append(_label(d, where) or d)
    data_files, data_targets = [], []
    for d in attrs.pop("data", []):
        if (lab := _label(d, where)) is not None:
            data_targets.append(lab)
        elif (root / d).is_file():
            data_files.append(d)
        else:
            raise BuildError(f"{where}: data entry {d!r} is neither ':target' nor a file")
    return Target(kind, name, line, srcs, deps, reqs, data_files, data_targets, attrs)


def read_pins(path: pathlib.Path) -> set[str]:
    """Normalised names pinned in a requirements file, following `-r` includes."""
    names = set()
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r"):
            names |= read_pins(path.parent / line[2:].strip())
        elif m := re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line):
            names.add(normalise(m.group()))
    return names


def module_name(rel: str) -> str:
    parts = list(pathlib.PurePosixPath(rel).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def has_main_block(tree: ast.Module) -> bool:
    """True when the module has a top-level `if __name__ == "__main__":`."""
    return any(
        isinstance(s, ast.If)
        and isinstance(s.test, ast.Compare)
        and isinstance(s.test.left, ast.Name)
        and s.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in s.test.comparators)
        for s in tree.body
    )


@dataclasses.dataclass(frozen=True)
class Need:
    """Something one source file needs at run time: a first-party file or an import name."""

    line: int
    what: str  # the import / reference as written
    file: str | None  # first-party file, or None for a third-party import


class Repo:
    """The BUILD targets, the sources on disk and the pins of one checkout."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.targets, self.parse_errors = parse_build(root)
        self.pins = read_pins(root / "requirements-dev.txt")
        self.sources = sorted(
            p.relative_to(root).as_posix()
            for d in FIRST_PARTY
            for p in (root / d).rglob("*.py")
            if "__pycache__" not in p.parts
        )
        self.modules = {module_name(rel): rel for rel in self.sources}
        self._trees, self._needs, self._reach = {}, {}, {}
        self.owners = collections.defaultdict(list)  # file -> names of targets with it in srcs
        for t in self.targets.values():
            for s in t.srcs:
                self.owners[s].append(t.name)

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            self._trees[rel] = ast.parse((self.root / rel).read_text(), filename=rel)
        return self._trees[rel]

    def is_main(self, rel: str) -> bool:
        return has_main_block(self.tree(rel))

    def _files_of(self, module: str) -> list[str]:
        """The module's file and the __init__.py of every package above it."""
        parts = module.split(".")
        names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return [self.modules[n] for n in names if n in self.modules]

    def resolve(self, name: str) -> str | None:
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name or None

    def needs(self, rel: str) -> list[Need]:
        """Imports anywhere in the file, its packages, `-m module` runs and files named by path."""
        if rel not in self._needs:
            self._needs[rel] = self._find_needs(rel)
        return self._needs[rel]

    def _find_needs(self, rel: str) -> list[Need]:
        mod = module_name(rel)
        pkg = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
        out = [Need(0, "its package", f) for f in self._files_of(pkg)]
        for node in ast.walk(self.tree(rel)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
                names = [n for n in names[1:] if n in self.modules] or names[:1]
            elif isinstance(node, ast.List | ast.Tuple):  # [sys.executable, "-m", "<module>"]
                code = [ast.unparse(e) for e in node.elts]
                names = [
                    node.elts[i + 2].value
                    for i in range(len(code) - 2)
                    if code[i : i + 2] == ["sys.executable", "'-m'"]
                    and isinstance(getattr(node.elts[i + 2], "value", None), str)
                ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                paths = re.findall(r"--config=([\w./-]+\.py)", node.value)
                refs = [(f"--config={p}", p) for p in paths] + [(repr(node.value), node.value)]
                out += [Need(node.lineno, what, f) for what, f in refs if f in self.sources]
            for n in names:
                out += self.import_needs(n, node.lineno)
        return out

    def import_needs(self, name: str, line: int) -> list[Need]:
        """A first-party module's file and packages, or a third-party import."""
        if name.split(".")[0] in FIRST_PARTY:
            return [Need(line, name, f) for f in self._files_of(self.resolve(name) or "")]
        return [] if name.split(".")[0] in sys.stdlib_module_names else [Need(line, name, None)]

    def edges(self, t: Target) -> list[str]:
        return [d for d in t.deps + t.data_targets if d in self.targets]

    def reach(self, name: str) -> tuple[set, set]:
        """(files, pip names) in the runfiles of a target: its srcs, data and deps, transitively."""
        if name not in self._reach:
            self._reach[name] = self._find_reach(name)
        return self._reach[name]

    def _find_reach(self, name: str) -> tuple[set, set]:
        files, reqs, stack, seen = set(), set(), [name], {name}
        while stack:
            t = self.targets[stack.pop()]
            files |= {*t.srcs, *t.data_files}
            reqs |= set(t.reqs)
            for d in self.edges(t):
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return files, reqs

    def main_file(self, t: Target) -> str | None:
        """The file a py_binary runs: its `main_module`'s file, its `main`, or its first src."""
        if "main_module" in t.attrs:
            return self.modules.get(t.attrs["main_module"])
        return t.attrs.get("main", t.srcs[0] if t.srcs else None)

    def test_mains(self, t: Target) -> list[str]:
        """The files a py_test runs: pytest's file arguments, or its `main`."""
        if t.attrs.get("main_module") == "pytest":
            return [a for a in t.attrs.get("args", []) if a.endswith(".py")]
        return [t.attrs.get("main", t.srcs[0] if t.srcs else f"{t.name}.py")]

    def suggest(self, rel: str) -> str:
        """Which target a file should join, for the failure message."""
        path = pathlib.PurePosixPath(rel)
        if rel.startswith("tests/") and path.name.startswith("test_"):
            return (
                f'add py_test(name = "{path.stem}", size = "small", srcs = ["{rel}"], '
                f'args = ["{rel}"], main_module = "pytest", deps = [":test_support", ...])'
            )
        if rel.startswith("experiments/") and self.is_main(rel):
            name = "_".join(path.with_suffix("").parts[1:])
            return (
                f'add it to a py_binary: py_binary(name = "{name}", srcs = ["{rel}"], '
                f'main = "{rel}", deps = [":experiments", ...]) (if other files import it: a '
                f'py_library, and main_module = "{module_name(rel)}" in the binary)'
            )
        # A module joins the library of its folder; a new __init__.py may join its parent's.
        folders = [path.parent] + ([path.parent.parent] if path.name == "__init__.py" else [])
        for folder in folders:
            libs = collections.Counter(
                o
                for s in self.sources
                if pathlib.PurePosixPath(s).parent == folder
                for o in self.owners.get(s, [])
                if self.targets[o].kind == "py_library"
            )
            if libs:
                return f"add it to the srcs of :{libs.most_common(1)[0][0]}"
        return (
            f'add py_library(name = "{path.parent.name}", srcs = glob(["{path.parent}/**/*.py"]), '
            "deps = [...]) for the new package"
        )


def check_parse(repo: Repo) -> list[str]:
    return list(repo.parse_errors)


def check_coverage(repo: Repo) -> list[str]:
    errors = []
    mains = collections.Counter(
        m for t in repo.targets.values() if t.kind == "py_test" for m in repo.test_mains(t)
    )
    binaries = {repo.main_file(t) for t in repo.targets.values() if t.kind == "py_binary"}
    for rel in repo.sources:
        owners = repo.owners.get(rel, [])
        if rel.startswith("tests/") and pathlib.PurePosixPath(rel).name.startswith("test_"):
            if mains[rel] != 1:
                errors.append(f"{rel} is run by {mains[rel]} py_tests, not 1: {repo.suggest(rel)}")
        elif not owners:
            errors.append(f"{rel} is in no target: {repo.suggest(rel)}")
        elif len(owners) > 1 and not rel.startswith("tests/"):
            errors.append(f"{rel} is in the srcs of {', '.join(owners)}: keep it in one target")
        elif rel.startswith("experiments/") and rel not in binaries and repo.is_main(rel):
            errors.append(f"{rel} has a __main__ block: {repo.suggest(rel)}")
    return errors


def check_labels(repo: Repo) -> list[str]:
    """Deps exist and are libraries; testonly stays in tests; requirements are pinned."""
    errors = []
    for t in repo.targets.values():
        testonly = t.kind == "py_test" or t.attrs.get("testonly") is True
        for d in t.deps + t.data_targets:
            dep = repo.targets.get(d)
            if dep is None:
                errors.append(f"BUILD:{t.line}: :{t.name} depends on :{d}, which does not exist")
            elif d in t.deps and dep.kind != "py_library":
                errors.append(f"BUILD:{t.line}: :{t.name} has {dep.kind} :{d} in deps: use data")
            elif not testonly and (dep.kind == "py_test" or dep.attrs.get("testonly") is True):
                errors.append(f"BUILD:{t.line}: :{t.name} uses testonly :{d}: mark it testonly")
        for r in t.reqs:
            if r not in repo.pins:
                errors.append(
                    f'BUILD:{t.line}: :{t.name} has requirement("{r}"), which is not pinned in '
                    "requirements.txt or requirements-dev.txt: pin it or drop it"
                )
    return errors


def check_cycles(repo: Repo) -> list[str]:
    """Depth-first search; every back edge closes a cycle, reported as a path."""
    errors, state, path = [], {}, []

    def visit(name):
        state[name] = "open"
        path.append(name)
        for d in repo.edges(repo.targets[name]):
            if state.get(d) == "open":
                cycle = " -> ".join(":" + n for n in [*path[path.index(d) :], d])
                errors.append(f"dependency cycle {cycle}: split a target so deps only point down")
            elif d not in state:
                visit(d)
        path.pop()
        state[name] = "done"

    for name in repo.targets:
        if name not in state:
            visit(name)
    return errors


def _pip_of(import_name: str) -> str:
    parts = import_name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in IMPORT_TO_PIP:
            return IMPORT_TO_PIP[".".join(parts[:i])]
    return normalise(parts[0])


def _unmet(repo: Repo, t: Target, need: Need) -> tuple[str, str] | None:
    """None when the target reaches what `need` names, else (what it lacks, the fix)."""
    files, reqs = repo.reach(t.name)
    if need.file is not None:
        if need.what.startswith("--config="):  # a launch line binds entry points only
            exempt = t.kind != "py_binary"
        else:  # a file's exact path ('configs/sao.py') binds all but test files
            exempt = need.what.startswith("'") and t.kind == "py_test"
        if need.file in files or exempt:
            return None
        owners = repo.owners.get(need.file, [])
        kinds = ["deps" if repo.targets[o].kind == "py_library" else "data" for o in owners]
        fix = " or ".join(f"add :{o} to its {k}" for o, k in zip(owners, kinds))
        return need.file, fix or "that file is in no target"
    pip = _pip_of(need.what)
    if pip in repo.pins:
        return None if pip in reqs else (pip, f'add requirement("{pip}") to its deps')
    providers = PROVIDED_BY.get(pip, ())
    if reqs & set(providers):
        return None
    hint = " or ".join(f'requirement("{p}")' for p in providers)
    return f"{pip} (not pinned)", f"add {hint} to its deps" if hint else "pin it first"


def check_imports(repo: Repo) -> list[str]:
    """Each need of each src is met by the target's own srcs/data or its transitive deps."""
    unmet = collections.defaultdict(lambda: ({}, {}))  # (target, fix) -> (missing, places)
    for t in repo.targets.values():
        places = [(s, n) for s in t.srcs for n in repo.needs(s)]
        if "main_module" in t.attrs:
            places += [("BUILD", n) for n in repo.import_needs(t.attrs["main_module"], t.line)]
        for src, need in places:
            if (miss := _unmet(repo, t, need)) is not None:
                missing, where = unmet[t.name, miss[1]]
                missing[miss[0]] = where[f"{src}:{need.line} ({need.what})"] = None
    return [
        f":{name} cannot reach {', '.join(missing)}: {fix} (used at {', '.join(list(where)[:3])}"
        + (f" and {len(where) - 3} more)" if len(where) > 3 else ")")
        for (name, fix), (missing, where) in unmet.items()
    ]


def check_entry_points(repo: Repo) -> list[str]:
    """py_binary mains have a __main__ block; py_tests run pytest on their own file."""
    errors = []
    for t in repo.targets.values():
        if t.kind == "py_binary":
            main = repo.main_file(t)
            if (
                main is None
                or not repo.is_main(main)
                or not (main in t.srcs or "main_module" in t.attrs)
            ):
                errors.append(
                    f"BUILD:{t.line}: :{t.name} runs {main}, which must be in srcs (or named by "
                    'main_module) and have an `if __name__ == "__main__":` block'
                )
        if t.kind != "py_test":
            continue
        if t.attrs.get("size") not in SIZES:
            errors.append(f"BUILD:{t.line}: :{t.name} needs size = one of {SIZES}")
        mains = repo.test_mains(t)
        if t.attrs.get("main_module") != "pytest" or not mains or set(mains) - set(t.srcs):
            errors.append(
                f'BUILD:{t.line}: :{t.name} must run main_module = "pytest" with args = [its '
                "test file], the file also in srcs"
            )
        files = repo.reach(t.name)[0]
        for m in mains:
            for folder in pathlib.PurePosixPath(m).parents:
                conftest = (folder / "conftest.py").as_posix()
                if conftest in repo.sources and conftest not in files:
                    errors.append(f"BUILD:{t.line}: :{t.name} needs {conftest}: add :test_support")
        if "pyproject.toml" not in files:
            errors.append(
                f"BUILD:{t.line}: :{t.name} needs pyproject.toml (pytest options) in data"
            )
    return errors


CHECKS = (
    check_parse,
    check_coverage,
    check_labels,
    check_cycles,
    check_imports,
    check_entry_points,
)


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
