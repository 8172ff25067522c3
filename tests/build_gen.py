"""BUILD, generated from the sources' imports: `make build-file` (`python -m tests.build_gen`).

tests/test_build.py regenerates it in memory and fails when the committed file differs, so
a new, moved or re-wired module needs no hand edit: run `make build-file` and commit BUILD.
The rules are written out in HEADER (the head of the generated file). What a file needs
comes from tests/build_rules.py (`Sources.needs`), which the checks of tests/build_checks.py
read too. Everything here is deterministic: sorted files, sorted targets, no timestamps.
It lives beside those checks in tests/ because it shares their model of the sources, and
the design card fixes the top-level folders (sao_jax/, configs/, experiments/, tests/).
"""

import collections
import dataclasses
import heapq
import pathlib
import sys

from tests.build_rules import (
    PROVIDED_BY,
    BuildError,
    Sources,
    is_test_file,
    module_name,
    normalise,
    pip_of,
)

ROOT = pathlib.Path(__file__).absolute().parents[1]
SOURCE_GLOBS = ["configs/**/*.py", "experiments/**/*.py", "sao_jax/**/*.py", "tests/**/*.py"]
# Files a test reads that no import or path in it names: tests that read the tree as text
# or regenerate the committed tables. The only hand-kept part (tests/test_build.py checks
# that each file named here exists; a pattern that matches nothing is left out).
DATA_GLOBS = {
    "tests/test_audit.py": [
        "results/**/*_runs.jsonl",
        "results/**/*.md",
        "results/**/preregistration.json",
    ],
    "tests/test_build.py": [*SOURCE_GLOBS, "BUILD", "requirements*.txt"],
    # the pages it reads (the front page it names by path), the runs files whose tables
    # must be among them
    "tests/test_claims_wording.py": [
        "docs/**/*.md",
        "results/**/*.md",
        "results/**/*_runs.jsonl",
    ],
    "tests/test_config.py": SOURCE_GLOBS,
    "tests/test_import_graph.py": SOURCE_GLOBS,
}
PYTEST_CONFIG = "pyproject.toml"  # pytest's options: data of the target holding conftest.py
WIDTH = 100

HEADER = """\
# Bazel build of sao_jax: one package for the whole repository (no BUILD files below it).
# GENERATED from the sources' imports by tests/build_gen.py: do not edit by hand, run
# `make build-file` (tests/test_build.py fails when this file differs from a fresh one).
#
# Targets:
# - sao_jax/: one py_library per package with its subpackages (sao_jax/models/** is :models),
#   the top-level modules are :sao_jax; configs/** is :configs. Where a package's modules
#   import each other through another package, the package is split into layers :<name>,
#   :<name>_1, ... (each module in the lowest layer that keeps the deps free of cycles).
# - experiments/ and tests/ hold separate scripts: one target per module. Under experiments/,
#   a module with a `__main__` block is a py_binary named by its path (bench/gae.py is
#   :bench_gae; ablations/__main__.py is :ablations, running main_module
#   experiments.ablations; :<name>_main where a library has the name); a module that other
#   modules import, and any other module there, is a py_library :<name>_lib (a binary runs
#   its script from there as main_module). Each tests/test_*.py is a py_test running pytest
#   on it, every other module a testonly py_library named after it. The package markers
#   (__init__.py, conftest.py) form :experiments and :test_support.
# - deps: the targets holding the first-party modules a target's sources import (anywhere
#   in the file, and their packages) or name by path, and requirement() of the pinned
#   packages they import (an unpinned one through the pinned package that installs it).
# - data: the py_binary of each module a target runs (`python -m`, or a module's name in a
#   string; a binary also those its libraries run, unless that closes a cycle), test files
#   a test imports, files that tests/ name by path, pyproject.toml (pytest's options) with
#   :test_support, and the globs of DATA_GLOBS in tests/build_gen.py.
# - size: "large" for a test file that marks a test `slow`, else "medium".
# Third-party packages come from a `pip` hub declared in MODULE.bazel: pip.parse(hub_name =
# "pip", requirements_lock = a full lock of requirements-dev.txt, e.g. from `uv pip compile`),
# since requirements*.txt pin only the direct packages (jax brings ml_dtypes, ...).
# `main_module` (pytest for the tests, a script's module for its binary) needs rules_python
# >= 1.7, or >= 1.3 with --@rules_python//python/config_settings:bootstrap_impl=script.
"""


