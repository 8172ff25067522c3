"""Run untrusted Python in a separate, limited process. See docs/sandbox.md for the layers.

`run_python(code)` writes `code` to `main.py` in a fresh private directory and starts
`<python> -I -S -B -c <bootstrap> <config>` with an environment built from scratch, no
stdin, no inherited file descriptors (but one status pipe), in its own session. When
this process is root the child runs as `nobody` (so RLIMIT_NPROC and file permissions
apply). When user namespaces work here (probed once, `probe_setup`), the command is
wrapped in `unshare --user --map-root-user --net --pid --fork --mount --mount-proc`: no
network, its own pid space and /proc, the private directory a size-capped tmpfs, and the
world-writable temp directories covered by empty tmpfs mounts. The bootstrap (a small
supervisor) forks the worker, which sets its rlimits (CPU, address space, file size,
processes, open files, no core), installs an audit hook (no sockets, no
fork/exec/spawn/kill, no file access outside the private directory but for reading the
standard library) and runs `main.py`. The supervisor reports the
worker's exit status on the status pipe. The host reads at most `output_bytes` of each
stream and kills the whole process group at the wall-clock limit or the output cap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NAMESPACES, RLIMITS = "namespaces", "rlimits"
NOBODY = 65534  # uid/gid the child runs as when the host process is root
_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--mount")
_UNSHARE_FLAGS += ("--mount-proc", "--kill-child")
# World-writable directories covered by an empty tmpfs inside the mount namespace.
_HIDE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2  # RLIMIT_CPU: SIGXCPU at cpu_s, SIGKILL at cpu_s + 1 CPU seconds
    wall_s: float = 5.0  # wall clock, then SIGKILL to the process group
    memory_bytes: int = 256 << 20  # RLIMIT_AS of the worker
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: largest file the worker may write
    disk_bytes: int = 8 << 20  # tmpfs size of the private directory (namespaces only)
    max_procs: int = 1  # RLIMIT_NPROC: processes+threads of the sandbox uid (1: none new)
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
    isolation: str  # "namespaces" | "rlimits"
    error: str | None  # None when the program exited 0 within every limit
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class SandboxSetup:
    """What this machine allows; probed once per process by `probe_setup`."""

    python: str  # interpreter for the child (readable by the child's uid)
    uid: int | None  # uid/gid the child runs as; None: the host's own
    isolation: str  # best available: "namespaces" or "rlimits"
    unshare: str | None
    mount: str | None
    note: str  # why namespaces are off, or ""


# The child program. argv[1] is the JSON config. Kept stdlib-only and closure-free: the
# audit hook binds everything it uses as default arguments, so user code that patches
# builtins or module attributes does not change what the hook checks.
_BOOT = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
root, status_fd = cfg["root"], cfg["status_fd"]


def report(msg):
    os.write(status_fd, msg.encode())
    os._exit(0)


def mount_tmpfs(path, options):
    argv = [cfg["mount"], "-t", "tmpfs", "-o", options, "tmpfs", path]
    pid = os.posix_spawn(cfg["mount"], argv, {})
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        report("setup: cannot mount tmpfs on %s" % path)


def read_code():
    with open(os.path.join(root, "main.py"), "rb") as f:
        code = f.read()
    if cfg["mount"]:
        for d in cfg["hide"]:
            if os.path.isdir(d) and not os.path.islink(d):
                mount_tmpfs(d, "size=1m,mode=1777")
        os.makedirs(root, mode=0o700, exist_ok=True)
        mount_tmpfs(root, "size=%d,mode=0700" % cfg["disk"])
    return code


def set_limits():
    import resource
    for name, soft, hard in cfg["limits"]:
        r = getattr(resource, name)
        cap = resource.getrlimit(r)[1]
        if cap != resource.RLIM_INFINITY:
            soft, hard = min(soft, cap), min(hard, cap)
        resource.setrlimit(r, (soft, hard))


def install_guard():
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    deny = frozenset((
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen", "os.symlink",
        "os.link", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "webbrowser.open", "urllib.Request",
    ))
    deny_prefix = ("socket.", "ctypes.", "_ctypes.", "http.client.", "ftplib.", "smtplib.",
                   "imaplib.", "poplib.", "nntplib.", "telnetlib.")
    deny_import = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters",
                             "_testcapi", "_testinternalcapi"))
    write_events = frozenset((  # first argument is a path the event writes to
        "os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.chmod", "os.chown", "os.utime",
        "os.truncate", "os.mkfifo", "os.mknod", "os.setxattr", "os.removexattr",
        "shutil.rmtree", "os.chdir",
    ))
    read_events = frozenset(("os.listdir", "os.scandir", "os.listxattr", "os.getxattr"))
    func_attrs = frozenset(("__code__", "__defaults__", "__kwdefaults__"))

    def hook(event, args, *, isinstance=isinstance, int=int, str=str, bytes=bytes,
             PermissionError=PermissionError, fspath=os.fspath, getcwd=os.getcwd,
             deny=deny, deny_prefix=deny_prefix, deny_import=deny_import,
             write_events=write_events, read_events=read_events, func_attrs=func_attrs,
             writable=(root,), readable=(root, stdlib, "/dev/null"), W=W):
        if event in deny or event.startswith(deny_prefix):
            raise PermissionError("sandbox: %s is not allowed" % event)
        if event == "import":
            name = str.__str__(args[0]) if isinstance(args[0], str) else ""
            if str.partition(name, ".")[0] in deny_import:
                raise PermissionError("sandbox: import of %s is not allowed" % args[0])
            return
        if event == "object.__setattr__":
            if isinstance(args[1], str) and str.__str__(args[1]) in func_attrs:
                raise PermissionError("sandbox: setting %s is not allowed" % args[1])
            return
        if event == "open":
            mode, flags = args[1], args[2]
            write = (isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode
                                                or "+" in mode)) or (
                isinstance(flags, int) and flags & W)
            paths, roots = args[:1], (writable if write else readable)
        elif event in write_events:
            paths, roots = (args[:2] if event == "os.rename" else args[:1]), writable
        elif event in read_events:
            paths, roots = args[:1], readable
        else:
            return
        for p in paths:
            if p is None:
                p = "."
            if isinstance(p, int):
                if event == "os.chdir":
                    raise PermissionError("sandbox: fchdir is not allowed")
                continue
            try:
                s = fspath(p)
                if isinstance(s, bytes):
                    s = bytes.decode(s, "utf-8", "surrogateescape")
            except Exception:
                raise PermissionError("sandbox: bad path in %s" % event) from None
            if not isinstance(s, str):
                raise PermissionError("sandbox: bad path in %s" % event)
            s = str.__str__(s)  # an exact str: a subclass cannot override the checks below
            if not str.startswith(s, "/"):
                s = getcwd() + "/" + s
            parts = []
            for part in str.split(s, "/"):
                if part == "..":
                    if parts:
                        parts.pop()
                elif part and part != ".":
                    parts.append(part)
            s = "/" + str.join("/", parts)
            for r in roots:
                if s == r or str.startswith(s, r + "/"):
                    break
            else:
                raise PermissionError("sandbox: %s of %s is not allowed" % (event, s))

    sys.addaudithook(hook)


def worker(code):
    os.close(status_fd)
    import runpy, traceback
    os.chdir(root)
    with open("main.py", "wb") as f:
        f.write(code)
    set_limits()
    if cfg["audit"]:
        install_guard()
    sys.argv = ["main.py"]
    try:
        runpy.run_path("main.py", run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # print the traceback from the first frame of main.py on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        sys.exit(1)


def supervise(pid):
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        try:
            child, status = os.waitpid(-1, 0)
        except ChildProcessError:
            report("lost")
        if child == pid:
            break
    if os.WIFSIGNALED(status):
        report("signal %d" % os.WTERMSIG(status))
    report("exit %d" % os.waitstatus_to_exitcode(status))


code = read_code()
pid = os.fork()
if pid == 0:
    worker(code)
else:
    supervise(pid)
"""


