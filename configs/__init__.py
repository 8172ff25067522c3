"""Run configs (`get_config(arg)`), importable as `sao_jax.configs` (installed or not)."""
