"""Sampling: the KV-cache engine, generation, the async sampler and the trajectories.

The face: `Engine` (continuous batching of S slots with their envs) and `EngineConfig`;
`AsyncSampler` (worker threads feeding a bounded queue, versions, staleness cap) and
`SamplerConfig`, both built from `config.sampling` by `configs_from_section`; the run's
rollout sources `AsyncRollouts` / `SyncRollouts`; `Trajectory` and the batches made of
it (`pad_batch`, `pack_batch`). docs/sampling.md describes them.
"""

from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.rollouts import AsyncRollouts, SyncRollouts
from sao_jax.sampling.sampler import (
    AsyncSampler,
    EnvErrorLimit,
    SamplerConfig,
    SamplerError,
    configs_from_section,
)
from sao_jax.sampling.trajectory import Trajectory, pack_batch, pad_batch

__all__ = [
    "AsyncRollouts",
    "AsyncSampler",
    "Engine",
    "EngineConfig",
    "EnvErrorLimit",
    "SamplerConfig",
    "SamplerError",
    "SyncRollouts",
    "Trajectory",
    "configs_from_section",
    "pack_batch",
    "pad_batch",
]
