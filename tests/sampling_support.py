"""Shared fakes of the sampling tests (test_generate.py, test_sampler.py, test_routing_replay.py).

A tiny MoE policy config, a character tokenizer and a multi-turn env; the fakes follow the
protocols of sao_jax/text/tokenizer.py and sao_jax/envs/base.py. `engine_rollouts` and
`assert_same_rollouts` are the run and the comparison of the tests that check a cache
variant (spans, paged pool, mesh) against a reference engine.
"""

import numpy as np

from sao_jax.envs.base import Prompt, StepResult
from sao_jax.models.config import ModelConfig
from sao_jax.sampling.engine import Engine, EngineConfig

MODEL = ModelConfig(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=(0,),
    initializer_range=0.1,
)


class FakeTokenizer:
    """pad 0, bos 1, eos 2, unk 3, then one id per character."""

    chars = "abcdefghij0123456789 <>/=+.?"
    vocab_size, pad_id, bos_id, eos_id, unk_id = 32, 0, 1, 2, 3

    def encode(self, text):
        return [4 + self.chars.index(c) if c in self.chars else self.unk_id for c in text]

    def decode(self, ids):
        return "".join(self.chars[i - 4] for i in ids if 4 <= i < 4 + len(self.chars))


class TurnEnv:
    """Turn t (1-based) is answered with '<t>' and reward t; done after meta['turns']."""

    stop_strings = ("a",)
    max_turns = 3

    def reset(self, prompt):
        self.t, self.turns = 0, prompt.meta.get("turns", 2)
        return prompt.text

    def step(self, action_text):
        self.t += 1
        done = self.t >= self.turns
        return StepResult("" if done else f"<{self.t}>", float(self.t), done, {"success": done})


def prompts(n, seed=0, turns=2):
    rng = np.random.default_rng(seed)
    return [
        Prompt(f"p{i}", "".join(rng.choice(list("bcdef0123"), rng.integers(1, 20))), None,
               {"turns": turns})
        for i in range(n)
    ]  # fmt: skip


def engine_rollouts(mdef, params, *, num_prompts=13, sharder=None, **kw):
    """The tiny engine's rollouts of `num_prompts` 3-turn prompts (sorted by uid), seed 3,
    version 2, top-k 20 / top-p 0.9, routing recorded; `kw` sets the other EngineConfig
    fields. Returns (trajectories, engine)."""
    cfg = dict(num_slots=4, max_len=64, max_turn_tokens=10, record_routing=True, top_k=20,
               top_p=0.9)  # fmt: skip
    eng = Engine.create(
        mdef, FakeTokenizer(), TurnEnv, EngineConfig(**{**cfg, **kw}), seed=3, sharder=sharder
    )
    trajs, drops = eng.run(params, prompts(num_prompts, seed=1, turns=3), version=2)
    assert not drops and len(trajs) == num_prompts
    return sorted(trajs, key=lambda t: t.prompt_uid), eng


def assert_same_rollouts(ref, got, atol=2e-6):
    """Same prompts, tokens, actions, routing, versions and episode ends; log-probs within
    `atol` (float32 summation order)."""
    for a, b in zip(ref, got, strict=True):
        assert a.prompt_uid == b.prompt_uid
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.action_mask, a.action_mask)
        np.testing.assert_array_equal(b.experts, a.experts)
        np.testing.assert_array_equal(b.versions, a.versions)
        np.testing.assert_allclose(b.rollout_logp, a.rollout_logp, atol=atol, rtol=0)
        np.testing.assert_allclose(b.sampled_logp, a.sampled_logp, atol=atol, rtol=0)
        assert (b.terminated, b.outcome, b.num_turns) == (a.terminated, a.outcome, a.num_turns)
