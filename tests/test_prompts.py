"""Grain prompt sources: determinism, disjoint train/eval splits, checkpointable iterators."""

import itertools

import pytest

from sao_jax.data import prompts as P
from sao_jax.envs.arithmetic import parse_tree, tree_value
from sao_jax.envs.base import Prompt

ENVS = ("arithmetic", "python_tool", "style")


def _take(it, n):
    return list(itertools.islice(it, n))


@pytest.mark.parametrize("env", ENVS)
def test_deterministic_by_seed(env):
    a = _take(P.prompt_iterator(env, "train", seed=3), 20)
    b = _take(P.prompt_iterator(env, "train", seed=3), 20)
    c = _take(P.prompt_iterator(env, "train", seed=4), 20)
    assert all(isinstance(p, Prompt) for p in a)
    assert a == b and a != c


@pytest.mark.parametrize("env", ENVS)
def test_train_and_eval_are_disjoint(env):
    train = {p.uid for p in _take(P.prompt_iterator(env, "train", seed=0), 400)}
    train |= {p.uid for p in _take(P.prompt_iterator(env, "train", seed=1), 400)}
    ev = P.prompt_source(env, "eval", seed=0, size=30)
    eval_uids = [p.uid for p in ev]
    assert len(eval_uids) == len(set(eval_uids)) > 0
    assert not train & set(eval_uids)
    assert all(P.split_of(u) == "train" for u in train)
    assert all(P.split_of(u) == "eval" for u in eval_uids)
    assert [p.uid for p in P.prompt_source(env, "eval", seed=0, size=30)] == eval_uids


def test_split_of_is_a_stable_hash():
    uids = [f"arithmetic:{i}+{i}" for i in range(4000)]
    share = sum(P.split_of(u, 0.1) == "eval" for u in uids) / len(uids)
    assert 0.07 < share < 0.13
    assert P.split_of("arithmetic:(12*7)+5") == P.split_of("arithmetic:(12*7)+5")
    assert all(P.split_of(u, 0.1) == "train" or P.split_of(u, 0.2) == "eval" for u in uids)


def test_iterator_state_round_trip():
    it = P.prompt_iterator("arithmetic", "train", seed=5, size=64)
    _take(it, 37)  # crosses nothing yet; then past the end of the first epoch below
    state = it.get_state()
    expected = _take(it, 50)
    restored = P.prompt_iterator("arithmetic", "train", seed=5, size=64)
    restored.set_state(state)
    assert _take(restored, 50) == expected


def test_train_repeats_and_epochs_are_reshuffled():
    items = _take(P.prompt_iterator("arithmetic", "train", seed=0, size=16), 32)
    first, second = items[:16], items[16:]
    assert sorted(p.uid for p in first) == sorted(p.uid for p in second)
    assert first != second


def test_difficulty_params_and_answers():
    it = P.prompt_iterator("arithmetic", "train", seed=0, n_ops=3, operand_range=(10, 20))
    for p in _take(it, 30):
        assert p.meta["n_ops"] == 3 and p.answer == tree_value(parse_tree(p.meta["expr"]))
        assert p.text == f"q:{p.meta['expr']}\n"
    big = _take(P.prompt_iterator("python_tool", "train", seed=0), 30)
    assert max(abs(p.answer) for p in big) > 10_000
    small = P.prompt_source("style", "eval", size=80)
    assert 0 < len(small) < 80  # 45 of the 465 topic sets hash to eval: fewer than asked


def test_argument_errors():
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        P.prompt_source("chess", "train")
    with pytest.raises(ValueError, match="split='test'"):
        P.prompt_source("arithmetic", "test")
    with pytest.raises(ValueError, match="bad arithmetic parameters"):
        P.prompt_source("arithmetic", "train", n_operations=2)
    with pytest.raises(ValueError, match="unknown style parameters"):
        P.prompt_source("style", "train", n_ops=2)
    with pytest.raises(ValueError, match="eval_fraction"):
        P.prompt_source("arithmetic", "train", eval_fraction=1.0)
    tiny = {"n_ops": 1, "operand_range": (2, 2), "ops": "+"}  # one problem: 2+2
    other = "train" if P.split_of("arithmetic:2+2") == "eval" else "eval"
    with pytest.raises(ValueError, match=f"no '{other}' prompt"):
        _take(P.prompt_iterator("arithmetic", other, size=4, **tiny), 1)
