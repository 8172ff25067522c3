"""Per-user style shift: each user wants its own style and switches it at its own steps.

An online-learning task where a critic can beat a moving average, registered as
`user_style`: the default design of configs/online_shift.py (the global switch of
sao_jax/envs/style.py is its `global_style` variant). Single turn, as sao_jax/envs/style.py,
whose judge, lexicons and demonstrations it uses; the prompt names a user and one or two
topics:
```
u3: moon tea\\n                                  prompt (context)
verily the moon and tea hath doom~\\n           model turn (stop string "\\n" or EOS) -> done
```
What differs from the global switch of sao_jax/envs/style.py, and why:
- **The target is predictable from the state.** User u wants STYLES[(u + k) % 3] in its
  k-th phase and moves on at its own `switch_steps[u]`; users' switches are staggered, so
  at any step some users have just switched and the others have not. A critic that reads
  the user tag can track each user's current target; a global reward average cannot
  tell users apart.
- **A quality factor that varies by prompt and not with style.** A correct line pays
  `payouts[u]` (e.g. 1.0, 0.75, 0.5, 0.25), and every line of user u, judged or not,
  earns `offsets[u]` (default 0) besides: reward = offset + payout x r_quality x r_style,
  so the expected reward of a prompt differs per user whatever the style (an offset is
  variance that only a baseline which tells users apart removes, and says nothing about
  the line); `success` is r_quality x r_style = 1 (the line is right), which the tables
  score.
- **The current target as privileged input for a critic only.** Every verdict carries
  `info["critic_hint"] = (" ", HINTS[style], "all")`: the digit a ceiling row's critic
  reads in place of every space of the trajectory, the prompt's included (its tag is
  followed by one), so the target is near every token (`rl.privileged_critic`,
  sao_jax/sampling/trajectory.py privileged_tokens); the policy always reads " ".
- **What the tables would read.** `info["log"]` holds the line's success under three
  names by where the user stands when it is judged: `success_initial` (before the user's
  first switch), `success_recovering` (within `recovery_steps` steps after a switch) or
  `success_settled` (later), a recovering line also as `success_recovering_u<user>`,
  and every line after a switch under `success_since_switch_<k>`, the bin of `bin_steps`
  steps since the switch. The trainer logs them as `env/<name>` with their counts
  (sao_jax/run/accounting.py EnvLog); experiments/online_shift/report.py reads them.

The schedule is shared by every env of a run and moved by the trainer (`set_step`), as
the style task's is.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sao_jax.envs import style
from sao_jax.envs.base import Prompt, StepResult
from sao_jax.envs.registry import PRETRAIN_STEP, register_task

STYLES = style.STYLES
RECOVERY_STEPS = 20  # default: a user's first 20 steps after a switch are 'recovering'
BIN_STEPS = 5  # default: success since a switch in bins of 5 steps
PRETRAIN_TARGETS = ("schedule", "uniform")  # value pretraining's targets: the schedule's
# start, or a style drawn per episode (a privileged critic must then read the hint: with
# the schedule's start, each user's target is fixed and its words alone predict the value)
HINT_AT = " "  # what the critic of the ceiling row reads replaced, at every occurrence
HINTS = {"cute": "7", "chuunibyou": "8", "classical": "9"}  # judged style -> its digit
USER_TAG = "u"
DIALECT_LETTERS = "bzqxjvkwgfhp"  # user u's dialect prefixes every marker with letter u


def dialect_lexicons(user: int) -> dict[str, tuple[str, ...]]:
    """User `user`'s own marker words: style.LEXICONS with its dialect letter in front
    (user 1: 'znya', 'zthee', ...), so that every marker of a line names its user."""
    if not 0 <= user < len(DIALECT_LETTERS):
        raise ValueError(f"user_style dialects: at most {len(DIALECT_LETTERS)} users, got {user}")
    return {
        s: tuple(DIALECT_LETTERS[user] + w for w in words) for s, words in style.LEXICONS.items()
    }


def staggered(
    users: int, first: int, stagger: int, period: int, switches: int = 2
) -> tuple[tuple[int, ...], ...]:
    """Per user u, `switches` switch steps: first + u * stagger, then every `period`."""
    if users < 1 or switches < 0 or first < 0 or stagger < 0 or period < 1:
        raise ValueError(
            f"staggered(users={users}, first={first}, stagger={stagger}, period={period}, "
            f"switches={switches}): need users, period >= 1 and the rest >= 0"
        )
    return tuple(
        tuple(first + u * stagger + k * period for k in range(switches)) for u in range(users)
    )


class UserSchedule(style.SharedStep):
    """Each user's target style by training step; `set_step` by the trainer, read by envs.

    User u's k-th phase (k switches passed) wants STYLES[(u + k) % len(STYLES)].
    """

    def __init__(self, switch_steps: Sequence[Sequence[int]]) -> None:
        self.switch_steps = tuple(tuple(int(s) for s in user) for user in switch_steps)
        if not self.switch_steps:
            raise ValueError("UserSchedule switch_steps: need at least one user")
        for u, steps in enumerate(self.switch_steps):
            if any(b <= a for a, b in itertools.pairwise(steps)) or (steps and steps[0] < 1):
                raise ValueError(
                    f"UserSchedule switch_steps[{u}]={steps}: must be >= 1 and increasing"
                )
        super().__init__()

    @property
    def users(self) -> int:
        return len(self.switch_steps)

    def phase(self, user: int, step: int) -> int:
        """Switches user `user` has passed at `step`."""
        return bisect.bisect_right(self.switch_steps[user], step)

    def style_at(self, user: int, step: int) -> str:
        return STYLES[(user + self.phase(user, step)) % len(STYLES)]

    def since_switch(self, user: int, step: int) -> int | None:
        """Steps since the user's last switch at `step` (None before its first)."""
        k = self.phase(user, step)
        return None if k == 0 else step - self.switch_steps[user][k - 1]


