"""The graded calculator task (sao_jax/envs/levels.py): checker, turn budget, demonstrations,
prompt stream."""

import collections

import numpy as np
import pytest

from sao_jax.configs import sao
from sao_jax.data.prompts import prompt_iterator, prompt_source
from sao_jax.envs import arithmetic as A
from sao_jax.envs import levels as L
from sao_jax.envs.base import Env
from sao_jax.envs.registry import make_env
from sao_jax.run.sft import demonstration, encode_segments
from sao_jax.text.tokenizer import CharTokenizer
from tests.env_support import play


def _prompt(level, expr):
    return L.make_prompt(level, A.parse_tree(expr))


def test_a_correct_episode_and_its_text():
    env = make_env("arithmetic_levels")
    assert isinstance(env, Env)
    p = _prompt(3, "(12*7)+5")
    assert p.text == "q3:(12*7)+5\n" and p.uid == "levels:3:(12*7)+5" and p.answer == 89
    res = play(env, p, ["c:12*7\n", "c:84+5\n", "a:89\n"])
    assert [r.observation for r in res] == ["r:84\n", "r:89\n", ""]
    assert res[-1].done and res[-1].reward == 1.0 and res[-1].info["success"]
    assert res[-1].info["tool_errors"] == 0 and env.max_turns == 2 + 1 + 1


def test_checker_accepts_steps_and_subtrees_only():
    problem = A.parse_tree("(12*7)+(5-3)")
    for call in ("12*7", "5-3", "84+2", "(12*7)+2", "84+(5-3)", "(12*7)+(5-3)"):
        assert L.is_step(A.parse_tree(call), problem), call
    for call in ("12*8", "7*12", "84-2", "86", "5+3", "2+84", "84+3"):
        assert not L.is_step(A.parse_tree(call), problem), call


def test_errors_spend_the_turn_budget():
    p = _prompt(3, "(12*7)+5")  # 2 ops: budget 2 calls + answer + 1 spare = 4 turns
    env = L.LevelsEnv(spare_turns=1)
    res = play(env, p, ["c:12*8\n", "c:12*7\n", "c:84+5\n", "a:89\n"])
    assert res[0].observation == "e:step\n" and "not a step" in res[0].info["error"]
    assert res[-1].reward == 1.0 and res[-1].info["tool_errors"] == 1
    # two slips: the 4th turn is the last; the answer never comes
    res = play(env, p, ["c:12*8\n", "c:12*7\n", "c:84+6\n", "c:84+5\n", "a:89\n"])
    assert len(res) == 4 and res[-1].done and res[-1].reward == 0.0
    assert res[-1].info["truncated"] and not res[-1].info["success"]
    # the calculator env's own error codes still apply
    res = play(env, p, ["c:12/0\n"])
    assert res[0].observation == "e:div0\n"
    res = play(env, p, ["c:7/2\n"])
    assert res[0].observation == "e:step\n"  # '/' is never a step of a + - * problem
    res = play(env, p, ["hello\n"])
    assert res[0].observation == "e:bad\n"
    res = play(L.LevelsEnv(spare_turns=0), p, ["a:90\n"])
    assert res[0].done and res[0].reward == 0.0 and res[0].info["answer"] == 90


def test_bad_use_is_one_clear_error():
    env = L.LevelsEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("a:1\n")
    with pytest.raises(ValueError, match="spare_turns"):
        L.LevelsEnv(spare_turns=-1)
    with pytest.raises(ValueError, match="levels="):
        L.check_levels((1, 9), None)
    with pytest.raises(ValueError, match="weights"):
        L.check_levels((1, 2), (1.0,))
    with pytest.raises(ValueError, match="unknown arithmetic_levels parameters"):
        prompt_source("arithmetic_levels", "train", n_ops=2)


def test_demonstrations_replay_through_the_env():
    """Every demonstration's observations are exactly what the env answers, and its
    segments tokenise like a rollout."""
    rng = np.random.default_rng(0)
    it = prompt_iterator("arithmetic_levels", "train", seed=1)
    tok = CharTokenizer()
    for _ in range(200):
        p = next(it)
        segs = demonstration("arithmetic_levels", p, rng, 0.6)
        env = L.LevelsEnv()
        assert segs[0] == (env.reset(p), False)
        expect_obs = None
        for text, is_model in segs[1:]:
            if is_model:
                assert expect_obs is None
                r = env.step(text)
                expect_obs = None if r.done else r.observation
            else:
                assert text == expect_obs
                expect_obs = None
        ids, mask = encode_segments(segs, tok, add_bos=True)
        assert len(ids) <= 128 and mask.any()


@pytest.mark.parametrize("error_rate", [0.3, 0.8])
def test_demonstration_success_falls_with_the_level(error_rate):
    """Demo success at rate q = error_rate * weight, 1 spare turn, n calls:
    (1 - q) * (1 - q)^n * (1 + n q) * (1 - q * TYPO_SHARE) (the negative binomial). At the
    demo's error rate (configs/sao.py) the level explains over 45% of the outcome's
    variance: Var_level(p_level) / (p (1 - p)), levels equally likely."""
    rng = np.random.default_rng(0)
    it = prompt_iterator("arithmetic_levels", "train", seed=2)
    wins = collections.defaultdict(list)
    for _ in range(3000):
        p = next(it)
        segs = L.demonstration(p, rng, error_rate=error_rate)
        env = L.LevelsEnv()
        env.reset(p)
        for text, is_model in segs[1:]:
            if is_model:
                r = env.step(text)
        wins[L.level_of(p)].append(r.reward)
    assert sorted(wins) == [1, 2, 3, 4]
    for level, w in wins.items():
        spec = L.LEVELS[level]
        q, n = error_rate * spec.weight, spec.n_ops
        expect = (1 - q) * (1 - q) ** n * (1 + n * q) * (1 - q * L.TYPO_SHARE)
        assert abs(np.mean(w) - expect) < 4 * np.sqrt(expect * (1 - expect) / len(w)) + 0.01
    means = [np.mean(wins[k]) for k in sorted(wins)]
    assert means == sorted(means, reverse=True) and means[0] - means[-1] > 0.4
    if error_rate == sao.get_config().sft.error_rate:
        p = np.mean(means)
        assert means[0] == 1.0 and means[-1] < 0.05  # near-certain and rarely solved
        assert np.var(means) / (p * (1 - p)) > 0.45


def test_prompt_stream_mixes_levels_and_splits_stay_disjoint():
    train = [p for _, p in zip(range(400), prompt_iterator("arithmetic_levels", "train"))]
    levels = collections.Counter(L.level_of(p) for p in train)
    assert set(levels) == {1, 2, 3, 4} and min(levels.values()) > 60
    evals = list(prompt_source("arithmetic_levels", "eval", size=64))
    assert not {p.uid for p in train} & {p.uid for p in evals}
    only = list(prompt_source("arithmetic_levels", "eval", size=16, levels=(2,)))
    assert {L.level_of(p) for p in only} == {2}
    for p in only:
        assert A.n_ops_of(A.parse_tree(L.expr_of(p))) == 1
        assert L.level_of(L.make_prompt(2, A.parse_tree(L.expr_of(p)))) == 2
