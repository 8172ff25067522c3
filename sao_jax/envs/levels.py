"""Graded calculator task: levels of difficulty in one stream, checked tool calls, a turn budget.

The default task of the demo and the ablation tables. It extends the calculator task
(`arithmetic.py`) with what a learned critic needs to beat a moving-average baseline:

- **Levels in one prompt stream.** Each prompt shows its level (`q3:`); levels differ in
  operations and operand sizes, and the demonstrations the warm start imitates are more
  often imperfect at harder levels, so expected reward differs widely per prompt.
- **Visible mid-episode events.** The calculator is checked: a call that is not a step of
  the problem (a wrong operand, a wrong operator) gets `e:step` and no result, like a
  failing test in a coding environment. The turn is spent.
- **A turn budget.** An episode may take `n_ops + 1 + spare_turns` model turns (the calls,
  the answer, and `spare_turns` retries). Every error uses up a retry; past the budget the
  episode ends with reward 0, so each `e:` line lowers the expected outcome.

A level-3 episode (two operations, one retry spent):
```
q3:(12*7)+5\\n    prompt (context)                    not a model turn
c:12*7\\n         model: calculator call               action
r:84\\n           env: result                          observation
c:84+6\\n         model: a call that is no step        action
e:step\\n         env: checker error, turn spent       observation
c:84+5\\n
r:89\\n
a:89\\n           model: answer -> done, reward 1.0 (0.0 if wrong)
```
A call is a step of the problem when it matches a subtree of the problem: same operators,
and each operand either the problem's own number or the value of that subtree (so
`c:84+5` after `r:84` and `c:(12*7)+5` are both steps). Malformed turns get the
calculator env's codes (`e:bad`, `e:syntax`, ...). Reward 1.0 for a correct `a:` answer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from sao_jax.envs import arithmetic as A
from sao_jax.envs import calculator
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.episode import IntegerAnswerEpisode
from sao_jax.envs.registry import register_task


@dataclasses.dataclass(frozen=True)
class Level:
    """One difficulty level: its problems and how imperfect its demonstrations are.

    `weight` scales the demonstrations' error rate (sft.error_rate) at this level: a demo
    answers without calling the calculator (guess) with probability error_rate * weight,
    each call slips (copies an operand wrongly, then retries) with that probability, and
    the final answer has a typo with probability error_rate * weight * TYPO_SHARE.
    """

    n_ops: int
    operand_range: tuple[int, int]
    weight: float

    @property
    def params(self) -> A.ArithmeticParams:
        return A.make_params(self.n_ops, self.operand_range)


# Weights chosen (with sft.error_rate 0.8 in configs/sao.py) so that the level alone
# explains about half the variance of the outcome: replayed demonstrations succeed at
# 1.00 / 0.74 / 0.29 / 0.01 per level, and the per-level mean explains 52% of the
# variance of the return over action tokens (58% with the `e:` lines seen so far, 67%
# with whether the episode opened with a guess). The demo's warm start (1000 SFT steps)
# solves fewer, 0.87 / 0.35 / 0.02 / 0.01 sampled, and there the level alone explains 50%
# (experiments/testbed_probe.py, 512 held-out rollouts, seed 0).
LEVELS = {
    1: Level(1, (2, 20), 0.0),  # one call, small numbers: demonstrations always correct
    2: Level(1, (10, 99), 0.25),  # one call, two-digit numbers
    3: Level(2, (2, 20), 0.55),  # two calls, small numbers
    4: Level(2, (10, 99), 1.0),  # two calls, two-digit numbers: rarely solved
}
TYPO_SHARE = 0.2
QUESTION = "q"  # the prompt is `q<level>:<expr>\n`
STEP_ERROR = "step"  # the checker's error code: the call is not a step of the problem


def level_of(prompt: Prompt) -> int:
    """The prompt's level (meta, else the digit after 'q')."""
    level = prompt.meta.get("level")
    if level is None:
        head = prompt.text.split(":", 1)[0]
        level = int(head[len(QUESTION) :]) if head[len(QUESTION) :].isdigit() else 0
    return int(level)


def expr_of(prompt: Prompt) -> str:
    return prompt.meta.get("expr") or prompt.text.split(":", 1)[1].strip()