def make_prompt(user: int, topics: Sequence[str], dialect: bool = False) -> Prompt:
    """uid `user_style:u<user>:<topics sorted, joined by +>`, text `u<user>: <topics>\\n`
    (the space after the tag is the ceiling hint's anchor: every prompt has one);
    `dialect`: the user writes (and is judged) in its own dialect (`dialect_lexicons`)."""
    topics = tuple(sorted(topics))
    return Prompt(
        uid=f"user_style:{USER_TAG}{user}:" + "+".join(topics),
        text=f"{USER_TAG}{user}: {' '.join(topics)}\n",
        meta={"topics": topics, "user": user, "dialect": dialect},
    )


def _stable_draw(*keys: str, n: int) -> int:
    """A draw in [0, n) fixed by `keys` (the same episode is always judged alike)."""
    digest = hashlib.blake2b("\x00".join(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def user_topics(user: int, users: int) -> tuple[str, ...]:
    """The topics user `user` writes about when users have topics of their own: every
    `users`-th topic of style.TOPICS from the user's index (disjoint pools)."""
    return style.TOPICS[user::users]


def sample_prompt(
    rng: np.random.Generator,
    users: int = 6,
    n_topics: tuple[int, int] = (1, 2),
    own_topics: bool = False,
    dialects: bool = False,
) -> Prompt:
    """A user drawn uniformly, then topics as the style task draws them: from all topics,
    or with `own_topics` from the user's own pool (`user_topics`), so that the topic
    words every line must contain also name its user, next to the words that decide its
    style, and not only the tag at the start of the prompt."""
    user = int(rng.integers(users))
    pool = user_topics(user, users) if own_topics else style.TOPICS
    lo, hi = n_topics
    if not 1 <= lo <= hi <= len(pool):
        raise ValueError(f"user_style n_topics={n_topics}: need 1 <= min <= max <= {len(pool)}")
    n = int(rng.integers(lo, hi + 1))
    topics = [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]
    return make_prompt(user, topics, dialect=dialects)


def success_bin(since: int, bin_steps: int) -> str:
    """`success_since_switch_<lo>` of the bin holding `since` (e.g. 00, 05, 10, ...)."""
    lo = since // bin_steps * bin_steps
    return f"success_since_switch_{lo:02d}"


class UserStyleEnv:
    """One turn; reward = offset[user] + payout[user] x r_quality x r_style of the user's
    current style."""

    stop_strings = style.STOP_STRINGS
    max_turns = 1

    def __init__(
        self,
        *,
        schedule: UserSchedule,
        payouts: Sequence[float],
        judge: style.Judge | None = None,
        recovery_steps: int = RECOVERY_STEPS,
        bin_steps: int = BIN_STEPS,
        pretrain_targets: str = "schedule",
        max_turn_chars: int = 256,
        offsets: Sequence[float] | None = None,
    ) -> None:
        if len(payouts) != schedule.users or not all(0 < p <= 1 for p in payouts):
            raise ValueError(
                f"user_style payouts={tuple(payouts)}: one value in (0, 1] per user "
                f"({schedule.users} users)"
            )
        offsets = (0.0,) * schedule.users if offsets is None else tuple(offsets)
        if len(offsets) != schedule.users or not all(0 <= o <= 10 for o in offsets):
            raise ValueError(
                f"user_style offsets={offsets}: one value in [0, 10] per user "
                f"({schedule.users} users)"
            )
        self.offsets = tuple(float(o) for o in offsets)
        if recovery_steps < 1 or bin_steps < 1:
            raise ValueError("user_style recovery_steps and bin_steps: must be >= 1")
        if pretrain_targets not in PRETRAIN_TARGETS:
            raise ValueError(
                f"user_style pretrain_targets={pretrain_targets!r}: one of {PRETRAIN_TARGETS}"
            )
        self.pretrain_targets = pretrain_targets
        self.schedule, self.payouts = schedule, tuple(float(p) for p in payouts)
        self.judge = style.LexiconJudge() if judge is None else judge
        self._dialect_judges: dict[int, style.LexiconJudge] = {}
        self.recovery_steps, self.bin_steps = recovery_steps, bin_steps
        self.max_turn_chars = max_turn_chars
        self._prompt: Prompt | None = None

    def set_step(self, step: int) -> None:
        self.schedule.set_step(step)

    def reset(self, prompt: Prompt) -> str:
        user = prompt.meta.get("user")
        if not isinstance(user, int) or not 0 <= user < self.schedule.users:
            raise ValueError(
                f"user_style prompt {prompt.uid!r}: meta user {user!r} is not one of the "
                f"{self.schedule.users} users"
            )
        if prompt.meta.get("dialect") and not isinstance(self.judge, style.LexiconJudge):
            raise ValueError(
                f"user_style prompt {prompt.uid!r}: dialects need the lexicon judge "
                "(env.params.judge='lexicon')"
            )
        self._prompt = prompt
        return prompt.text

    def step(self, action_text: str) -> StepResult:
        if self._prompt is None:
            raise RuntimeError("user_style env: step() before reset() or after the episode ended")
        prompt, self._prompt = self._prompt, None
        user = prompt.meta["user"]
        step = self.schedule.step
        target = self.schedule.style_at(user, step)
        if step == PRETRAIN_STEP and self.pretrain_targets == "uniform":
            target = STYLES[_stable_draw(prompt.uid, str(action_text), n=len(STYLES))]
        since = self.schedule.since_switch(user, step)
        info: dict[str, Any] = {
            "turn": 1, "user": user, "style": target, "step": step, "since_switch": since,
            "truncated": False, "critic_hint": (HINT_AT, HINTS[target], "all"),
        }  # fmt: skip
        scores = style.judge_turn(
            self._judge(prompt), prompt, action_text, target, self.max_turn_chars, info
        )
        if scores is None:
            return StepResult("", self.offsets[user], True, info)
        correct = scores[0] * scores[1]
        info.update(success=correct == 1.0, r_quality=scores[0], r_style=scores[1])
        info["log"] = self._log(correct, since, user)
        return StepResult("", self.offsets[user] + self.payouts[user] * correct, True, info)

    def _judge(self, prompt: Prompt) -> style.Judge:
        """The run's judge, or for a prompt in its user's dialect (prompt.meta) a lexicon
        judge of that dialect's markers."""
        if not prompt.meta.get("dialect"):
            return self.judge
        user = prompt.meta["user"]
        if user not in self._dialect_judges:
            self._dialect_judges[user] = style.LexiconJudge(lexicons=dialect_lexicons(user))
        return self._dialect_judges[user]

    def _log(self, correct: float, since: int | None, user: int) -> dict[str, float]:
        if since is None:
            return {"success_initial": correct}
        if since < self.recovery_steps:
            return {
                "success_recovering": correct,
                f"success_recovering_u{user}": correct,
                success_bin(since, self.bin_steps): correct,
            }
        return {"success_settled": correct, success_bin(since, self.bin_steps): correct}


# ------------------------------------------------------------------------------ the task


def task_prompts(**params: Any):
    """`sample(rng)` of user-style prompts; params: users, n_topics, own_topics, dialects."""
    unknown = set(params) - {"users", "n_topics", "own_topics", "dialects"}
    if unknown:
        raise ValueError(f"prompt_source: unknown user_style parameters {sorted(unknown)}")
    users = int(params.get("users", 6))
    n_topics = tuple(params.get("n_topics", (1, 2)))
    own = bool(params.get("own_topics", False))
    dialects = bool(params.get("dialects", False))
    if users < 1 or (dialects and users > len(DIALECT_LETTERS)):
        raise ValueError(
            f"user_style users={users}: need >= 1 (<= {len(DIALECT_LETTERS)} with dialects)"
        )
    smallest = min(len(user_topics(u, users)) for u in range(users)) if own else len(style.TOPICS)
    if not 1 <= n_topics[0] <= n_topics[1] <= smallest:
        raise ValueError(
            f"user_style n_topics={n_topics}: need 1 <= min <= max <= {smallest} (topics "
            f"{'of the smallest user pool' if own else 'in all'})"
        )
    return functools.partial(
        sample_prompt, users=users, n_topics=n_topics, own_topics=own, dialects=dialects
    )


def task_setup(params: dict[str, Any]) -> tuple[dict[str, Any], Callable]:
    """One UserSchedule shared by every env of the run (moved by the returned hook); a
    judge from params['judge']: 'lexicon' or a dict for the LLM judge client."""
    params = dict(params)
    schedule = UserSchedule(params.pop("switch_steps"))
    judge = style.make_judge(params.pop("judge", "lexicon"))
    return {**params, "schedule": schedule, "judge": judge}, schedule.set_step


def initial_style(user: int) -> str:
    """The style user `user` wants before its first switch (UserSchedule's phase 0)."""
    return STYLES[user % len(STYLES)]


def _demonstration(prompt, rng, *, error_rate: float = 0.0):
    """A line in the user's initial style, or with probability `error_rate`
    (sft.error_rate) in one of the other styles, uniformly: the warm start knows who
    wanted what before any switch only partly (error_rate 2/3: not at all), so the trunk
    the critic is copied from already reads the user tag, and RL has the rest to learn."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"user_style demonstrations: error_rate={error_rate} not in [0, 1]")
    user = prompt.meta["user"]
    own = initial_style(user)
    others = [s for s in STYLES if s != own]
    pick = others[int(rng.integers(len(others)))] if rng.random() < error_rate else own
    lexicons = dialect_lexicons(user) if prompt.meta.get("dialect") else None
    return style.demonstration(prompt, rng, style=pick, lexicons=lexicons)


register_task(
    "user_style",
    env=UserStyleEnv,
    prompts=task_prompts,
    demonstrations=_demonstration,
    setup=task_setup,
)
