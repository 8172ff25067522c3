"""The BUILD model behind tests/test_build.py: parse BUILD, evaluate its globs, resolve imports.

Starlark BUILD files are Python expressions, so `ast.parse` reads them; nothing is executed.
`Repo` holds one checkout's targets (`parse_build`), its sources on disk and its pins
(`read_pins`); `Repo.needs` finds what a source file needs at run time (imports anywhere in
the file, its packages, `[sys.executable, "-m", "<module>"]` runs, files named by path) and
`Repo.reach` what a target's runfiles hold. tests/build_checks.py holds the checks.
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
        # sao_jax.configs / sao_jax.experiments: in a checkout, pointers (their __init__.py)
        # to the top-level configs/ and experiments/ folders, shipped under those names.
        for alias, folder in (
            ("sao_jax.configs", "configs"),
            ("sao_jax.experiments", "experiments"),
        ):
            for name, rel in list(self.modules.items()):
                if name.startswith(folder + "."):
                    self.modules[alias + name[len(folder) :]] = rel
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
