"""Calculator arithmetic: the embedded multi-turn tool-use task.

One line per turn, so the only stop string is "\\n". A 2-operation episode:
```
q:(12*7)+5\\n     prompt (context)              not a model turn
c:12*7\\n         model: calculator call        action
r:84\\n           env: result                   observation
c:84+5\\n         model: calculator call        action
r:89\\n           env: result                   observation
a:89\\n           model: final answer           action -> done, reward 1.0 (0.0 if wrong)
```
A malformed turn gets `e:<code>\\n` (code: bad, syntax, long, div0, big) and counts as a
turn. A call must end with "\\n"; an answer may also end at EOS. When a turn does not end
with "\\n" its observation starts with "\\n" so every line keeps its tag. After
`max_turns` model turns without an answer the episode ends with reward 0 and
`info["truncated"] = True`. The question is the ground truth; the calculator
(`calculator.py`) is the only tool.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import operator
import re
from typing import Any

import numpy as np

from sao_jax.envs import calculator
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.episode import IntegerAnswerEpisode
from sao_jax.envs.registry import register_task

QUESTION, CALL, RESULT, ANSWER, ERROR = "q:", "c:", "r:", "a:", "e:"
STOP_STRINGS = ("\n",)
_EXPR_RE = re.compile(r"[0-9+\-*/%() .]+")
_INT_RE = re.compile(r"-?[0-9]{1,18}")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_PREC = {"+": 1, "-": 1, "*": 2}
IMPERFECT_KINDS = ("guess", "copy", "typo")

# An expression tree: an int leaf or (op, left, right) with op in "+-*".
Tree = int | tuple[str, "Tree", "Tree"]


def split_turn(action_text: Any) -> tuple[str, bool, str]:
    """(the model turn without its final newline, whether it had one, the lead an
    observation needs to start on a line of its own: "" or "\n")."""
    text = action_text if isinstance(action_text, str) else repr(action_text)
    terminated = text.endswith("\n")
    return (text[:-1] if terminated else text), terminated, ("" if terminated else "\n")


@dataclasses.dataclass(frozen=True)
class ArithmeticParams:
    """Problem difficulty."""

    n_ops: tuple[int, int] = (2, 2)  # [min, max] binary operations per problem
    operand_range: tuple[int, int] = (2, 99)  # [low, high] integer operands
    ops: str = "+-*"  # operators drawn uniformly
    parens: str = "all"  # "all": every nested operation in parentheses; "minimal"

    def __post_init__(self) -> None:
        n_lo, n_hi = self.n_ops
        if not 1 <= n_lo <= n_hi <= 6:
            raise ValueError(f"arithmetic n_ops={self.n_ops}: need 1 <= min <= max <= 6")
        lo, hi = self.operand_range
        if not 0 <= lo <= hi <= 10**6:
            raise ValueError(f"arithmetic operand_range={self.operand_range}: need 0<=lo<=hi<=1e6")
        if not self.ops or set(self.ops) - set(_OPS):
            raise ValueError(f"arithmetic ops={self.ops!r}: a non-empty subset of '+-*'")
        if self.parens not in ("all", "minimal"):
            raise ValueError(f"arithmetic parens={self.parens!r}: 'all' or 'minimal'")


def make_params(
    n_ops: int | tuple[int, int] = (2, 2),
    operand_range: tuple[int, int] = (2, 99),
    ops: str = "+-*",
    parens: str = "all",
) -> ArithmeticParams:
    """ArithmeticParams from loose values (an int n_ops means exactly that many)."""
    n = (n_ops, n_ops) if isinstance(n_ops, int) else tuple(n_ops)
    return ArithmeticParams(n, tuple(operand_range), ops, parens)


def sample_tree(rng: np.random.Generator, n_ops: int, params: ArithmeticParams) -> Tree:
    """A random tree with `n_ops` operations: left size uniform in [0, n_ops - 1]."""
    if n_ops == 0:
        lo, hi = params.operand_range
        return int(rng.integers(lo, hi + 1))
    k = int(rng.integers(0, n_ops))
    op = params.ops[int(rng.integers(len(params.ops)))]
    return (op, sample_tree(rng, k, params), sample_tree(rng, n_ops - 1 - k, params))


def tree_value(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, a, b = tree
    return _OPS[op](tree_value(a), tree_value(b))


def n_ops_of(tree: Tree) -> int:
    return 0 if isinstance(tree, int) else 1 + n_ops_of(tree[1]) + n_ops_of(tree[2])


def _wrap(child: Tree, op: str, right: bool, parens: str) -> bool:
    if isinstance(child, int):
        return child < 0
    if parens == "all":
        return True
    p_child, p_op = _PREC[child[0]], _PREC[op]
    return p_child < p_op or (right and p_child == p_op and op == "-")


def render(tree: Tree, parens: str = "all") -> str:
    """Infix text; "all" parenthesises every nested operation: `(12*7)+5`."""
    if isinstance(tree, int):
        return str(tree)
    op, a, b = tree
    sa, sb = render(a, parens), render(b, parens)
    sa = f"({sa})" if _wrap(a, op, False, parens) else sa
    sb = f"({sb})" if _wrap(b, op, True, parens) else sb
    return f"{sa}{op}{sb}"


def _to_tree(node: ast.expr) -> Tree:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _to_tree(node.operand)
        if isinstance(inner, int):
            return -inner
    if isinstance(node, ast.BinOp) and calculator.OP_SYMBOLS.get(type(node.op)) in _OPS:
        return (calculator.OP_SYMBOLS[type(node.op)], _to_tree(node.left), _to_tree(node.right))
    raise ValueError(f"arithmetic: {type(node).__name__} is not an integer + - * expression")


def parse_tree(expr: str) -> Tree:
    """Inverse of `render` (any parenthesisation); ValueError on anything else."""
    try:
        return _to_tree(calculator.parse(expr))
    except calculator.CalcError as e:
        raise ValueError(f"arithmetic: cannot parse expression {expr!r}: {e}") from None


def make_prompt(tree: Tree, parens: str = "all") -> Prompt:
    """uid `arithmetic:<expr>`, text `q:<expr>\\n`, answer the exact integer value."""
    expr = render(tree, parens)
    return Prompt(
        uid=f"arithmetic:{expr}",
        text=f"{QUESTION}{expr}\n",
        answer=tree_value(tree),
        meta={"expr": expr, "n_ops": n_ops_of(tree)},
    )


def sample_prompt(rng: np.random.Generator, params: ArithmeticParams) -> Prompt:
    n = int(rng.integers(params.n_ops[0], params.n_ops[1] + 1))
    return make_prompt(sample_tree(rng, n, params), params.parens)


def parse_answer(line: str) -> int | None:
    """The integer after `a:` (surrounding spaces allowed), or None."""
    m = _INT_RE.fullmatch(line.strip())
    return int(m.group()) if m else None


class ArithmeticEnv(IntegerAnswerEpisode):
    """Calculator tool use; reward 1.0 for a correct `a:` answer, else 0.0."""

    stop_strings = STOP_STRINGS
    task = "arithmetic"

    def __init__(self, *, max_turns: int = 4, max_turn_chars: int = 40) -> None:
        if max_turns < 1:
            raise ValueError(f"arithmetic max_turns={max_turns}: must be >= 1")
        if max_turn_chars < 4:
            raise ValueError(f"arithmetic max_turn_chars={max_turn_chars}: must be >= 4")
        self.max_turns = max_turns
        self.max_turn_chars = max_turn_chars

    def reset(self, prompt: Prompt) -> str:
        self._start(prompt)
        return prompt.text

    def step(self, action_text: str) -> StepResult:
        self._next_turn()
        line, terminated, lead = split_turn(action_text)
        info: dict[str, Any] = {"turn": self._turn}
        if len(line) > self.max_turn_chars or "\n" in line:
            return self._error("bad", f"turn is not one line of <= {self.max_turn_chars}", lead)
        if line.startswith(ANSWER):
            value = parse_answer(line[len(ANSWER) :])
            if value is None:
                return self._error("bad", f"answer {line!r} is not an integer", lead)
            return self._finish(value == self._target, answer=value, info=info)
        if not line.startswith(CALL):
            return self._error("bad", f"turn {line[:16]!r} starts with neither c: nor a:", lead)
        if not terminated:
            return self._error("bad", "calculator call not terminated by a newline", lead)
        expr = line[len(CALL) :]
        self._tools += 1
        if not _EXPR_RE.fullmatch(expr):
            return self._error("syntax", f"call {expr[:16]!r} has characters outside 0-9+-*/%(). ")
        try:
            obs = f"{RESULT}{calculator.calculate(expr)}\n"
        except calculator.CalcError as e:
            return self._error(e.code, str(e))
        return self._continue(obs, info)

    def _error(self, code: str, message: str, lead: str = "") -> StepResult:
        return self._continue(f"{lead}{ERROR}{code}\n", {"error": message})


def _solution_calls(tree: Tree, corrupt_at: int, rng: np.random.Generator) -> tuple[list[str], int]:
    """Post-order calculator calls and the last result; call `corrupt_at` copies wrongly."""
    calls: list[str] = []

    def solve(t: Tree) -> int:
        if isinstance(t, int):
            return t
        a, b = solve(t[1]), solve(t[2])
        if len(calls) == corrupt_at:
            delta = int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
            a, b = (a + delta, b) if rng.random() < 0.5 else (a, b + delta)
        calls.append(f"{a}{t[0]}{b}")
        return _OPS[t[0]](a, b)

    return calls, solve(tree)


def _wrong(value: int, rng: np.random.Generator) -> int:
    scale = max(1, abs(value) // 10)
    return value + int(rng.integers(1, scale + 10)) * (1 if rng.random() < 0.5 else -1)


def demonstration_turns(
    prompt: Prompt, rng: np.random.Generator, *, kind: str = "correct"
) -> list[str]:
    """Model turns for `prompt`: kind "correct" or one of IMPERFECT_KINDS.

    correct: one call per operation (post-order), then the answer. guess: no calls, a
    wrong answer near the true one. copy: one call copies an operand wrongly and the rest
    follows from it. typo: correct calls, then a wrong final answer.
    """
    expr = prompt.meta.get("expr") or prompt.text.removeprefix(QUESTION).strip()
    tree = parse_tree(expr)
    if kind == "guess":
        return [f"{ANSWER}{_wrong(tree_value(tree), rng)}\n"]
    if kind not in ("correct", "copy", "typo"):
        raise ValueError(f"demonstration kind={kind!r}: 'correct' or one of {IMPERFECT_KINDS}")
    corrupt_at = int(rng.integers(0, max(1, n_ops_of(tree)))) if kind == "copy" else -1
    calls, final = _solution_calls(tree, corrupt_at, rng)
    final = _wrong(final, rng) if kind == "typo" else final
    return [f"{CALL}{c}\n" for c in calls] + [f"{ANSWER}{final}\n"]


def demonstration(
    prompt: Prompt, rng: np.random.Generator, *, error_rate: float = 0.0
) -> list[tuple[str, bool]]:
    """A full SFT trajectory as (text, is_model_turn) segments, replayed through the env.

    With probability `error_rate` the demo is imperfect (kind uniform over
    IMPERFECT_KINDS), so the SFT policy leaves headroom for RL. The first segment is the
    prompt (not a model turn); observations are exactly what `ArithmeticEnv` returns.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"demonstration error_rate={error_rate}: must be in [0, 1]")
    bad = rng.random() < error_rate
    kind = IMPERFECT_KINDS[int(rng.integers(len(IMPERFECT_KINDS)))] if bad else "correct"
    turns = demonstration_turns(prompt, rng, kind=kind)
    env = ArithmeticEnv(max_turns=len(turns), max_turn_chars=calculator.MAX_CHARS + 8)
    segments = [(env.reset(prompt), False)]
    for turn in turns:
        result = env.step(turn)
        segments.append((turn, True))
        if result.observation:
            segments.append((result.observation, False))
    return segments


# ------------------------------------------------------------------------------ the task


def task_prompts(_defaults: dict[str, Any] | None = None, **params: Any):
    """`sample(rng)` of arithmetic problems; params: n_ops, operand_range, ops, parens
    (`_defaults` under them: another task's difficulty, python_tool's)."""
    try:
        p = make_params(**{**(_defaults or {}), **params})
    except TypeError as e:
        raise ValueError(
            f"prompt_source: bad arithmetic parameters {sorted(params)}: {e}"
        ) from None
    return functools.partial(sample_prompt, params=p)


register_task("arithmetic", env=ArithmeticEnv, prompts=task_prompts, demonstrations=demonstration)
