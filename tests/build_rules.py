"""The BUILD model shared by the generator (tests/build_gen.py) and the checks
(tests/build_checks.py): the sources and what each needs, and a parsed BUILD file.

`Sources` holds one checkout's Python files under FIRST_PARTY and its pins (`read_pins`);
`Sources.needs` finds what a file needs at run time (`Need`: imports anywhere in the file,
its packages, modules it runs, files it names by path). Starlark BUILD files are Python
expressions, so `ast.parse` reads them (`parse_build`, nothing executed); `Repo` adds the
targets to the sources and `Repo.reach` says what a target's runfiles hold.
"""

import ast
import collections
import dataclasses
import pathlib
import re
import sys

FIRST_PARTY = ("sao_jax", "configs", "experiments", "tests")
RULES_BZL = "@rules_python//python:defs.bzl"
PIP_BZL = "@pip//:requirements.bzl"
PY_RULES = ("py_library", "py_binary", "py_test")
NATIVE = ("package", "exports_files", "filegroup", "licenses")
# Import name -> pip distribution where they differ (normalised names; dotted keys first).
# fmt: off
IMPORT_TO_PIP = {
    "google.protobuf": "protobuf", "absl": "absl-py", "ml_collections": "ml-collections",
    "orbax": "orbax-checkpoint", "PIL": "pillow", "yaml": "pyyaml", "attr": "attrs",
    "sklearn": "scikit-learn", "cv2": "opencv-python", "dateutil": "python-dateutil",
    "xdist": "pytest-xdist", "_pytest": "pytest", "agents": "openai-agents",
}
# Unpinned distributions that a pinned one installs: importing them needs one of these.
PROVIDED_BY = {
    "ml-dtypes": ("jax",), "opt-einsum": ("jax",), "scipy": ("jax",), "jaxlib": ("jax",),
    "etils": ("orbax-checkpoint", "clu"), "msgpack": ("flax", "orbax-checkpoint"),
    "pyyaml": ("flax", "orbax-checkpoint"), "treescope": ("flax",),
    "typing-extensions": ("flax", "orbax-checkpoint", "clu"),
}
# fmt: on
# Folders skipped when looking for files that tests name by path.
NOT_DATA = (".git", ".venv", "__pycache__", "workdirs", "build", "dist")


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


def parse_build(root: pathlib.Path, text: str) -> tuple[dict[str, Target], list[str]]:
    """Targets of a BUILD file's text by name (globs evaluated under root), and the errors
    found while reading them."""
    tree = ast.parse(text, filename="BUILD")
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


def read_pin_spellings(path: pathlib.Path) -> dict[str, str]:
    """Normalised name -> the name as written, for the packages pinned in a requirements
    file, following `-r` includes."""
    names = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r"):
            names |= read_pin_spellings(path.parent / line[2:].strip())
        elif m := re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line):
            names[normalise(m.group())] = m.group()
    return names


def read_pins(path: pathlib.Path) -> set[str]:
    """Normalised names pinned in a requirements file, following `-r` includes."""
    return set(read_pin_spellings(path))


def pip_of(import_name: str) -> str:
    """The pip distribution (normalised) an import name comes from."""
    parts = import_name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in IMPORT_TO_PIP:
            return IMPORT_TO_PIP[".".join(parts[:i])]
    return normalise(parts[0])


def is_test_file(rel: str) -> bool:
    """tests/test_*.py: a file pytest runs (its py_test's own)."""
    return rel.startswith("tests/") and pathlib.PurePosixPath(rel).name.startswith("test_")


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
    """Something one source file needs at run time.

    kind: "import" (a module it imports, or its package: `file` is the first-party file,
    None for a third-party import), "run" (a module it runs: `[sys.executable, "-m", m]`, a
    string equal to an entry point's module name, or in a file that runs
    f"experiments.{name}" or imports one that does, a string equal to that name that is no
    path part, key or compared value), "path" (a first-party .py file
    named by its exact path), "config" (a `--config=<file>` launch line) or "data" (a file
    of the checkout that a file under tests/ names by path). `optional`: an import inside a
    `try` that catches ImportError.
    """

    line: int
    what: str  # the import / reference as written
    file: str | None  # first-party file, or None for a third-party import
    kind: str = "import"
    optional: bool = False


_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")


