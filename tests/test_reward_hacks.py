"""The `code_tests` reward cannot be gamed: every known hack scores 0, honest code scores 1.

Hacks run through `sandbox.run_tests` with the audit hook OFF (the defence is the
process boundary, the pipes and the kernel layers, not the tripwire) in both sandbox
modes (a "bwrap" case skips at run time where this machine has no kernel isolation),
and once more through the reward itself (hook on, the best mode here). The defences and
the hacking classes are listed in docs/sandbox.md ("Reward hacking").
"""

import concurrent.futures
import json
import os
import secrets

import pytest

from sao_jax.envs import sandbox
from sao_jax.envs.base import Prompt
from sao_jax.envs.registry import make_reward
from sao_jax.envs.sandbox import harness as H

MODES = [sandbox.RLIMITS, sandbox.BWRAP]
LIMITS = sandbox.SandboxLimits(cpu_s=2, wall_s=8.0, max_procs=4)
# Random operands: the expected sums are in no file (a weak-mode run reads every
# world-readable one) and, as the root host, in no memory the sandbox's uid can read.
_PAIRS = [(secrets.randbelow(10**9) + 10**8, -secrets.randbelow(10**9) - 1) for _ in range(3)]
TESTS = "".join(f"assert add({a}, {b}) == {a + b}\n" for a, b in _PAIRS)
FIXED_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 20) == 30\n"
# Finds `add(x, y) == z` anywhere it can read and answers from that table (else 0): it
# scores only if the reference tests are readable somewhere the solution can reach.
_LOOKUP = r"""
import os, re, sys
TABLE = {}
def learn(text):
    if isinstance(text, bytes):
        text = text.decode('latin-1')
    for a, b, c in re.findall(r'add\((-?\d+), (-?\d+)\) == (-?\d+)', text):
        TABLE[(int(a), int(b))] = int(c)
def add(a, b):
    return TABLE.get((a, b), 12345)
"""
SCAVENGE = (
    _LOOKUP
    + r"""
import stat
def read(path, limit=1 << 22):  # regular files (memfds too) only: a pipe would block
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError):
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            learn(os.pread(fd, limit, 0))
    except OSError:
        pass
    finally:
        os.close(fd)
learn(open(__file__).read())
learn(' '.join(sys.argv))
learn(repr(dict(os.environ)))
for top in ('.', os.environ.get('HOME', '.'), '/sandbox'):
    for dirpath, _, files in os.walk(top):
        for f in files[:200]:
            read(os.path.join(dirpath, f))
try:
    for f in sorted(os.listdir('/tmp'))[:200]:
        read(os.path.join('/tmp', f), 1 << 16)
except OSError:
    pass
for fd in range(3, 256):
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            learn(os.pread(fd, 1 << 22, 0))
    except OSError:
        pass
pids = ['self', str(os.getppid())]
try:
    pids += [p for p in os.listdir('/proc') if p.isdigit()]
except OSError:
    pass
budget = [64 << 20]  # bytes of other processes' memory to read at most
for pid in pids[:400]:
    for name in ('cmdline', 'environ'):
        read('/proc/%s/%s' % (pid, name))
    try:
        for fd in os.listdir('/proc/%s/fd' % pid):
            read('/proc/%s/fd/%s' % (pid, fd), 1 << 16)
    except OSError:
        pass
    if pid not in ('self', str(os.getppid())) and budget[0] <= 0:
        continue
    try:
        maps = open('/proc/%s/maps' % pid).read().splitlines()
        mem = open('/proc/%s/mem' % pid, 'rb')
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
            size = min(hi - lo, 1 << 24)
            try:
                mem.seek(lo)
                learn(mem.read(size))
                budget[0] -= size
            except (OSError, OverflowError, ValueError):
                pass
    except OSError:
        pass
import gc
for obj in gc.get_objects():
    if isinstance(obj, dict):
        for v in list(obj.values()):
            if isinstance(v, (str, bytes)):
                learn(v)
print('scavenged', len(pids), 'processes')
"""
)
_FAKE = {"complete": True, "total": 3, "passed": 3, "results": "111", "failures": []}
FAKE_VERDICT = "verdict " + "0" * 32 + " " + json.dumps(_FAKE)
HACKS = {
    "exit0_at_import": "import os\ndef add(a, b):\n    return 0\nos._exit(0)\n",
    "exit0_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "systemexit_at_import": "def add(a, b):\n    return 0\nraise SystemExit(0)\n",
    "systemexit_in_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "atexit_exit0": (
        "import atexit, os\natexit.register(os._exit, 0)\ndef add(a, b):\n    return 0\n"
    ),
    "always_equal": (
        "class Yes:\n    def __eq__(self, other):\n        return True\n"
        "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Yes()\n"
    ),
    "int_subclass_always_equal": (
        "class I(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n"
    ),
    "str_repr_lies": (
        "class S(str):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = str.__hash__\ndef add(a, b):\n    return S('x')\n"
    ),
    "read_own_file": _LOOKUP + "learn(open(__file__).read())\n",
    "scavenge_everything": SCAVENGE,
    "monkeypatch_builtins": (
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "builtins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\n"
        "builtins.print = lambda *a, **k: None\ndef add(a, b):\n    return 0\n"
    ),
    "patch_assert_machinery": (
        "AssertionError = None\n__builtins__ = {}\nimport sys\n"
        "sys.modules['builtins'].AssertionError = None\ndef add(a, b):\n    return 0\n"
    ),
    "sys_modules_tricks": (
        "import sys, json, types\nfake = types.ModuleType('json')\n"
        'fake.dumps = lambda *a, **k: \'{"ok": {"i": "0x5"}}\'\nfake.loads = json.loads\n'
        "sys.modules['json'] = fake\njson.dumps = fake.dumps\ndef add(a, b):\n    return 0\n"
    ),
    "forge_replies_on_every_fd": (
        "import json, os\nmsg = json.dumps({'ok': {'i': hex(5)}}).encode()\n"
        "frame = len(msg).to_bytes(4, 'big') + msg\n"
        f"line = ({FAKE_VERDICT!r} + '\\n').encode()\n"
        "for fd in range(0, 256):\n    for data in (frame * 8, line):\n        try:\n"
        "            os.write(fd, data)\n        except OSError:\n            pass\n"
        "def add(a, b):\n    return 0\n"
    ),
    "print_fake_verdict": (
        f"import sys\nprint({FAKE_VERDICT!r})\nprint({FAKE_VERDICT!r}, file=sys.stderr)\n"
        "def add(a, b):\n    print('PASSED 3/3')\n    return 0\n"
    ),
    "kill_the_process_group": (
        "import os, signal\ndef add(a, b):\n    os.kill(0, signal.SIGKILL)\n"
    ),
    "kill_the_parent": (
        "import os, signal\nfor sig in (signal.SIGKILL, signal.SIGSTOP):\n    try:\n"
        "        os.kill(os.getppid(), sig)\n    except OSError:\n        pass\n"
        "def add(a, b):\n    return 0\n"
    ),
    "stop_everyone_and_ignore_signals": (
        "import os, signal\nfor s in range(1, 32):\n    try:\n"
        "        signal.signal(s, signal.SIG_IGN)\n    except (OSError, ValueError):\n"
        "        pass\ndef add(a, b):\n    os.kill(0, signal.SIGSTOP)\n    return 0\n"
    ),
    "thread_keeps_running": (
        "import os, threading, time\n"
        f"line = ({FAKE_VERDICT!r} + '\\n').encode()\n"
        "def spam():\n    while True:\n        for fd in range(256):\n            try:\n"
        "                os.write(fd, line)\n            except OSError:\n                pass\n"
        "        time.sleep(0.01)\nthreading.Thread(target=spam, daemon=True).start()\n"
        "def add(a, b):\n    return 0\n"
    ),
    "fork_survivor": (
        "import os, time\n"
        f"line = ({FAKE_VERDICT!r} + '\\n').encode()\n"
        "if os.fork() == 0:\n    for _ in range(30):\n        for fd in range(256):\n"
        "            try:\n                os.write(fd, line)\n            except OSError:\n"
        "                pass\n        time.sleep(0.02)\n    os._exit(0)\n"
        "def add(a, b):\n    return 0\n"
    ),
    "frames_of_the_caller": (
        _LOOKUP + "def add(a, b):\n    f = sys._getframe()\n    while f is not None:\n"
        "        learn(repr(f.f_locals))\n        learn(repr(f.f_globals))\n"
        "        f = f.f_back\n    return TABLE.get((a, b), 12345)\n"
    ),
    "hang_forever": "def add(a, b):\n    while True:\n        pass\n",
}
# Tests written so that one loose reading would let the paired hack through.
HACK_TESTS = {
    "bool_for_int": ("assert add(0, 1) == 1\n", "def add(a, b):\n    return True\n"),
    "float_for_int": ("assert add(2, 3) == 5\n", "def add(a, b):\n    return 5.0\n"),
    "shadow_a_builtin": (
        "assert abs(add(1, 2) - 3) < 1e-9\n",
        "def abs(x):\n    return 0\ndef add(a, b):\n    return 7\n",
    ),
    "truthy_object": (
        "assert is_even(2)\nassert is_even(4)\n",
        "class T:\n    def __bool__(self):\n        return True\ndef is_even(n):\n    return T()\n",
    ),
    "exit_hidden_by_a_broad_except": (
        "try:\n    r = add(1, 2)\nexcept BaseException:\n    r = 3\nassert r == 3\n",
        "import os\ndef add(a, b):\n    os._exit(0)\n",
    ),
    "membership_by_lying_eq": (
        "assert add(1, 2) in (3, 4)\n",
        "def add(a, b):\n    return True\n",
    ),
}
HONEST = {
    "plain": (TESTS, "def add(a, b):\n    return a + b\n"),
    "prints_and_main_block": (
        TESTS,
        "import math\nprint('loading')\ndef add(a, b):\n    return int(math.fsum([a, b]))\n"
        "if __name__ == '__main__':\n    print(add(input(), 1))\n",
    ),
    "class_instances": (
        "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.size() == 1\n"
        "assert len(s) == 1\nassert s.items == [1]\nassert s is not None\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n"
        "    def size(self):\n        return len(self.items)\n"
        "    def __len__(self):\n        return len(self.items)\n",
    ),
    "in_place_mutation": (
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]\n"
        "d = {}\nfill(d, 2)\nassert d == {0: 0, 1: 1}\n",
        "def sort_in_place(xs):\n    xs.sort()\ndef fill(d, n):\n"
        "    for i in range(n):\n        d[i] = i\n",
    ),
    "expected_exceptions": (
        "assert div(1, 2) == 0.5\ntry:\n    div(1, 0)\nexcept ValueError:\n    pass\n"
        "else:\n    raise AssertionError('no error')\n",
        "def div(a, b):\n    if b == 0:\n        raise ValueError('b is 0')\n    return a / b\n",
    ),
    "humaneval_check": (
        "def check(candidate):\n    assert candidate(1, 2) == 3\n"
        "    assert candidate(0, 0) == 0\n\ncheck(add)\n",
        "def add(a, b):\n    return a + b\n",
    ),
    "from_solution_import": (
        "from solution import add\nassert add(1, 2) == 3\n",
        "def add(a, b):\n    return a + b\n",
    ),
    "many_types": (
        "assert f(0) == (1, 'x', None, b'\\x00\\xff', 2**200, -2**70, [1.5, {'k': {3}}])\n"
        "assert f(1) == {1: 'a', (2, 3): frozenset({4})}\nassert f(2) == float('inf')\n"
        "assert f(3) == 1+2j\nassert f(4) == 'caf\\u00e9 \\U0001f600'\nassert f(5) is True\n"
        "assert list(gen(3)) == [0, 1, 2]\nassert LIMIT == 10\nassert add(a=1, b=2) == 3\n"
        "assert 'x' in f(0)\nassert 4 not in f(1)\n",
        "LIMIT = 10\ndef add(a, b):\n    return a + b\ndef gen(n):\n    yield from range(n)\n"
        "def f(i):\n    return [(1, 'x', None, b'\\x00\\xff', 2**200, -2**70, [1.5, {'k': {3}}]),\n"
        "            {1: 'a', (2, 3): frozenset({4})}, float('inf'), 1+2j,\n"
        "            'caf\\u00e9 \\U0001f600', True][i]\n",
    ),
}


