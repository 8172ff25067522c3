"""Per-user style shift (sao_jax/envs/user_style.py): staggered schedules, the reward
payout x quality x style under each user's current target, what each verdict logs, and
the registered task end to end (prompts, demonstrations, a shared schedule)."""

import numpy as np
import pytest

from sao_jax.envs import registry
from sao_jax.envs import style as S
from sao_jax.envs import user_style as U


def test_staggered_schedule_by_hand():
    assert U.staggered(3, first=10, stagger=5, period=30) == ((10, 40), (15, 45), (20, 50))
    with pytest.raises(ValueError, match="period"):
        U.staggered(3, first=10, stagger=5, period=0)
    sched = U.UserSchedule(((10, 40), (15, 45)))
    # user u wants STYLES[(u + k) % 3] after k switches
    assert [sched.style_at(0, s) for s in (0, 9, 10, 39, 40)] == [
        "cute", "cute", "chuunibyou", "chuunibyou", "classical"
    ]  # fmt: skip
    assert [sched.style_at(1, s) for s in (0, 14, 15, 45)] == [
        "chuunibyou", "chuunibyou", "classical", "cute"
    ]  # fmt: skip
    assert sched.since_switch(0, 9) is None and sched.since_switch(0, 17) == 7
    with pytest.raises(ValueError, match=r"switch_steps\[1\]"):
        U.UserSchedule(((10, 40), (45, 15)))


def _line(prompt, style, seed=0):
    return S.demonstration(prompt, np.random.default_rng(seed), style=style)[1][0]


def test_reward_is_payout_times_a_correct_line_of_the_current_target():
    sched = U.UserSchedule(((10,), (20,)))
    env = U.UserStyleEnv(schedule=sched, payouts=(1.0, 0.5), recovery_steps=5, bin_steps=5)
    prompt = U.make_prompt(1, ("tea", "moon"))
    assert prompt.text == "u1: moon tea\n" and prompt.uid == "user_style:u1:moon+tea"
    for step, target, log in (
        (0, "chuunibyou", {"success_initial": 1.0}),
        (
            22,
            "classical",
            {
                "success_recovering": 1.0,
                "success_recovering_u1": 1.0,
                "success_since_switch_00": 1.0,
            },
        ),
        (31, "classical", {"success_settled": 1.0, "success_since_switch_10": 1.0}),
    ):
        env.set_step(step)
        env.reset(prompt)
        right = env.step(_line(prompt, target))
        assert right.done and right.reward == 0.5 and right.info["success"], step
        assert right.info["log"] == log and right.info["critic_hint"] == (
            " ",
            U.HINTS[target],
            "all",
        )
        env.reset(prompt)
        wrong = env.step(_line(prompt, "cute"))  # another user's style is worth nothing
        assert wrong.reward == 0.0 and not wrong.info["success"]
    with pytest.raises(ValueError, match="payouts"):
        U.UserStyleEnv(schedule=sched, payouts=(1.0,))
    with pytest.raises(ValueError, match="meta user 7"):
        env.reset(U.make_prompt(7, ("tea",)))


def test_offset_is_paid_on_every_line_of_its_user_whatever_the_line():
    sched = U.UserSchedule(((10,), (20,)))
    env = U.UserStyleEnv(schedule=sched, payouts=(1.0, 0.5), offsets=(0.0, 2.0))
    prompt = U.make_prompt(1, ("tea",))
    env.reset(prompt)
    assert env.step(_line(prompt, "chuunibyou")).reward == 2.5  # 2.0 + 0.5 x correct
    env.reset(prompt)
    assert env.step(_line(prompt, "cute")).reward == 2.0  # wrong style: the offset alone
    env.reset(prompt)
    assert env.step("").reward == 2.0  # not even judged: still the prompt's own offset
    zero = U.make_prompt(0, ("tea",))
    env.reset(zero)
    assert env.step(_line(zero, "cute")).reward == 1.0  # user 0: no offset
    for bad in ((1.0,), (0.0, -1.0), (0.0, 11.0)):
        with pytest.raises(ValueError, match="offsets"):
            U.UserStyleEnv(schedule=sched, payouts=(1.0, 0.5), offsets=bad)


def test_registered_task_shares_one_schedule_and_validates_params():
    assert "user_style" in registry.task_names()
    params = {"switch_steps": U.staggered(2, 10, 5, 30), "payouts": (1.0, 0.25)}
    make, set_step = registry.env_factory("user_style", params)
    envs = [make(), make()]
    set_step(16)
    assert all(e.schedule.step == 16 for e in envs)
    sample = registry.get_task("user_style").prompts(users=2)
    rng = np.random.default_rng(0)
    users = {sample(rng).meta["user"] for _ in range(50)}
    assert users == {0, 1}
    with pytest.raises(ValueError, match="unknown user_style parameters"):
        registry.get_task("user_style").prompts(people=2)
    demo = registry.get_task("user_style").demonstrations(sample(rng), rng)
    assert [m for _, m in demo] == [False, True]


def test_dialects_judge_each_user_by_its_own_markers():
    sched = U.UserSchedule(((10,), (20,)))
    env = U.UserStyleEnv(schedule=sched, payouts=(1.0, 1.0))
    prompt = U.make_prompt(1, ("tea",), dialect=True)
    rng = np.random.default_rng(0)
    line = S.demonstration(prompt, rng, style="chuunibyou", lexicons=U.dialect_lexicons(1))
    text = line[1][0]
    assert all(w.startswith("z") for w in text.split() if w.strip("!.,~") in
               {m for ms in U.dialect_lexicons(1).values() for m in ms})  # fmt: skip
    env.reset(prompt)
    assert env.step(text).info["success"]  # user 1 wants chuunibyou at step 0, in its dialect
    env.reset(prompt)
    plain = _line(U.make_prompt(1, ("tea",)), "chuunibyou")
    assert not env.step(plain).info["success"]  # the plain words are another dialect's
    demo = registry.get_task("user_style").demonstrations(prompt, rng, error_rate=0.0)
    words = set(demo[1][0].replace(",", " ").replace(".", " ").split())
    assert words & set(U.dialect_lexicons(1)["chuunibyou"])  # its initial style, its dialect
    sample = registry.get_task("user_style").prompts(users=3, dialects=True, own_topics=True)
    for p in (sample(rng) for _ in range(20)):
        assert p.meta["dialect"] and set(p.meta["topics"]) <= set(U.user_topics(p.meta["user"], 3))
    with pytest.raises(ValueError, match="users=13"):
        registry.get_task("user_style").prompts(users=13, dialects=True)
