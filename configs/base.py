"""Shared defaults of every run config. Experiment configs start from `get_config()`.

Every section's defaults, with a comment per field, are `sao_jax.defaults.default_config()`
(sao_jax/defaults.py: seed, model, mesh, optim, rl, sampling, env, data, init, sft,
value_pretrain, train); this file takes them as they are and puts the embedded model
(configs/models/tiny.py) in `model`. Every RNG stream of a run (model init, prompts,
rollouts, evaluation, SFT, value pretraining, the update step) is split from `seed` by
name, in one table (sao_jax/run/streams.py). Each section is validated by the module that
consumes it (sao_jax.config.validate).
"""

from sao_jax.configs.models import tiny

from sao_jax.defaults import default_config


def get_config(arg=None):
    del arg
    c = default_config()
    c.model = tiny.get_config()  # the embedded model, trained from scratch on CPU
    return c