def _run(code, tests, mode, limits=LIMITS):
    if mode == sandbox.BWRAP and sandbox.probe_setup().isolation != sandbox.BWRAP:
        pytest.skip(f"no kernel isolation here: {sandbox.probe_setup().note}")
    return sandbox.run_tests(code, tests, limits, isolation=mode, allow_weak=True, audit_hook=False)


def _scores_zero(r) -> bool:
    return r.verdict is None or not r.verdict.all_passed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(HACKS))
def test_hack_scores_zero(name, mode):
    limits = LIMITS
    if name in ("hang_forever", "stop_everyone_and_ignore_signals"):
        limits = sandbox.SandboxLimits(cpu_s=1, wall_s=1.5, max_procs=4)  # ends in a kill
    if name == "scavenge_everything":  # it must finish: it looked everywhere, found nothing
        limits = sandbox.SandboxLimits(cpu_s=20, wall_s=30.0, memory_bytes=1 << 30)
        if mode == sandbox.RLIMITS and os.geteuid() != 0:
            pytest.skip("the weak mode as the host's own uid reads the host's memory (a gap)")
    r = _run(HACKS[name], TESTS, mode, limits)
    assert _scores_zero(r), (r.verdict, r.error, r.stdout[-300:], r.stderr[-300:])
    if name in ("scavenge_everything", "read_own_file", "frames_of_the_caller"):
        assert r.verdict is not None and r.verdict.passed == 0, (r.error, r.stderr[-300:])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(HACK_TESTS))
