"""Calculator arithmetic env, safe calculator, demonstrations and the env registry."""

import fractions

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.envs import arithmetic as A
from sao_jax.envs import calculator
from sao_jax.envs.base import Env
from sao_jax.envs.registry import get_task, make_env, task_names
from sao_jax.text.tokenizer import CharTokenizer
from tests.env_support import play


def _prompt(expr):
    return A.make_prompt(A.parse_tree(expr))


def _reference(tree):  # slow literal reference: Python's own integer arithmetic on the text
    if isinstance(tree, int):
        return tree
    a, b = _reference(tree[1]), _reference(tree[2])
    return {"+": a + b, "-": a - b, "*": a * b}[tree[0]]


def test_calculator_values_and_errors():
    assert calculator.calculate("12*7") == "84"
    assert calculator.calculate(" (84+5) ") == "89"
    assert calculator.calculate("-4-6") == "-10"
    assert calculator.calculate("5--3") == "8"
    assert calculator.calculate("7/2") == "3.5"
    assert calculator.calculate("1/3") == "0.333333"
    assert calculator.calculate("7//2") == "3" and calculator.calculate("-7%3") == "2"
    assert calculator.evaluate("2/4+1/4") == fractions.Fraction(3, 4)
    cases = {
        "1/0": "div0",
        "5%(3-3)": "div0",
        "999999*999999*999999": "big",
        "9" * 20: "big",
        "1" + "+1" * 40: "long",
        "2**10": "syntax",
        "__import__('os')": "syntax",
        "x+1": "syntax",
        "'a'*3": "syntax",
        "(1,2)": "syntax",
        "1<2": "syntax",
        "True+1": "syntax",
        "lambda: 1": "syntax",
        "1+": "syntax",
        "1\x00+2": "syntax",
        "1e999": "big",
    }
    for expr, code in cases.items():
        with pytest.raises(calculator.CalcError) as e:
            calculator.evaluate(expr)
        assert e.value.code == code, expr


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_trees_render_parse_and_value(seed, n_ops):
    rng = np.random.default_rng(seed)
    params = A.make_params(n_ops=n_ops, operand_range=(0, 999))
    tree = A.sample_tree(rng, n_ops, params)
    assert A.n_ops_of(tree) == n_ops
    for parens in ("all", "minimal"):
        expr = A.render(tree, parens)
        assert A.tree_value(A.parse_tree(expr)) == _reference(tree)
        assert calculator.evaluate(expr, max_chars=200, max_abs=10**18) == _reference(tree)
    assert A.parse_tree(A.render(tree, "all")) == tree


def test_correct_episode_and_format():
    env = A.ArithmeticEnv()
    prompt = _prompt("(12*7)+5")
    assert prompt.text == "q:(12*7)+5\n" and prompt.answer == 89
    assert env.stop_strings == ("\n",) and env.max_turns == 4
    assert env.reset(prompt) == "q:(12*7)+5\n"
    r1 = env.step("c:12*7\n")
    assert (r1.observation, r1.reward, r1.done) == ("r:84\n", 0.0, False)
    r2 = env.step("c:84+5\n")
    assert r2.observation == "r:89\n"
    r3 = env.step("a:89\n")
    assert (r3.observation, r3.reward, r3.done) == ("", 1.0, True)
    assert r3.info["success"] is True and r3.info["truncated"] is False
    assert r3.info["tool_calls"] == 2
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("a:89\n")


def test_wrong_answer_and_answer_at_eos():
    env = A.ArithmeticEnv()
    (r,) = play(env, _prompt("(12*7)+5"), ["a:88\n"])
    assert r.done and r.reward == 0.0 and r.info["success"] is False
    (r,) = play(env, _prompt("(12*7)+5"), ["a: 89"])  # ended by EOS, spaces allowed
    assert r.done and r.reward == 1.0


def test_malformed_turns_are_error_observations():
    env = A.ArithmeticEnv(max_turns=8)
    env.reset(_prompt("(12*7)+5"))
    bad = {
        "hello\n": "e:bad\n",
        "c:12*7": "\ne:bad\n",  # unterminated call: newline first keeps lines aligned
        "c:__import__('os')\n": "e:syntax\n",
        "c:1/0\n": "e:div0\n",
        "a:eighty\n": "e:bad\n",
        "c:" + "9" * 60 + "\n": "e:bad\n",
        "\xff\udcff\x00\n": "e:bad\n",
    }
    for i, (turn, obs) in enumerate(bad.items()):
        r = env.step(turn)
        assert (r.observation, r.reward, r.done) == (obs, 0.0, False), turn
        assert r.info["error"] and r.info["turn"] == i + 1


