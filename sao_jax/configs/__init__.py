"""The shipped configs as `sao_jax.configs` (`from sao_jax.configs import base`).

In a checkout this name points at the repository's top-level configs/ folder, which
stays where README.md's Layout puts it; an installed package maps `sao_jax.configs`
onto that same folder (pyproject.toml, package-dir) and ships configs/__init__.py
instead of this file.
"""

import pathlib

__path__ = [str(pathlib.Path(__file__).resolve().parents[2] / "configs")]
