"""Host side of one sandbox run: read the streams under the limits, kill, clean up.

`collect` reads stdout, stderr, the status pipe and bwrap's info pipe until all reach
end of file, the wall-clock deadline passes, a stream passes the output cap, or (weak
mode only) the private directory passes its disk cap. `Reaper` ends the run so that no
sandboxed process outlives it: in bwrap mode it SIGKILLs the sandbox's pid-1 through a
pidfd (the kernel then kills every process of the pid namespace before that pid-1's
exit completes) and waits for bwrap; in the weak mode it SIGKILLs the process group
(setsid/setpgid are denied by seccomp, so nothing left it) until none of it is alive.
`remove_tree` deletes a private directory of any depth without following symlinks and
never raises.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import selectors
import signal
import stat
import subprocess
import time

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DISK_POLL_S = 0.05  # weak mode: how often the private directory's size is measured
BLOCK = 4096  # weak mode: an entry counts as at least one block against the disk cap


class Collected:
    """What `collect` read, and why it stopped."""

    def __init__(self):
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.status = bytearray()
        self.info = bytearray()
        self.verdict = bytearray()
        self.timed_out = False
        self.truncated = False
        self.disk_full = False
        self.files_full = False


def tree_usage(root: str, byte_cap: int, file_cap: int) -> tuple[int, int]:
    """(bytes, entries) of the tree under `root` (each entry at least BLOCK bytes),
    counted until a cap is passed, entry by entry (so only the cap passed first reads as
    passed: many empty files pass the file count, not the bytes their blocks add up to);
    iterative and fd-relative, so any depth works and no symlink is followed."""
    total = files = 0
    try:
        stack = [os.open(root, _DIR_FLAGS)]
    except OSError:
        return 0, 0
    while stack and total <= byte_cap and files <= file_cap:
        fd = stack.pop()
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += max(BLOCK, st.st_blocks * 512)
                    files += 1
                    if total > byte_cap or files > file_cap:
                        break  # the cap passed first is the one reported
                    if stat.S_ISDIR(st.st_mode):
                        with contextlib.suppress(OSError):
                            stack.append(os.open(entry.name, _DIR_FLAGS, dir_fd=fd))
        except OSError:
            pass
        finally:
            os.close(fd)
    for fd in stack:
        os.close(fd)
    return total, files


def collect(
    proc: subprocess.Popen,
    extra: dict[str, int],
    deadline: float,
    output_bytes: int,
    *,
    on_info=None,
    disk: tuple[str, int, int] | None = None,
) -> Collected:
    """Reads proc's stdout/stderr and the pipes in `extra` ({"status": fd, "info": fd,
    "verdict": fd}).

    `on_info(bytes_so_far)` is called whenever the info pipe grows; `disk=(root,
    byte_cap, file_cap)` turns on the weak mode's disk watch.
    """
    got = Collected()
    buffers = {proc.stdout.fileno(): got.stdout, proc.stderr.fileno(): got.stderr}
    capped = set(buffers)
    for name, fd in extra.items():
        buffers[fd] = getattr(got, name)
    info_fd = extra.get("info")
    next_disk = time.monotonic()
    with selectors.DefaultSelector() as sel:
        for fd in buffers:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not got.truncated:
            now = time.monotonic()
            if now >= deadline:
                got.timed_out = True
                break
            if disk is not None and now >= next_disk:
                used, files = tree_usage(*disk)
                got.disk_full, got.files_full = used > disk[1], files > disk[2]
                if got.disk_full or got.files_full:
                    break
                next_disk = now + DISK_POLL_S
            wait = deadline - now
            if disk is not None:
                wait = min(wait, max(0.0, next_disk - now))
            for key, _ in sel.select(wait):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf = buffers[key.fd]
                room = output_bytes - len(buf)
                buf += data[:room]
                if key.fd in capped and len(data) > room:
                    got.truncated = True
                if key.fd == info_fd and on_info is not None:
                    on_info(bytes(buf))
    return got


class Reaper:
    """Ends one run: every process it started is dead when `finish` returns."""

    def __init__(self, proc: subprocess.Popen, *, pid_namespace: bool):
        self.proc = proc
        self.pid_namespace = pid_namespace
        self._init_fd: int | None = None  # pidfd of the sandbox's pid-1 (bwrap mode)

    def on_info(self, data: bytes) -> None:
        """bwrap's --info-fd JSON: open a pidfd of the sandbox's pid-1 at once."""
        if self._init_fd is not None:
            return
        try:
            pid = int(json.loads(data.decode())["child-pid"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return  # not complete yet
        with contextlib.suppress(OSError):
            self._init_fd = os.pidfd_open(pid)

    def finish(self) -> None:
        if self._init_fd is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(self._init_fd, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
        if self._init_fd is not None:
            select.select([self._init_fd], [], [], 10.0)  # readable once pid-1 has exited
            os.close(self._init_fd)
        if not self.pid_namespace:
            _await_group_exit(self.proc.pid)


def _live_members(pgid: int) -> list[int]:
    """Pids of the process group that are not yet dead (zombies excluded); Linux /proc."""
    live = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "(comm)"
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            live.append(int(path.split("/")[2]))
    return live


def _await_group_exit(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL is delivered at once but a process takes a moment to die (a fork bomb's
    children on a loaded machine): return only when none of the group is alive."""
    deadline = time.monotonic() + timeout_s
    while _live_members(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.01)


