"""sao_jax: single-rollout asynchronous RL (SAO) for agentic MoE language models in JAX."""

__version__ = "0.1.0"
