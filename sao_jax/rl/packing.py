"""Packed model passes: run the model on packed rows, hand back the per-trajectory layout.

A packed batch (`sao_jax.sampling.trajectory.pack_batch`) holds the usual per-trajectory
[N, T] fields, which the RL math reads unchanged (rewards, GAE, losses, metrics), plus
the same tokens packed several per row, [R, Lp], which the model reads. Trajectory n sits
at packed row `pack_row[n]` (within its microbatch) from column `pack_start[n]`, with
positions restarting at 0 and its own segment id, so attention never crosses trajectories
and every token gets the output it would get alone in a padded row.

Per-token outputs come back through one gather, out[n, t] = x[pack_row[n], pack_start[n]
+ t], kept on the trajectory's real tokens except t = 0 and zero elsewhere: position 0
is what `passes.shift_right` leaves 0 in the padded layout (there the packed row holds
the previous trajectory's last output), padding is masked by every consumer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Batch = dict[str, jax.Array]


def is_packed(batch: Batch) -> bool:
    return "packed_tokens" in batch


def model_inputs(batch: Batch, *, replay: bool = False, critic: bool = False):
    """(tokens, positions, segment_ids, forced experts or None) of the rows the model runs.

    `critic`: the critic's tokens, i.e. `critic_tokens` (`packed_critic_tokens`) where the
    batch has them (a privileged critic, `rl.privileged_critic`), else the same tokens."""
    packed = is_packed(batch)
    prefix = "packed_" if packed else ""
    tokens = batch[f"{prefix}tokens"]
    if critic:
        tokens = batch.get(f"{prefix}critic_tokens", tokens)
    forced = batch.get(f"{prefix}forced_experts") if replay else None
    return tokens, batch[f"{prefix}positions"], batch[f"{prefix}segment_ids"], forced


def _columns_nt(batch: Batch) -> jax.Array:
    """[N, T] packed column of token t of trajectory n (clipped into the row)."""
    t = batch["segment_ids"].shape[1]
    lp = batch["packed_tokens"].shape[1]
    return jnp.clip(batch["pack_start"][:, None] + jnp.arange(t)[None, :], 0, lp - 1)


def to_trajectories(batch: Batch, x_rl: jax.Array) -> jax.Array:
    """[R, Lp] per-token output aligned to the token -> [N, T] (identity when unpacked).

    out[n, t] = x[pack_row[n], pack_start[n] + t] for 0 < t < len(n), else 0.
    """
    if not is_packed(batch):
        return x_rl
    rows_n1 = batch["pack_row"][:, None]
    x_nt = x_rl[rows_n1, _columns_nt(batch)]
    t = batch["segment_ids"].shape[1]
    keep_nt = (batch["segment_ids"] != 0) & (jnp.arange(t)[None, :] > 0)
    return jnp.where(keep_nt, x_nt, jnp.zeros((), x_nt.dtype))


def at_last_token(batch: Batch, x_rl: jax.Array) -> jax.Array:
    """[N]: the packed output at each trajectory's last real token (0-length: column 0)."""
    length_n = jnp.sum(batch["segment_ids"] != 0, axis=1)
    col_n = batch["pack_start"] + jnp.maximum(length_n - 1, 0)
    return x_rl[batch["pack_row"], col_n]
