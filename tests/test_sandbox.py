"""The sandbox's limits, its minimal root, its seccomp filter and the python_tool env.

Every run goes through the kernel layers alone (`audit_hook=False`) unless a test is
about the tripwire hook. Both modes are always collected (the same test ids on every
machine: collection never probes); a "bwrap" test skips at run time where this machine
has no kernel isolation. Hermetic: each test has its own scratch root (the weak mode's
private directories go there) and checks only what it made. The hostile corpus is
tests/test_sandbox_corpus.py; the code_tests reward's hacks are tests/test_reward_hacks.py.
"""

import concurrent.futures
import logging
import os
import pathlib
import platform
import shutil
import signal
import tempfile

import pytest

from sao_jax.envs.sandbox import host as sandbox_host
from sao_jax.envs.sandbox import runner as S
from sao_jax.envs.sandbox import seccomp as F

MODES = [S.RLIMITS, S.BWRAP]
FAST = S.SandboxLimits(cpu_s=1, wall_s=10.0, memory_bytes=128 << 20, output_bytes=4096)


def skip_unless_available(mode: str) -> None:
    """Skips the running test when `mode` cannot run here (a run-time probe, cached)."""
    setup = S.probe_setup()
    if mode == S.BWRAP and setup.isolation != S.BWRAP:
        pytest.skip(f"no kernel isolation here: {setup.note}")


@pytest.fixture
def best_mode():
    """bwrap where this machine has it, else the weak mode."""
    return S.BWRAP if S.probe_setup().isolation == S.BWRAP else S.RLIMITS


@pytest.fixture
def scratch():
    """This test's own root for the weak mode's private directories (traversable by the
    sandbox's uid), removed afterwards."""
    root = tempfile.mkdtemp(prefix="sao_test_sandbox_")
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def run(scratch):
    def go(code, mode, limits=FAST, *, audit_hook=False):
        skip_unless_available(mode)
        r = S.run_python(
            code, limits, isolation=mode, allow_weak=True, audit_hook=audit_hook,
            scratch_dir=scratch,
        )  # fmt: skip
        assert r.isolation == mode and r.wall_s < limits.wall_s + 10.0
        assert os.listdir(scratch) == []  # the private directory is gone
        return r

    return go


@pytest.mark.parametrize("mode", MODES)
def test_ordinary_program(run, mode):
    code = (
        "import math, os, sys\n"
        "open('note.txt', 'w').write('hi')\n"
        "print(math.factorial(5), open('note.txt').read(), sorted(os.listdir('.')))\n"
        "print('warn', file=sys.stderr)\n"
    )
    r = run(code, mode)
    assert r.ok and r.exit_code == 0 and r.error is None
    assert r.stdout == "120 hi ['main.py', 'note.txt']\n" and r.stderr == "warn\n"
    r = run("raise SystemExit(3)", mode)
    assert r.exit_code == 3 and r.error == "exit status 3"
    r = run("1/0", mode)
    assert r.error == "exit status 1" and r.stderr.strip().endswith(
        "ZeroDivisionError: division by zero"
    )
    assert 'File "main.py"' in r.stderr and "runpy" not in r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_process_and_thread_limits(run, mode):
    r = run("import os\nos.system('echo spawned')\nprint(os.fork())\n", mode)
    assert "spawned" not in r.stdout and "BlockingIOError" in r.stderr  # max_procs=1
    r = run("import threading\nthreading.Thread(target=print).start()\n", mode)
    assert r.error == "exit status 1" and "can't start new thread" in r.stderr
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run(bomb, mode, S.SandboxLimits(cpu_s=1, wall_s=3.0, max_procs=8))
    assert r.error is not None


