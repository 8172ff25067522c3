r"""Code with hidden unit tests: the task where the observation is the signal.

The model writes one line of Python defining `f` from a spec, hidden unit tests run
against it, and their output is the observation. The spec's constant is stale with
probability `stale_rate` (the tests expect another one), which nothing before the test
output shows: the first failure message tells the model what to write next, and the
passing run prints the value the model must report. So the observation carries what the
policy needs to finish, and the expected outcome moves across it (up on `ok`, down on
`fail`): what docs/experiments.md's observation-signal experiment needs, against the
graded calculator task (sao_jax/envs/levels.py) whose results follow from the call.

```
s:x*7+27 at 5\n          prompt: the spec f(x) = x*7+27 (its constant may be stale), query 5
f=lambda x:x*7+27\n      model: one line of Python defining f                 action
fail:f(0)=27 want 29\n   env: the first failing test (tests: f(0), f(1), f(2))  observation
f=lambda x:x*7+29\n      model: the fix                                       action
ok:f(5)=64\n             env: every test passed, and f at the query           observation
a:64\n                   model: the answer -> done, reward 1.0 (0.0 if wrong)  action
```
A turn starting with `a:` answers; any other turn is code. Code that does not run gives
`error:<kind>\n` (`syntax`, `name`, `type`, ..., `no f` when it defines no `f`). Each
episode may take `2 + spare_turns` model turns (the code, the answer, and retries); past
the budget it ends with reward 0. A turn that is not one line of at most
`max_turn_chars` characters ending in a newline gets `error:bad`.

Two executors give the same observations on the lines they both run (tests check it on
a corpus): `executor="sandbox"` runs the line and the tests in the Python sandbox
(sao_jax/envs/sandbox/, docs/sandbox.md); `executor="inline"` (the default) evaluates
lines of the form `f=lambda x:<integer expression in x with + - * and parentheses>`
exactly, in process, without executing anything (the syntax check is `ast.parse`; other
valid Python gets `error:unsupported`, where the sandbox would run it). The sandbox costs
0.10-0.20 s a run on this project's 2-core machine (weak mode: bwrap is not installed
there): ~20 s of env time per 64-rollout RL step (the update takes ~1 s) and ~45 min per
seed's value pretraining, so the experiments run inline (docs/experiments.md,
"Observation signal").
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from typing import Any

import numpy as np

from sao_jax.envs import arithmetic as A
from sao_jax.envs import sandbox
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.episode import IntegerAnswerEpisode
from sao_jax.envs.registry import register_task
from sao_jax.text.tokenizer import CHAR_ALPHABET

SPEC, OK, FAIL, ERROR = "s:", "ok:", "fail:", "error:"
STOP_STRINGS = ("\n",)
TEST_POINTS = (0, 1, 2)  # the hidden tests: f(x) == a*x + b at each point, in order
EXECUTORS = ("inline", "sandbox")
# Demonstrations: the first line slips at error_rate, a retry after a failure at
# FIX_SLIP x error_rate (capped at 1: repairs are sloppier than copies, so a failing test
# lowers the expected outcome), the answer has a typo at TYPO_SHARE x error_rate.
FIX_SLIP = 2.0
TYPO_SHARE = 0.1
_SPEC_RE = re.compile(r"^x\*(\d+)\+(\d+) at (\d+)$")
_OUTPUT_CHARS = frozenset(CHAR_ALPHABET) - {"\n"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One problem: f(x) = mult*x + const_true; the prompt shows const_shown."""

    mult: int
    const_shown: int
    const_true: int
    query: int

    @property
    def answer(self) -> int:
        return self.mult * self.query + self.const_true

    def expected(self, x: int) -> int:
        return self.mult * x + self.const_true


def make_prompt(spec: Spec) -> Prompt:
    """Text `s:x*<mult>+<shown> at <query>\\n`; the uid also names the true constant
    (the same text with another truth is another problem)."""
    text = f"x*{spec.mult}+{spec.const_shown} at {spec.query}"
    return Prompt(
        uid=f"code_feedback:{text}:{spec.const_true}",
        text=f"{SPEC}{text}\n",
        answer=spec.answer,
        meta={"stale": spec.const_shown != spec.const_true, **dataclasses.asdict(spec)},
    )


