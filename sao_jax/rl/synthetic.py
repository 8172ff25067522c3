"""Synthetic agentic batches (prompt, then alternating action / observation turns).

For tests and benchmarks of the update step: the layout of a real multi-turn batch
(right padding, action spans, observation spans, outcome on the last action token,
per-token versions) with random tokens. Deterministic in `seed`.
"""

from __future__ import annotations

import numpy as np

from sao_jax.batch_schema import empty_batch, fields_for
from sao_jax.rl.batch import check_batch


def synthetic_batch(
    batch_size: int,
    length: int,
    vocab_size: int,
    *,
    seed: int = 0,
    prompt_len: int = 4,
    turns: int = 3,
    obs_fraction: float = 0.5,
    version: int = 0,
    max_lag: int = 0,
    groups: int = 0,
    truncated_fraction: float = 0.25,
) -> dict[str, np.ndarray]:
    """A batch dict (sao_jax/batch_schema.py) of random multi-turn trajectories.

    Rows have random real lengths in [length // 2, length]; after a prompt of
    `prompt_len` tokens the rest splits into `turns` action spans, each followed by an
    observation span taking about `obs_fraction` of the turn (the last turn has none).
    rollout_logp is a random negative number per action token; versions lag the given
    `version` by up to `max_lag`. With `groups` > 0, rows get group ids 0..groups-1.
    """
    rng = np.random.default_rng(seed)
    b, t = batch_size, length
    batch = empty_batch(fields_for(), dict(B=b, T=t))
    tokens, segment, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
    action, turn_ids, rewards = batch["action_mask"], batch["turn_ids"], batch["rewards"]
    for i in range(b):
        n = int(rng.integers(max(length // 2, prompt_len + 2 * turns), length + 1))
        tokens[i, :n] = rng.integers(1, vocab_size, n)
        segment[i, :n] = 1
        positions[i, :n] = np.arange(n)
        bounds = np.linspace(prompt_len, n, turns + 1).astype(int)
        for k in range(turns):
            lo, hi = bounds[k], bounds[k + 1]
            act_end = hi if k == turns - 1 else lo + max(1, round((hi - lo) * (1 - obs_fraction)))
            action[i, lo:act_end] = True
            turn_ids[i, lo:act_end] = k
    outcome = rng.integers(0, 2, b).astype(np.float32)
    for i in range(b):
        idx = np.flatnonzero(action[i])
        if idx.size:
            rewards[i, idx[-1]] = outcome[i]
    rollout_logp = np.where(action, -rng.uniform(0.5, 4.0, (b, t)), 0.0).astype(np.float32)
    lag = rng.integers(0, max_lag + 1, (b, t)) if max_lag else np.zeros((b, t), int)
    versions = np.where(segment != 0, np.maximum(version - lag, 0), 0).astype(np.int32)
    batch.update(
        rollout_logp=rollout_logp,
        versions=versions,
        outcome=outcome,
        terminated=rng.uniform(size=b) >= truncated_fraction,
    )
    if groups:
        batch["group_ids"] = (np.arange(b) % groups).astype(np.int32)
    check_batch(batch)
    return batch
