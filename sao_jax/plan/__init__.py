"""Capacity planning: analytic FLOP and memory models of the update step, the sampler and
the KV cache, checked against XLA's compiled counts in the tests."""