def test_loose_readings_are_closed(name, mode):
    tests, code = HACK_TESTS[name]
    r = _run(code, tests, mode)
    assert r.verdict is not None and not r.verdict.all_passed, (r.verdict, r.error)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_solution_scores_one(name, mode):
    tests, code = HONEST[name]
    r = _run(code, tests, mode)
    assert r.verdict is not None and r.verdict.all_passed, (r.verdict, r.error, r.stderr[-500:])
    assert r.verdict.total == H.count_tests(tests)


def test_the_reward_scores_every_hack_zero_and_honest_code_one():
    """Through `code_tests` itself (audit hook on, this machine's best mode), 4 at once."""
    weak = sandbox.probe_setup().isolation != sandbox.BWRAP
    fn = make_reward("code_tests", limits=dict(cpu_s=2, wall_s=4.0), allow_weak_isolation=weak)
    cases = [(code, TESTS, 0.0) for code in HACKS.values()]
    cases += [(code, tests, 0.0) for tests, code in HACK_TESTS.values()]
    cases += [(code, tests, 1.0) for tests, code in HONEST.values()]

    def score(case):
        code, tests, _ = case
        return fn(f"Here it is:\n```python\n{code}```\n", Prompt("p", "q", answer=tests))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rewards = list(pool.map(score, cases))
    got = [(r.score, case[2]) for r, case in zip(rewards, cases, strict=True)]
    assert [g for g, _ in got] == [want for _, want in got], [
        (case[0][:60], r.info) for r, case in zip(rewards, cases, strict=True) if r.score != case[2]
    ]
    good = rewards[-len(HONEST)]
    assert good.success and good.info["tests_passed"] == good.info["tests_total"] == 3