@pytest.mark.parametrize("mode", MODES)
def test_cpu_wall_memory_output_and_file_limits(run, mode):
    r = run("while True:\n    pass\n", mode)
    assert r.error in ("cpu time limit exceeded (1 s)", "wall-clock limit exceeded (10 s)")
    r = run("import time\ntime.sleep(60)\n", mode, S.SandboxLimits(wall_s=1.0))
    assert r.timed_out and r.error == "wall-clock limit exceeded (1 s)"
    r = run("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", mode)
    assert r.error is not None and "MemoryError" in r.stderr
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", mode)
    assert r.output_truncated and r.error == "output limit exceeded (4096 bytes)"
    assert r.stdout == "x" * 4096
    r = run("open('big', 'wb').write(b'x' * (2 << 20))\n", mode)
    assert r.error == "exit status 1" and "File too large" in r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_disk_cap(run, mode):
    code = "n = 0\nwhile True:\n    open('f%d' % n, 'wb').write(b'x' * 500000)\n    n += 1\n"
    r = run(code, mode, S.SandboxLimits(disk_bytes=4 << 20))
    if mode == S.BWRAP:  # the tmpfs is full
        assert r.error == "exit status 1" and "No space left on device" in r.stderr
    else:  # the host measured the directory and killed the run
        assert r.error == "disk limit exceeded (4194304 bytes)"


@pytest.mark.parametrize("mode", MODES)
def test_file_count_cap(run, mode):
    """Empty files take no bytes but host memory: their number is capped too (bwrap: the
    supervisor counts the tmpfs inodes; weak mode: the host counts the entries)."""
    code = "import os\nfor i in range(100000):\n    open('f%d' % i, 'w').close()\n"
    if mode == S.BWRAP:
        code += "for i in range(100000):\n    open('/tmp/f%d' % i, 'w').close()\n"
    limits = S.SandboxLimits(max_files=300, wall_s=20.0)
    r = run(code, mode, limits)
    assert r.error == "file count limit exceeded (300 files)", (r.error, r.stderr[-300:])
    r = run(code.replace("100000", "100"), mode, limits)  # below the cap: no effect
    assert r.ok, (r.error, r.stderr[-300:])


def test_tree_usage_stops_at_the_cap_passed_first(tmp_path):
    """Many empty files, measured late (a loaded box polls seldom), still read as the file
    count cap: counting stops at the first cap passed, before their blocks add up to the
    byte cap (the weak mode reported the disk cap in a CI run)."""
    (tmp_path / "d").mkdir()
    for i in range(3000):
        (tmp_path / "d" / f"f{i}").touch()
    byte_cap, file_cap = 8 << 20, 300
    used, files = sandbox_host.tree_usage(str(tmp_path), byte_cap, file_cap)
    assert files == file_cap + 1 and used <= byte_cap
    (tmp_path / "big").write_bytes(b"x" * (1 << 20))  # bytes pass first here
    used, files = sandbox_host.tree_usage(str(tmp_path), 1 << 19, 10**6)
    assert used > 1 << 19 and files <= 3002


@pytest.mark.parametrize("mode", MODES)
def test_own_sigkill_is_not_reported_as_the_cpu_limit(run, mode):
    r = run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", mode)
    assert r.signal == signal.SIGKILL and r.error == "killed by signal 9"


@pytest.mark.parametrize("mode", MODES)
def test_environment_is_scrubbed_and_output_decoded(run, mode, monkeypatch):
    monkeypatch.setenv("SAO_SECRET_TOKEN", "hunter2-do-not-leak")
    r = run("import os\nprint(sorted(os.environ.items()))\n", mode)
    assert r.ok and "hunter2" not in r.stdout
    assert all(f"'{k}'" in r.stdout for k in ("HOME", "LANG", "PATH", "TMPDIR"))
    r = run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\x00 end')\n", mode)
    assert r.ok and r.stdout.startswith("ok ") and r.stdout.endswith(" end")
    assert "\ufffd" in r.stdout


