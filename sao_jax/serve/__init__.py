"""The rollout gateway: an OpenAI-compatible server in front of a generation backend
(sao_jax/sampling/backend.py) that records every session as an episode. docs/harness.md
describes it."""
