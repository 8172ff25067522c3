"""Run untrusted Python in a kernel-isolated process. Layers and figures: docs/sandbox.md.

Public API (stable; reward functions and the python_tool env call it):

    run_python(code, limits=None, *, isolation="auto", allow_weak=False) -> SandboxResult
    run_tests(code, tests, limits=None, *, isolation="auto", allow_weak=False)
        -> SandboxResult whose `verdict` is a TestsVerdict (or None: no complete verdict)
    resolve_isolation(isolation="auto", allow_weak=False) -> "bwrap" | "rlimits"
    SandboxLimits, SandboxResult, TestsVerdict, SandboxUnavailable, probe_setup()

Two modes:
* "bwrap" (kernel isolation): bubblewrap builds a minimal read-only root (the
  interpreter, its standard library and the shared libraries they load; a private
  size-capped tmpfs and an empty capped /tmp are the only writable places) in new user,
  pid, network, mount, IPC, UTS and cgroup namespaces, under a seccomp filter
  (seccomp.py); the worker adds rlimits and a second filter that lets it signal
  only itself. Files: bwrap.py (command line, root), child.py (the
  program inside), host.py (reading, killing, cleaning up).
* "rlimits" (weak, opt-in): the same program, rlimits and seccomp filter (plus: no
  sockets) without any namespace; the host file system stays visible to the child's uid
  (a uid of its own per run when the host is root, else the host's own uid!). Runs only
  with allow_weak=True: asked for (isolation="rlimits"), or as the fallback of "auto".

`isolation="auto"` is bwrap when the probe (one trial run, cached per process) succeeds;
otherwise it raises SandboxUnavailable (one line naming the reason) unless
`allow_weak=True`, which logs one warning line and uses "rlimits".

`run_tests` is the `code_tests` reward's run: the solution is imported in the worker and
the reference tests run in a separate process of the sandbox (harness.py); the verdict
comes back on its own pipe with a per-run secret, and counts only when it is complete.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from sao_jax.envs.sandbox import bwrap as sandbox_bwrap
from sao_jax.envs.sandbox import harness as sandbox_harness
from sao_jax.envs.sandbox import host as sandbox_host
from sao_jax.envs.sandbox import seccomp as sandbox_seccomp

log = logging.getLogger(__name__)

BWRAP, RLIMITS = "bwrap", "rlimits"
ISOLATIONS = ("auto", BWRAP, RLIMITS)
NOBODY = 65534  # uid/gid the child runs as when the host process is root
# The weak mode as a root host: each run gets a uid (and gid) of its own from this range,
# no user's, so no other run can reach its processes (/proc, signals) or files.
RUN_UIDS = (0x6000_0000, 0x7000_0000)
_BOOT = pathlib.Path(__file__).with_name("child.py").read_text()
_HARNESS = pathlib.Path(__file__).with_name("harness.py").read_bytes()


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot run here (one line: why, and what to do)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL at cpu_s + 1 CPU seconds
    wall_s: float = 5.0  # wall clock, then SIGKILL to everything in the sandbox
    memory_bytes: int = 256 << 20  # RLIMIT_AS of the worker (and of each child of it)
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file the worker may write
    disk_bytes: int = 8 << 20  # size of the private tmpfs and of /tmp (each)
    max_files: int = 4096  # files + directories the code may create (each tmpfs)
    max_procs: int = 1  # processes + threads the code may have, itself included (1: none new)
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 64 << 10  # per stream (stdout, stderr); more -> kill, truncated

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            real = field.name == "wall_s"
            if not isinstance(value, int | float if real else int) or isinstance(value, bool):
                raise ValueError(f"SandboxLimits.{field.name}={value!r}: must be a number")
            if value <= 0:
                raise ValueError(f"SandboxLimits.{field.name}={value!r}: must be > 0")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str  # decoded as UTF-8 with replacement characters
    stderr: str
    exit_code: int | None  # worker exit status; None if killed or never reported
    signal: int | None  # signal that ended the worker, if any
    timed_out: bool  # killed at the wall-clock limit
    output_truncated: bool  # killed at the output cap
    isolation: str  # "bwrap" | "rlimits"
    error: str | None  # None when the program exited 0 within every limit
    wall_s: float
    verdict: TestsVerdict | None = None  # run_tests: the complete, authentic verdict

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class TestsVerdict:
    """What the reference tests said about a solution (run_tests)."""

    __test__ = False  # not a pytest test class, despite its name
    passed: int
    total: int  # top-level test statements (harness.count_tests)
    results: tuple[bool, ...]  # per test statement, in order
    failures: tuple[str, ...]  # the first failures: "line N: AssertionError: ..."

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


@dataclasses.dataclass(frozen=True)
class SandboxSetup:
    """What this machine allows; probed once per process by `probe_setup`."""

    python: str  # interpreter for the child (runnable by the child's uid)
    uid: int | None  # uid/gid bwrap runs as (the weak mode: a fresh one per run); None: the host's
    isolation: str  # best available: "bwrap" or "rlimits"
    bwrap: str | None  # path of bwrap when it works here
    binds: tuple[tuple[str, str], ...]  # the minimal root (bwrap mode)
    note: str  # why bwrap is unavailable, or ""


def _limits_table(limits: SandboxLimits, setup_procs: int) -> list[tuple[str, int, int]]:
    """(resource name, soft, hard) the worker sets on itself before running user code.
    RLIMIT_NPROC counts every process of the uid (in bwrap mode: of the sandbox's user
    namespace), so the `setup_procs` started before the worker are added."""
    procs = limits.max_procs + setup_procs
    return [
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),
        ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
        ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes),
        ("RLIMIT_NPROC", procs, procs),
        ("RLIMIT_NOFILE", limits.open_files, limits.open_files),
    ]


def _popen_user(uid: int | None) -> dict:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _system_env() -> dict[str, str]:
    return {"PATH": sandbox_bwrap.SYSTEM_PATH, "LC_ALL": "C"}


def _runs(cmd: list[str], uid: int | None) -> bool:
    try:
        done = subprocess.run(
            cmd, capture_output=True, timeout=30, env=_system_env(), cwd="/", **_popen_user(uid)
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


_probe_lock = threading.Lock()
_probed: SandboxSetup | None = None


def probe_setup() -> SandboxSetup:
    """Picks the interpreter and uid, and tries one bwrap run; cached per process."""
    global _probed
    with _probe_lock:
        if _probed is None:
            _probed = _probe()
        return _probed


def _probe() -> SandboxSetup:
    uid = NOBODY if os.geteuid() == 0 else None
    candidates = [os.path.realpath(sys.executable)]
    system = shutil.which("python3", path=sandbox_bwrap.SYSTEM_PATH)
    if system and os.path.realpath(system) not in candidates:
        candidates.append(os.path.realpath(system))
    check = "import json, resource, runpy, ctypes"
    runnable = [c for c in candidates if _runs([c, "-I", "-S", "-c", check], uid)]
    note = ""
    if not runnable:  # nothing the unprivileged uid can run: stay as we are
        uid, runnable = None, candidates[:1]
        note = "no interpreter runnable as nobody, the child runs as the host uid; "
    weak = SandboxSetup(runnable[0], uid, RLIMITS, None, (), note)
    bwrap = sandbox_bwrap.find_bwrap()
    if bwrap is None:
        return dataclasses.replace(weak, note=note + "bwrap (bubblewrap) is not installed")
    why = ""
    for python in runnable:
        try:
            stdlib = sandbox_bwrap.stdlib_dirs(python, _system_env(), _popen_user(uid))
            binds = sandbox_bwrap.root_binds(python, stdlib)
        except (OSError, subprocess.SubprocessError) as e:
            why = f"{python}: {e}"
            continue
        trial = SandboxSetup(python, uid, BWRAP, bwrap, binds, "")
        result = _run("print('ok')", SandboxLimits(wall_s=30.0), trial, audit_hook=True)
        if result.ok and result.stdout == "ok\n":
            return trial
        why = (result.error or "unexpected output") + ": " + result.stderr.strip()[-200:]
    why = " ".join(why.split())
    return dataclasses.replace(weak, note=note + f"bwrap does not work here ({why})")


_announced: set[tuple[str, str]] = set()


WEAK_ADVICE = (
    "allow the weaker mode explicitly for this run (python_tool / answer env: "
    "env.params.allow_weak_isolation=True; run_python: allow_weak=True)"
)


def resolve_isolation(isolation: str = "auto", allow_weak: bool = False) -> str:
    """The mode `run_python` will use; raises SandboxUnavailable (one line) when the
    kernel isolation is needed but unavailable, or the weak mode is not allowed. Logs one
    line per process for the weak mode."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation={isolation!r}: must be one of {ISOLATIONS}")
    if isolation == RLIMITS:
        if not allow_weak:
            raise SandboxUnavailable(
                "sandbox: isolation='rlimits' is the weak mode (no namespaces: the host's "
                "files, /proc and processes of its uid are reachable); refusing to run "
                f"model code in it unless allowed: {WEAK_ADVICE}"
            )
        _announce(isolation, "requested")
        return RLIMITS
    setup = probe_setup()
    if setup.isolation == BWRAP:
        return BWRAP
    if isolation == BWRAP or not allow_weak:
        raise SandboxUnavailable(
            f"sandbox: kernel isolation (bwrap) is unavailable: {setup.note}; refusing to "
            "run model code. Install bubblewrap (apt-get install bubblewrap, or make "
            "sandbox-deps) on a kernel that allows unprivileged user namespaces, or " + WEAK_ADVICE
        )
    _announce(isolation, setup.note)
    return RLIMITS