def test_bwrap_root_is_minimal_and_read_only(run):
    code = (
        "import os, sys\n"
        "print(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/dev')))\n"
        "for p in ('/x', os.path.join(os.path.dirname(os.__file__), 'x.py'), '/dev/x'):\n"
        "    try:\n        open(p, 'w')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
        "open('/tmp/t', 'w').write('tmp ok')\nprint(open('/tmp/t').read(), os.getcwd())\n"
    )
    r = run(code, S.BWRAP)
    assert r.ok, r.stderr
    top, dev, *rest = r.stdout.splitlines()
    assert set(eval(top)) <= {"dev", "lib", "lib64", "sandbox", "tmp", "usr", "root", "home"}
    for hidden in ("etc", "proc", "sys", "work", "run", "var", "opt"):
        assert hidden not in eval(top), hidden
    assert set(eval(dev)) <= {"null", "zero", "full", "random", "urandom"}
    assert not any(line.startswith("WROTE") for line in rest)
    assert rest[-1] == "tmp ok /sandbox"


def test_tripwire_hook_still_reports(run):
    r = run("import socket\nsocket.socket()\n", S.RLIMITS, audit_hook=True)
    assert r.error == "exit status 1" and "socket.__new__ is not allowed" in r.stderr


def test_concurrent_runs_are_independent(scratch, best_mode):
    def one(i):
        code = f"open('mine', 'w').write('{i}')\nimport os\n"
        code += "print(open('mine').read(), len(os.listdir('.')))"
        return S.run_python(
            code, FAST, isolation=best_mode, allow_weak=True, audit_hook=False,
            scratch_dir=scratch,
        )  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(12)))
    assert [r.stdout for r in results] == [f"{i} 2\n" for i in range(12)]
    assert os.listdir(scratch) == []


def test_remove_tree_any_depth_never_follows_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    root = tmp_path / "private"
    d = root
    for _ in range(1500):  # deeper than PATH_MAX and Python's recursion limit
        d = d / "d"
        os.mkdir(d) if d.parent.exists() else os.makedirs(d)
    os.symlink(outside, root / "link")
    os.symlink(outside / "keep.txt", root / "file_link")
    (root / "locked").mkdir()
    (root / "locked" / "f").write_text("x")
    os.chmod(root / "locked", 0)
    assert sandbox_host.remove_tree(str(root))
    assert not root.exists() and (outside / "keep.txt").read_text() == "keep"