def spec_of(prompt: Prompt) -> Spec:
    """The prompt's Spec (from meta; else parsed from the text, const_true = const_shown
    unless the answer says otherwise)."""
    m = prompt.meta
    if {"mult", "const_shown", "const_true", "query"} <= set(m):
        return Spec(int(m["mult"]), int(m["const_shown"]), int(m["const_true"]), int(m["query"]))
    match = _SPEC_RE.match(prompt.text.removeprefix(SPEC).strip())
    if match is None or type(prompt.answer) is not int:
        raise ValueError(f"code_feedback prompt {prompt.uid!r}: text is not 's:x*A+B at Q'")
    mult, shown, query = map(int, match.groups())
    return Spec(mult, shown, prompt.answer - mult * query, query)


def sample_spec(
    rng: np.random.Generator,
    *,
    stale_rate: float = 0.5,
    mult_range: tuple[int, int] = (2, 9),
    const_range: tuple[int, int] = (10, 99),
    query_range: tuple[int, int] = (2, 9),
) -> Spec:
    """mult, true constant and query uniform in their ranges; with prob `stale_rate` the
    shown constant is off by 1-9 (`_off_by`)."""
    mult = int(rng.integers(mult_range[0], mult_range[1] + 1))
    const = int(rng.integers(const_range[0], const_range[1] + 1))
    query = int(rng.integers(query_range[0], query_range[1] + 1))
    shown = const
    if rng.random() < stale_rate:
        shown = _off_by(const, rng)
    return Spec(mult, shown, const, query)


def _off_by(value: int, rng: np.random.Generator) -> int:
    """`value` moved by 1-9 either way, downwards only while the result stays >= 1."""
    delta = int(rng.integers(1, 10))
    return value - delta if value - delta >= 1 and rng.random() < 0.5 else value + delta


# --------------------------------------------------------------------------- the tests


def clean(text: str, max_chars: int) -> str:
    """Lower case, characters outside the tokenizer's alphabet as '?', cut to max_chars."""
    return "".join(c if c in _OUTPUT_CHARS else "?" for c in text.lower())[:max_chars]


def verdict(results: list[Any], spec: Spec) -> str:
    """The test output from f's values at TEST_POINTS then at the query (the first
    failing test, or `ok` with f at the query), without its newline."""
    for x, got in zip(TEST_POINTS, results, strict=False):
        if got != spec.expected(x):
            return f"{FAIL}f({x})={got!r} want {spec.expected(x)}"
    return f"{OK}f({spec.query})={results[len(TEST_POINTS)]!r}"


def error_kind(exc: BaseException) -> str:
    """`NameError` -> 'name', `ZeroDivisionError` -> 'zerodivision'."""
    return type(exc).__name__.lower().removesuffix("error") or "exception"


class _Unsupported(Exception):
    """Valid Python outside the inline subset."""


def _eval(node: ast.expr, x: int) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        if node.id != "x":
            raise NameError(node.id)
        return x
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand, x)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
        a, b = _eval(node.left, x), _eval(node.right, x)
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)]
    raise _Unsupported(type(node).__name__)