def _limits_table(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    """(resource name, soft, hard) the worker sets on itself before running user code."""
    return [
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),
        ("RLIMIT_AS", limits.memory_bytes, limits.memory_bytes),
        ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes),
        ("RLIMIT_NPROC", limits.max_procs, limits.max_procs),
        ("RLIMIT_NOFILE", limits.open_files, limits.open_files),
    ]


def _popen_user(uid: int | None) -> dict:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _runs(cmd: list[str], uid: int | None) -> bool:
    try:
        done = subprocess.run(
            cmd, capture_output=True, timeout=20, env={"PATH": _SYSTEM_PATH}, cwd="/",
            **_popen_user(uid),
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@functools.cache
def probe_setup() -> SandboxSetup:
    """Picks the interpreter, the uid, and whether namespaces + tmpfs work; cached."""
    uid = NOBODY if os.geteuid() == 0 else None
    candidates = [os.path.realpath(sys.executable)]
    candidates += [p for p in (shutil.which("python3", path=_SYSTEM_PATH),) if p]
    check = "import json, resource, runpy"
    python = next((c for c in candidates if _runs([c, "-I", "-S", "-c", check], uid)), None)
    note = ""
    if python is None:  # no interpreter the unprivileged uid can run: stay as we are
        uid, python = None, candidates[0]
        note = "no interpreter runnable as nobody; child runs as the host uid. "
    unshare = shutil.which("unshare", path=_SYSTEM_PATH)
    mount = shutil.which("mount", path=_SYSTEM_PATH)
    setup = SandboxSetup(python, uid, RLIMITS, unshare, mount, note)
    if unshare is None or mount is None:
        return dataclasses.replace(setup, note=note + "unshare or mount not found")
    trial = dataclasses.replace(setup, isolation=NAMESPACES)
    result = _run("print('ok')", SandboxLimits(wall_s=20.0), trial, audit_hook=True)
    if result.ok and result.stdout == "ok\n":
        return trial
    why = (result.error or "unexpected output") + ": " + result.stderr.strip()[-200:]
    return dataclasses.replace(setup, note=note + f"namespaces unavailable ({why})")


def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    *,
    isolation: str = "auto",
    audit_hook: bool = True,
) -> SandboxResult:
    """Runs `code` as a script in the sandbox; never raises for anything `code` does.

    Args:
      code: Python source (text; unencodable characters are replaced).
      limits: resource limits; SandboxLimits() by default.
      isolation: "auto" (namespaces when available), "namespaces" (error when not
        available) or "rlimits" (no namespaces).
      audit_hook: install the in-child audit hook (turn off only to test the kernel layers).
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    limits = SandboxLimits() if limits is None else limits
    setup = probe_setup()
    if isolation == NAMESPACES and setup.isolation != NAMESPACES:
        raise RuntimeError(f"sandbox isolation='namespaces' is not available: {setup.note}")
    if isolation not in ("auto", NAMESPACES, RLIMITS):
        raise ValueError(f"sandbox isolation={isolation!r}: 'auto', 'namespaces' or 'rlimits'")
    if isolation == RLIMITS:
        setup = dataclasses.replace(setup, isolation=RLIMITS)
    return _run(code, limits, setup, audit_hook=audit_hook)


def _env(root: str) -> dict[str, str]:
    """Built from scratch: nothing of the host's environment reaches the child."""
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}


