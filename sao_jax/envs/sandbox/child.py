"""The program the sandbox runs: `python -I -S -B -c <this file's source> <config JSON>`.

Standard library only, self-contained (it is passed as source text, never imported by
the host). Layout inside the sandbox:

    supervisor (this program)  -- reads the code, forks, reaps, reports the status
      └─ worker                -- writes main.py, installs the seccomp filter bound to
                                  its own pid, sets its rlimits, installs the audit-hook
                                  tripwire, runs main.py

The supervisor never runs user code. It reports the worker's wait status on the status
pipe ("exit N" / "signal N" / "setup: ..."), so the host knows how the code ended even
when the code closed or flooded stdout. The config (argv[1]) holds: root (the private
directory, the worker's cwd), status_fd, code_fd (a memfd with the source), seccomp
(the filter as [code, jt, jf, k] rows, the worker's pid still a placeholder), the
rlimits table, and audit (install the tripwire hook).
"""

import json
import os
import sys

cfg = json.loads(sys.argv[1])
root, status_fd = cfg["root"], cfg["status_fd"]


def report(msg):
    os.write(status_fd, (msg + "\n").encode())
    os._exit(0)


def read_code():
    chunks = []
    while True:
        chunk = os.read(cfg["code_fd"], 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(cfg["code_fd"])
    return b"".join(chunks)


def install_seccomp(rows):
    """prctl(NO_NEW_PRIVS), then prctl(SET_SECCOMP, FILTER, &prog) on this process."""
    import ctypes
    import struct

    pid = os.getpid()
    placeholder = cfg["pid_placeholder"]
    data = b"".join(
        struct.pack("=HBBI", c, jt, jf, pid if k == placeholder else k) for c, jt, jf, k in rows
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


def worker(code):
    import runpy
    import traceback

    os.chdir(root)
    with open("main.py", "wb") as f:
        f.write(code)
    problem = install_seccomp(cfg["seccomp"])
    if problem is not None:  # the host reads the first status line
        os.write(status_fd, f"setup: {problem}\n".encode())
        os._exit(125)
    os.close(status_fd)
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
            child, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            report("lost")
        if child == pid:
            break
    if os.WIFSIGNALED(status):  # with the CPU seconds: a SIGKILL at the hard CPU limit
        report(f"signal {os.WTERMSIG(status)} {usage.ru_utime + usage.ru_stime:.3f}")
    report(f"exit {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    source = read_code()
    child_pid = os.fork()
    if child_pid == 0:
        worker(source)
    else:
        supervise(child_pid)