def _announce(isolation: str, why: str) -> None:
    setup = probe_setup()
    if (isolation, why) in _announced:
        return
    _announced.add((isolation, why))
    uid = "a uid of its own" if setup.uid is not None else f"the host's uid {os.geteuid()}"
    log.warning(
        "sandbox: running model code in the WEAK 'rlimits' mode, allowed for this run "
        "(allow_weak_isolation=True): %s; no namespaces, host files visible to %s "
        "(docs/sandbox.md lists what it does not defend)",
        why,
        uid,
    )


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    isolation: str = "auto",
    allow_weak: bool = False,
    audit_hook: bool = True,
    scratch_dir: str | os.PathLike | None = None,
) -> SandboxResult:
    """Runs `code` as a script in the sandbox; never raises for anything `code` does.

    Args:
      code: Python source (text; unencodable characters are replaced).
      limits: resource limits; SandboxLimits() by default.
      isolation: "auto" (bwrap; see allow_weak), "bwrap" or "rlimits" (weak).
      allow_weak: allow the weak "rlimits" mode: asked for, or as the fallback of
        "auto" when bwrap does not work here (else SandboxUnavailable).
      audit_hook: install the in-child audit-hook tripwire (off: test the kernel layers).
      scratch_dir: where the weak mode makes its private directories (default: the
        system temp dir; bwrap mode uses none on the host).

    Raises:
      SandboxUnavailable: the isolation asked for cannot run on this machine.
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    limits = SandboxLimits() if limits is None else limits
    mode = resolve_isolation(isolation, allow_weak)
    setup = dataclasses.replace(probe_setup(), isolation=mode)
    return _run(code, limits, setup, audit_hook=audit_hook, scratch_dir=scratch_dir)


def run_tests(
    code: str,
    tests: str,
    limits: SandboxLimits | None = None,
    *,
    isolation: str = "auto",
    allow_weak: bool = False,
    audit_hook: bool = True,
    scratch_dir: str | os.PathLike | None = None,
) -> SandboxResult:
    """Imports `code` (the solution) in the sandbox and runs the reference `tests`
    against it from a separate process (harness.py); never raises for anything either
    does. `result.verdict` is the tests' verdict, or None when no complete, authentic
    one came back (the solution ended the run, a limit was hit, the tests do not parse):
    then `result.error` says why (with a verdict, it says how the solution's process
    ended: None when cleanly). Arguments as for run_python.

    Raises:
      SandboxUnavailable: the isolation asked for cannot run on this machine.
    """
    for name, text in (("code", code), ("tests", tests)):
        if not isinstance(text, str):
            raise TypeError(f"run_tests: {name} must be a str, got {type(text).__name__}")
    limits = SandboxLimits() if limits is None else limits
    mode = resolve_isolation(isolation, allow_weak)
    try:
        expected = sandbox_harness.count_tests(tests)
    except (SyntaxError, ValueError) as e:
        why = f"the reference tests do not parse: {type(e).__name__}: {e}"
        return SandboxResult("", "", None, None, False, False, mode, why, 0.0)
    setup = dataclasses.replace(probe_setup(), isolation=mode)
    secret = secrets.token_hex(16)
    spec = json.dumps({"secret": secret, "tests": tests}).encode()
    return _run(
        code, limits, setup, audit_hook=audit_hook, scratch_dir=scratch_dir,
        tests=(spec, secret, expected),
    )  # fmt: skip


def _env(root: str) -> dict[str, str]:
    """Built from scratch: nothing of the host's environment reaches the child."""
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}