def _lambda_body(tree: ast.Module) -> ast.expr:
    """The body of `f=lambda x:<body>`, the only form inline runs."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
        raise _Unsupported("statement")
    stmt = tree.body[0]
    target, value = stmt.targets, stmt.value
    if len(target) != 1 or not isinstance(target[0], ast.Name) or target[0].id != "f":
        raise _Unsupported("target")
    args = value.args if isinstance(value, ast.Lambda) else None
    if args is None or [a.arg for a in args.args] != ["x"] or args.defaults or args.vararg:
        raise _Unsupported("lambda")
    if args.kwonlyargs or args.kwarg or args.posonlyargs:
        raise _Unsupported("lambda")
    return value.body


def run_inline(line: str, spec: Spec) -> str:
    """The test output of `line` (no newline), computed without executing it."""
    try:
        tree = ast.parse(line, mode="exec")
    except (SyntaxError, ValueError):  # ValueError: a null byte
        return f"{ERROR}syntax"
    except (RecursionError, MemoryError):
        return f"{ERROR}unsupported"
    try:
        body = _lambda_body(tree)
        results = [_eval(body, x) for x in (*TEST_POINTS, spec.query)]
    except _Unsupported:
        return f"{ERROR}unsupported"
    except NameError as e:
        return f"{ERROR}{error_kind(e)}"
    return verdict(results, spec)


# The program the sandbox runs: the model's line as a module, then the tests. Exceptions
# are reported by kind; the verdict comes from `verdict` (the same text as inline).
_HARNESS = """\
src = {line!r}
def kind(e):
    return type(e).__name__.lower().removesuffix("error") or "exception"
try:
    code = compile(src, "<line>", "exec")
except (SyntaxError, ValueError):
    print("error:syntax")
    raise SystemExit
ns = {{}}
try:
    exec(code, ns)
    f = ns.get("f")
    if f is None:
        print("error:no f")
        raise SystemExit
    out = None
    for x, want in {tests!r}:
        got = f(x)
        if got != want:
            out = "fail:f(%d)=%r want %d" % (x, got, want)
            break
    print(out or "ok:f(%d)=%r" % ({query}, f({query})))
except SystemExit:
    raise
except BaseException as e:
    print("error:" + kind(e))