@dataclasses.dataclass
class Spec:
    """One target to write."""

    kind: str  # py_library | py_binary | py_test
    name: str
    srcs: list[str]
    deps: set = dataclasses.field(default_factory=set)  # target names
    reqs: set = dataclasses.field(default_factory=set)  # pip names as pinned
    data: set = dataclasses.field(default_factory=set)  # target names and files
    globs: list = dataclasses.field(default_factory=list)
    attrs: dict = dataclasses.field(default_factory=dict)  # main, main_module, size, ...
    layer: int = 0
    key: tuple = ()


def entry_name(rel: str) -> str:
    """experiments/bench/gae.py -> bench_gae; experiments/x/__main__.py -> x."""
    parts = list(pathlib.PurePosixPath(rel).with_suffix("").parts[1:])
    return "_".join(parts[:-1] if parts[-1] == "__main__" else parts)


def library_key(rel: str) -> tuple[str, str]:
    """(top folder, name) of the library a module joins (before layers)."""
    parts = rel.split("/")
    if parts[0] == "sao_jax" and parts[1] in ("configs", "experiments"):
        parts = parts[1:]  # sao_jax/configs/ and sao_jax/experiments/ point at those folders
    top, last = parts[0], parts[-1]
    if top == "sao_jax":
        return ("sao_jax", "sao_jax" if len(parts) == 2 else parts[1])
    if top == "configs":
        return ("configs", "configs")
    if top == "experiments":
        return ("experiments", "experiments" if last == "__init__.py" else entry_name(rel) + "_lib")
    if last in ("__init__.py", "conftest.py"):
        return ("tests", "test_support")
    return ("tests", "_".join(pathlib.PurePosixPath(rel).with_suffix("").parts[1:]))


def _components(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(edges[w])))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def _reaches(graph: dict[str, set], start: str, goal: str) -> bool:
    seen, stack = {start}, [start]
    while stack:
        v = stack.pop()
        if v == goal:
            return True
        for w in graph.get(v, ()):
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return False


