"""The sandbox's seccomp filter: a classic-BPF program emitted here, stdlib only.

The kernel runs the program on every system call of the sandboxed processes (and of
their children; a filter can never be removed, only stacked with stricter ones). It
sees the call's number, the architecture and the six raw arguments (`struct
seccomp_data`), and answers ALLOW, ERRNO(e) or KILL_PROCESS. The program:

1. KILL_PROCESS unless the architecture is the one the table was built for (a 32-bit
   or x32 call would reach another table of numbers);
2. ERRNO(EPERM) for every call in `DENIED` (debuggers, signals by pidfd, mounts,
   namespaces, keyrings, eBPF, kernel modules, clock and host settings, io_uring, ...);
3. `clone` with a CLONE_NEW* flag: EPERM (a plain fork or thread stays allowed, the
   rlimits bound them); `clone3` (flags in memory the filter cannot read): ENOSYS, so
   the C library falls back to `clone`;
4. the signal-sending calls (`kill`, `tkill`, `tgkill`, `rt_sigqueueinfo`,
   `rt_tgsigqueueinfo`): with `own_pid` given only to that pid (and `kill(0, sig)`, the
   caller's own process group), else EPERM; without it, all allowed (bubblewrap's pid
   namespace leaves nothing outside the sandbox to address);
5. with `deny_network` (the weak mode, which has the host's network): ERRNO(EPERM) for
   `socket` (no socket of any family: inet, inet6, unix, netlink; nothing is inherited);
6. ALLOW otherwise.

`own_pid` may be `PID_PLACEHOLDER`: the worker process, which knows its pid, patches it
(see `patch_pid`) and installs the program on itself.

Encoding: `struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}` in native byte order,
the format of `prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)` and `bwrap --seccomp`.
Syscall numbers: the kernel's uapi headers (tests/test_sandbox.py checks them against
/usr/include when present).
"""

from __future__ import annotations

import errno
import platform
import struct

# ---- BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
# ---- struct seccomp_data offsets (little endian: the low 32 bits of args[i] first)
_NR, _ARCH, _ARG0_LO = 0, 4, 16

PID_PLACEHOLDER = 0x7FFFFFF1  # no real pid: pid_max is at most 2**22
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_FLAGS |= 0x20000000 | 0x40000000

DENIED = (
    # debugging and reading other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "perf_event_open",
    "process_madvise",
    # signals and handles by pidfd
    "pidfd_open", "pidfd_send_signal", "pidfd_getfd",
    # mounts, roots and namespaces
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    # keyrings, eBPF, userfaultfd, io_uring (its own path around this filter)
    "keyctl", "add_key", "request_key", "bpf", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register",
    # file handles (open by inode, bypassing paths)
    "open_by_handle_at", "name_to_handle_at",
    # host settings, modules, accounting, logs
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "acct", "syslog", "quotactl", "quotactl_fd", "swapon", "swapoff",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "vhangup", "lookup_dcookie", "personality", "memfd_secret",
    "iopl", "ioperm",
    # leaving the sandbox's session / process group (orphans that outlive the run)
    "setsid", "setpgid",
)  # fmt: skip
SIGNALS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
NETWORK = ("socket",)  # denied with deny_network

# Numbers from arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.
_X86_64 = dict(
    ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312, perf_event_open=298,
    process_madvise=440, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, mount=165,
    umount2=166, pivot_root=155, chroot=161, move_mount=429, open_tree=428, fsopen=430,
    fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, unshare=272, setns=308,
    keyctl=250, add_key=248, request_key=249, bpf=321, userfaultfd=323, io_uring_setup=425,
    io_uring_enter=426, io_uring_register=427, open_by_handle_at=304, name_to_handle_at=303,
    reboot=169, kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313,
    delete_module=176, acct=163, syslog=103, quotactl=179, quotactl_fd=443, swapon=167,
    swapoff=168, settimeofday=164, clock_settime=227, clock_adjtime=305, adjtimex=159,
    sethostname=170, setdomainname=171, vhangup=153, lookup_dcookie=212, personality=135,
    memfd_secret=447, iopl=172, ioperm=173, setsid=112, setpgid=109, kill=62, tkill=200,
    tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, clone=56, clone3=435, socket=41,
)  # fmt: skip
_GENERIC = dict(  # aarch64 (and riscv64) use the generic table
    ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272, perf_event_open=241,
    process_madvise=440, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, mount=40,
    umount2=39, pivot_root=41, chroot=51, move_mount=429, open_tree=428, fsopen=430,
    fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, unshare=97, setns=268,
    keyctl=219, add_key=217, request_key=218, bpf=280, userfaultfd=282, io_uring_setup=425,
    io_uring_enter=426, io_uring_register=427, open_by_handle_at=265, name_to_handle_at=264,
    reboot=142, kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273,
    delete_module=106, acct=89, syslog=116, quotactl=60, quotactl_fd=443, swapon=224,
    swapoff=225, settimeofday=170, clock_settime=112, clock_adjtime=266, adjtimex=171,
    sethostname=161, setdomainname=162, vhangup=58, lookup_dcookie=18, personality=92,
    memfd_secret=447, setsid=157, setpgid=154, kill=129, tkill=130, tgkill=131,
    rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, clone=220, clone3=435, socket=198,
)  # fmt: skip
# machine -> (AUDIT_ARCH_*, syscall table, first number of the x32 ABI or None)
ARCHES = {
    "x86_64": (0xC000003E, _X86_64, 0x40000000),
    "aarch64": (0xC00000B7, _GENERIC, None),
}


