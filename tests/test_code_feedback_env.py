"""The code-with-hidden-tests task (sao_jax/envs/code_feedback.py): episodes, the turn
budget, error codes, inline == sandbox observations, demonstrations, prompt stream."""

import collections

import numpy as np
import pytest

from sao_jax.configs import observation_signal
from sao_jax.data.prompts import prompt_source
from sao_jax.envs import code_feedback as C
from sao_jax.envs.base import Env
from sao_jax.envs.registry import get_task, make_env
from sao_jax.run.sft import demonstration, encode_segments
from sao_jax.text.tokenizer import CharTokenizer
from tests.env_support import play

STALE = C.make_prompt(C.Spec(mult=7, const_shown=27, const_true=29, query=5))
FRESH = C.make_prompt(C.Spec(mult=7, const_shown=27, const_true=27, query=5))


def test_a_stale_spec_episode_and_its_text():
    env = make_env("code_feedback")
    assert isinstance(env, Env) and env.max_turns == 3
    assert STALE.text == "s:x*7+27 at 5\n" and STALE.answer == 64
    assert STALE.uid == "code_feedback:x*7+27 at 5:29" and STALE.meta["stale"]
    res = play(env, STALE, ["f=lambda x:x*7+27\n", "f=lambda x:x*7+29\n", "a:64\n"])
    assert [r.observation for r in res] == ["fail:f(0)=27 want 29\n", "ok:f(5)=64\n", ""]
    assert res[-1].done and res[-1].reward == 1.0 and res[-1].info["success"]
    assert res[-1].info["test_runs"] == 2 and res[-1].info["failed_runs"] == 1


def test_a_fresh_spec_passes_at_once_and_the_answer_must_be_copied():
    env = C.CodeFeedbackEnv()
    res = play(env, FRESH, ["f=lambda x:x*7+27\n", "a:61\n"])
    assert res[0].observation == "ok:f(5)=62\n"
    assert res[-1].done and res[-1].reward == 0.0 and res[-1].info["answer"] == 61


def test_failures_spend_the_turn_budget():
    env = C.CodeFeedbackEnv(spare_turns=1)  # code + one retry + answer
    res = play(env, STALE, ["f=lambda x:x*7+27\n", "f=lambda x:x*6+29\n", "a:64\n"])
    assert res[1].observation == "fail:f(1)=35 want 36\n"
    assert len(res) == 3 and res[-1].reward == 1.0  # the answer still counts (a guess)
    res = play(env, STALE, ["f=lambda x:x*7+27\n", "f=lambda x:x*6+29\n", "f=lambda x:x*7+29\n"])
    assert res[-1].done and res[-1].reward == 0.0 and res[-1].info["truncated"]
    res = play(C.CodeFeedbackEnv(spare_turns=0), FRESH, ["f=lambda x:x*7+27\n", "a:62\n"])
    assert res[-1].reward == 1.0


@pytest.mark.parametrize(
    "turn, observation",
    [
        ("f=lambda x:x*7+\n", "error:syntax\n"),
        ("f=lambda x:y*7+27\n", "error:name\n"),
        ("f=lambda x:x/7+27\n", "error:unsupported\n"),
        ("f=lambda x:x*7+27", "\nerror:bad\n"),  # not terminated
        ("f=lambda x:x*7+27+0+0+0+0+0+0+0+0+0+0+0+0\n", "error:bad\n"),  # > 40 chars
        ("a:sixty\n", "error:bad\n"),
        ("f=lambda x:x*99999999999999999999999999\n", "fail:f(0)=0 want 27\n"),
        ("f=lambda x:x*7+27-(0)\n", "ok:f(5)=62\n"),
    ],
)
def test_each_line_gets_the_tests_verdict(turn, observation):
    (res,) = play(C.CodeFeedbackEnv(), FRESH, [turn])
    assert res.observation == observation and not res.done


# Lines of the inline subset, syntax errors and undefined names: the sandbox runs them
# and must print exactly what the inline evaluator computes.
CORPUS = (
    "f=lambda x:x*7+27",
    "f=lambda x:x*7+29",
    "f=lambda x:x*6+29",
    "f=lambda x:(x-1)*7+36",
    "f=lambda x:-x*7+29",
    "f=lambda x:x*7+",
    "f=lambda x:x*07",
    "f=lambda x:z+1",
    "f=lambda x:x*99999999999999999999",
)