class Generator:
    """The targets of one checkout, planned from its sources (`plan`), then written."""

    def __init__(self, root: pathlib.Path, sources: Sources | None = None):
        self.root = root
        self.src = Sources(root) if sources is None else sources
        self.problems: list[str] = []
        self.specs: dict[str, Spec] = {}
        self.owner: dict[str, str] = {}  # library file -> its target's name
        self.binary_of: dict[str, str] = {}  # main file -> its py_binary's name
        self.test_of: dict[str, str] = {}  # test file -> its py_test's name

    # ---------------------------------------------------------------- planning

    def plan(self) -> None:
        src = self.src
        mains = [r for r in src.sources if r.startswith("experiments/") and src.is_main(r)]
        imported = {
            n.file
            for r in src.sources
            for n in src.needs(r)
            if n.kind == "import" and n.file != r and n.what != "its package"
        }
        tests = [r for r in src.sources if is_test_file(r)]
        leaves = set(tests) | {m for m in mains if m not in imported}
        libraries = [r for r in src.sources if r not in leaves]
        self._plan_libraries(libraries)
        names = set(self.specs)
        for m in mains:
            name = entry_name(m)
            name = name + "_main" if name in names else name
            self.binary_of[m] = name
        for t in tests:
            self.test_of[t] = pathlib.PurePosixPath(t).stem
        taken = collections.Counter([*self.specs, *self.binary_of.values(), *self.test_of.values()])
        for name, count in sorted(taken.items()):
            if count > 1:
                self.problems.append(f"{count} targets would be named :{name}: rename a module")
        for m in mains:
            self._plan_binary(m, m in imported)
        for t in tests:
            self._plan_test(t)
        for spec in self.specs.values():
            if spec.kind == "py_library":
                self._fill(spec, spec.srcs)
        self._propagate_runs()

    def _plan_libraries(self, files: list[str]) -> None:
        """Group by library_key, each module in the lowest layer that keeps deps acyclic."""
        lib = set(files)
        edges = {
            f: sorted({n.file for n in self._needs(f, ("import", "path")) if n.file in lib} - {f})
            for f in files
        }
        units = _components(files, edges)
        unit_of = {f: i for i, u in enumerate(units) for f in u}
        below = [{unit_of[g] for f in u for g in edges[f]} - {i} for i, u in enumerate(units)]
        waiting = [len(b) for b in below]
        above = collections.defaultdict(list)
        for i, b in enumerate(below):
            for j in b:
                above[j].append(i)
        ready = [(units[i][0], i) for i in range(len(units)) if not waiting[i]]
        heapq.heapify(ready)
        graph, layers = {}, collections.defaultdict(list)  # target -> deps; key -> targets
        while ready:
            _, i = heapq.heappop(ready)
            key = library_key(units[i][0])
            deps = {self.owner[g] for f in units[i] for g in edges[f] if unit_of[g] != i}
            chosen = next(
                (t for t in layers[key] if not any(d != t and _reaches(graph, d, t) for d in deps)),
                None,
            )
            if chosen is None:
                k = len(layers[key])
                chosen = key[1] if k == 0 else f"{key[1]}_{k}"
                if chosen in self.specs:  # two folders' libraries of one name
                    chosen = f"{key[0]}_{chosen}"
                layers[key].append(chosen)
                graph[chosen] = set()
                self.specs[chosen] = Spec("py_library", chosen, [], layer=k, key=key)
                if key[0] == "tests":
                    self.specs[chosen].attrs["testonly"] = True
            graph[chosen] |= deps - {chosen}
            self.specs[chosen].srcs += units[i]
            for f in units[i]:
                self.owner[f] = chosen
            for j in above[i]:
                waiting[j] -= 1
                if not waiting[j]:
                    heapq.heappush(ready, (units[j][0], j))
        for spec in self.specs.values():
            spec.srcs.sort()

    def _needs(self, rel: str, kinds) -> list:
        return [n for n in self.src.needs(rel) if n.kind in kinds]

    def _plan_binary(self, main: str, imported: bool) -> None:
        name = self.binary_of[main]
        if imported:
            spec = Spec("py_binary", name, [], attrs={"main_module": module_name(main)})
            spec.deps.add(self.owner[main])
        else:
            package_main = pathlib.PurePosixPath(main).name == "__main__.py"
            how = {"main_module": module_name(main)[: -len(".__main__")]} if package_main else {}
            spec = Spec("py_binary", name, [main], attrs=how or {"main": main})
            self._fill(spec, [main], kinds=("import", "path", "config"))  # runs: below
        spec.attrs["direct_runs"] = self._runs(main)
        self.specs[name] = spec

    def _plan_test(self, test: str) -> None:
        name = self.test_of[test]
        size = "large" if "mark.slow" in (self.root / test).read_text() else "medium"
        spec = Spec("py_test", name, [test], attrs={"size": size, "args": [test]})
        spec.attrs["main_module"] = "pytest"
        self._fill(spec, [test])
        spec.deps.add("test_support")
        spec.reqs.add(self._pin("pytest", test) or "pytest")
        for pattern in DATA_GLOBS.get(test, []):
            if any(p.is_file() for p in self.root.glob(pattern)):
                spec.globs.append(pattern)
        self.specs[name] = spec

    def _fill(self, spec: Spec, files: list[str], kinds=None) -> None:
        """deps, reqs and data of `spec` from what its files need."""
        testonly = spec.kind == "py_test" or spec.attrs.get("testonly")
        if kinds is None:
            kinds = ("import", "path", "run", "data") if testonly else ("import", "path")
        for rel in files:
            for n in self._needs(rel, kinds):
                if n.file is None:
                    if (pin := self._pin(pip_of(n.what), rel, n)) is not None:
                        spec.reqs.add(pin)
                elif n.kind == "data":
                    spec.data.add(n.file)
                elif n.kind == "path" and n.file in self.test_of:
                    continue  # a test file named by path is read, not run
                elif n.kind == "path" and not testonly and n.file not in self.owner:
                    continue  # a script named outside tests/: its binary could close a cycle
                elif (target := self.target_of(n.file, n.kind)) not in (None, spec.name):
                    library = target == self.owner.get(n.file) and n.kind != "run"
                    (spec.deps if library else spec.data).add(target)
        conftest = any(pathlib.PurePosixPath(f).name == "conftest.py" for f in spec.srcs)
        if conftest and (self.root / PYTEST_CONFIG).is_file():
            spec.data.add(PYTEST_CONFIG)

    def target_of(self, rel: str, kind: str = "import") -> str | None:
        """The target holding a file: its library, else its py_binary or py_test (a file
        that is run: its py_binary first)."""
        if kind == "run" and rel in self.binary_of:
            return self.binary_of[rel]
        return self.owner.get(rel) or self.binary_of.get(rel) or self.test_of.get(rel)

    def _pin(self, pip: str, rel: str, need=None) -> str | None:
        """The requirement() name for a pip distribution, or None (a problem if needed)."""
        spell = self.src.spellings
        if pip in spell:
            return spell[pip]
        for provider in PROVIDED_BY.get(pip, ()):
            if normalise(provider) in spell:
                return spell[normalise(provider)]
        if need is not None and not need.optional:
            self.problems.append(
                f"{rel}:{need.line}: imports {need.what} ({pip}), which is not pinned in "
                "requirements.txt or requirements-dev.txt: pin it (or import it in a try "
                "that catches ImportError)"
            )
        return None

    def _runs(self, rel: str) -> list[str]:
        """The binaries (and libraries) a file runs."""
        out = []
        for n in self._needs(rel, ("run",)):
            target = self.binary_of.get(n.file) or self.owner.get(n.file)
            if target is not None and target not in out:
                out.append(target)
        return out

    def _propagate_runs(self) -> None:
        """A binary's data: what its own script runs first, then what its libraries run,
        each unless it would close a cycle (a binary that reaches this one)."""
        graph = {n: s.deps | {d for d in s.data if d in self.specs} for n, s in self.specs.items()}
        binaries = sorted(n for n, s in self.specs.items() if s.kind == "py_binary")
        inherited = {}
        for name in binaries:
            spec = self.specs[name]
            seen, stack, runs = set(), sorted(graph[name]), []
            while stack:
                d = stack.pop(0)
                if d in seen or self.specs[d].kind != "py_library":
                    continue
                seen.add(d)
                if not self.specs[d].attrs.get("testonly"):
                    runs += [r for f in self.specs[d].srcs for r in self._runs(f)]
                stack += sorted(self.specs[d].deps)
            inherited[name] = sorted(set(runs))
        for phase in ("direct", "inherited"):
            for name in binaries:
                spec = self.specs[name]
                runs = spec.attrs["direct_runs"] if phase == "direct" else inherited[name]
                for r in runs:
                    if r == name or r in spec.deps or r in spec.data:
                        continue
                    if _reaches(graph, r, name):
                        continue
                    spec.data.add(r) if self.specs[r].kind == "py_binary" else spec.deps.add(r)
                    graph[name].add(r)
        for name in binaries:
            del self.specs[name].attrs["direct_runs"]

    # ---------------------------------------------------------------- writing

    def layer_lines(self) -> list[str]:
        """The libraries by depth (longest dep path to a library with no library deps)."""
        libs = {n: s for n, s in self.specs.items() if s.kind == "py_library"}
        depth = {}

        def visit(n):
            if n not in depth:
                depth[n] = 0  # no cycles by construction
                depth[n] = 1 + max((visit(d) for d in libs[n].deps if d in libs), default=-1)
            return depth[n]

        for n in sorted(libs):
            visit(n)
        lines = []
        for k in range(max(depth.values(), default=-1) + 1):
            words = [f":{n}" for n in sorted(n for n in libs if depth[n] == k)]
            line = f"#   {k}:"
            for w in words:
                if len(line) + 1 + len(w) > WIDTH - 5:
                    lines.append(line)
                    line = "#     "
                line += " " + w
            lines.append(line)
        return lines

    def render(self) -> str:
        out = [HEADER.rstrip("\n")]
        out += ["#", "# Libraries by depth (each depends only on libraries of lower rows):"]
        out += self.layer_lines()
        out += [
            "",
            'load("@pip//:requirements.bzl", "requirement")',
            'load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")',
            "",
            'package(default_visibility = ["//visibility:public"])',
        ]
        sections = [
            ("Libraries: sao_jax/ and configs/", lambda s: s.kind == "py_library"
             and s.key[0] in ("sao_jax", "configs")),
            ("Libraries: experiments/", lambda s: s.kind == "py_library"
             and s.key[0] == "experiments"),
            ("Entry points: python -m experiments.<name> / bazel run //:<name>",
             lambda s: s.kind == "py_binary"),
            ("Test support (testonly)", lambda s: s.kind == "py_library" and s.key[0] == "tests"),
            ("Tests: `bazel test //:all`, each runs `python -m pytest tests/<file>`",
             lambda s: s.kind == "py_test"),
        ]  # fmt: skip
        for title, pick in sections:
            specs = [self.specs[n] for n in sorted(self.specs) if pick(self.specs[n])]
            if not specs:
                continue
            out += ["", "# " + "-" * (WIDTH - 7), f"# {title}"]
            for spec in specs:
                out += ["", *self._stanza(spec)]
        return "\n".join(out) + "\n"

    def _stanza(self, spec: Spec) -> list[str]:
        lines = []
        if spec.layer:
            base = spec.key[1]
            lower = ", ".join(f":{base}" + (f"_{k}" if k else "") for k in range(spec.layer))
            lines.append(f"# Layer {spec.layer} of {base}: above {lower} through other packages.")
        lines += [f"{spec.kind}(", f'    name = "{spec.name}",']
        if "size" in spec.attrs:
            lines.append(f'    size = "{spec.attrs["size"]}",')
        if spec.attrs.get("testonly"):
            lines.append("    testonly = True,")
        if spec.srcs:
            lines += _attr("srcs", [_q(s) for s in spec.srcs])
        if "args" in spec.attrs:
            lines += _attr("args", [_q(a) for a in spec.attrs["args"]])
        globbed = {
            p.relative_to(self.root).as_posix() for g in spec.globs for p in self.root.glob(g)
        }
        data = sorted(f":{d}" if d in self.specs else d for d in spec.data - globbed)
        if data or spec.globs:
            lines += _attr("data", [_q(d) for d in data], [_q(g) for g in sorted(spec.globs)])
        for key in ("main", "main_module"):
            if key in spec.attrs:
                lines.append(f'    {key} = "{spec.attrs[key]}",')
        deps = [_q(f":{d}") for d in sorted(spec.deps)]
        deps += [f'requirement("{r}")' for r in sorted(spec.reqs, key=normalise)]
        if deps:
            lines += _attr("deps", deps)
        return [*lines, ")"]


