"""Test setup: 8 fake CPU devices (before jax is imported), exact fp32 matmuls, one
persistent compilation cache per test session, and the module order.

`--xla_backend_optimization_level=0` skips LLVM's optimisation of the compiled CPU code:
the tests' programs are tiny, so compiling them dominates, and this halves it. It changes
no result a test compares (both sides of every comparison run under the same flags).
`--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1` make XLA
CPU emit fused loops with its older elemental emitters into one LLVM module: an update
step of tests/test_update.py's model compiled in ~3 s instead of 10-16 s side by side on
the AMD box, and the suite's in-process modules took 2.6x less in a full run; the
tolerances (tests/closeness.py) do not assume one emitter's summation order.
Subprocesses the tests start inherit these flags through the environment.

Tests that start `python -m experiments.train` (or a sweep of them) on the same small
configs repeat compiles that are about 60% of a smoke run's CPU time, and in-process tests
of different modules build the same tiny programs again (a fresh `jax.jit` of the same
function on the same shapes misses JAX's in-memory cache). `jax_cache_dir` is one cache
directory under this session's pytest temporary root (shared by the xdist workers, new
with every session, so every run starts cold; JAX writes an entry only if it is absent
and treats an unreadable one as a miss): every in-process test compiles through it
(`_in_process_compilation_cache`), and the tests that start processes pass it on
(tests/train_support.py: `persistent_compilation_cache`, `cache_env_vars`). A hit loads
the executable XLA compiled before, so no result changes (its HLO text, memory and cost
analyses are the compiled program's).
"""

import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def _session_root(tmp_path_factory) -> pathlib.Path:
    """This session's folder that the xdist workers share: under xdist each worker's
    temporary root is a folder of the session's, so beside them; alone, the root."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory) -> pathlib.Path:
    """The session's persistent compilation cache directory, shared by the xdist workers
    and new with every session: each run starts cold, and two runs never share it."""
    cache = _session_root(tmp_path_factory) / "jax_cache"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@pytest.fixture(scope="session", autouse=True)
def _in_process_compilation_cache(jax_cache_dir):
    """Every test's in-process programs go through the session's cache too: many modules
    compile the same tiny programs (a fresh jit of the same function on the same shapes
    misses JAX's in-memory cache but hits this one)."""
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(jax_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # re-reads the settings at the next compile
    yield


@pytest.fixture(scope="session")
def shared_runs_dir(tmp_path_factory) -> pathlib.Path:
    """The session's folder for the smoke runs several experiment tests start alike, shared
    by the xdist workers and never kept between sessions (tests/experiment_support.py
    `SharedRuns` builds them there once, under a lock)."""
    return _session_root(tmp_path_factory) / "shared_smoke_runs"


def pytest_collection_modifyitems(config, items):
    """Modules holding a `slow` test run first, the others after, each group in its usual
    order. Under the Makefile's `--dist loadscope` each module goes whole to one xdist
    worker (its module fixtures built once), and the long modules starting first leaves
    short ones, not a long one, for the end of the run.

    Among the slow modules, the first that uses the shared smoke runs (`shared_runs_dir`)
    leads and the others that use them come after every other slow module: the first
    builds the pool while the other worker runs modules that never wait for its lock.
    The vLLM modules go before all of them: most of their wall time is spent waiting on
    vLLM's server (start-up, requests), which the other worker's CPU work fills."""
    by_path: dict = {}  # module path -> its items, in collection order
    for item in items:
        by_path.setdefault(item.path, []).append(item)
    vllm = [p for p, its in by_path.items() if any(i.get_closest_marker("vllm") for i in its)]
    slow = [p for p, its in by_path.items() if any(i.get_closest_marker("slow") for i in its)]
    slow = [p for p in slow if p not in vllm]
    pool = [p for p in slow if any("shared_runs_dir" in i.fixturenames for i in by_path[p])]
    order = vllm + pool[:1] + [p for p in slow if p not in pool] + pool[1:]
    rank = {p: i for i, p in enumerate(order)}
    items.sort(key=lambda item: rank.get(item.path, len(order)))
