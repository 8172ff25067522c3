"""Test setup: 8 fake CPU devices (before jax is imported) and exact fp32 matmuls.

`--xla_backend_optimization_level=0` skips LLVM's optimisation of the compiled CPU code:
the tests' programs are tiny, so compiling them dominates, and this halves it. It changes
no result a test compares (both sides of every comparison run under the same flags).
Subprocesses the tests start inherit these flags through the environment.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_default_matmul_precision", "highest")