def _q(s: str) -> str:
    return f'"{s}"'


def _attr(name: str, items: list[str], globs: list[str] = ()) -> list[str]:
    """`name = [...]` (and `+ glob([...])`), one line when it fits, else one item a line."""
    if len(items) + len(globs) == 1:
        one = f"[{items[0]}]" if items else f"glob([{globs[0]}])"
        if len(f"    {name} = {one},") <= WIDTH:
            return [f"    {name} = {one},"]
    lines = []
    if items:
        lines += [f"    {name} = [", *[f"        {x}," for x in items]]
    if globs:
        lines.append("    ] + glob([" if items else f"    {name} = glob([")
        lines += [f"        {x}," for x in globs]
    lines.append("    ])," if globs else "    ],")
    return lines


def generate(root: pathlib.Path, sources: Sources | None = None) -> tuple[str, list[str]]:
    """(the BUILD text for the checkout at root, the problems found on the way)."""
    gen = Generator(root, sources)
    gen.plan()
    return gen.render(), gen.problems


def main() -> int:
    try:
        text, problems = generate(ROOT)
    except BuildError as e:
        print(f"build_gen: {e}; BUILD not written", file=sys.stderr)
        return 2
    path = ROOT / "BUILD"
    changed = not path.is_file() or path.read_text() != text
    path.write_text(text)
    print(f"{'wrote' if changed else 'unchanged:'} {path.relative_to(ROOT)}")
    for p in problems:
        print(f"build_gen: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