def test_remove_tree_with_a_symlink_at_its_own_path(tmp_path):
    """The code renamed its directory away and planted a symlink in its place: the
    cleanup removes the link, never chmods or enters its target, and does not raise."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "key").write_text("secret")
    os.chmod(victim / "key", 0o600)
    os.chmod(victim, 0o750)
    private = tmp_path / "private"
    os.symlink(victim, private)
    assert sandbox_host.remove_tree(str(private))
    assert not private.is_symlink() and (victim / "key").read_text() == "secret"
    assert (victim.stat().st_mode & 0o777, (victim / "key").stat().st_mode & 0o777) == (
        0o750,
        0o600,
    )
    os.symlink(victim / "key", private)  # a link to a file
    assert sandbox_host.remove_tree(str(private)) and (victim / "key").exists()
    assert sandbox_host.remove_tree(str(tmp_path / "never_made"))


@pytest.mark.parametrize("mode", MODES)
def test_code_cannot_replace_its_private_dir(run, mode, tmp_path):
    """Renaming the private directory away and planting a symlink to a host file at its
    path: refused (the weak mode's directory sits in a host-owned 0711 directory; bwrap's
    is a mount point), the host file keeps its mode, run_python returns normally."""
    target = tmp_path / "host_file"
    target.write_text("host")
    os.chmod(target, 0o600)
    code = (
        "import os\nhere = os.getcwd()\n"
        "for what, fn in (('rename', lambda: os.rename(here, here + '.x')),\n"
        f"                 ('symlink', lambda: os.symlink({str(target)!r}, here))):\n"
        "    try:\n        fn()\n        print(what, 'DONE')\n"
        "    except OSError as e:\n        print(what, 'refused', e.errno)\n"
    )
    r = run(code, mode)
    assert "DONE" not in r.stdout, r.stdout
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_text() == "host"


def test_weak_mode_supervisor_is_not_reachable_through_proc(run):
    """The weak mode's supervisor is non-dumpable: its worker (same uid) cannot open its
    /proc/<pid>/mem (patching it would let code outlive the run or forge a result), its
    environ or its descriptors (the status pipe)."""
    code = (
        "import os\nppid = os.getppid()\n"
        "for path, flags in (('mem', os.O_RDWR), ('mem', os.O_RDONLY), ('environ', 0)):\n"
        "    try:\n        os.open('/proc/%d/%s' % (ppid, path), flags)\n"
        "        print('OPENED', path)\n"
        "    except OSError as e:\n        print('refused', path, e.errno)\n"
        "try:\n    print('OPENED fds', os.listdir('/proc/%d/fd' % ppid))\n"
        "except OSError as e:\n    print('refused fd', e.errno)\n"
    )
    r = run(code, S.RLIMITS)
    assert r.ok and "OPENED" not in r.stdout and r.stdout.count("refused") == 4, r.stdout


# --- the seccomp program ----------------------------------------------------------------


def _arch():
    return F.ARCHES[platform.machine()][0]


@pytest.mark.skipif(platform.machine() not in F.ARCHES, reason="no syscall table here")
def test_seccomp_program_rules_on_the_reference_interpreter():
    table = F.ARCHES[platform.machine()][1]
    prog = F.instructions()
    eperm = F.RET_ERRNO | 1
    for name in F.DENIED:
        if name in table:
            assert F.run_filter(prog, table[name]) == eperm, name
    assert F.run_filter(prog, table["clone3"]) == F.RET_ERRNO | 38  # ENOSYS: use clone
    assert F.run_filter(prog, table["clone"], (0x11 | 0x01000000,)) == F.RET_ALLOW  # fork
    assert F.run_filter(prog, table["clone"], (0x10000000,)) == eperm  # CLONE_NEWUSER
    assert F.run_filter(prog, 0) == F.RET_ALLOW  # read
    assert F.run_filter(prog, table["kill"], (1234, 9)) == F.RET_ALLOW  # pid namespace
    assert F.run_filter(prog, 0, arch=0x40000003) == F.RET_KILL_PROCESS  # i386
    assert F.run_filter(prog, table["socket"], (2, 1, 0)) == F.RET_ALLOW
    weak = F.instructions(deny_network=True)
    assert F.run_filter(weak, table["socket"], (1, 1, 0)) == eperm  # AF_UNIX too
    own = F.patch_pid(F.instructions(own_pid=F.PID_PLACEHOLDER), 4321)
    assert F.run_filter(own, table["kill"], (4321, 9)) == F.RET_ALLOW
    assert F.run_filter(own, table["kill"], (0, 9)) == F.RET_ALLOW  # own process group
    assert F.run_filter(own, table["tgkill"], (4321, 4321, 9)) == F.RET_ALLOW
    for target in (1, 4320, -1, -4321):
        assert F.run_filter(own, table["kill"], (target, 9)) == eperm, target
    assert F.run_filter(own, table["tgkill"], (0, 0, 9)) == eperm
    assert len(F.encode(prog)) == 8 * len(prog)


@pytest.mark.parametrize(
    "header, table",
    [
        ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", F._X86_64),
        ("/usr/include/asm-generic/unistd.h", F._GENERIC),
    ],
)
def test_syscall_numbers_match_the_kernel_headers(header, table):
    path = pathlib.Path(header)
    if not path.exists():
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    text = path.read_text()
    for name, nr in table.items():
        if name in ("iopl", "ioperm") and "generic" in header:
            continue
        import re

        m = re.search(rf"#define __NR(?:3264)?_{name}\s+(\d+)", text)
        assert m and int(m.group(1)) == nr, name


def test_seccomp_unknown_architecture_is_named():
    with pytest.raises(F.SeccompUnsupported, match="s390x"):
        F.instructions("s390x")


# --- choosing the isolation -------------------------------------------------------------


def test_auto_refuses_weak_mode_unless_allowed(monkeypatch, caplog):
    weak = S.SandboxSetup("/usr/bin/python3", None, S.RLIMITS, None, (), "bwrap is not installed")
    monkeypatch.setattr(S, "probe_setup", lambda: weak)
    monkeypatch.setattr(S, "_announced", set())
    with pytest.raises(S.SandboxUnavailable) as e:
        S.resolve_isolation("auto")
    assert "\n" not in str(e.value) and "bwrap is not installed" in str(e.value)
    assert "allow_weak_isolation=True" in str(e.value)
    with pytest.raises(S.SandboxUnavailable):
        S.run_python("print(1)", isolation="bwrap")
    with pytest.raises(S.SandboxUnavailable, match="isolation='rlimits' is the weak mode"):
        S.resolve_isolation("rlimits")  # asked for, but not allowed
    with caplog.at_level(logging.WARNING, logger="sao_jax.envs.sandbox.runner"):
        assert S.resolve_isolation("auto", allow_weak=True) == S.RLIMITS
        assert S.resolve_isolation("auto", allow_weak=True) == S.RLIMITS
    lines = [r.getMessage() for r in caplog.records if "WEAK" in r.getMessage()]
    assert len(lines) == 1 and "bwrap is not installed" in lines[0]


def test_argument_checks():
    with pytest.raises(ValueError, match="cpu_s"):
        S.SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="wall_s"):
        S.SandboxLimits(wall_s=-1.0)
    with pytest.raises(ValueError, match="isolation"):
        S.run_python("print(1)", isolation="docker")
    with pytest.raises(TypeError, match="code must be a str"):
        S.run_python(b"print(1)")


# --- the python_tool env on top of the sandbox -------------------------------------------

from sao_jax.envs import python_tool as PT  # noqa: E402
from sao_jax.envs.arithmetic import make_prompt, parse_tree  # noqa: E402


@pytest.fixture
def tool(best_mode):
    return dict(limits=FAST, isolation=best_mode, allow_weak_isolation=True)


def _tool_prompt(expr="(123*45)-67"):
    return make_prompt(parse_tree(expr))


def test_python_tool_correct_episode_and_demo(tool):
    env = PT.PythonToolEnv(**tool)
    assert env.stop_strings == ("```\n",)
    prompt = _tool_prompt()
    assert env.reset(prompt) == "q:(123*45)-67\n"
    r = env.step("let me compute\n```python\nx = (123*45)-67\nprint(x)\n```\n")
    assert (r.observation, r.reward, r.done) == ("```output\n5468\n```\n", 0.0, False)
    assert r.info["sandbox"] == {"error": None, "isolation": tool["isolation"]}
    r = env.step("a:5468\n")
    assert r.done and r.reward == 1.0 and r.info["success"] is True and r.info["code_runs"] == 1
    segments = PT.demonstration(prompt, **tool)
    assert [m for _, m in segments] == [False, True, False, True]
    assert segments[-1] == ("a:5468\n", True)


def test_python_tool_errors_are_observations(tool):
    env = PT.PythonToolEnv(max_turns=8, **tool)
    env.reset(_tool_prompt())
    r = env.step("```python\n1/0\n```\n")
    assert r.observation.startswith("```output\n") and r.observation.endswith("```\n")
    assert "ZeroDivisionError" in r.observation and not r.done
    r = env.step("```python\nimport socket\nsocket.socket()\n```\n")
    assert "not allowed" in r.observation
    r = env.step("```python\nprint('x' * 100000)\n```\n")
    assert "error: output limit exceeded" in r.observation and len(r.observation) < 700
    r = env.step("```python\nprint(1)")  # unterminated block, ended by EOS
    assert r.observation == "\ne:bad\n" and r.info["error"] == "code block not closed"
    r = env.step("just chatting\n")
    assert r.observation == "e:bad\n"
    r = env.step("a:1\n")
    assert r.done and r.reward == 0.0 and r.info["success"] is False


def test_python_tool_truncates_at_max_turns_and_checks_isolation(tool):
    env = PT.PythonToolEnv(max_turns=2, **tool)
    env.reset(_tool_prompt())
    assert not env.step("hmm\n").done
    last = env.step("```python\nprint(2)\n```\n")
    assert last.done and last.reward == 0.0 and last.info["truncated"] is True
    with pytest.raises(ValueError, match="isolation"):
        PT.PythonToolEnv(isolation="namespaces")


# --- the run's start-up check (sao_jax/run/settings.py check_sandbox) -----------------------

_NO_BWRAP_RUN = """
import sys
from sao_jax.envs.sandbox import bwrap
bwrap.find_bwrap = lambda: None  # as on a machine without bubblewrap
from experiments.train import cli_main
sys.argv = ["sao-train", *sys.argv[1:]]
cli_main()
"""


def test_run_without_bwrap_refuses_at_start_up(tmp_path):
    """The python tool configured (which used to fail at its first call, mid-run), no
    bubblewrap, the weak mode not allowed: through the entry point, one line naming the
    field and what to install, exit 2, no workdir (the other fields: the next test)."""
    import json
    import subprocess
    import sys

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    workdir = tmp_path / "w"
    cmd = [
        sys.executable, "-c", _NO_BWRAP_RUN, "--config=configs/sao.py:smoke",
        "--config.env.name=answer", f"--config.data.train={data}", "--config.sft.steps=0",
        "--config.data.fields.prompt=question", f"--workdir={workdir}",
        "--config.env.params={'reward': 'math', 'tools': ('python',)}",
    ]  # fmt: skip
    repo = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.stdout, done.stderr)
    assert lines[0].startswith("error: config field env.params.tools: "), lines[0]
    for part in ("bwrap (bubblewrap) is not installed", "apt-get install bubblewrap",
                 "env.params.allow_weak_isolation=True"):  # fmt: skip
        assert part in lines[0], lines[0]
    assert not workdir.exists()


def test_start_up_check_names_the_field_or_says_the_weak_mode_is_on(monkeypatch, caplog):
    from configs import sao
    from sao_jax.run.settings import check_sandbox, sandbox_uses
    from sao_jax.schema import ConfigError

    weak = S.SandboxSetup("/usr/bin/python3", None, S.RLIMITS, None, (), "bwrap is missing")
    monkeypatch.setattr(S, "probe_setup", lambda: weak)
    monkeypatch.setattr(S, "_announced", set())
    c = sao.get_config("smoke")
    assert sandbox_uses(c) == []
    check_sandbox(c)  # arithmetic runs no model code: no sandbox needed
    c.env.name = "python_tool"
    with pytest.raises(ConfigError, match=r"^config field env.name: .*bwrap is missing"):
        check_sandbox(c)
    c.env.name = "answer"
    c.env.params = {"reward": "code_tests"}
    with pytest.raises(ConfigError, match=r"^config field env.params.reward: .*apt-get"):
        check_sandbox(c)
    c.env.params = {"reward": "code_tests", "reward_params": {"isolation": "rlimits"}}
    with pytest.raises(ConfigError, match=r"^config field env.params.reward: .*weak mode"):
        check_sandbox(c)
    c.env.params = {"reward": "code_tests", "tools": ["python"], "allow_weak_isolation": True}
    assert [u[0] for u in sandbox_uses(c)] == ["env.params.tools", "env.params.reward"]
    with caplog.at_level(logging.WARNING):
        check_sandbox(c)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "WEAK" in line and "allow_weak_isolation=True" in line and "bwrap is missing" in line
