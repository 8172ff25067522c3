"""The program the sandbox runs: `python -I -S -B -c <this file's source> <config JSON>`.

Standard library only, self-contained (it is passed as source text, never imported by
the host). Layout inside the sandbox:

    supervisor (this program)  -- non-dumpable, seccomp-filtered; reads the code, forks,
      │                           reaps, watches the private file systems' file count,
      │                           reports the status
      ├─ worker                -- writes the code to a file, installs the seccomp filter
      │                           bound to its own pid, closes every other descriptor,
      │                           sets its rlimits, installs the audit-hook tripwire, runs
      │                           the code (a script: main.py; a `code_tests` solution:
      │                           solution.py, imported and served by harness.py)
      └─ tests (code_tests)    -- forked after the worker: reads the test source and the
                                  run's secret (never in the worker's memory, files, argv
                                  or environment), runs the tests against the worker,
                                  writes the verdict on a pipe only it holds

The supervisor never runs user code. It is non-dumpable (PR_SET_DUMPABLE 0: a process
of the same uid cannot open its /proc/<pid>/mem or fds, nor ptrace it) and, in the weak
mode, runs the same seccomp filter the worker stacks its own on. It reports the worker's
wait status on the status pipe ("exit N" / "signal N CPU" / "files N" / "setup: ..."),
so the host knows how the code ended even when the code closed or flooded stdout. The
config (argv[1]) holds: root (the private directory, the worker's cwd), status_fd,
code_fd (a memfd with the source), seccomp (the worker's filter as [code, jt, jf, k]
rows, its pid still a placeholder), supervisor_seccomp (rows or null), the rlimits
table, audit (install the tripwire hook), fs_paths + max_files (file systems whose
inode count is capped), and harness (null, or the harness_fd / tests_fd / verdict_fd).
"""

import json
import os
import signal
import sys
import time

cfg = json.loads(sys.argv[1])
root, status_fd = cfg["root"], cfg["status_fd"]
harness = cfg["harness"]
FS_POLL_S = 0.05  # how often the file count of the private file systems is checked
GRACE_S = 1.0  # code_tests: how long the worker may take to exit after the tests end


def report(msg):
    os.write(status_fd, (msg + "\n").encode())
    os._exit(0)


