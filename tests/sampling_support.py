"""Shared fakes of the sampling tests (test_generate.py, test_sampler.py, test_routing_replay.py).

A tiny MoE policy config, a character tokenizer and a multi-turn env; the fakes follow the
protocols of sao_jax/text/tokenizer.py and sao_jax/envs/base.py.
"""

import numpy as np

from sao_jax.envs.base import Prompt, StepResult
from sao_jax.models.config import ModelConfig

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
