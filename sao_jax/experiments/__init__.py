"""The entry points as `sao_jax.experiments` (`python -m sao_jax.experiments.train`).

In a checkout this name points at the repository's top-level experiments/ folder (run
there as `python -m experiments.train`); an installed package maps `sao_jax.experiments`
onto that same folder (pyproject.toml, package-dir) and its console scripts (sao-train,
sao-sweep, sao-export, sao-memory-plan) call these modules' `cli()`.
"""

import pathlib

__path__ = [str(pathlib.Path(__file__).resolve().parents[2] / "experiments")]
