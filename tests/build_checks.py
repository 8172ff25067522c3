"""The checks of tests/test_build.py, each `check(repo) -> list of errors` (empty: true).

BUILD is generated (tests/build_gen.py); these checks read it as Bazel would, against the
sources found on disk, so they hold the generator to what Bazel needs:
- every module under sao_jax/, configs/, experiments/ is in the srcs of exactly one target,
  every tests/test_*.py is run by one py_test, every other tests/*.py is in some target;
- every ':name' dep exists, every requirement("x") is pinned in requirements*.txt, no cycle;
- every import (found with `ast` anywhere in the file) resolves to a module the target reaches
  through its deps (or data), every third-party import to a requirement() it reaches (an
  unpinned import inside a try that catches ImportError is optional); so do the modules a
  file runs (tests/build_rules.py `Need`; a non-test library's runs are its binaries'),
  exact .py paths ("configs/sao.py") outside test files, files tests/ names by path, and
  `--config=<file>` launch lines of py_binary mains;
- py_binary mains have a `__main__` block; py_tests run pytest on their file with the config.
"""

import collections
import pathlib

from tests.build_rules import IMPORT_TO_PIP as IMPORT_TO_PIP  # tests/test_packaging.py reads it
from tests.build_rules import PROVIDED_BY, Need, Repo, Target, is_test_file, pip_of

SIZES = ("small", "medium", "large", "enormous")
FIX = "run `make build-file` (tests/build_gen.py writes BUILD)"


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
        if is_test_file(rel):
            if mains[rel] != 1:
                errors.append(f"{rel} is run by {mains[rel]} py_tests, not 1: {FIX}")
        elif not owners:
            errors.append(f"{rel} is in no target: {FIX}")
        elif len(owners) > 1 and not rel.startswith("tests/"):
            errors.append(f"{rel} is in the srcs of {', '.join(owners)}: keep it in one target")
        elif rel.startswith("experiments/") and rel not in binaries and repo.is_main(rel):
            errors.append(f"{rel} has a __main__ block but no py_binary runs it: {FIX}")
    return errors


def check_labels(repo: Repo) -> list[str]:
    """Deps exist and are libraries; testonly stays in tests; requirements are pinned; no
    attribute names a label twice (Bazel rejects it, also through a glob)."""
    errors = []
    for t in repo.targets.values():
        for attr, labels in (
            ("srcs", t.srcs),
            ("deps", t.deps + t.reqs),
            ("data", t.data_files + t.data_targets),
        ):
            twice = sorted(x for x, n in collections.Counter(labels).items() if n > 1)
            if twice:
                errors.append(f"BUILD:{t.line}: :{t.name} names {', '.join(twice)} twice in {attr}")
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


def _exempt(repo: Repo, t: Target, need: Need) -> bool:
    """Needs that bind only some targets."""
    testonly = t.kind == "py_test" or t.attrs.get("testonly") is True
    if need.kind == "config":  # a launch line binds entry points only
        return t.kind != "py_binary"
    if need.kind == "path":  # an exact path binds all but tests, unless it names a test
        # file or, outside tests/, a script (its binary as data could close a cycle)
        script = need.file.startswith("experiments/") and repo.is_main(need.file)
        return t.kind == "py_test" or is_test_file(need.file) or (script and not testonly)
    if need.kind == "run":  # a library's runs are its binaries' (BUILD would cycle)
        return not testonly and t.kind == "py_library"
    return False


def _unmet(repo: Repo, t: Target, need: Need) -> tuple[str, str] | None:
    """None when the target reaches what `need` names, else (what it lacks, the fix)."""
    files, reqs = repo.reach(t.name)
    if need.file is not None:
        if need.file in files or _exempt(repo, t, need):
            return None
        owners = repo.owners.get(need.file, [])
        kinds = ["deps" if repo.targets[o].kind == "py_library" else "data" for o in owners]
        fix = " or ".join(f"add :{o} to its {k}" for o, k in zip(owners, kinds))
        return need.file, fix or "that file is in no target"
    pip = pip_of(need.what)
    if pip in repo.pins:
        return None if pip in reqs else (pip, f'add requirement("{pip}") to its deps')
    providers = PROVIDED_BY.get(pip, ())
    if reqs & set(providers) or need.optional:
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