def _catches_import_error(node: ast.Try) -> bool:
    for h in node.handlers:
        types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        if any(t is None or (isinstance(t, ast.Name) and t.id in _IMPORT_ERRORS) for t in types):
            return True
    return False


def _optional_imports(tree: ast.Module) -> set[int]:
    """id() of the imports inside a `try` that catches ImportError."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try | ast.TryStar) and _catches_import_error(node):
            for stmt in node.body:
                out |= {id(n) for n in ast.walk(stmt) if isinstance(n, ast.Import | ast.ImportFrom)}
    return out


def _operands(node: ast.AST) -> list[ast.AST]:
    """The parts of an expression whose strings name no script (a path part, a key, a value
    compared against)."""
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    if isinstance(node, ast.Compare):
        return [node.left, *node.comparators]
    if isinstance(node, ast.Subscript):
        return [node.slice]
    return [k for k in node.keys if k is not None]  # ast.Dict


def _joined_path(node: ast.AST) -> str | None:
    """'a/b.py' for `x / "a" / "b.py"` (two or more string parts joined by `/`), else None:
    a path from the root when x is the root, as in the tests (ROOT / "tests" / "x.py")."""
    parts = []
    while (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and isinstance(node.right, ast.Constant)
        and isinstance(node.right.value, str)
    ):
        parts.insert(0, node.right.value)
        node = node.left
    return "/".join(parts) if len(parts) > 1 else None


class Sources:
    """The Python files under FIRST_PARTY of one checkout, what each needs, and the pins."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.spellings = read_pin_spellings(root / "requirements-dev.txt")
        self.pins = set(self.spellings)
        self.sources = sorted(
            p.relative_to(root).as_posix()
            for d in FIRST_PARTY
            for p in (root / d).rglob("*.py")
            if "__pycache__" not in p.parts
        )
        self._source_set = set(self.sources)
        self.modules = {module_name(rel): rel for rel in self.sources}
        # sao_jax.configs / sao_jax.experiments: in a checkout, pointers (their __init__.py)
        # to the top-level configs/ and experiments/ folders, shipped under those names.
        for alias, folder in (
            ("sao_jax.configs", "configs"),
            ("sao_jax.experiments", "experiments"),
        ):
            for name, rel in list(self.modules.items()):
                if name.startswith(folder + "."):
                    self.modules[alias + name[len(folder) :]] = rel
        self._trees, self._needs, self._prefixes = {}, {}, {}

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            try:
                self._trees[rel] = ast.parse((self.root / rel).read_text(), filename=rel)
            except (SyntaxError, UnicodeDecodeError) as e:
                where = f"{rel}:{getattr(e, 'lineno', 0)}"
                raise BuildError(f"{where}: cannot parse ({e}): fix the file first") from None
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

    def run_file(self, module: str) -> str | None:
        """The first-party file `python -m module` runs (a package's __main__.py)."""
        if module.split(".")[0] not in FIRST_PARTY:
            return None
        return self.modules.get(module + ".__main__") or self.modules.get(module)

    def _runnable(self, module: str) -> bool:
        """A first-party module with a __main__ block (`python -m` runs it)."""
        rel = self.run_file(module)
        return rel is not None and self.is_main(rel)

    def needs(self, rel: str) -> list[Need]:
        """Imports anywhere in the file, its packages, modules it runs, files named by path."""
        if rel not in self._needs:
            self._needs[rel] = self._find_needs(rel)
        return self._needs[rel]

    def _find_needs(self, rel: str) -> list[Need]:
        mod = module_name(rel)
        pkg = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
        out = [Need(0, "its package", f) for f in self._files_of(pkg)]
        strings, operands = [], set()
        tree = self.tree(rel)
        optional = _optional_imports(tree)
        for node in ast.walk(tree):
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
            elif isinstance(node, ast.List | ast.Tuple) and any(
                isinstance(e, ast.Constant) and e.value == "-m" for e in node.elts
            ):  # [sys.executable, "-m", "<module>"]
                code = [ast.unparse(e) for e in node.elts]
                out += [
                    n
                    for i in range(len(code) - 2)
                    if code[i : i + 2] == ["sys.executable", "'-m'"]
                    and isinstance(getattr(node.elts[i + 2], "value", None), str)
                    for n in self.run_needs(node.elts[i + 2].value, node.lineno)
                ]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node)
            elif isinstance(node, ast.BinOp | ast.Compare | ast.Subscript | ast.Dict):
                operands.update(map(id, _operands(node)))
            elif rel.startswith("tests/") and (path := _joined_path(node)) is not None:
                strings.append(ast.Constant(path, lineno=node.lineno))  # ROOT / "a" / "b"
            for n in names:
                out += self.import_needs(n, node.lineno, id(node) in optional)
        # f"experiments.{name}" runs, here or in a module this one imports: its names
        run_prefixes = self._run_prefixes(rel).union(
            *(self._run_prefixes(n.file) for n in out if n.file is not None)
        )
        for node in strings:
            prefixes = () if id(node) in operands else run_prefixes
            out += self._string_needs(rel, node, prefixes)
        return out

    def _run_prefixes(self, rel: str) -> set[str]:
        """'experiments.' for a file that runs f"experiments.{name}" (an f-string naming a
        first-party module by a variable part)."""
        if rel not in self._prefixes:
            self._prefixes[rel] = {
                node.values[0].value
                for node in ast.walk(self.tree(rel))
                if isinstance(node, ast.JoinedStr)
                and node.values[1:]
                and isinstance(node.values[0], ast.Constant)
                and node.values[0].value.split(".")[0] in FIRST_PARTY
                and node.values[0].value.endswith(".")
            }
        return self._prefixes[rel]

    def _string_needs(self, rel: str, node: ast.Constant, run_prefixes) -> list[Need]:
        value, line = node.value, node.lineno
        runs = [p + value for p in run_prefixes if self._runnable(p + value)]
        out = [n for m in runs for n in self.run_needs(m, line)]
        if self._runnable(value):  # e.g. entry_module("experiments.train")
            out += self.run_needs(value, line)
        for path in re.findall(r"--config=([\w./-]+\.py)", value):
            if path in self._source_set:
                out.append(Need(line, f"--config={path}", path, "config"))
        if value in self._source_set:
            out.append(Need(line, repr(value), value, "path"))
        elif rel.startswith("tests/") and self._is_data_file(value):
            out.append(Need(line, repr(value), value, "data"))
        return out

    def _is_data_file(self, value: str) -> bool:
        """A file of the checkout, named by its path from the root (not a .py source)."""
        if not value or value.endswith(".py") or not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", value):
            return False
        parts = value.split("/")
        if parts[0] in NOT_DATA or any(p in ("..", ".") or p.startswith(".") for p in parts):
            return False
        return (self.root / value).is_file()

    def run_needs(self, module: str, line: int) -> list[Need]:
        """`python -m module`: the file it runs, when it is first-party."""
        rel = self.run_file(module)
        return [] if rel is None else [Need(line, module, rel, "run")]

    def import_needs(self, name: str, line: int, optional: bool = False) -> list[Need]:
        """A first-party module's file and packages, or a third-party import."""
        if name.split(".")[0] in FIRST_PARTY:
            return [Need(line, name, f) for f in self._files_of(self.resolve(name) or "")]
        if name.split(".")[0] in sys.stdlib_module_names:
            return []
        return [Need(line, name, None, optional=optional)]