def test_inline_equals_the_sandbox_on_a_corpus():
    spec = C.spec_of(STALE)
    for line in CORPUS:
        inline = C.clean(C.run_inline(line, spec), 40)
        boxed = C.clean(C.run_sandboxed(line, spec, allow_weak=True), 40)
        assert inline == boxed, line
    # outside the subset the sandbox runs what inline refuses
    assert C.run_inline("c:12", spec) == "error:unsupported"
    assert C.run_sandboxed("c:12", spec, allow_weak=True) == "error:no f"


def test_the_sandbox_executor_runs_an_episode():
    env = C.CodeFeedbackEnv(executor="sandbox", allow_weak_isolation=True)
    res = play(env, STALE, ["f=lambda x:x*7+27\n", "f=lambda x:x*7+29\n", "a:64\n"])
    assert [r.observation for r in res[:2]] == ["fail:f(0)=27 want 29\n", "ok:f(5)=64\n"]
    assert res[-1].reward == 1.0


def test_demonstrations_replay_the_env_and_succeed_at_the_closed_form_rate():
    rng = np.random.default_rng(0)
    sample = C.task_prompts(stale_rate=0.5)
    tok = CharTokenizer()
    wins, n, r = 0, 3000, 0.3
    longest = 0
    for _ in range(n):
        prompt = sample(rng)
        segments = demonstration("code_feedback", prompt, rng, r)
        env = C.CodeFeedbackEnv()
        assert env.reset(prompt) == segments[0][0]
        result = None
        for (text, is_model), nxt in zip(segments[1:], [*segments[2:], None], strict=True):
            if is_model:
                result = env.step(text)
                if nxt is not None:
                    assert nxt == (result.observation, False)
        wins += result.reward
        longest = max(longest, len(encode_segments(segments, tok, add_bos=True)[0]))
    # first run passes iff the spec is fresh and the line did not slip; one retry passes
    # iff it did not slip (at FIX_SLIP * r); the answer has a typo at r * TYPO_SHARE. (A
    # slip that lands on the true constant is ignored: ~0.5% of demonstrations.)
    first = 0.5 * (1 - r)
    fix = 1 - min(1.0, C.FIX_SLIP * r)
    p = (first + (1 - first) * fix) * (1 - r * C.TYPO_SHARE)
    assert abs(wins / n - p) < 3 * np.sqrt(p * (1 - p) / n) + 0.006, (wins / n, p)
    assert longest <= observation_signal.get_config().sampling.max_len
    perfect = demonstration("code_feedback", STALE, rng, 0.0)
    assert [t for t, m in perfect if m] == ["f=lambda x:x*7+27\n", "f=lambda x:x*7+29\n", "a:64\n"]


def test_prompt_stream_and_parameters():
    sample = C.task_prompts(stale_rate=0.5, mult_range=(2, 9), query_range=(2, 9))
    rng = np.random.default_rng(1)
    prompts = [sample(rng) for _ in range(2000)]
    stale = collections.Counter(p.meta["stale"] for p in prompts)
    assert abs(stale[True] / 2000 - 0.5) < 0.04
    for p in prompts[:50]:
        spec = C.spec_of(p)
        assert 1 <= abs(spec.const_shown - spec.const_true) <= 9 or not p.meta["stale"]
        bare = C.Prompt(uid=p.uid, text=p.text, answer=p.answer)  # no meta: parsed back
        assert C.spec_of(bare) == spec
    held_out = prompt_source("code_feedback", "eval", size=16, seed=0)
    assert len({p.uid for p in held_out}) == 16
    assert get_task("code_feedback").demonstrations is not None
    with pytest.raises(ValueError, match="stale_rate"):
        C.task_prompts(stale_rate=2.0)
    with pytest.raises(ValueError, match="unknown code_feedback parameters"):
        C.task_prompts(levels=(1,))
    with pytest.raises(ValueError, match="executor"):
        C.CodeFeedbackEnv(executor="docker")
    with pytest.raises(ValueError, match="spare_turns"):
        C.CodeFeedbackEnv(spare_turns=-1)
    with pytest.raises(ValueError, match="not 's:x"):
        C.spec_of(C.Prompt(uid="u", text="q:1+2\n", answer=3))
