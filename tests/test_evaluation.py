"""Held-out evaluation (sao_jax/run/evaluation.py): one decoding mode alone, and an evaluator
moved onto other prompts and seed (`for_prompts`, as sao_jax/run/rescore.py uses it) scores
exactly what a fresh evaluator built for them scores, while sharing the compiled engines;
success per difficulty level against a literal count; the sampled evaluation's repeats."""

import dataclasses
from types import SimpleNamespace

import pytest
from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.run.evaluation import Evaluator, success_by_level
from sao_jax.sampling.engine import Drop, EngineConfig
from tests.sampling_support import MODEL, FakeTokenizer, TurnEnv, prompts

ENGINE = EngineConfig(num_slots=4, max_len=48, max_turn_tokens=4, temperature=1.0)


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


def _evaluator(model, ps, seed, **kw):
    return Evaluator(model[0], FakeTokenizer(), TurnEnv, ps, ENGINE, seed=seed, **kw)


def test_for_prompts_equals_a_fresh_evaluator_and_shares_engines(model):
    first, other = prompts(6, seed=0), prompts(10, seed=1)
    ev = _evaluator(model, first, seed=3)
    ev(model[1], step=5)  # compiled on the first prompts
    moved = ev.for_prompts(other, seed=4)
    assert moved.greedy is ev.greedy and moved.sampled is ev.sampled  # nothing recompiled
    assert ev.prompts == first and ev.seed == 3  # the original is untouched
    got = moved(model[1], step=5)
    want = _evaluator(model, other, seed=4)(model[1], step=5)
    assert got == want
    assert got["eval/sampled_episodes"] == 10
    with pytest.raises(ValueError, match="at least one"):
        ev.for_prompts([], seed=0)


def test_one_decoding_mode_alone(model):
    ps = prompts(5, seed=2)
    both = _evaluator(model, ps, seed=0)(model[1], step=1)
    sampled = _evaluator(model, ps, seed=0, greedy=False)(model[1], step=1)
    greedy = _evaluator(model, ps, seed=0, sampled=False)(model[1], step=1)
    assert not any(k.startswith("eval/greedy_") for k in sampled)
    assert not any(k.startswith("eval/sampled_") for k in greedy)
    assert {**greedy, **sampled} == both
    with pytest.raises(ValueError, match="neither greedy nor sampled"):
        _evaluator(model, ps, seed=0, sampled=False, greedy=False)


def test_success_by_level_literal():
    traj = lambda uid, ok: SimpleNamespace(prompt_uid=uid, info={"success": ok})
    levels = {"a": 1, "b": 1, "c": 2, "d": 3}
    trajs = [traj("a", True), traj("b", False), traj("c", True)]
    drops = [Drop("env_error", "d", None)]
    out = success_by_level(trajs, drops, levels, "eval/x_")
    assert out == {"eval/x_success_level1": 0.5, "eval/x_success_level2": 1.0,
                   "eval/x_success_level3": 0.0}  # fmt: skip


def test_levels_are_scored_when_every_prompt_has_one(model):
    ps = [
        dataclasses.replace(p, meta={**p.meta, "level": 1 + i % 2})
        for i, p in enumerate(prompts(8))
    ]
    out = _evaluator(model, ps, seed=0)(model[1], step=0)
    for mode in ("greedy", "sampled"):
        per = [out[f"eval/{mode}_success_level{k}"] for k in (1, 2)]
        assert out[f"eval/{mode}_success"] == pytest.approx(sum(per) / 2)  # 4 prompts each
    plain = _evaluator(model, prompts(8), seed=0)(model[1], step=0)  # no level meta
    assert not any("_level" in k for k in plain)


def test_sampled_repeats_sample_each_prompt_k_times(model):
    """k repeats: k x the episodes, fresh samples (not one sample counted k times), the
    greedy evaluation unchanged; k < 1 is refused."""
    ps = prompts(6, seed=5)
    once = _evaluator(model, ps, seed=2)(model[1], step=3)
    ev = _evaluator(model, ps, seed=2, sampled_repeats=3)
    runs, run = {}, ev._run

    def spy(name, engine, params, version, episodes):
        runs[name] = run(name, engine, params, version, episodes)[0]
        return runs[name], []

    ev._run = spy
    thrice = ev(model[1], step=3)
    assert thrice["eval/sampled_episodes"] == 18 and once["eval/sampled_episodes"] == 6
    greedy = lambda out: {k: v for k, v in out.items() if k.startswith("eval/greedy_")}
    assert greedy(thrice) == greedy(once) and len(runs["greedy"]) == 6
    by_uid = {}
    for t in runs["sampled"]:
        by_uid.setdefault(t.prompt_uid, []).append(tuple(t.tokens))
    assert sorted(map(len, by_uid.values())) == [3] * 6
    assert any(len(set(v)) > 1 for v in by_uid.values())  # the repeats are fresh samples
    with pytest.raises(ValueError, match="sampled_repeats=0"):
        _evaluator(model, ps, seed=0, sampled_repeats=0)
