"""The bubblewrap sandbox of a harness process: its files, and the gateway as its only network.

A harness that executes model-written code (a coding agent's shell or Python tool) runs
whole inside `bwrap` (docs/sandbox.md describes the tool and the kernel layers), with:

    /usr (and the /bin, /lib, /lib64, /sbin links or binds)   read-only
    sys.prefix, sys.base_prefix    read-only: the interpreter and its site-packages
    gateway.harness.sandbox_paths  read-only, at their real paths: the harness's code
    <its working directory>        read-write, at its real path, the current directory
    /tmp                           an empty tmpfs;  /proc, /dev: the sandbox's own
    /run/sao/gateway.sock          the gateway's Unix socket (its folder, bound)
    /opt/sao/forwarder.py          sao_jax/serve/forwarder.py, read-only

Namespaces: new user (uid / gid 65534 inside, no capabilities), pid, network (loopback
only), mount, IPC, UTS, cgroup; `--die-with-parent` ends it with the driver. No /etc, no
/home, no /root beyond the interpreter's own folder, no checkout beyond the listed paths.

The network: the sandbox's first process is the forwarder (sao_jax/serve/forwarder.py):
it listens on the sandbox's own 127.0.0.1:`FORWARD_PORT` and pipes every connection to
the gateway's socket, then runs the harness and exits with its status. The harness is
therefore given `base_url` = `http://127.0.0.1:FORWARD_PORT/sessions/{id}/v1`, a plain
HTTP URL any client takes unchanged (an in-sandbox forwarder rather than an httpx Unix
socket transport, which only httpx-based Python clients could be configured with).

Unlike the model-code sandbox of docs/sandbox.md (seccomp, rlimits, uid `nobody`
outside), the harness keeps the host uid outside its user namespace (it reads the
interpreter from the caller's paths) and has no seccomp filter or rlimits: it is a
whole program, not a snippet; the process group, timeout and kill are the driver's
(sao_jax/serve/harness.py).
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

from sao_jax.envs.sandbox.bwrap import find_bwrap

SOCKET_DIR = "/run/sao"
SOCKET_NAME = "gateway.sock"
FORWARDER = "/opt/sao/forwarder.py"
FORWARD_PORT = 8000
SYSTEM_DIRS = ("/bin", "/lib", "/lib64", "/sbin")


@functools.cache
def unavailable() -> str:
    """'' when a harness sandbox can run here, else why not (one line)."""
    bwrap = find_bwrap()
    if bwrap is None:
        return "bwrap (bubblewrap) is not installed (apt-get install bubblewrap)"
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent",
           "--ro-bind", "/usr", "/usr", *_system_links(), "--", "/usr/bin/true"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap does not run: {e}"
    if done.returncode != 0:
        return "bwrap does not run here: " + " ".join(done.stderr.split())[-200:]
    return ""


def _system_links() -> list[str]:
    out = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    return out


def command(
    argv: list[str],
    *,
    workdir: pathlib.Path,
    socket_dir: pathlib.Path,
    read_only: tuple[str, ...],
    env: dict[str, str],
) -> list[str]:
    """The bwrap argv that runs `argv` (the formatted harness command) in the sandbox."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise RuntimeError("bwrap (bubblewrap) is not installed")
    cmd = [bwrap, "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
           "--die-with-parent", "--new-session", "--clearenv"]  # fmt: skip
    if os.geteuid() == 0:  # bwrap keeps a root caller's capabilities unless told not to
        cmd += ["--cap-drop", "ALL"]
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    cmd += ["--ro-bind", "/usr", "/usr", *_system_links()]
    # /tmp's tmpfs first: a checkout, interpreter or workdir under /tmp is bound over it
    cmd += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    prefixes = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    prefixes |= {sys.prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    for path in sorted(prefixes) + [str(pathlib.Path(p).resolve()) for p in read_only]:
        if not path.startswith("/usr/") and os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    here = str(workdir.resolve())
    cmd += ["--bind", here, here, "--bind", str(socket_dir), SOCKET_DIR]
    cmd += ["--ro-bind", str(pathlib.Path(__file__).with_name("forwarder.py")), FORWARDER]
    cmd += ["--chdir", here, "--", sys.executable, "-I", FORWARDER]
    cmd += [f"--socket={SOCKET_DIR}/{SOCKET_NAME}", f"--port={FORWARD_PORT}", "--", *argv]
    return cmd
