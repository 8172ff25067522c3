"""Models: the Qwen3-MoE-style policy and critic, and Hugging Face checkpoint I/O.

The face: `ModelConfig` (the hyperparameters, from `config.model` or a config.json);
`Policy` and `Critic` (a shared trunk of decoder layers: attention, router, dispatch,
experts); `init_models` (randomly initialised, sharded) and `load_hf_policy` /
`load_hf_critic` / `save_hf_checkpoint` (both expert layouts, streamed and sharded).
"""

from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import Models, critic_def, init_models, policy_def
from sao_jax.models.hf import load_hf_critic, load_hf_policy, save_hf_checkpoint
from sao_jax.models.transformer import Critic, Policy, critic_params_from_policy

__all__ = [
    "Critic",
    "ModelConfig",
    "Models",
    "Policy",
    "critic_def",
    "critic_params_from_policy",
    "init_models",
    "load_hf_critic",
    "load_hf_policy",
    "policy_def",
    "save_hf_checkpoint",
]