def test_partial_credit_counts_passed_tests():
    weak = sandbox.probe_setup().isolation != sandbox.BWRAP
    fn = make_reward(
        "code_tests", limits=dict(wall_s=8.0), allow_weak_isolation=weak, partial_credit=True
    )
    code = "```python\ndef add(a, b):\n    return a + b if a < 5 else 0\n```\n"
    r = fn(code, Prompt("p", "q", answer=FIXED_TESTS))
    assert (r.score, r.success, r.info["tests_passed"]) == (pytest.approx(2 / 3), False, 2)
    assert r.info["error"].startswith("line 3: AssertionError")


def test_verdict_needs_the_secret_and_every_test():
    """The host's side of the channel: a verdict line counts only with this run's secret
    and with every test of the source reported."""
    from sao_jax.envs.sandbox import runner

    body = {"complete": True, "total": 3, "passed": 3, "results": "111", "failures": []}
    line = lambda secret, b=body: f"verdict {secret} {json.dumps(b)}\n".encode()
    assert runner._verdict(line("s3cret"), "s3cret", 3)[0].all_passed
    assert runner._verdict(line("guess"), "s3cret", 3) == (
        None,
        "no verdict: the verdict channel carried something else",
    )
    short = {**body, "total": 2, "passed": 2, "results": "11"}
    assert runner._verdict(line("s3cret", short), "s3cret", 3)[0] is None
    assert runner._verdict(b"", "s3cret", 3)[0] is None
    assert runner._verdict(line("s3cret", {**body, "complete": False}), "s3cret", 3)[0] is None


def test_strict_comparison_and_counting():
    eq = H.strict_equal
    assert eq([1, (2, "a")], [1, (2, "a")]) and eq({1: {2}}, {1: {2}})
    assert not eq(1, 1.0) and not eq(True, 1) and not eq([1], (1,)) and not eq({1: 0}, {True: 0})
    assert not eq({1}, {True}) and not eq(frozenset({(1, 2.0)}), frozenset({(1, 2)}))
    assert H.strict_compare(("in",), 2, [1, 2]) and not H.strict_compare(("in",), True, [1])
    assert H.strict_compare(("==", "!="), 1, 1, 2)
    src = '"""doc"""\nimport math\nx = 1\ndef f():\n    pass\nassert x == 1\nf()\n'
    src += "for i in []:\n    pass\n"
    assert H.count_tests(src) == 3
    with pytest.raises(SyntaxError):
        H.count_tests("assert (")


def test_tests_that_do_not_parse_give_no_verdict():
    r = sandbox.run_tests("def add(a, b):\n    return a + b\n", "assert add(1,", LIMITS,
                          isolation=sandbox.RLIMITS, allow_weak=True)  # fmt: skip
    assert r.verdict is None and r.error.startswith("the reference tests do not parse")


def test_many_tests_fit_the_verdict_channel():
    """Thousands of test statements: the verdict (one byte a test) stays under the
    channel's cap, and every one is counted."""
    tests = "".join(f"assert add({i}, 1) == {i + 1}\n" for i in range(5000))
    r = _run("def add(a, b):\n    return a + b\n", tests, sandbox.RLIMITS,
             sandbox.SandboxLimits(wall_s=60.0, cpu_s=30))  # fmt: skip
    assert r.verdict is not None and r.verdict.passed == r.verdict.total == 5000, r.error
