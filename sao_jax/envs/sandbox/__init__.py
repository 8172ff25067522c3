"""Run untrusted Python in a kernel-isolated process (docs/sandbox.md).

The package's face; the implementation is in runner.py (the API, the probe, one run),
bwrap.py (the bubblewrap command line), seccomp.py (the filter), child.py (the program
inside the sandbox) and host.py (reading, killing, cleaning up).
"""

from sao_jax.envs.sandbox.runner import (
    BWRAP,
    ISOLATIONS,
    RLIMITS,
    SandboxLimits,
    SandboxResult,
    SandboxSetup,
    SandboxUnavailable,
    probe_setup,
    resolve_isolation,
    run_python,
)

__all__ = [
    "BWRAP",
    "ISOLATIONS",
    "RLIMITS",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSetup",
    "SandboxUnavailable",
    "probe_setup",
    "resolve_isolation",
    "run_python",
]
