"""The bubblewrap (`bwrap`) command line of one sandbox run, and its minimal root.

The sandbox's whole file system is what `bwrap` mounts, read-only unless noted:

    <python>                   the interpreter binary, at its real path
    <stdlib>/                  its standard library (lib-dynload included)
    <lib>.so                   each shared library the interpreter and its extension
                               modules load (from `ldd`; without ldd: their directories)
    /dev/{null,zero,full,random,urandom}
    /sandbox/                  the private directory: a tmpfs of `disk_bytes`, writable
    /tmp/                      an empty tmpfs of `disk_bytes`, writable
    /                          bwrap's own tmpfs root, remounted read-only

Nothing else exists: no /proc, /sys, /etc, /home, /root, no project checkout, no site
packages. Namespaces: a new user namespace (the sandbox uid maps to the uid bwrap runs
as, `nobody` when the host is root), and new pid, network (loopback only), mount, IPC,
UTS and cgroup namespaces; `--disable-userns` forbids nested user namespaces,
`--die-with-parent` kills the sandbox with bwrap, `--new-session` detaches the terminal.
The seccomp program comes on an inherited file descriptor (`--seccomp FD`); bwrap
reports the host pid of the sandbox's pid-1 on `--info-fd` (the host kills that process
to end the run: the kernel then kills everything in the pid namespace).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

PRIVATE, TMP = "/sandbox", "/tmp"
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_LDD_LINE = re.compile(r"^\s*(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-f]+\)\s*$")


def find_bwrap() -> str | None:
    return shutil.which("bwrap", path=SYSTEM_PATH)


def stdlib_dirs(python: str, env: dict[str, str], user: dict) -> tuple[str, ...]:
    """The interpreter's standard library directories (real paths), asked of itself."""
    code = "import os, sysconfig; print(os.path.dirname(os.__file__)); "
    code += "print(sysconfig.get_path('platstdlib') or '')"
    out = subprocess.run(
        [python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30,
        env=env, cwd="/", check=True, **user,
    ).stdout.split()  # fmt: skip
    dirs = []
    for d in out:
        real = os.path.realpath(d)
        if os.path.isdir(real) and real not in dirs:
            dirs.append(real)
    return tuple(dirs)


def _ldd(files: list[str], env: dict[str, str]) -> set[str] | None:
    """Shared libraries `files` load (as ldd lists them), or None without ldd."""
    ldd = shutil.which("ldd", path=SYSTEM_PATH)
    if ldd is None or not files:
        return None if ldd is None else set()
    done = subprocess.run(
        [ldd, *files], capture_output=True, text=True, timeout=60, env=env, cwd="/"
    )
    libs = set()
    for line in done.stdout.splitlines():
        m = _LDD_LINE.match(line)
        if m and os.path.exists(m.group(1)):
            libs.add(m.group(1))
    return libs


def _extension_modules(dirs: tuple[str, ...]) -> list[str]:
    found = []
    for d in dirs:
        for sub in (d, os.path.join(d, "lib-dynload")):
            if os.path.isdir(sub):
                found += [os.path.join(sub, f) for f in sorted(os.listdir(sub)) if ".so" in f]
    return found


@functools.cache
def root_binds(python: str, stdlib: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(source, destination) of every read-only bind of the minimal root (cached).

    A library that ldd lists under a symlinked path is bound from its real file at that
    path (the dynamic loader opens it there); without ldd the directories holding the
    interpreter's libraries are bound whole.
    """
    env = {"PATH": SYSTEM_PATH, "LC_ALL": "C"}
    binds = {python: os.path.realpath(python)}
    for d in stdlib:
        binds[d] = d
    libs = _ldd([python, *_extension_modules(stdlib)], env)
    if libs is None:  # no ldd: the usual library directories, whole
        for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64"):
            if os.path.isdir(d) and not any(d == s or d.startswith(s + "/") for s in stdlib):
                binds[d] = os.path.realpath(d)
    else:
        for lib in sorted(libs):
            binds[lib] = os.path.realpath(lib)
    return tuple((src, dst) for dst, src in sorted(binds.items()))


def command(
    bwrap: str,
    python: str,
    binds: tuple[tuple[str, str], ...],
    boot: list[str],
    *,
    disk_bytes: int,
    seccomp_fd: int,
    info_fd: int,
    env: dict[str, str],
) -> list[str]:
    """The full argv: bwrap's options, then `python -I -S -B <boot args>`."""
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    cmd += ["--new-session", "--clearenv"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    for src, dst in binds:
        cmd += ["--ro-bind", src, dst]
    cmd += ["--dir", "/dev"]
    for dev in DEVICES:
        if os.path.exists(dev):
            cmd += ["--dev-bind", dev, dev]
    for path, mode in ((PRIVATE, "0700"), (TMP, "1777")):
        cmd += ["--size", str(disk_bytes), "--perms", mode, "--tmpfs", path]
    cmd += ["--remount-ro", "/", "--chdir", PRIVATE]
    cmd += ["--seccomp", str(seccomp_fd), "--info-fd", str(info_fd), "--"]
    return [*cmd, python, "-I", "-S", "-B", *boot]
