"""Shared defaults of every run config. Experiment configs start from `get_config()`.

Sections: model (sao_jax.models.config.ModelConfig fields), mesh (device mesh and the
logical-axis rules table), optim (policy and critic AdamW), rl (the update step's
algorithm: estimator, loss, TTUR, lambdas; sao_jax.rl.settings), sampling (rollout
engine and async sampler), env / data / init / sft / value_pretrain / train (the run's stages;
sao_jax.run.settings). Each section is validated
by the module that consumes it (sao_jax.config.validate).
"""

import ml_collections
from sao_jax.configs.models import tiny

from sao_jax.parallel.mesh import DEFAULT_RULES, MESH_AXES
from sao_jax.rl.optim import ATTENTION_PATTERNS, optimizer_section
from sao_jax.rl.settings import rl_section
from sao_jax.run.settings import (
    data_section,
    env_section,
    init_section,
    sft_section,
    train_section,
    value_pretrain_section,
)
from sao_jax.sampling.sampler import sampling_section


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.seed = 0  # the one seed every named RNG stream is split from

    c.model = tiny.get_config()

    c.mesh = ml_collections.ConfigDict()
    c.mesh.axes = MESH_AXES  # named mesh axes
    c.mesh.shape = (-1, 1, 1, 1)  # one size may be -1 (all remaining devices)
    c.mesh.rules = DEFAULT_RULES  # logical axis -> mesh axes (the one rules table)

    c.optim = ml_collections.ConfigDict()
    c.optim.policy = optimizer_section(1e-6)  # paper: policy lr 1e-6
    c.optim.critic = optimizer_section(5e-6)  # paper: critic lr 5e-6
    c.optim.critic.freeze_attention = True  # SAO's frozen-attention critic
    c.optim.critic.trainable = "moe"  # what trains while attention is frozen: 'moe' (MoE /
    # MLP blocks + router + value head, the seed's) | 'all_but_attention' (+ embedding, norms)
    c.optim.critic.frozen_patterns = ATTENTION_PATTERNS  # regexes on parameter paths
    c.optim.critic.warmup_steps = 10  # the paper's 10-step critic warm-up, read as an LR
    # warm-up over the first RL steps; rl.critic_only_steps gives the other reading

    c.rl = rl_section()
    c.sampling = sampling_section()  # generation engine + async sampler
    c.env = env_section()  # task, prompt difficulty, held-out split, group size
    c.data = data_section()  # prompts: the task's generator or a dataset file (field mapping)
    c.init = init_section()  # warm start: SFT on demonstrations | HF checkpoint | random
    c.sft = sft_section()
    c.value_pretrain = value_pretrain_section()
    c.train = train_section()  # RL steps, rollout mode, logging, eval, checkpoints
    return c
