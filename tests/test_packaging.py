"""pyproject.toml stays true: packages, runtime requirements = what the library imports,
dev extras = requirements-dev.txt, console scripts that exist. (The wheel itself is built,
installed and run outside the checkout by tests/test_own_data_e2e.py.)"""

import ast
import importlib
import pathlib
import sys
import tomllib

from tests.build_checks import IMPORT_TO_PIP
from tests.build_rules import normalise, read_pins

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SHIPPED = {"sao_jax": "sao_jax", "sao_jax.configs": "configs", "sao_jax.experiments": "experiments"}
# Pinned but imported through another package (their compute / storage backends).
BACKENDS = {"jaxlib": "jax", "tensorstore": "orbax-checkpoint"}
# experiments/bench/gae.py compares against PyTorch; experiments/bench/gateway.py drives
# the rollout gateway with the OpenAI client; experiments/bench/peers.py times google-tunix
# (the `bench` extra of pyproject.toml, never a library dependency)
# torch, openai: tests and examples; tunix: the peers bench; vllm: sao_jax/sampling/
# vllm_server.py, run by vLLM's own environment (make vllm-env; docs/vllm.md); transformers:
# experiments/vllm_parity/tiny.py builds its model with it
DEV_ONLY_IMPORTS = {"torch", "openai", "tunix", "vllm", "transformers"}


def _packages_on_disk() -> set[str]:
    out = set()
    for name, folder in SHIPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in rel and not (
                name == "sao_jax" and rel[:1] in (("configs",), ("experiments",))
            ):
                out.add(".".join((name, *rel)))
    return out


def test_every_package_is_shipped():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert listed == _packages_on_disk()
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {
        "sao_jax.configs": "configs",
        "sao_jax.experiments": "experiments",
    }


def _third_party_imports() -> set[str]:
    names = set()
    for folder in SHIPPED.values():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module)
    out = set()
    for name in names:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ("sao_jax", "configs", "experiments"):
            continue
        key = next((k for k in IMPORT_TO_PIP if name == k or name.startswith(k + ".")), top)
        out.add(normalise(IMPORT_TO_PIP.get(key, key)))
    return out


def test_runtime_requirements_are_what_the_library_imports():
    pins = read_pins(ROOT / "requirements.txt")
    imported = _third_party_imports() - DEV_ONLY_IMPORTS
    assert imported - pins == set(), "imported but not a runtime requirement"
    assert pins - imported - set(BACKENDS) == set(), "a runtime requirement nothing imports"
    for pin, user in BACKENDS.items():
        assert pin in pins and user in pins
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["dependencies"]["file"] == [
        "requirements.txt"
    ]


def test_dev_extra_is_requirements_dev():
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    pinned = sorted(x.split("#")[0].strip() for x in lines if x.strip() and x[0] not in "#-")
    assert sorted(PYPROJECT["project"]["optional-dependencies"]["dev"]) == pinned
    extras = PYPROJECT["project"]["optional-dependencies"]
    jax_pin = next(x for x in (ROOT / "requirements.txt").read_text().split() if "jax==" in x)
    version = jax_pin.split("==")[1]
    assert extras["tpu"] == [f"jax[tpu]=={version}"]
    assert extras["gpu"] == [f"jax[cuda12]=={version}"]


def test_console_scripts_exist():
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == {
        "sao-train",
        "sao-sweep",
        "sao-export",
        "sao-memory-plan",
        "sao-device-check",
        "sao-serve",
    }
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert module.startswith("sao_jax.experiments.")
        path = ROOT / "experiments" / (module.split(".")[-1] + ".py")
        tree = ast.parse(path.read_text())
        assert function in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}


def test_sao_jax_configs_is_the_checkouts_configs():
    import configs.base

    shipped = importlib.import_module("sao_jax.configs.base")
    assert pathlib.Path(shipped.__file__) == pathlib.Path(configs.base.__file__)
    assert shipped.get_config().to_dict() == configs.base.get_config().to_dict()