def read_fd(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def install_seccomp(rows, pid=None):
    """prctl(NO_NEW_PRIVS), then prctl(SET_SECCOMP, FILTER, &prog) on this process (the
    pid placeholder patched to `pid`)."""
    import ctypes
    import struct

    placeholder = cfg["pid_placeholder"]
    data = b"".join(
        struct.pack("=HBBI", c, jt, jf, pid if k == placeholder and pid else k)
        for c, jt, jf, k in rows
    )
    libc = ctypes.CDLL(None, use_errno=True)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(data, len(data))
    prog = Fprog(len(rows), ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return f"no_new_privs: errno {ctypes.get_errno()}"
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, MODE_FILTER
        return f"seccomp: errno {ctypes.get_errno()}"
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # user code must import it afresh (the tripwire sees that)
    return None


def harden_supervisor():
    """Non-dumpable (its /proc files belong to root, no ptrace by its uid), and the
    general seccomp filter when the sandbox has none yet (the weak mode)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
        return f"dumpable: errno {ctypes.get_errno()}"
    if cfg["supervisor_seccomp"] is not None:
        return install_seccomp(cfg["supervisor_seccomp"])
    return None


def close_fds(keep):
    """Closes every descriptor >= 3 but those in `keep`."""
    lo = 3
    for fd in sorted(k for k in keep if k >= 3):
        if fd > lo:
            os.closerange(lo, fd)
        lo = max(lo, fd + 1)
    os.closerange(lo, 1 << 20)


def set_limits():
    import resource

    for name, soft, hard in cfg["limits"]:
        r = getattr(resource, name)
        cap = resource.getrlimit(r)[1]
        if cap != resource.RLIM_INFINITY:
            soft, hard = min(soft, cap), min(hard, cap)
        resource.setrlimit(r, (soft, hard))


def install_guard():
    """The audit-hook tripwire (PEP 578): not a security boundary, the kernel layers are.

    It binds everything it uses as default arguments, so patching builtins or module
    attributes does not change what it checks.
    """
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    deny = frozenset((
        "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "os.kill", "os.killpg", "signal.pthread_kill", "subprocess.Popen", "os.symlink",
        "os.link", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "webbrowser.open", "urllib.Request",
    ))  # fmt: skip
    deny_prefix = ("socket.", "ctypes.", "_ctypes.", "http.client.", "ftplib.", "smtplib.",
                   "imaplib.", "poplib.", "nntplib.", "telnetlib.")  # fmt: skip
    deny_import = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters",
                             "_testcapi", "_testinternalcapi"))  # fmt: skip
    write_events = frozenset((  # first argument is a path the event writes to
        "os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.chmod", "os.chown", "os.utime",
        "os.truncate", "os.mkfifo", "os.mknod", "os.setxattr", "os.removexattr",
        "shutil.rmtree", "os.chdir",
    ))  # fmt: skip
    read_events = frozenset(("os.listdir", "os.scandir", "os.listxattr", "os.getxattr"))
    func_attrs = frozenset(("__code__", "__defaults__", "__kwdefaults__"))

    def hook(event, args, *, isinstance=isinstance, int=int, str=str, bytes=bytes,
             PermissionError=PermissionError, fspath=os.fspath, getcwd=os.getcwd,
             deny=deny, deny_prefix=deny_prefix, deny_import=deny_import,
             write_events=write_events, read_events=read_events, func_attrs=func_attrs,
             writable=(root,), readable=(root, stdlib, "/dev/null"), W=W):  # fmt: skip
        if event in deny or event.startswith(deny_prefix):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import":
            name = str.__str__(args[0]) if isinstance(args[0], str) else ""
            if str.partition(name, ".")[0] in deny_import:
                raise PermissionError(f"sandbox: import of {name} is not allowed")
            return
        if event == "object.__setattr__":
            if isinstance(args[1], str) and str.__str__(args[1]) in func_attrs:
                raise PermissionError("sandbox: setting a function attribute is not allowed")
            return
        if event == "open":
            mode, flags = args[1], args[2]
            write = (isinstance(mode, str) and ("w" in mode or "a" in mode or "x" in mode
                                                or "+" in mode)) or (
                isinstance(flags, int) and flags & W)  # fmt: skip
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
                raise PermissionError(f"sandbox: bad path in {event}") from None
            if not isinstance(s, str):
                raise PermissionError(f"sandbox: bad path in {event}")
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
                raise PermissionError(f"sandbox: {event} of {s} is not allowed")

    sys.addaudithook(hook)


def worker(code, harness_source, pipes):
    """Runs the code; `pipes` = (requests_r, replies_w) in code_tests mode, else None."""
    import runpy
    import traceback

    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.chdir(root)
    name = "main.py" if pipes is None else "solution.py"
    with open(name, "wb") as f:
        f.write(code)
    problem = install_seccomp(cfg["seccomp"], os.getpid())
    if problem is not None:  # the host reads the first status line
        os.write(status_fd, f"setup: {problem}\n".encode())
        os._exit(125)
    close_fds(pipes or ())  # status, tests and verdict descriptors among them
    set_limits()
    if cfg["audit"]:
        install_guard()
    if pipes is not None:
        namespace = {"__name__": "sao_harness"}
        exec(compile(harness_source, "harness.py", "exec"), namespace)
        namespace["serve"](pipes[0], pipes[1], name)  # never returns
    sys.argv = [name]
    try:
        runpy.run_path(name, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # print the traceback from the first frame of main.py on
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != name:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        sys.exit(1)


def tests(harness_source, pipes):
    """code_tests: runs the tests against the worker; writes `verdict <secret> <json>`."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    spec = json.loads(read_fd(harness["tests_fd"]))
    verdict_fd = harness["verdict_fd"]
    close_fds((*pipes, verdict_fd))
    namespace = {"__name__": "sao_harness"}
    exec(compile(harness_source, "harness.py", "exec"), namespace)
    conn = namespace["Connection"](pipes[0], pipes[1])
    try:
        out = namespace["run_tests"](spec["tests"], conn)
    except BaseException as e:  # the tests themselves do not parse, or the harness broke
        out = {"complete": False, "error": f"{type(e).__name__}: {e}"[:300]}
    os.close(pipes[0])  # end of file for the worker: it exits
    data = f"verdict {spec['secret']} {json.dumps(out)}\n".encode()
    while data:
        data = data[os.write(verdict_fd, data) :]
    os._exit(0)


def file_count(paths):
    """Inodes in use on the file systems at `paths` (each a tmpfs of its own)."""
    total = 0
    for p in paths:
        st = os.statvfs(p)
        total += st.f_files - st.f_ffree
    return total


def supervise(pid, tests_pid):
    """Reaps the worker (and the tests process); reports the worker's end. Polls the file
    count every FS_POLL_S while a cap applies, and ends the worker past it."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    paths, cap = cfg["fs_paths"], cfg["max_files"]
    baseline = file_count(paths)
    poll = bool(paths) or tests_pid is not None
    status = usage = None
    over = tests_done_at = None
    live = {pid} | ({tests_pid} if tests_pid is not None else set())
    while live:
        if poll:
            signal.sigtimedwait([signal.SIGCHLD], FS_POLL_S)
            flags = os.WNOHANG
        else:
            flags = 0
        while live:
            try:
                child, st, ru = os.wait4(-1, flags)
            except ChildProcessError:
                report("lost")
            if child == 0:
                break
            live.discard(child)
            if child == pid:
                status, usage = st, ru
            elif child == tests_pid:
                tests_done_at = time.monotonic()
        late = tests_done_at is not None and time.monotonic() - tests_done_at > GRACE_S
        if pid in live and late:
            os.kill(pid, signal.SIGKILL)  # the tests are over: the solution may not linger
        if paths and over is None and pid in live:
            used = file_count(paths) - baseline
            if used > cap:
                over = used
                os.kill(pid, signal.SIGKILL)
    if over is not None:
        report(f"files {over}")
    if os.WIFSIGNALED(status):  # with the CPU seconds: a SIGKILL at the hard CPU limit
        report(f"signal {os.WTERMSIG(status)} {usage.ru_utime + usage.ru_stime:.3f}")
    report(f"exit {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    problem = harden_supervisor()
    if problem is not None:
        report(f"setup: {problem}")
    source = read_fd(cfg["code_fd"])
    harness_source = read_fd(harness["harness_fd"]) if harness is not None else None
    pipes = None
    if harness is not None:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        pipes = ((requests_r, replies_w), (requests_w, replies_r))
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # none lost before the wait
    child_pid = os.fork()
    if child_pid == 0:
        if harness is not None:
            os.close(harness["tests_fd"])  # before anything else: the tests stay unread
        worker(source, harness_source, pipes and pipes[0])
        sys.exit(0)  # the script ran to its end (interpreter exit: atexit, flushing)
    tests_pid = None
    if harness is not None:
        tests_pid = os.fork()
        if tests_pid == 0:
            tests(harness_source, pipes[1])
        for fd in (*pipes[0], *pipes[1], harness["tests_fd"], harness["verdict_fd"]):
            os.close(fd)
    supervise(child_pid, tests_pid)
