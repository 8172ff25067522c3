r"""Built-in rewards: math answer equivalence, exact match, code tests in the sandbox.

Each registers itself here by name (sao_jax/envs/registry.py) and is built from
`env.params`:

  math        the completion's final answer (the last `\boxed{...}`, or the last match
              of `pattern`, a regex whose group 1 is the answer) is checked against the
              reference with math-verify (LaTeX through its latex2sympy backend, plain
              expressions through sympy): 1/2 == 0.5 == \frac{1}{2}, x+1 == 1+x.
  exact_match the same extraction, then string equality after stripping (and, by
              default, collapsing whitespace; `ignore_case` optional).
  code_tests  the last ```python block of the completion is imported as a module in the
              sandbox and the reference (test code: asserts, calls) runs against it from
              another process there (sao_jax/envs/sandbox/harness.py); 1.0 when every
              test statement passed (or, with `partial_credit`, the fraction that did).
              The verdict comes back with a per-run secret on a channel the solution does
              not hold, only once the tests ran to their end: exiting, crashing, lying
              objects or reading the tests score 0 (docs/sandbox.md, "Reward hacking").

math-verify's own timeouts use SIGALRM, which only works in the main thread; rewards
run in sampler threads, so they are off here and the engine's `sampling.env_timeout_s`
bounds a reward call instead (answers longer than `max_answer_chars` score 0 unparsed).
"""

from __future__ import annotations

import logging
import re

from sao_jax.envs import sandbox
from sao_jax.envs.base import Prompt
from sao_jax.envs.registry import Reward, register_reward

_BOXED = ("\\boxed{", "\\fbox{")
_CODE_RE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" per call


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced."""
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
        j += 1
    return None  # unbalanced: no answer


def extract_answer(text: str, pattern: str = "") -> str | None:
    """The final answer: group 1 (or the whole match) of the last `pattern` match, or the
    last \\boxed{} content when `pattern` is empty; None when there is none."""
    if not pattern:
        return last_boxed(text)
    matches = list(re.finditer(pattern, text, re.DOTALL))
    if not matches:
        return None
    m = matches[-1]
    return m.group(1) if m.groups() else m.group(0)


def _compile(pattern: str, where: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{where}: pattern {pattern!r} is not a regex: {e}") from None


def _reference(prompt: Prompt, kind: str) -> str:
    if prompt.answer is None:
        raise ValueError(f"{kind} reward: prompt {prompt.uid!r} has no reference answer")
    return str(prompt.answer)


@register_reward("math")
def math_reward(*, pattern: str = "", max_answer_chars: int = 512):
    """math-verify equivalence of the extracted answer and the reference."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    _compile(pattern, "math reward")
    config = [LatexExtractionConfig(), ExprExtractionConfig()]

    def parsed(text: str):
        body = text if text.lstrip().startswith("$") else f"${text}$"
        return parse(body, config, parsing_timeout=None)

    def score(completion: str, prompt: Prompt) -> Reward:
        gold = _reference(prompt, "math")
        answer = extract_answer(completion, pattern)
        if answer is None or len(answer) > max_answer_chars:
            why = "no final answer" if answer is None else "answer too long"
            return Reward(0.0, False, {"answer": None, "error": why})
        try:
            ok = bool(verify(parsed(gold), parsed(answer), timeout_seconds=None))
        except Exception as e:  # a sympy corner case: a wrong answer, never a crash
            return Reward(0.0, False, {"answer": answer, "error": f"verify: {e}"[:200]})
        return Reward(float(ok), ok, {"answer": answer})

    return score


@register_reward("exact_match")
def exact_match_reward(*, pattern: str = "", ignore_case: bool = False):
    """String equality of the extracted answer and the reference (whitespace collapsed)."""
    _compile(pattern, "exact_match reward")

    def norm(s: str) -> str:
        s = " ".join(s.split())
        return s.casefold() if ignore_case else s

    def score(completion: str, prompt: Prompt) -> Reward:
        gold = _reference(prompt, "exact_match")
        answer = extract_answer(completion, pattern)
        ok = answer is not None and norm(answer) == norm(gold)
        return Reward(float(ok), ok, {"answer": answer})

    return score


def last_code_block(text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```), or None."""
    blocks = _CODE_RE.findall(text)
    return blocks[-1] if blocks else None


@register_reward("code_tests", runs_code=True)
def code_tests_reward(
    *,
    limits: dict | None = None,
    isolation: str = "auto",
    allow_weak_isolation: bool = False,
    partial_credit: bool = False,
):
    """The reference tests against the completion's code, in the sandbox (run_tests).
    Refuses (SandboxUnavailable, one line) when the run would be in the weak mode and
    `allow_weak_isolation` is off."""
    sandbox_limits = sandbox.SandboxLimits(**(limits or {}))
    sandbox.resolve_isolation(isolation, allow_weak_isolation)

    def score(completion: str, prompt: Prompt) -> Reward:
        tests = _reference(prompt, "code_tests")
        code = last_code_block(completion)
        if code is None:
            return Reward(0.0, False, {"error": "no code block"})
        result = sandbox.run_tests(
            code, tests, sandbox_limits, isolation=isolation, allow_weak=allow_weak_isolation
        )
        info = {"error": result.error, "isolation": result.isolation}
        verdict = result.verdict
        if verdict is None:
            return Reward(0.0, False, info)
        info.update(tests_passed=verdict.passed, tests_total=verdict.total)
        ok = verdict.all_passed
        if not ok:  # the first failing test ("line N: AssertionError ..."), or no tests
            info["error"] = verdict.failures[0] if verdict.failures else "no test statements"
        value = verdict.passed / verdict.total if partial_credit and verdict.total else float(ok)
        return Reward(value, ok, info)

    return score