class SeccompUnsupported(RuntimeError):
    """No syscall table for this machine's architecture."""


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k & 0xFFFFFFFF)


def instructions(
    machine: str | None = None, own_pid: int | None = None, *, deny_network: bool = False
) -> list[tuple]:
    """The filter as (code, jt, jf, k) tuples; see the module docstring for its rules."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise SeccompUnsupported(f"no seccomp syscall table for architecture {machine!r}")
    arch, table, x32 = ARCHES[machine]
    eperm, enosys = RET_ERRNO | errno.EPERM, RET_ERRNO | errno.ENOSYS
    prog = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, 1, 0), _op(_RET_K, RET_KILL_PROCESS)]
    prog.append(_op(_LD_W_ABS, _NR))
    if x32 is not None:  # the x32 ABI: numbers with bit 30 set
        prog += [_op(_JGE_K, x32, 0, 1), _op(_RET_K, eperm)]
    for name in DENIED + (NETWORK if deny_network else ()):
        if name in table:  # iopl/ioperm exist on x86 only
            prog += [_op(_JEQ_K, table[name], 0, 1), _op(_RET_K, eperm)]
    prog += [_op(_JEQ_K, table["clone3"], 0, 1), _op(_RET_K, enosys)]
    # clone: nr is in the accumulator; this block ends in a return either way.
    prog += [
        _op(_JEQ_K, table["clone"], 0, 4),
        _op(_LD_W_ABS, _ARG0_LO),
        _op(_JSET_K, CLONE_NEW_FLAGS, 0, 1),
        _op(_RET_K, eperm),
        _op(_RET_K, RET_ALLOW),
    ]
    if own_pid is not None:
        for name in SIGNALS:
            zero_ok = name == "kill"  # kill(0, sig): the caller's own process group
            block = [
                _op(_LD_W_ABS, _ARG0_LO),
                _op(_JEQ_K, own_pid, 2 if zero_ok else 1, 0),
            ]
            if zero_ok:
                block.append(_op(_JEQ_K, 0, 1, 0))
            block += [_op(_RET_K, eperm), _op(_RET_K, RET_ALLOW)]
            prog += [_op(_JEQ_K, table[name], 0, len(block)), *block]
    prog.append(_op(_RET_K, RET_ALLOW))
    return prog


def patch_pid(prog: list, pid: int) -> list:
    """`prog` with every PID_PLACEHOLDER constant replaced by `pid`."""
    return [(c, jt, jf, pid if k == PID_PLACEHOLDER else k) for c, jt, jf, k in prog]


def encode(prog: list) -> bytes:
    """The program as the kernel's `struct sock_filter` array."""
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def run_filter(prog: list, nr: int, args: tuple[int, ...] = (), arch: int | None = None) -> int:
    """Interprets `prog` on one system call (the slow reference the tests compare the
    kernel's behaviour with); returns the action (RET_ALLOW, RET_ERRNO | e, ...)."""
    arch = ARCHES[platform.machine()][0] if arch is None else arch
    data = struct.pack("=iI", nr, arch) + struct.pack("=Q", 0)
    for a in (*args, 0, 0, 0, 0, 0, 0)[:6]:
        data += struct.pack("=Q", a & 0xFFFFFFFFFFFFFFFF)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == _LD_W_ABS:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == _RET_K:
            return k
        elif code in (_JEQ_K, _JGE_K, _JSET_K):
            hit = {_JEQ_K: acc == k, _JGE_K: acc >= k, _JSET_K: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise ValueError(f"unknown BPF opcode {code:#x} at {pc - 1}")
