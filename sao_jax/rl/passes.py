"""Model passes the update step needs, aligned to the batch's per-token convention.

The batch aligns everything to the token itself (sao_jax/batch_schema.py). A causal model's
output at position t - 1 is the one that predicts token t and summarises the state in
which token t was chosen, so:
  logp[b, t]    = log_softmax(policy_logits[b, t - 1])[tokens[b, t]]
  entropy[b, t] = H(softmax(policy_logits[b, t - 1]))
  values[b, t]  = critic_out[b, t - 1]
and position 0 (never an action) gets 0. The bootstrap value of a truncated row is the
critic output at its last real token (the state after the final token).

Microbatching splits the batch dimension into `[M, B / M]` and runs a `lax.scan` over M;
each microbatch keeps the batch sharding on its own batch dimension.

A packed batch (sao_jax/rl/packing.py) runs the model on its packed rows and returns the
same per-trajectory [B, T] outputs as the padded batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sao_jax.models.logprobs import chunked_logp_entropy
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl import packing

Batch = dict[str, jax.Array]


def shift_right(x_bt: jax.Array) -> jax.Array:
    """[B, T] -> [B, T] with out[:, t] = x[:, t - 1] and out[:, 0] = 0."""
    return jnp.pad(x_bt[:, :-1], ((0, 0), (1, 0)))


def token_logp_entropy(logits_btv: jax.Array, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token log-prob and predictive entropy (float32), aligned to the token."""
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    # Output t predicts token t + 1: gather next tokens, then shift right by one.
    nxt_bt = jnp.pad(tokens_bt[:, 1:], ((0, 0), (0, 1)))
    logp_next_bt = jnp.take_along_axis(logp_btv, nxt_bt[..., None], axis=-1)[..., 0]
    entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    return shift_right(logp_next_bt), shift_right(entropy_bt)


def last_token_index(segment_ids_bt: jax.Array) -> jax.Array:
    """[B] index of each row's last real (non-pad) token (0 for an empty row)."""
    t = segment_ids_bt.shape[1]
    idx_bt = jnp.where(segment_ids_bt != 0, jnp.arange(t)[None, :], 0)
    return jnp.max(idx_bt, axis=1)


def chunked_token_logp_entropy(policy, hidden_btd, tokens_bt) -> tuple[jax.Array, jax.Array]:
    """`token_logp_entropy(policy.head_logits(hidden), tokens)` with the LM head applied
    `policy.cfg.logits_chunk` tokens at a time: no [B, T, V] array (models/logprobs.py)."""
    nxt_bt = jnp.pad(tokens_bt[:, 1:], ((0, 0), (0, 1)))
    logp_next_bt, entropy_bt = chunked_logp_entropy(
        policy.head_logits, hidden_btd, nxt_bt, policy.cfg.logits_chunk
    )
    return shift_right(logp_next_bt), shift_right(entropy_bt)


def policy_pass(policy, batch: Batch, *, replay: bool) -> dict[str, jax.Array]:
    """logp, entropy [B, T] and the MoE aux loss of the policy on `batch`."""
    tokens, positions, segment_ids, forced = packing.model_inputs(batch, replay=replay)
    out = policy.hidden_states(tokens, positions, segment_ids, forced_experts_btlk=forced)
    logp, entropy = chunked_token_logp_entropy(policy, out.out, tokens)
    logp, entropy = packing.to_trajectories(batch, logp), packing.to_trajectories(batch, entropy)
    return dict(logp=logp, entropy=entropy, aux_loss=out.aux_loss)


def critic_pass(critic, batch: Batch) -> dict[str, jax.Array]:
    """values [B, T] (aligned), bootstrap value [B] of the last state, MoE aux loss. The
    critic reads the batch's `critic_tokens` when it has them (a privileged critic)."""
    tokens, positions, segment_ids, _ = packing.model_inputs(batch, critic=True)
    out = critic(tokens, positions, segment_ids)
    if packing.is_packed(batch):
        bootstrap_b = packing.at_last_token(batch, out.out)
    else:
        last_b = last_token_index(batch["segment_ids"])
        bootstrap_b = jnp.take_along_axis(out.out, last_b[:, None], axis=1)[:, 0]
    values = packing.to_trajectories(batch, shift_right(out.out))
    return dict(values=values, bootstrap=bootstrap_b, aux_loss=out.aux_loss)


def split_microbatches(tree: Any, num: int, sharder: Sharder) -> Any:
    """[B, ...] leaves -> [num, B / num, ...], batch sharding kept on dim 1."""

    def split(x):
        y = x.reshape((num, x.shape[0] // num, *x.shape[1:]))
        names = (None, "batch") + (None,) * (x.ndim - 1)
        return sharder.constrain(y, names)

    return jax.tree.map(split, tree)


def merge_microbatches(tree: Any, sharder: Sharder) -> Any:
    """Inverse of split_microbatches: [M, B / M, ...] -> [B, ...]."""

    def merge(x):
        y = x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))
        return sharder.constrain(y, ("batch",) + (None,) * (x.ndim - 2))

    return jax.tree.map(merge, tree)


def map_microbatches(fn: Callable[[Batch], Any], batch: Batch, num: int, sharder: Sharder):
    """fn over microbatches (no gradient), outputs concatenated back to [B, ...]."""
    if num == 1:
        return fn(batch)
    outs = jax.lax.map(fn, split_microbatches(batch, num, sharder))
    return merge_microbatches(outs, sharder)


def accumulate_grads(
    loss_fn: Callable[[Any, Batch], tuple[jax.Array, Any]],
    params: Any,
    batch: Batch,
    num: int,
    sharder: Sharder,
):
    """Sum over microbatches of (loss, grads, aux) from `jax.value_and_grad(loss_fn)`.

    `loss_fn` must already normalise by global (whole-batch) counts, so that the sum over
    microbatches equals the full-batch loss and gradient.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num == 1:
        (loss, aux), grads = grad_fn(params, batch)
        return loss, grads, aux

    def body(acc, mb):
        (loss, aux), grads = grad_fn(params, mb)
        return jax.tree.map(jnp.add, acc, (loss, grads, aux)), None

    mbs = split_microbatches(batch, num, sharder)
    first = jax.tree.map(lambda x: x[0], mbs)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: grad_fn(params, first)))
    (_, aux0), g0 = zeros
    init = (jnp.zeros((), jnp.float32), g0, aux0)
    (loss, grads, aux), _ = jax.lax.scan(body, init, mbs)
    return loss, grads, aux