def make_prompt(level: int, tree: A.Tree) -> Prompt:
    """uid `levels:<level>:<expr>`, text `q<level>:<expr>\\n`, answer the exact value."""
    expr = A.render(tree)
    return Prompt(
        uid=f"levels:{level}:{expr}",
        text=f"{QUESTION}{level}:{expr}\n",
        answer=A.tree_value(tree),
        meta={"expr": expr, "n_ops": A.n_ops_of(tree), "level": level},
    )


def check_levels(levels: tuple[int, ...], weights: tuple[float, ...] | None) -> None:
    if not levels or any(lv not in LEVELS for lv in levels):
        raise ValueError(f"levels={levels}: a non-empty subset of {sorted(LEVELS)}")
    if weights is not None and (
        len(weights) != len(levels) or min(weights) < 0 or sum(weights) <= 0
    ):
        raise ValueError(f"levels weights={weights}: one weight >= 0 per level, sum > 0")


def sample_prompt(
    rng: np.random.Generator,
    levels: tuple[int, ...] = tuple(LEVELS),
    weights: tuple[float, ...] | None = None,
) -> Prompt:
    """A level (uniform, or by `weights`), then a problem of that level."""
    p = None if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    level = int(levels[int(rng.choice(len(levels), p=p))])
    spec = LEVELS[level]
    return make_prompt(level, A.sample_tree(rng, spec.n_ops, spec.params))


def _matches(call: A.Tree, node: A.Tree) -> bool:
    """`call` computes `node`: an int equal to the node's value, or the same operator
    over operands that match the node's children."""
    if isinstance(call, int):
        return call == A.tree_value(node)
    if isinstance(node, int) or call[0] != node[0]:
        return False
    return _matches(call[1], node[1]) and _matches(call[2], node[2])


def _subtrees(tree: A.Tree) -> list[A.Tree]:
    if isinstance(tree, int):
        return []
    return [tree, *_subtrees(tree[1]), *_subtrees(tree[2])]


def is_step(call: A.Tree, problem: A.Tree) -> bool:
    """Whether the call (with at least one operation) is a step of `problem`."""
    return not isinstance(call, int) and any(_matches(call, t) for t in _subtrees(problem))


class LevelsEnv(IntegerAnswerEpisode):
    """Checked calculator with a per-episode turn budget; reward 1.0 for a correct answer."""

    stop_strings = A.STOP_STRINGS
    task = "arithmetic_levels"

    def __init__(self, *, spare_turns: int = 1, max_turn_chars: int = 40) -> None:
        if spare_turns < 0:
            raise ValueError(f"arithmetic_levels spare_turns={spare_turns}: must be >= 0")
        if max_turn_chars < 4:
            raise ValueError(f"arithmetic_levels max_turn_chars={max_turn_chars}: must be >= 4")
        self.spare_turns = spare_turns
        self.max_turn_chars = max_turn_chars
        self.max_turns = 1  # set per episode by reset: n_ops + 1 + spare_turns
        self._problem: A.Tree | None = None
        self._errors = 0

    def reset(self, prompt: Prompt) -> str:
        self._check_prompt(prompt)  # before the problem is parsed
        self._problem = A.parse_tree(expr_of(prompt))
        self.max_turns = A.n_ops_of(self._problem) + 1 + self.spare_turns
        self._start(prompt)
        self._errors = 0
        return prompt.text

    def step(self, action_text: str) -> StepResult:
        self._next_turn()
        line, terminated, lead = A.split_turn(action_text)
        if len(line) > self.max_turn_chars or "\n" in line:
            return self._error("bad", f"turn is not one line of <= {self.max_turn_chars}", lead)
        if line.startswith(A.ANSWER):
            value = A.parse_answer(line[len(A.ANSWER) :])
            if value is None:
                return self._error("bad", f"answer {line!r} is not an integer", lead)
            return self._finish(value == self._target, answer=value)
        if not line.startswith(A.CALL):
            return self._error("bad", f"turn {line[:16]!r} starts with neither c: nor a:", lead)
        if not terminated:
            return self._error("bad", "calculator call not terminated by a newline", lead)
        expr = line[len(A.CALL) :]
        self._tools += 1
        if not A._EXPR_RE.fullmatch(expr):
            return self._error("syntax", f"call {expr[:16]!r} has characters outside 0-9+-*()")
        try:
            value = calculator.calculate(expr)
            call = A.parse_tree(expr)
        except calculator.CalcError as e:
            return self._error(e.code, str(e))
        except ValueError as e:  # '/', '%' or '//': not a step of an integer + - * problem
            return self._error(STEP_ERROR, str(e))
        if not is_step(call, self._problem):
            return self._error(STEP_ERROR, f"call {expr!r} is not a step of the problem")
        return self._continue(f"{A.RESULT}{value}\n")

    def _error(self, code: str, message: str, lead: str = "") -> StepResult:
        self._errors += 1
        return self._continue(f"{lead}{A.ERROR}{code}\n", {"error": message})

    def _final_info(self) -> dict[str, Any]:
        return {"tool_errors": self._errors}


