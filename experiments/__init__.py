"""Thin entry points (`python -m experiments.<name>`; installed: `sao_jax.experiments`)."""
