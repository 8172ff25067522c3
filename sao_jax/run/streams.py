"""The run's named RNG streams, all split from the one seed (`config.seed`), in one table.

Every random draw of a run (model init, prompt order, rollouts, evaluation, SFT, value
pretraining, the update step's key) takes its seed from `stream_seed(config.seed, name)`.
The derivation is `seed + STREAMS[name]`: the integer offsets the code used before it
had names, kept as they were so that every committed result reproduces bit for bit
(results/, README, docs/experiments.md). Streams that share an offset share that seed;
they stay apart only by how they consume it (a JAX key folded with a worker index, with
the update count, or the model's init; NumPy generators for prompt order and SFT).
A new stream takes an offset no other stream uses.
"""

from __future__ import annotations

# name -> offset from config.seed, and where it is drawn.
STREAMS: dict[str, int] = {
    "model_init": 0,  # the random init of the policy and critic (run/inputs.build_models)
    "prompts": 0,  # the RL prompt stream's order (data/pipeline.run_prompts; its held-out
    # prompts are drawn from config.seed itself)
    "rollouts": 0,  # async sampler worker i samples with fold_in(key(seed), i)
    # (sampling/sampler.SamplerConfig.seed)
    "update": 0,  # the update step's key fold_in(key(seed), update) and TrainState.rng
    # (train.Run._key, rl/update.Learner.new_state)
    "sft_batches": 0,  # which demonstrations SFT builds and their imperfections (run/sft)
    "eval": 1,  # evaluation's sampling key fold_in(key(seed), step) (run/evaluation,
    # run/rescore: a rescored checkpoint draws what the run's own evaluation drew)
    "value_pretrain": 3,  # value pretraining's prompt stream and sampler (train.Run)
    "sync_rollouts": 5,  # synchronous rollouts' keys (sampling/rollouts.SyncRollouts)
    "sft_prompts": 7,  # the prompt stream SFT writes demonstrations for (train.Run)
    "testbed_probe": 11,  # experiments/testbed_probe.py's held-out rollouts
}


def stream_seed(seed: int, name: str) -> int:
    """The seed of stream `name` of a run with seed `seed` (module docstring)."""
    if name not in STREAMS:
        raise KeyError(f"unknown RNG stream {name!r}; known: {', '.join(sorted(STREAMS))}")
    return seed + STREAMS[name]
