"""Style-shift writing env: schedule switches, the offline lexicon judge, dropped verdicts."""

import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.envs import style as S
from sao_jax.envs.llm_judge import JudgeError
from sao_jax.text.tokenizer import CharTokenizer


def test_schedule_switches_at_configured_steps():
    sched = S.StyleSchedule(switch_steps=(150, 300))
    got = {step: sched.style_at(step) for step in (0, 149, 150, 299, 300, 10**6)}
    assert got == {
        0: "cute",
        149: "cute",
        150: "chuunibyou",
        299: "chuunibyou",
        300: "classical",
        10**6: "classical",
    }
    assert sched.current() == (0, "cute")
    sched.set_step(300)
    assert sched.current() == (300, "classical")
    with pytest.raises(ValueError, match="switch_steps"):
        S.StyleSchedule(switch_steps=(150,))
    with pytest.raises(ValueError, match="increasing"):
        S.StyleSchedule(switch_steps=(300, 150))


def test_schedule_is_shared_and_thread_safe():
    sched = S.StyleSchedule(switch_steps=(10, 20))
    envs = [S.StyleEnv(schedule=sched) for _ in range(4)]
    envs[0].set_step(15)
    assert all(e.schedule.current() == (15, "chuunibyou") for e in envs)

    def writer(k):
        for i in range(300):
            sched.set_step(k * 1000 + i)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(300):
        step, style = sched.current()
        assert style == sched.style_at(step)
    for t in threads:
        t.join()


def _shared_with(style, target):
    return set(S.LEXICONS[style]) & set(S.LEXICONS[target])


def test_demonstrations_score_in_their_style_and_next_only_through_shared_words():
    judge, tok = S.LexiconJudge(), CharTokenizer()
    rng = np.random.default_rng(0)
    reach = []
    for _ in range(200):
        prompt = S.sample_prompt(rng)
        for style in S.STYLES:
            segments = S.demonstration(prompt, rng, style=style)
            assert [m for _, m in segments] == [False, True]
            text = segments[1][0]
            assert tok.unk_id not in tok.encode(prompt.text + text)
            words = set(re.findall("[a-z]+", text))
            for target in S.STYLES:
                q, s = judge.score(prompt, text.removesuffix("\n"), target)
                assert q == 1.0, text
                # 3 markers of `style`: another target needs >= 2 of them shared with it
                expect = target == style or len(words & _shared_with(style, target)) >= 2
                assert s == float(expect), (text, target)
            if style == "cute":
                reach.append(judge.style(text.removesuffix("\n"), "chuunibyou"))
    # 3 of 12 cute words are shared with chuunibyou: P(>= 2 of 3 distinct) = 28/220
    assert 0.05 < np.mean(reach) < 0.22


def test_lexicons_share_words_only_between_consecutive_styles():
    assert all(len(S.LEXICONS[s]) == 12 for s in S.STYLES)
    assert len(_shared_with("cute", "chuunibyou")) == 3
    assert len(_shared_with("chuunibyou", "classical")) == 3
    assert not _shared_with("cute", "classical")


def test_quality_rules():
    judge = S.LexiconJudge()
    prompt = S.make_prompt(["moon"])
    assert prompt.text == "w:moon\n" and prompt.meta["topics"] == ("moon",)
    good = "nya the moon is fluffy and sweet~"
    assert judge.score(prompt, good, "cute") == (1.0, 1.0)
    bad = {
        "short": "moon nya",
        "too long": good + " and" + " so very tiny" * 10,
        "repeats": "nya nya nya the moon is fluffy",
        "alphabet": "Nya the moon is fluffy and sweet",
        "topic": "nya the sun is fluffy and sweet~",
    }
    for why, text in bad.items():
        assert judge.quality(prompt, text) == 0.0, why
    # a tie between two lexicons is not the target style
    assert judge.style("the moon is fluffy sweet and thou hath", "cute") == 0.0
    assert judge.style("the moon is fluffy", "cute") == 0.0  # one marker is not enough


def test_env_reward_follows_the_switch():
    sched = S.StyleSchedule(switch_steps=(5, 10))
    env = S.StyleEnv(schedule=sched)
    assert env.stop_strings == ("\n",) and env.max_turns == 1
    prompt = S.make_prompt(["tea", "rain"])
    assert prompt.text == "w:rain tea\n" and prompt.uid == "style:rain+tea"
    text = "oh rain and tea, so kawaii and fluffy, tiny.\n"
    rewards = []
    for step in (0, 5, 10):
        sched.set_step(step)
        env.reset(prompt)
        r = env.step(text)
        assert r.done and r.observation == "" and r.info["step"] == step
        rewards.append(r.reward)
        assert r.info["success"] is (r.reward == 1.0)
    assert rewards == [1.0, 0.0, 0.0]
    env.reset(prompt)
    r = env.step("verily thou hath rain and tea yonder\n")
    assert r.reward == 1.0 and r.info["style"] == "classical"
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x\n")


class _FailingJudge:
    def __init__(self, exc):
        self.exc = exc

    def score(self, prompt, text, style):
        raise self.exc


@pytest.mark.parametrize("exc", [JudgeError("timeout"), ValueError("judge bug")])
def test_judge_failure_drops_the_trajectory(exc):
    env = S.StyleEnv(judge=_FailingJudge(exc))
    env.reset(S.make_prompt(["moon"]))
    r = env.step("nya the moon is fluffy\n")
    assert r.done and r.reward == 0.0 and r.info["dropped"] is True
    assert str(exc) in r.info["error"] and r.info["success"] is False


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_env_never_raises(text):
    env = S.StyleEnv()
    env.reset(S.make_prompt(["moon"]))
    r = env.step(text)
    assert r.done and r.reward in (0.0, 1.0) and isinstance(r.info["success"], bool)


def test_sample_prompt_deterministic():
    a = [S.sample_prompt(np.random.default_rng(3)) for _ in range(2)]
    assert a[0] == a[1]
    with pytest.raises(ValueError, match="n_topics"):
        S.sample_prompt(np.random.default_rng(0), (0, 2))