def _memfd(name: str, data: bytes) -> int:
    """A read-only memfd holding `data` (sealed: nobody who reaches it can change it)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _private_dir(setup: SandboxSetup, scratch_dir) -> tuple[str, str]:
    """(outer, root) of the weak mode: `root`, the child's private directory (its uid's,
    0700), is a randomly named entry of `outer` (the host's, 0711: traversable, not
    listable, not writable), so the child can neither rename its directory away nor
    plant a symlink in its place, and no other sandbox of its uid can find it."""
    outer = os.path.realpath(tempfile.mkdtemp(prefix="sao_sandbox_", dir=scratch_dir))
    os.chmod(outer, 0o711)
    root = os.path.join(outer, secrets.token_hex(16))
    os.mkdir(root, 0o700)
    if setup.uid is not None:
        os.chown(root, setup.uid, setup.uid)
    return outer, root


def _run(code, limits, setup: SandboxSetup, *, audit_hook: bool, scratch_dir=None, tests=None):
    start = time.monotonic()
    bwrap = setup.isolation == BWRAP
    code_fd = _memfd("sao_code", code.encode("utf-8", errors="replace"))
    status_r, status_w = os.pipe()
    host_fds, child_fds = [code_fd, status_r], [code_fd, status_w]  # closed at the end
    pipes = {"status": status_r}
    root, outer = sandbox_bwrap.PRIVATE, None
    proc = reaper = got = None
    harness = None
    if tests is not None:  # code_tests: the harness, the tests + secret, the verdict pipe
        harness_fd = _memfd("sao_harness", _HARNESS)
        tests_fd = _memfd("sao_tests", tests[0])
        verdict_r, verdict_w = os.pipe()
        host_fds += [harness_fd, tests_fd, verdict_r]
        child_fds += [harness_fd, tests_fd, verdict_w]
        pipes["verdict"] = verdict_r
        harness = {"harness_fd": harness_fd, "tests_fd": tests_fd, "verdict_fd": verdict_w}
    try:
        if not bwrap:
            if setup.uid is not None:  # root host: a uid no other run has
                setup = dataclasses.replace(setup, uid=RUN_UIDS[0] + secrets.randbelow(
                    RUN_UIDS[1] - RUN_UIDS[0]))  # fmt: skip
            outer, root = _private_dir(setup, scratch_dir)
        setup_procs = (2 if bwrap else 1) + (tests is not None)  # + the tests process
        weak = not bwrap
        cfg = {
            "root": root,
            "status_fd": status_w,
            "code_fd": code_fd,
            "seccomp": sandbox_seccomp.instructions(
                own_pid=sandbox_seccomp.PID_PLACEHOLDER, deny_network=weak
            ),
            "supervisor_seccomp": sandbox_seccomp.instructions(deny_network=True) if weak else None,
            "pid_placeholder": sandbox_seccomp.PID_PLACEHOLDER,
            "limits": _limits_table(limits, setup_procs),
            "audit": audit_hook,
            "fs_paths": [sandbox_bwrap.PRIVATE, sandbox_bwrap.TMP] if bwrap else [],
            "max_files": limits.max_files,
            "harness": harness,
        }
        boot = ["-c", _BOOT, json.dumps(cfg)]
        if bwrap:
            outer_filter = sandbox_seccomp.encode(sandbox_seccomp.instructions())
            filter_fd = _memfd("sao_seccomp", outer_filter)
            info_r, info_w = os.pipe()
            host_fds.append(info_r)
            child_fds += [filter_fd, info_w]
            pipes["info"] = info_r
            cmd = sandbox_bwrap.command(
                setup.bwrap, setup.python, setup.binds, boot, disk_bytes=limits.disk_bytes,
                seccomp_fd=filter_fd, info_fd=info_w, env=_env(root),
            )  # fmt: skip
        else:
            cmd = [setup.python, "-I", "-S", "-B", *boot]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd="/" if bwrap else root, env=_env(root), pass_fds=child_fds,
                start_new_session=True, **_popen_user(setup.uid),
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:  # the machine, not the code
            return _result(b"", b"", f"start: {e}".encode(), None, limits, setup, start)
        finally:
            for fd in child_fds:  # the child's ends; the memfds stay the host's too
                if fd not in host_fds:
                    os.close(fd)
        reaper = sandbox_host.Reaper(proc, pid_namespace=bwrap)
        got = sandbox_host.collect(
            proc, pipes, start + limits.wall_s, limits.output_bytes, on_info=reaper.on_info,
            disk=None if bwrap else (root, limits.disk_bytes, limits.max_files),
        )  # fmt: skip
    finally:
        if reaper is not None:
            reaper.finish()
        for fd in host_fds:
            os.close(fd)
        if outer is not None and not sandbox_host.remove_tree(outer):
            log.warning("sandbox: could not remove the private directory %s entirely", outer)
    result = _result(got.stdout, got.stderr, got.status, got, limits, setup, start)
    if tests is None:
        return result
    verdict, problem = _verdict(bytes(got.verdict), tests[1], tests[2])
    if verdict is None:  # why there is none, and how the solution's process ended
        error = problem + (f" ({result.error})" if result.error else "")
    else:
        error = result.error  # how the solution's process ended: None if cleanly
    return dataclasses.replace(result, verdict=verdict, error=error)


def _verdict(data: bytes, secret: str, expected: int) -> tuple[TestsVerdict | None, str | None]:
    """The tests' verdict if `data` is one complete, authentic verdict line (this run's
    secret, every one of the `expected` tests reported), else (None, why)."""
    text = data.decode("utf-8", errors="replace")
    if not text:
        return None, "no verdict: the tests did not finish"
    head, _, rest = text.partition(" ")
    got_secret, _, body = rest.partition(" ")
    if head != "verdict" or not secrets.compare_digest(got_secret, secret):
        return None, "no verdict: the verdict channel carried something else"
    try:
        out = json.loads(body)
        if not out["complete"]:
            return None, f"no verdict: the tests did not run ({out.get('error', '?')})"
        if not isinstance(out["results"], str) or set(out["results"]) - {"0", "1"}:
            raise ValueError("results")
        results = tuple(c == "1" for c in out["results"])
        failures = tuple(str(f)[:300] for f in out["failures"])
        passed, total = int(out["passed"]), int(out["total"])
    except (ValueError, KeyError, TypeError) as e:
        return None, f"no verdict: malformed ({type(e).__name__})"
    if total != expected or len(results) != total or passed != sum(results):
        return None, f"no verdict: {total} of {expected} tests reported"
    return TestsVerdict(passed, total, results, failures), None


def _result(out, err, status, got, limits, setup, start) -> SandboxResult:
    status = bytes(status).decode("utf-8", errors="replace").split("\n", 1)[0]
    kind, _, value = status.partition(" ")
    exit_code = int(value) if kind == "exit" and value.lstrip("-").isdigit() else None
    sig, cpu = None, 0.0
    if kind == "signal":  # "signal N CPU_SECONDS"
        parts = value.split()
        sig = int(parts[0]) if parts and parts[0].isdigit() else None
        cpu = float(parts[1]) if len(parts) > 1 else 0.0
    timed_out = bool(got and got.timed_out)
    truncated = bool(got and got.truncated)
    if truncated:
        error = f"output limit exceeded ({limits.output_bytes} bytes)"
    elif got is not None and got.disk_full:
        error = f"disk limit exceeded ({limits.disk_bytes} bytes)"
    elif (got is not None and got.files_full) or kind == "files":
        error = f"file count limit exceeded ({limits.max_files} files)"
    elif timed_out:
        error = f"wall-clock limit exceeded ({limits.wall_s:g} s)"
    elif kind == "setup:":
        error = f"sandbox failure ({status})"
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
        error = f"cpu time limit exceeded ({limits.cpu_s} s)"
    elif sig == signal.SIGXFSZ:
        error = f"file size limit exceeded ({limits.file_bytes} bytes)"
    elif sig is not None:
        error = f"killed by signal {sig}"
    elif exit_code is None:
        error = f"sandbox failure ({status or 'no status'})"
    elif exit_code != 0:
        error = f"exit status {exit_code}"
    else:
        error = None
    decode = lambda b: bytes(b).decode("utf-8", errors="replace")
    return SandboxResult(
        decode(out), decode(err), exit_code, sig, timed_out, truncated, setup.isolation, error,
        time.monotonic() - start,
    )  # fmt: skip
