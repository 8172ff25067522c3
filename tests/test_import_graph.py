"""The import graph of sao_jax, configs/ and experiments/ reads top-down: no arrow from a
lower floor (the model, RL, sampling, parallel, env and data packages and the leaves under
them) up to the run's stages, planning, reporting, config loading or the face; nothing
under sao_jax/ imports configs/ or experiments/ (the library never reads a config file's
code or an experiment's reading), configs/ never imports experiments/; `rl/` and
`sampling/` never import each other, and no module imports itself back through others (no
cycle). Every import counts, also one inside a function. configs/ and experiments/ are
also importable as sao_jax.configs and sao_jax.experiments (pointer packages): both
spellings are the same module here."""

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Floors by the unit a module belongs to: sao_jax/<package>/ or the top-level sao_jax/<m>.py.
LOWER = (
    "models", "rl", "sampling", "parallel", "envs", "data", "checkpointing", "text",
    "metrics", "schema", "registry", "stop",
)  # fmt: skip
UPPER = ("run", "plan", "report", "train", "sweep", "cli", "config", "defaults", "export")
TOP = ("configs", "experiments")  # above the library: configs/, then experiments/
POINTERS = ("sao_jax.configs", "sao_jax.experiments")  # their sao_jax.* spelling


def _name(module: str) -> str:
    """One name per module: sao_jax.configs.x and configs.x are configs.x."""
    for pointer in POINTERS:
        if module == pointer or module.startswith(pointer + "."):
            return module.removeprefix("sao_jax.")
    return module


def _graph() -> dict[str, set[str]]:
    """module -> the sao_jax modules it imports (`from a import b`: a.b when that is a
    module, else a)."""
    files = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for folder in ("sao_jax", *TOP)
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
        and not any(p.parent == ROOT / pointer.replace(".", "/") for pointer in POINTERS)
    }
    graph = {}
    for mod, path in files.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {_name(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                module = _name(node.module)
                subs = {f"{module}.{a.name}" for a in node.names} & set(files)
                names = {a.name for a in node.names} - {s.rsplit(".", 1)[1] for s in subs}
                out |= subs | ({module} if names else set())
        graph[mod] = {m for m in out if m in files and m != mod}
    return graph


def _unit(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] in TOP:
        return parts[0]
    return parts[1] if len(parts) > 1 else "sao_jax"


def test_the_graph_covers_configs_and_experiments():
    graph = _graph()
    assert {"configs.sao", "experiments.train", "sao_jax.train"} <= set(graph)
    assert "configs.base" in graph["configs.sao"]  # `from sao_jax.configs import base`
    script = graph["experiments.online_shift.__main__"]
    assert {"configs.online_shift", "experiments.online_shift.report"} <= script


def test_the_library_never_imports_configs_or_experiments():
    up = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if _unit(a) not in TOP and _unit(b) in TOP
    ]
    assert not up, up


def test_configs_never_import_experiments():
    up = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if _unit(a) == "configs" and _unit(b) == "experiments"
    ]
    assert not up, up


def test_no_arrow_from_a_lower_floor_up():
    up = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if _unit(a) in LOWER and _unit(b) in UPPER
    ]
    assert not up, up
    assert set(LOWER).isdisjoint(UPPER)


def test_rl_and_sampling_never_import_each_other():
    cross = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in sorted(targets)
        if {_unit(a), _unit(b)} == {"rl", "sampling"}
    ]
    assert not cross, cross


def test_no_import_cycle():
    graph, index, low, stack, on_stack, cycles = _graph(), {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_package_faces_export_their_names():
    for package in ("rl", "sampling", "models", "envs"):
        face = importlib.import_module(f"sao_jax.{package}")
        assert face.__all__, package
        missing = [name for name in face.__all__ if not hasattr(face, name)]
        assert not missing, (package, missing)
        assert face.__doc__ and "face" in face.__doc__.lower(), package
