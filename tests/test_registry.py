"""The one registry mechanism (sao_jax/registry.py): names, refusals, import paths, built-ins."""

import pytest

from sao_jax.registry import Registry, RegistryError, check_params


def test_unknown_and_twice_registered_names_are_refused_naming_them():
    r = Registry("widget")
    r.register("b", 2)
    r.register("a", 1)
    assert r.names() == ["a", "b"] and r.get("a") == 1 and "b" in r
    assert list(r.items()) == [("a", 1), ("b", 2)]
    with pytest.raises(RegistryError, match=r"^unknown widget 'c'; known: a, b$"):
        r.get("c")
    with pytest.raises(RegistryError, match="widget 'a' is registered twice"):
        r.register("a", 3)
    with pytest.raises(RegistryError, match="a non-empty name without ':'"):
        r.register("x:y", 3)
    replacing = Registry("widget", replace=True)
    replacing.register("a", 1)
    assert replacing.register("a", 2) == 2 and replacing.get("a") == 2


def test_import_paths_and_lazy_builtins():
    r = Registry("parser", builtins=("json",), from_path=lambda spec, obj: (spec, obj))
    assert r.get("json:loads")[1]("[1]") == [1]
    with pytest.raises(
        RegistryError, match=r"known: none \(or an import path 'package.module:attr"
    ):
        r.get("yaml")
    with pytest.raises(RegistryError, match="cannot import 'no_such_pkg_xyz'"):
        r.get("no_such_pkg_xyz:f")
    with pytest.raises(RegistryError, match="module 'json' has no 'nope'"):
        r.get("json:nope")
    with pytest.raises(TypeError, match=r"'x' got unexpected parameter\(s\) \['b'\]; it accepts"):
        check_params("widget", "x", {"a": 1, "b": 2}, ("a",))
