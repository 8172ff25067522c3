"""Run untrusted Python in a kernel-isolated process (docs/sandbox.md).

The package's face; the implementation is in runner.py (the API, the probe, one run),
bwrap.py (the bubblewrap command line), seccomp.py (the filter), child.py (the program
inside the sandbox), harness.py (code_tests: the tests against the solution, across a
process boundary) and host.py (reading, killing, cleaning up).
"""

from sao_jax.envs.sandbox.runner import (
    BWRAP,
    ISOLATIONS,
    RLIMITS,
    SandboxLimits,
    SandboxResult,
    SandboxSetup,
    SandboxUnavailable,
    TestsVerdict,
    probe_setup,
    resolve_isolation,
    run_python,
    run_tests,
)

__all__ = [
    "BWRAP",
    "ISOLATIONS",
    "RLIMITS",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSetup",
    "SandboxUnavailable",
    "TestsVerdict",
    "probe_setup",
    "resolve_isolation",
    "run_python",
    "run_tests",
]
