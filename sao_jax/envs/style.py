"""Online style-shift writing: one judged text per prompt, and a target style that moves.

Single turn. The prompt names one or two topics; the model writes one short line:
```
w:moon tea\\n                                  prompt (context)
nya the moon and tea are fluffy and sweet~\\n  model turn (stop string "\\n" or EOS) -> done
```
Reward r = r_quality * r_style in {0, 1} (docs/method.md section 6). The target style is read
from a shared, thread-safe `StyleSchedule` when the turn is judged: "cute" until
`switch_steps[0]`, then "chuunibyou", then "classical" after `switch_steps[1]`. The
trainer calls `schedule.set_step(step)` (or `env.set_step`) once per update; every env
built on the same schedule sees the switch. The default `LexiconJudge` is offline and
deterministic; `llm_judge.LLMJudge` is the HTTP alternative. A judge failure drops the
trajectory (`info["dropped"] = True`) instead of failing the run.
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.llm_judge import JudgeError, judge_from_config
from sao_jax.envs.registry import register_task

STYLES = ("cute", "chuunibyou", "classical")
# Consecutive styles share words, as real styles share features: a line of the current
# style that happens to use >= 2 shared words is already the next style, so the next
# target is reachable from a policy trained on the current one (docs/experiments.md).
SHARED = {
    ("cute", "chuunibyou"): ("magic", "sparkle", "wish"),
    ("chuunibyou", "classical"): ("destiny", "eternal", "doom"),
}
_OWN = {
    "cute": ("nya", "uwu", "kawaii", "fluffy", "bunny", "kitty", "sweet", "hugs", "puppy"),
    "chuunibyou": ("darkness", "abyss", "sealed", "crimson", "flame", "cursed"),
    "classical": ("thee", "thou", "hath", "doth", "yonder", "alas", "verily", "nay", "hither"),
}
LEXICONS = {
    style: own + sum((words for pair, words in SHARED.items() if style in pair), ())
    for style, own in _OWN.items()
}  # 12 words each
TOPICS = (
    "moon", "rain", "tea", "cat", "river", "city", "winter", "garden", "train", "bread",
    "ocean", "lamp", "forest", "letter", "bell", "cloud", "snow", "apple", "road", "star",
    "book", "clock", "bird", "wind", "fire", "stone", "song", "door", "mirror", "bridge",
)  # fmt: skip
PROMPT_TAG = "w:"
STOP_STRINGS = ("\n",)
TEXT_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz .,!?'~")
_WORD_RE = re.compile(r"[a-z]+")
_TEMPLATES = (
    "{a} the {t} is {b} and {c}!",
    "oh {t}, so {a} and {b}, {c}.",
    "my {t} is {a}, {b} {c}~",
    "{a} {b}, the {t} {c}.",
)


class SharedStep:
    """The training step a run's envs judge at: `set_step` by the trainer after each
    update, `step` read by every env of the run (from sampler threads, hence the lock)."""

    def __init__(self) -> None:
        self._step = 0
        self._lock = threading.Lock()

    def set_step(self, step: int) -> None:
        with self._lock:
            self._step = int(step)

    @property
    def step(self) -> int:
        with self._lock:
            return self._step


class StyleSchedule(SharedStep):
    """Target style by training step; `set_step` is called by the trainer, read by envs."""

    def __init__(
        self, styles: Sequence[str] = STYLES, switch_steps: Sequence[int] = (150, 300)
    ) -> None:
        styles, switch_steps = tuple(styles), tuple(int(s) for s in switch_steps)
        if len(switch_steps) != len(styles) - 1:
            raise ValueError(
                f"StyleSchedule: {len(styles)} styles need {len(styles) - 1} switch_steps, "
                f"got {switch_steps}"
            )
        if any(b <= a for a, b in itertools.pairwise(switch_steps)) or (
            switch_steps and switch_steps[0] < 0
        ):
            raise ValueError(f"StyleSchedule switch_steps={switch_steps}: must be >= 0, increasing")
        super().__init__()
        self.styles, self.switch_steps = styles, switch_steps

    def style_at(self, step: int) -> str:
        return self.styles[bisect.bisect_right(self.switch_steps, step)]

    def current(self) -> tuple[int, str]:
        """(step, style) read together."""
        step = self.step
        return step, self.style_at(step)


class Judge(Protocol):
    def score(self, prompt: Prompt, text: str, style: str) -> tuple[float, float]:
        """(r_quality, r_style) in {0, 1}; raises JudgeError when it cannot decide."""
        ...


class LexiconJudge:
    """Deterministic, offline judge.

    quality = 1 iff: min_chars <= len <= max_chars, every character in TEXT_ALPHABET, at
      least `min_words` words, no word more than `max_repeat` times, and (when
      `require_topics`) every prompt topic appears as a word.
    style = 1 iff the text uses >= `min_markers` distinct words of the target lexicon and
      more of them than distinct off-style words (words of other lexicons, not the
      target's: a word two styles share counts for both).
    """

    def __init__(
        self,
        *,
        min_chars: int = 12,
        max_chars: int = 96,
        min_words: int = 3,
        max_repeat: int = 2,
        min_markers: int = 2,
        require_topics: bool = True,
        lexicons: dict[str, Sequence[str]] | None = None,
    ) -> None:
        if not 0 < min_chars <= max_chars or min_words < 1 or max_repeat < 1 or min_markers < 1:
            raise ValueError("LexiconJudge: need 0 < min_chars <= max_chars and counts >= 1")
        self.min_chars, self.max_chars = min_chars, max_chars
        self.min_words, self.max_repeat = min_words, max_repeat
        self.min_markers, self.require_topics = min_markers, require_topics
        self.lexicons = {k: frozenset(v) for k, v in (lexicons or LEXICONS).items()}
        self._all_markers = frozenset().union(*self.lexicons.values())

    def quality(self, prompt: Prompt, text: str) -> float:
        words = _WORD_RE.findall(text)
        counts = collections.Counter(words)
        ok = (
            self.min_chars <= len(text) <= self.max_chars
            and set(text) <= TEXT_ALPHABET
            and len(words) >= self.min_words
            and max(counts.values(), default=0) <= self.max_repeat
        )
        if ok and self.require_topics:
            ok = all(t in counts for t in prompt.meta.get("topics", ()))
        return 1.0 if ok else 0.0

    def style(self, text: str, style: str) -> float:
        if style not in self.lexicons:
            raise JudgeError(f"style {style!r} has no lexicon; known: {sorted(self.lexicons)}")
        words = set(_WORD_RE.findall(text))
        lex = self.lexicons[style]
        target = len(words & lex)
        off = len(words & (self._all_markers - lex))
        return 1.0 if target >= self.min_markers and target > off else 0.0

    def score(self, prompt: Prompt, text: str, style: str) -> tuple[float, float]:
        return self.quality(prompt, text), self.style(text, style)


def make_prompt(topics: Sequence[str]) -> Prompt:
    """uid `style:<topics sorted, joined by +>`, text `w:<topics>\\n`, no answer."""
    topics = tuple(sorted(topics))
    return Prompt(
        uid="style:" + "+".join(topics),
        text=f"{PROMPT_TAG}{' '.join(topics)}\n",
        meta={"topics": topics},
    )


def sample_prompt(rng: np.random.Generator, n_topics: tuple[int, int] = (1, 2)) -> Prompt:
    lo, hi = n_topics
    if not 1 <= lo <= hi <= len(TOPICS):
        raise ValueError(f"style n_topics={n_topics}: need 1 <= min <= max <= {len(TOPICS)}")
    n = int(rng.integers(lo, hi + 1))
    return make_prompt([TOPICS[i] for i in rng.choice(len(TOPICS), size=n, replace=False)])


def demonstration(
    prompt: Prompt,
    rng: np.random.Generator,
    *,
    style: str | None = None,
    lexicons: dict[str, Sequence[str]] | None = None,
) -> list[tuple[str, bool]]:
    """(text, is_model_turn) segments: the prompt, then one templated line in `style`
    (uniform over STYLES when None) with three distinct markers of its lexicon
    (`lexicons`, default LEXICONS)."""
    lexicons = LEXICONS if lexicons is None else lexicons
    style = STYLES[int(rng.integers(len(STYLES)))] if style is None else style
    if style not in lexicons:
        raise ValueError(f"demonstration style={style!r}: one of {sorted(lexicons)}")
    lex = lexicons[style]
    a, b, c = (lex[i] for i in rng.choice(len(lex), size=3, replace=False))
    topics = " and ".join(prompt.meta.get("topics", ())) or "day"
    template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
    return [(prompt.text, False), (template.format(a=a, b=b, c=c, t=topics) + "\n", True)]


class StyleEnv:
    """One turn; reward = r_quality * r_style of the schedule's current style."""

    stop_strings = STOP_STRINGS
    max_turns = 1

    def __init__(
        self,
        *,
        judge: Judge | None = None,
        schedule: StyleSchedule | None = None,
        max_turn_chars: int = 256,
    ) -> None:
        self.judge = LexiconJudge() if judge is None else judge
        self.schedule = StyleSchedule() if schedule is None else schedule
        self.max_turn_chars = max_turn_chars
        self._prompt: Prompt | None = None

    def set_step(self, step: int) -> None:
        """Forwards to the shared schedule (all envs on it switch together)."""
        self.schedule.set_step(step)

    def reset(self, prompt: Prompt) -> str:
        self._prompt = prompt
        return prompt.text

    def step(self, action_text: str) -> StepResult:
        if self._prompt is None:
            raise RuntimeError("style env: step() before reset() or after the episode ended")
        prompt, self._prompt = self._prompt, None
        step, style = self.schedule.current()
        info: dict[str, Any] = {"turn": 1, "style": style, "step": step, "truncated": False}
        scores = judge_turn(self.judge, prompt, action_text, style, self.max_turn_chars, info)
        if scores is None:
            return StepResult("", 0.0, True, info)
        reward = scores[0] * scores[1]
        info.update(success=reward == 1.0, r_quality=scores[0], r_style=scores[1])
        return StepResult("", reward, True, info)


def judge_turn(
    judge: Judge, prompt: Prompt, action_text: Any, style: str, max_turn_chars: int, info
) -> tuple[float, float] | None:
    """(r_quality, r_style) of one model line (its trailing newline dropped) under the
    target `style`: (0, 0) for a line over `max_turn_chars` (info['error'] says so);
    None when the judge failed, with the drop recorded in `info` (success False, dropped,
    error): a judge error never crashes the sampler."""
    text = action_text if isinstance(action_text, str) else repr(action_text)
    text = text.removesuffix("\n")
    if len(text) > max_turn_chars:
        info["error"] = "text too long"
        return 0.0, 0.0
    try:
        r_quality, r_style = judge.score(prompt, text, style)
    except Exception as e:  # JudgeError or a judge bug: drop, never crash the sampler
        info.update(success=False, dropped=True, error=f"{type(e).__name__}: {e}")
        return None
    return float(r_quality), float(r_style)


def make_judge(cfg: Any) -> Judge:
    """'lexicon' (the offline LexiconJudge) or a dict for the LLM judge client."""
    return LexiconJudge() if cfg == "lexicon" else judge_from_config(dict(cfg))


# ------------------------------------------------------------------------------ the task


def task_prompts(**params: Any):
    """`sample(rng)` of style prompts; params: n_topics (min, max topics per prompt)."""
    unknown = set(params) - {"n_topics"}
    if unknown:
        raise ValueError(f"prompt_source: unknown style parameters {sorted(unknown)}")
    n_topics = tuple(params.get("n_topics", (1, 2)))
    sample_prompt(np.random.default_rng(0), n_topics)  # validates n_topics
    return functools.partial(sample_prompt, n_topics=n_topics)


def task_setup(params: dict[str, Any]) -> tuple[dict[str, Any], Callable]:
    """One StyleSchedule shared by every env of the run (moved by the returned hook); a
    judge from params['judge']: 'lexicon' or a dict for the LLM judge client."""
    params = dict(params)
    schedule = StyleSchedule(params.pop("styles", STYLES), params.pop("switch_steps", (150, 300)))
    judge = make_judge(params.pop("judge", "lexicon"))
    return {**params, "schedule": schedule, "judge": judge}, schedule.set_step


def _demonstration(prompt, rng, *, error_rate: float = 0.0):
    del error_rate
    return demonstration(prompt, rng)


register_task(
    "style",
    env=StyleEnv,
    prompts=task_prompts,
    demonstrations=_demonstration,
    setup=task_setup,
)
