r"""The harness demo's policy behind the rollout gateway (sao_jax/serve/, docs/harness.md).

A small Qwen3-MoE-style model with the project's local BPE tokenizer and Qwen3-style chat
template (`init.tokenizer='harness'`: built into the workdir, sao_jax/text/
harness_tokenizer.py); a context long enough for the calculator tool's schema. Serving
uses `init`, `model`, `sampling` and `seed`; SFT is not run by the server.

  python -m experiments.serve --config=configs/harness.py:smoke --workdir=/tmp/gw

Variants (`:a,b=1`): smoke (a tiny model that is up in seconds on a CPU), seed=N.
"""

from sao_jax.config import parse_arg
from sao_jax.configs import base


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, seed=0)
    c = base.get_config()
    c.seed = arg.seed
    c.init.kind = "random"  # the server serves init as is (a warm start is a later stage)
    c.init.tokenizer = "harness"  # the local BPE (vocabulary 506) + the Qwen3-style template
    c.init.chat_template = "tokenizer"
    c.model.vocab_size = 512  # >= the tokenizer's 506
    c.sampling.num_slots = 16  # concurrent harness calls decoding together
    c.sampling.max_len = 1024  # the tool schema, a few turns and their results
    c.sampling.steps_per_sync = 4
    c.sampling.temperature = 1.0  # the law of requests that send none (docs/harness.md)
    if arg.smoke:
        c.model.update(hidden_size=32, num_hidden_layers=2, mlp_only_layers=(0,), num_experts=4)
        c.sampling.num_slots = 8
    return c
