"""Capacity planning: FLOP and memory models of the update step, the sampler and the KV
cache, checked against XLA's compiled counts in the tests. Parameter shapes come from one
source, the model itself (shapes.py: `jax.eval_shape` of its init)."""