def test_max_turns_truncates_with_zero_reward():
    env = A.ArithmeticEnv(max_turns=3)
    results = play(env, _prompt("(12*7)+5"), ["c:1+1\n"] * 5)
    assert len(results) == 3 and [r.done for r in results] == [False, False, True]
    last = results[-1]
    assert last.reward == 0.0 and last.observation == ""
    assert last.info["truncated"] is True and last.info["success"] is False


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=80), min_size=1, max_size=6))
def test_env_never_raises_on_any_output(turns):
    env = A.ArithmeticEnv()
    results = play(env, _prompt("(12*7)+5"), turns)
    for r in results:
        assert isinstance(r.observation, str) and r.reward in (0.0, 1.0)
        assert r.done or r.observation.endswith("\n")
    if results[-1].done:
        assert isinstance(results[-1].info["success"], bool)


def test_sampling_is_deterministic_and_respects_difficulty():
    params = A.make_params(n_ops=(1, 3), operand_range=(10, 20), ops="+*")
    a = [A.sample_prompt(np.random.default_rng(7), params) for _ in range(3)]
    b = [A.sample_prompt(np.random.default_rng(7), params) for _ in range(3)]
    assert a == b
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = A.sample_prompt(rng, params)
        tree = A.parse_tree(p.meta["expr"])
        assert 1 <= p.meta["n_ops"] == A.n_ops_of(tree) <= 3
        assert set(p.meta["expr"]) <= set("0123456789+*()")
    with pytest.raises(ValueError, match="ops"):
        A.make_params(ops="/")
    with pytest.raises(ValueError, match="n_ops"):
        A.make_params(n_ops=0)


def _replay_reward(prompt, segments):
    env = A.ArithmeticEnv(max_turns=8)
    assert env.reset(prompt) == segments[0][0] and segments[0][1] is False
    expected_obs = []
    result = None
    for text, is_model in segments[1:]:
        if is_model:
            result = env.step(text)
            expected_obs.append(result.observation)
        else:
            assert text == expected_obs[-1]
    assert result.done
    return result.reward


def test_demonstrations_correct_short_and_in_alphabet():
    tok = CharTokenizer()
    rng = np.random.default_rng(0)
    params = A.make_params()
    for _ in range(100):
        prompt = A.sample_prompt(rng, params)
        segments = A.demonstration(prompt, rng, error_rate=0.0)
        assert _replay_reward(prompt, segments) == 1.0
        kinds = [m for _, m in segments]
        assert kinds == [False, True, False, True, False, True]
        text = "".join(t for t, _ in segments)
        assert len(text) <= 64 and tok.unk_id not in tok.encode(text)
        assert all(t.endswith("\n") for t, _ in segments)


def test_imperfect_demonstrations_leave_headroom():
    rng = np.random.default_rng(1)
    params = A.make_params()
    rewards = []
    for _ in range(200):
        prompt = A.sample_prompt(rng, params)
        rewards.append(_replay_reward(prompt, A.demonstration(prompt, rng, error_rate=1.0)))
    assert np.mean(rewards) < 0.05
    mixed = []
    for _ in range(400):
        prompt = A.sample_prompt(rng, params)
        mixed.append(_replay_reward(prompt, A.demonstration(prompt, rng, error_rate=0.3)))
    assert 0.6 < np.mean(mixed) < 0.8
    for kind in A.IMPERFECT_KINDS:
        turns = A.demonstration_turns(_prompt("(12*7)+5"), rng, kind=kind)
        assert turns[-1].startswith("a:") and turns[-1] != "a:89\n"


def test_registry():
    procedural = ("arithmetic", "arithmetic_levels", "python_tool", "style")  # built-in
    assert set(procedural) <= set(task_names())
    for name in procedural:
        assert get_task(name).prompts is not None
        env = make_env(name)
        assert isinstance(env, Env) and env.max_turns >= 1 and env.stop_strings
    assert make_env("arithmetic", max_turns=6).max_turns == 6
    with pytest.raises(ValueError, match="unknown task 'chess'; known: .*arithmetic_levels"):
        make_env("chess")
    with pytest.raises(ValueError, match="bad parameters"):
        make_env("arithmetic", turns=3)