def remove_tree(path: str) -> bool:
    """Deletes the directory `path` and everything under it; True when nothing is left.
    Never raises and never follows a symlink: every step is relative to an open directory
    descriptor (any depth, no path length limit), a directory is entered with O_NOFOLLOW
    (a symlink planted at its name, `path` included, is unlinked, not followed), and a
    directory the code made inaccessible is chmod-ed through the descriptor of the exact
    inode (never by name). The parent of `path` is the host's own (trusted) directory."""
    head, name = os.path.split(os.path.abspath(path))
    try:
        top = os.open(head, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        _remove_under(top, name)
        os.stat(name, dir_fd=top, follow_symlinks=False)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    finally:
        os.close(top)
    return False


def _enter(name: str, dir_fd: int) -> int | None:
    """A descriptor of the real directory `name` in `dir_fd`, made accessible first when
    it is not; None when `name` is not a directory (a symlink or file) or cannot be."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:  # chmod-ed inaccessible (a host that is not root)
        pass
    except OSError:  # ELOOP: a symlink; ENOTDIR, ENOENT
        return None
    try:
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISDIR(os.fstat(path_fd).st_mode):
            return None
        os.chmod(f"/proc/self/fd/{path_fd}", 0o700)  # that inode, whatever its name now
        return os.open(".", _DIR_FLAGS, dir_fd=path_fd)
    except OSError:
        return None
    finally:
        os.close(path_fd)


def _remove_under(top: int, name: str) -> None:
    """Removes entry `name` of directory `top` (see remove_tree); OSError for the rest."""
    fd = _enter(name, top)
    if fd is None:  # a file or symlink in the place of the directory: the entry only
        with contextlib.suppress(IsADirectoryError):
            os.unlink(name, dir_fd=top)
        return
    names: list[str] = []  # path from `name` down to fd's directory
    stuck: set[tuple[int, int]] = set()  # directories that could not be entered
    try:
        while True:
            sub = None
            with contextlib.suppress(OSError), os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        key = (entry.stat(follow_symlinks=False).st_dev, entry.inode())
                        if key not in stuck:
                            sub = entry, key
                            break
                        continue
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=fd)
            if sub is not None:
                child = _enter(sub[0].name, fd)
                if child is None:
                    stuck.add(sub[1])
                    continue
                os.close(fd)
                fd = child
                names.append(sub[0].name)
                continue
            if not names:
                break
            parent = os.open("..", _DIR_FLAGS & ~os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = parent
            with contextlib.suppress(OSError):
                os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=top)