# --------------------------------------------------------------------------- demonstrations


def _slip(call: tuple[str, int, int], rng: np.random.Generator) -> str:
    """The call with one operand copied wrongly (off by 1-9)."""
    op, a, b = call
    delta = int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
    a, b = (a + delta, b) if rng.random() < 0.5 else (a, b + delta)
    return A.render((op, a, b))


def _steps(tree: A.Tree) -> list[tuple[str, int, int]]:
    """Post-order (op, left value, right value) of every operation."""
    if isinstance(tree, int):
        return []
    return [
        *_steps(tree[1]),
        *_steps(tree[2]),
        (tree[0], A.tree_value(tree[1]), A.tree_value(tree[2])),
    ]


def demonstration_turns(prompt: Prompt, rng: np.random.Generator, *, rate: float) -> list[str]:
    """Model turns of one demonstration with imperfection probability `rate`.

    guess (prob rate): a wrong answer near the true one, no calls. Otherwise one call per
    operation, post-order; each call slips with prob rate (a wrong operand, which the
    checker rejects) and is then retried; the answer has a typo with prob rate *
    TYPO_SHARE. Turns past the budget are cut by the env (a failed demonstration).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"demonstration rate={rate}: must be in [0, 1]")
    tree = A.parse_tree(expr_of(prompt))
    if rng.random() < rate:
        return [f"{A.ANSWER}{A._wrong(A.tree_value(tree), rng)}\n"]
    turns = []
    for call in _steps(tree):
        while rng.random() < rate and len(turns) < 8:
            turns.append(f"{A.CALL}{_slip(call, rng)}\n")
        turns.append(f"{A.CALL}{A.render(call)}\n")
    final = A.tree_value(tree)
    final = A._wrong(final, rng) if rng.random() < rate * TYPO_SHARE else final
    return [*turns, f"{A.ANSWER}{final}\n"]


def demonstration(
    prompt: Prompt, rng: np.random.Generator, *, error_rate: float = 0.3, spare_turns: int = 1
) -> list[tuple[str, bool]]:
    """A full SFT trajectory as (text, is_model_turn) segments, replayed through LevelsEnv
    (so observations, checker errors and the turn budget are exactly the env's). The
    imperfection rate is error_rate * the level's weight."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"demonstration error_rate={error_rate}: must be in [0, 1]")
    rate = min(1.0, error_rate * LEVELS[level_of(prompt)].weight)
    turns = demonstration_turns(prompt, rng, rate=rate)
    env = LevelsEnv(spare_turns=spare_turns, max_turn_chars=calculator.MAX_CHARS + 8)
    segments = [(env.reset(prompt), False)]
    for turn in turns:
        result = env.step(turn)
        segments.append((turn, True))
        if result.done:
            break
        segments.append((result.observation, False))
    return segments


# ------------------------------------------------------------------------------ the task


def task_prompts(**params: Any):
    """`sample(rng)` of graded problems; params: levels (subset of LEVELS), weights."""
    unknown = set(params) - {"levels", "weights"}
    if unknown:
        raise ValueError(f"prompt_source: unknown arithmetic_levels parameters {sorted(unknown)}")
    lv = tuple(params.get("levels", tuple(LEVELS)))
    weights = params.get("weights")
    weights = None if weights is None else tuple(weights)
    check_levels(lv, weights)
    return functools.partial(sample_prompt, levels=lv, weights=weights)


def _demonstration(prompt, rng, *, error_rate: float = 0.0):
    return demonstration(prompt, rng, error_rate=error_rate)


register_task(
    "arithmetic_levels", env=LevelsEnv, prompts=task_prompts, demonstrations=_demonstration
)