def _run(code: str, limits: SandboxLimits, setup: SandboxSetup, *, audit_hook: bool):
    start = time.monotonic()
    root = os.path.realpath(tempfile.mkdtemp(prefix="sao_sandbox_"))
    status_r, status_w = os.pipe()
    proc = None
    try:
        source = code.encode("utf-8", errors="replace")
        pathlib.Path(root, "main.py").write_bytes(source)
        if setup.uid is not None:
            os.chown(root, setup.uid, setup.uid)
            os.chown(os.path.join(root, "main.py"), setup.uid, setup.uid)
        ns = setup.isolation == NAMESPACES
        cfg = {
            "root": root,
            "status_fd": status_w,
            "mount": setup.mount if ns else None,
            "disk": limits.disk_bytes,
            "hide": _HIDE_DIRS,
            "limits": _limits_table(limits),
            "audit": audit_hook,
        }
        cmd = [setup.python, "-I", "-S", "-B", "-c", _BOOT, json.dumps(cfg)]
        if ns:
            cmd = [setup.unshare, *_UNSHARE_FLAGS, *cmd]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=root, env=_env(root), pass_fds=(status_w,), start_new_session=True,
                **_popen_user(setup.uid),
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:  # the machine, not the code
            return _result("", "", f"start: {e}", False, False, limits, setup, start)
        os.close(status_w)
        status_w = -1
        streams, timed_out, truncated = _collect(proc, status_r, start + limits.wall_s, limits)
    finally:
        if proc is not None:
            _kill_group(proc)
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        _remove_tree(root)
    out, err, status = (s.decode("utf-8", errors="replace") for s in streams)
    return _result(out, err, status, timed_out, truncated, limits, setup, start)


def _collect(proc: subprocess.Popen, status_r: int, deadline: float, limits: SandboxLimits):
    """Reads stdout, stderr and the status pipe until EOF, the deadline or the cap."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    buffers[status_r] = bytearray()
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for fd in buffers:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf = buffers[key.fd]
                room = limits.output_bytes - len(buf)
                buf += data[:room]
                truncated = len(data) > room and key.fd != status_r
    return [bytes(b) for b in buffers.values()], timed_out, truncated


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    _await_group_exit(proc.pid)


def _live_members(pgid: int) -> list[int]:
    """Pids of the process group that are not yet dead (zombies excluded); Linux /proc."""
    live = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)"
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            live.append(int(stat.split("/")[2]))
    return live


def _await_group_exit(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL is delivered at once but a process takes a moment to die (a fork bomb's
    children on a loaded machine): return only when none of the group is left alive, so
    no sandboxed process outlives `run_python`. Re-sends SIGKILL while waiting."""
    deadline = time.monotonic() + timeout_s
    while _live_members(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.01)


def _remove_tree(root: str) -> None:
    def fix(func, path, _exc):  # a directory the child made unreadable
        try:
            os.chmod(os.path.dirname(path), 0o700)
            os.chmod(path, 0o700)
            func(path)
        except OSError:
            pass

    shutil.rmtree(root, onerror=fix)


def _result(out, err, status, timed_out, truncated, limits, setup, start) -> SandboxResult:
    kind, _, value = status.partition(" ")
    exit_code = int(value) if kind == "exit" and value.lstrip("-").isdigit() else None
    sig = int(value) if kind == "signal" and value.isdigit() else None
    if truncated:
        error = f"output limit exceeded ({limits.output_bytes} bytes)"
    elif timed_out:
        error = f"wall-clock limit exceeded ({limits.wall_s:g} s)"
    elif sig in (signal.SIGXCPU, signal.SIGKILL):
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
    return SandboxResult(
        out, err, exit_code, sig, timed_out, truncated, setup.isolation, error,
        time.monotonic() - start,
    )  # fmt: skip