class Repo(Sources):
    """The BUILD targets (root/BUILD, or `build_text`) and the sources of one checkout."""

    def __init__(
        self, root: pathlib.Path, build_text: str | None = None, sources: Sources | None = None
    ):
        super().__init__(root)
        if sources is not None:  # reuse its parsed files
            self._trees, self._needs = sources._trees, sources._needs
            self._prefixes = sources._prefixes
        text = (root / "BUILD").read_text() if build_text is None else build_text
        self.targets, self.parse_errors = parse_build(root, text)
        self._reach = {}
        self.owners = collections.defaultdict(list)  # file -> names of targets with it in srcs
        for t in self.targets.values():
            for s in t.srcs:
                self.owners[s].append(t.name)

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
        """The file a py_binary runs: its `main_module`'s file (a package's __main__.py), its
        `main`, or its first src."""
        if "main_module" in t.attrs:
            return self.run_file(t.attrs["main_module"])
        return t.attrs.get("main", t.srcs[0] if t.srcs else None)

    def test_mains(self, t: Target) -> list[str]:
        """The files a py_test runs: pytest's file arguments, or its `main`."""
        if t.attrs.get("main_module") == "pytest":
            return [a for a in t.attrs.get("args", []) if a.endswith(".py")]
        return [t.attrs.get("main", t.srcs[0] if t.srcs else f"{t.name}.py")]
