"""experiments/harness_demo/task.py: the calculator agent's loop as an Env scores what the
agent scores, and its demonstrations replay through it (the demo's reward fires)."""

import numpy as np
import pytest

from experiments.harness_demo import task
from sao_jax.envs.arithmetic import task_prompts


@pytest.fixture(scope="module")
def prompts():
    sample = task_prompts(n_ops=(1, 1))
    rng = np.random.default_rng(0)
    return [sample(rng) for _ in range(8)]


def test_correct_demonstrations_score_one_and_end_turns_at_eos(prompts):
    chat = task.harness_chat()
    rng = np.random.default_rng(1)
    for p in prompts:
        segments = task.demonstration(p, rng, error_rate=0.0)
        assert [m for _, m in segments] == [False, True, False, True]
        assert all(t.endswith(chat.eos_text) for t, m in segments if m)
        assert not segments[2][0].startswith(chat.eos_text)  # the eos is the model's
        assert f'"expression": "{p.meta["expr"]}"' in segments[1][0]
        env = task.CalculatorAgentEnv(chat=chat)
        assert env.reset(p) == segments[0][0]
        first = env.step(segments[1][0])
        assert not first.done and first.observation.removeprefix(chat.eos_text) == segments[2][0]
        last = env.step(segments[3][0])
        assert last.done and last.reward == 1.0 and last.info["success"]


def test_wrong_answers_and_truncation_score_zero(prompts):
    chat = task.harness_chat()
    p = prompts[0]
    env = task.CalculatorAgentEnv(chat=chat)
    env.reset(p)
    assert env.step(f"The answer is {p.answer + 1}.").reward == 0.0
    env = task.CalculatorAgentEnv(chat=chat, max_turns=1)
    env.reset(p)
    result = env.step(task.call_text(p.meta["expr"]))
    assert result.done and result.reward == 0.0 and result.info["truncated"]
    rng = np.random.default_rng(2)
    imperfect = [task.demonstration(p, rng, error_rate=1.0) for p in prompts]
    for p, segments in zip(prompts, imperfect, strict=True):
        env = task.CalculatorAgentEnv(chat=chat)
        env.reset(p)
        results = [env.step(t) for t, m in segments if m]
        assert results[-1].done and results[-1].reward == 0.0


def test_schema_free_demonstrations_and_the_answer_tokenized_as_the_result(prompts):
    """A schema-free demonstration is the same episode without the tool schema in its
    context; the final answer is the result's text, so its tokens equal the tool result's
    (the policy copies tokens, it does not re-tokenize)."""
    from sao_jax.text.tokenizer import load_tokenizer

    tok = load_tokenizer("harness")
    for p in prompts:
        full = task.demonstration(p, np.random.default_rng(3), error_rate=0.0)
        free = task.demonstration(p, np.random.default_rng(3), error_rate=0.0, schema_free_rate=1.0)
        assert "<tools>" in full[0][0] and "<tools>" not in free[0][0]
        assert full[1:] == free[1:]  # the same turns and observations
        answer = tok.encode(full[3][0].removesuffix(task.harness_chat().eos_text))
        assert answer == tok.encode(str(p.answer))
        shown = tok.encode(full[2][0])  # the tool's result, as the observation shows it
        assert any(shown[i : i + len(answer)] == answer for i in range(len(shown)))
