"""Hostile programs in the sandbox: each ends with an error within its limits and leaves
the host process and file system untouched. Runs every isolation mode this machine has;
the `audit_hook=False` tests check the kernel layers alone."""

import glob
import os
import signal
import socket
import tempfile
import time

import pytest

from sao_jax.envs import sandbox as S

SETUP = S.probe_setup()
MODES = [S.RLIMITS] + ([S.NAMESPACES] if SETUP.isolation == S.NAMESPACES else [])
FAST = S.SandboxLimits(cpu_s=1, wall_s=3.0, memory_bytes=128 << 20, output_bytes=4096)
# RLIMIT_NPROC binds only a non-root uid (the child runs as nobody when we are root).
NPROC_BINDS = SETUP.uid is not None or os.geteuid() != 0
needs_ns = pytest.mark.skipif(S.NAMESPACES not in MODES, reason=f"no namespaces: {SETUP.note}")


def _leftovers():
    """Live processes started by the sandbox (their command line names the private dir)."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                if b"sao_sandbox_" in f.read():
                    found.append(path)
        except OSError:
            pass
    return found


def _private_dirs():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "sao_sandbox_*")))


@pytest.fixture
def run():
    before = _private_dirs()

    def go(code, mode, limits=FAST, **kw):
        t0 = time.monotonic()
        result = S.run_python(code, limits, isolation=mode, **kw)
        assert time.monotonic() - t0 < limits.wall_s + 5.0
        assert result.isolation == mode
        assert not _leftovers()
        return result

    yield go
    assert _private_dirs() == before  # every private directory removed


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
def test_fork_bomb(run, mode):
    r = run("import os\nwhile True:\n    os.fork()\n", mode)
    assert r.error == "exit status 1" and "os.fork is not allowed" in r.stderr


@pytest.mark.skipif(not NPROC_BINDS, reason="RLIMIT_NPROC does not bind root")
@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_kernel_layers(run, mode):
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = run(code, mode, S.SandboxLimits(cpu_s=1, wall_s=2.0, max_procs=8), audit_hook=False)
    assert r.error is not None


@pytest.mark.skipif(not NPROC_BINDS, reason="RLIMIT_NPROC does not bind root")
@pytest.mark.parametrize("mode", MODES)
def test_no_new_processes_by_default_kernel_layers(run, mode):
    code = "import os\nos.system('echo spawned')\nprint(os.fork())\n"
    r = run(code, mode, audit_hook=False)  # default max_procs=1: no fork, no threads
    assert "spawned" not in r.stdout and "BlockingIOError" in r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop(run, mode):
    r = run("while True:\n    pass\n", mode)
    assert r.error in ("cpu time limit exceeded (1 s)", "wall-clock limit exceeded (3 s)")
    r = run("import time\ntime.sleep(60)\n", mode, S.SandboxLimits(wall_s=1.0))
    assert r.timed_out and r.error == "wall-clock limit exceeded (1 s)"


@pytest.mark.parametrize("mode", MODES)
def test_memory_hog(run, mode):
    r = run("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", mode)
    assert r.error is not None and "MemoryError" in r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_gigabytes_of_output(run, mode):
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", mode)
    assert r.output_truncated and r.error == "output limit exceeded (4096 bytes)"
    assert r.stdout == "x" * 4096


@pytest.mark.parametrize("mode", MODES)
def test_big_file_hits_fsize(run, mode):
    r = run(
        "open('big', 'wb').write(b'x' * (2 << 20))\n", mode, S.SandboxLimits(file_bytes=1 << 20)
    )
    assert r.error == "exit status 1" and "File too large" in r.stderr


@pytest.mark.parametrize("mode", MODES)
def test_reading_outside_is_blocked(run, mode, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top-secret-contents")
    for path in (str(secret), "/etc/passwd", "/proc/1/environ", "../../../etc/hostname"):
        r = run(f"print(open({path!r}).read())", mode)
        assert r.error == "exit status 1" and "PermissionError" in r.stderr, path
        assert "top-secret" not in r.stdout and "root:" not in r.stdout
    r = run(f"import os\nprint(os.listdir({str(tmp_path)!r}))", mode)
    assert r.error is not None and "secret" not in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_writing_outside_is_blocked(run, mode, tmp_path):
    target = tmp_path / "escaped.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("unchanged")
    in_tmp = os.path.join(tempfile.gettempdir(), f"sao_escape_{os.getpid()}.txt")
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"open({in_tmp!r}, 'w').write('x')",
        f"import os\nos.remove({str(keep)!r})",
        f"import os\nos.rename('main.py', {str(target)!r})",
        f"import os\nos.symlink({str(keep)!r}, 'link')",
        "import os\nos.chdir('/')\nopen('x', 'w')",
    ):
        r = run(code, mode)
        assert r.error == "exit status 1" and "PermissionError" in r.stderr, code
    assert not target.exists() and not os.path.exists(in_tmp)
    assert keep.read_text() == "unchanged"


@pytest.fixture
def listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.3)
    yield srv
    srv.close()


def _connected(srv):
    try:
        conn, _ = srv.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def _connect_code(port):
    return (
        "import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        f"s.settimeout(1)\ns.connect(('127.0.0.1', {port}))\nprint('connected')\n"
    )


@pytest.mark.parametrize("mode", MODES)
def test_sockets_are_blocked(run, mode, listener):
    r = run(_connect_code(listener.getsockname()[1]), mode)
    assert r.error is not None and "connected" not in r.stdout
    assert not _connected(listener)


@needs_ns
def test_network_namespace_alone_stops_connections(run, listener):
    r = run(_connect_code(listener.getsockname()[1]), S.NAMESPACES, audit_hook=False)
    assert r.error is not None and "connected" not in r.stdout
    assert not _connected(listener)


@needs_ns
def test_mount_namespace_alone_hides_and_protects_files(run, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top-secret-contents")
    in_tmp = os.path.join(tempfile.gettempdir(), f"sao_escape_ns_{os.getpid()}.txt")
    r = run(f"print(open({str(secret)!r}).read())", S.NAMESPACES, audit_hook=False)
    assert r.error is not None and "top-secret" not in r.stdout
    r = run(f"open({in_tmp!r}, 'w').write('x')", S.NAMESPACES, audit_hook=False)
    assert not os.path.exists(in_tmp)  # landed in the sandbox's own /tmp, if anywhere


@pytest.mark.parametrize("mode", MODES)
def test_process_spawning_is_blocked(run, mode, tmp_path):
    marker = tmp_path / "ran.txt"
    for code in (
        f"import os\nos.system('touch {marker}')",
        f"import subprocess\nsubprocess.run(['touch', '{marker}'])",
        f"import os\nos.execv('/usr/bin/touch', ['touch', '{marker}'])",
        f"import os\nos.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})",
        "import ctypes\nctypes.CDLL(None)",
    ):
        r = run(code, mode)
        assert r.error == "exit status 1" and "not allowed" in r.stderr, code
    assert not marker.exists()


@pytest.mark.parametrize("mode", MODES)
def test_host_process_is_untouched(run, mode):
    code = f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n"
    r = run(code, mode)
    assert r.error == "exit status 1" and "os.kill is not allowed" in r.stderr
    r = run("import os, signal\nos.killpg(0, signal.SIGKILL)\n", mode)
    assert r.error == "exit status 1"
    assert os.getpgid(0) > 0  # still here


@pytest.mark.parametrize("mode", MODES)
def test_environment_is_scrubbed(run, mode, monkeypatch):
    monkeypatch.setenv("SAO_SECRET_TOKEN", "hunter2-do-not-leak")
    r = run("import os\nprint(sorted(os.environ.items()))\n", mode)
    assert r.ok and "hunter2" not in r.stdout
    keys = {"HOME", "LANG", "PATH", "TMPDIR"}
    assert all(f"'{k}'" in r.stdout for k in keys) and "SAO_SECRET" not in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_non_utf8_output(run, mode):
    r = run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\x00 end')\n", mode)
    assert r.ok and r.stdout.startswith("ok ") and r.stdout.endswith(" end")
    assert "\ufffd" in r.stdout


def test_run_python_argument_checks():
    with pytest.raises(ValueError, match="cpu_s"):
        S.SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="wall_s"):
        S.SandboxLimits(wall_s=-1.0)
    with pytest.raises(ValueError, match="isolation"):
        S.run_python("print(1)", isolation="docker")
    with pytest.raises(TypeError, match="code must be a str"):
        S.run_python(b"print(1)")
    assert SETUP.isolation in (S.NAMESPACES, S.RLIMITS)
    assert signal.SIGXCPU  # the platform has the signals the classifier names


# --- the python_tool env on top of the sandbox -------------------------------------------

from sao_jax.envs import python_tool as PT  # noqa: E402
from sao_jax.envs.arithmetic import make_prompt, parse_tree  # noqa: E402


def _tool_prompt(expr="(123*45)-67"):
    return make_prompt(parse_tree(expr))


def test_python_tool_correct_episode_and_demo():
    env = PT.PythonToolEnv(limits=FAST)
    assert env.stop_strings == ("```\n",)
    prompt = _tool_prompt()
    assert env.reset(prompt) == "q:(123*45)-67\n"
    r = env.step("let me compute\n```python\nx = (123*45)-67\nprint(x)\n```\n")
    assert (r.observation, r.reward, r.done) == ("```output\n5468\n```\n", 0.0, False)
    assert r.info["sandbox"]["error"] is None
    r = env.step("a:5468\n")
    assert r.done and r.reward == 1.0 and r.info["success"] is True and r.info["code_runs"] == 1
    segments = PT.demonstration(prompt, limits=FAST)
    assert [m for _, m in segments] == [False, True, False, True]
    assert segments[-1] == ("a:5468\n", True)


def test_python_tool_errors_are_observations():
    env = PT.PythonToolEnv(limits=FAST, max_turns=8)
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
    r = env.step("```python\nimport sys\nsys.stdout.buffer.write(b'\\xff\\xfe')\n```\n")
    assert "\ufffd" in r.observation
    r = env.step("a:1\n")
    assert r.done and r.reward == 0.0 and r.info["success"] is False


def test_python_tool_truncates_at_max_turns():
    env = PT.PythonToolEnv(limits=FAST, max_turns=2)
    env.reset(_tool_prompt())
    assert not env.step("hmm\n").done
    last = env.step("```python\nprint(2)\n```\n")
    assert last.done and last.reward == 0.0 and last.info["truncated"] is True
