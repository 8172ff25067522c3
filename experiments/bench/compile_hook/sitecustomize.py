"""Per-process JAX compile accounting for experiments/bench/compile_profile.py.

A folder on PYTHONPATH holding this file makes every Python process started under it
(pytest's workers, the training processes tests start) register a listener on JAX's
duration events as soon as `jax.monitoring` (public) is imported, without importing JAX
itself. At exit the process writes `$COMPILE_PROFILE_OUT/<pid>.json`: its argv, wall and
CPU seconds, and per running test (`PYTEST_CURRENT_TEST`, inherited by subprocesses) the
seconds and counts of each event and of each program's backend compile (a persistent
cache hit included: JAX times `compile_or_get_cached`). Standard library only.
"""

import atexit
import collections
import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import time

_START = time.time()
_EVENTS: dict = collections.defaultdict(lambda: [0.0, 0])  # (test, event) -> [s, n]
_PROGRAMS: dict = collections.defaultdict(lambda: [0.0, 0])  # (test, program) -> [s, n]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]


def _listener(event: str, duration: float, **kwargs) -> None:
    test = _test()
    row = _EVENTS[(test, event)]
    row[0] += duration
    row[1] += 1
    if event == COMPILE_EVENT:
        row = _PROGRAMS[(test, kwargs.get("fun_name", "?"))]
        row[0] += duration
        row[1] += 1


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the listener right after jax.monitoring (which `import jax` loads before
    anything compiles) is executed."""

    def find_spec(self, name, path, target=None):
        if name != "jax.monitoring":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.register_event_duration_secs_listener(_listener)

        spec.loader.exec_module = exec_module
        return spec


def _dump() -> None:
    out = os.environ.get("COMPILE_PROFILE_OUT")
    if not out or not (_EVENTS or _PROGRAMS):
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {
        "pid": os.getpid(),
        "argv": sys.argv[:6],
        "xdist_worker": "execnet" in sys.modules,  # a pytest-xdist worker, not a test's child
        "wall": time.time() - _START,
        "cpu": usage.ru_utime + usage.ru_stime,
        "events": {f"{t}|{e}": v for (t, e), v in _EVENTS.items()},
        "programs": {f"{t}|{p}": v for (t, p), v in _PROGRAMS.items()},
    }
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


sys.meta_path.insert(0, _RegisterOnImport())
atexit.register(_dump)