"""


def run_sandboxed(line: str, spec: Spec, **sandbox_kwargs: Any) -> str:
    """The test output of `line` run in the sandbox (the first line of its stdout, or
    `error:<kind>` of a run that failed: `error:timeout`, ...)."""
    tests = [(x, spec.expected(x)) for x in TEST_POINTS]
    code = _HARNESS.format(line=line, tests=tests, query=spec.query)
    result = sandbox.run_python(code, **sandbox_kwargs)
    first = result.stdout.split("\n", 1)[0]
    if first:
        return first
    kind = "timeout" if result.timed_out else "crash"
    return f"{ERROR}{kind}"


# ---------------------------------------------------------------------------- the env


class CodeFeedbackEnv(IntegerAnswerEpisode):
    """One line of code per turn against hidden tests; reward 1.0 for a correct answer."""

    stop_strings = STOP_STRINGS
    task = "code_feedback"
    tool_count = "test_runs"

    def __init__(
        self,
        *,
        spare_turns: int = 1,
        max_turn_chars: int = 40,
        max_obs_chars: int = 40,
        executor: str = "inline",
        limits: sandbox.SandboxLimits | None = None,
        isolation: str = "auto",
        allow_weak_isolation: bool = False,
    ) -> None:
        if spare_turns < 0:
            raise ValueError(f"code_feedback spare_turns={spare_turns}: must be >= 0")
        if max_turn_chars < 8 or max_obs_chars < 16:
            raise ValueError("code_feedback max_turn_chars must be >= 8, max_obs_chars >= 16")
        if executor not in EXECUTORS:
            raise ValueError(f"code_feedback executor={executor!r}: one of {EXECUTORS}")
        if executor == "sandbox":  # probes once per process; refuses without isolation
            sandbox.resolve_isolation(isolation, allow_weak_isolation)
        self.max_turns = 2 + spare_turns
        self.max_turn_chars = max_turn_chars
        self.max_obs_chars = max_obs_chars
        self.executor = executor
        self._sandbox = dict(limits=limits, isolation=isolation, allow_weak=allow_weak_isolation)
        self._spec: Spec | None = None
        self._failures = 0

    def reset(self, prompt: Prompt) -> str:
        self._spec = spec_of(prompt)
        self._start(prompt)
        self._failures = 0
        return prompt.text

    def step(self, action_text: str) -> StepResult:
        self._next_turn()
        line, terminated, lead = A.split_turn(action_text)
        if len(line) > self.max_turn_chars or "\n" in line or not line:
            return self._observe(f"{lead}{ERROR}bad\n")
        if line.startswith(A.ANSWER):
            value = A.parse_answer(line[len(A.ANSWER) :])
            if value is None:
                return self._observe(f"{lead}{ERROR}bad\n")
            return self._finish(value == self._target, answer=value)
        if not terminated:
            return self._observe(f"{lead}{ERROR}bad\n")
        self._tools += 1
        if self.executor == "inline":
            out = run_inline(line, self._spec)
        else:
            out = run_sandboxed(line, self._spec, **self._sandbox)
        return self._observe(clean(out, self.max_obs_chars) + "\n")

    def _observe(self, observation: str) -> StepResult:
        if not observation.lstrip("\n").startswith(OK):
            self._failures += 1
        return self._continue(observation)

    def _final_info(self) -> dict[str, Any]:
        return {"failed_runs": self._failures}


# --------------------------------------------------------------------------- demonstrations


def code_line(mult: int, const: int) -> str:
    return f"f=lambda x:x*{mult}+{const}\n"


def _slip(mult: int, const: int, rng: np.random.Generator) -> str:
    """The line with one operand (either, at even odds) copied wrongly: `_off_by`."""
    if rng.random() < 0.5:
        return code_line(_off_by(mult, rng), const)
    return code_line(mult, _off_by(const, rng))


def demonstration(
    prompt: Prompt, rng: np.random.Generator, *, error_rate: float = 0.3, spare_turns: int = 1
) -> list[tuple[str, bool]]:
    """A full SFT trajectory as (text, is_model_turn) segments, replayed through the env
    (inline), so every observation is the env's. The first line copies the spec, slipping
    one operand with prob `error_rate`; after a failure the retry writes the prompt's
    multiplier and the constant the failure showed (the truth), slipping with prob
    FIX_SLIP * error_rate (capped at 1); after `ok` the answer copies the printed value,
    with a typo at TYPO_SHARE * error_rate."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"demonstration error_rate={error_rate}: must be in [0, 1]")
    spec = spec_of(prompt)
    env = CodeFeedbackEnv(spare_turns=spare_turns)
    segments = [(env.reset(prompt), False)]
    turn = code_line(spec.mult, spec.const_shown)
    if rng.random() < error_rate:
        turn = _slip(spec.mult, spec.const_shown, rng)
    while True:
        result = env.step(turn)
        segments.append((turn, True))
        if result.done:
            return segments
        segments.append((result.observation, False))
        if result.observation.startswith(OK):
            value = int(result.observation.split("=", 1)[1])
            value = A._wrong(value, rng) if rng.random() < error_rate * TYPO_SHARE else value
            turn = f"{A.ANSWER}{value}\n"
        else:
            turn = code_line(spec.mult, spec.const_true)
            if rng.random() < min(1.0, FIX_SLIP * error_rate):
                turn = _slip(spec.mult, spec.const_true, rng)


# ------------------------------------------------------------------------------ the task


def task_prompts(**params: Any):
    """`sample(rng)` of problems; params: stale_rate, mult_range, const_range, query_range."""
    unknown = set(params) - {"stale_rate", "mult_range", "const_range", "query_range"}
    if unknown:
        raise ValueError(f"prompt_source: unknown code_feedback parameters {sorted(unknown)}")
    rate = float(params.get("stale_rate", 0.5))
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"prompt_source: code_feedback stale_rate={rate}: must be in [0, 1]")
    ranges = {
        k: tuple(params[k]) for k in ("mult_range", "const_range", "query_range") if k in params
    }
    for name, (lo, hi) in ranges.items():
        if not 1 <= lo <= hi <= 999:
            raise ValueError(
                f"prompt_source: code_feedback {name}={(lo, hi)}: 1 <= lo <= hi <= 999"
            )
    sample = functools.partial(sample_spec, stale_rate=rate, **ranges)
    return lambda rng: make_prompt(sample(rng))


def _demonstration(prompt, rng, *, error_rate: float = 0.0):
    return demonstration(prompt, rng, error_rate=error_rate)


register_task(
    "code_feedback", env=CodeFeedbackEnv, prompts=task_prompts, demonstrations=_demonstration
)
