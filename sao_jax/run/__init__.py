"""The run's stages: SFT warm start, value pretraining, evaluation, rescoring, and the run's
inputs, settings and accounting; sao_jax/train.py drives them."""
