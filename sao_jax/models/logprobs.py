"""Per-token log-probabilities and entropies from hidden states, LM head applied in chunks.

A training pass needs two numbers per token, log p(y_t) and H(p_t), not the [B, T, V]
float32 logits (19 GiB for one 32k-token row at V = 151,936). The sequence is cut into
chunks of C tokens; a `lax.scan` computes each chunk's logits [B, C, V], reduces them to
    logp[b, t]    = z[b, t, y[b, t]] - logsumexp_v z[b, t, v]
    entropy[b, t] = -sum_v p[b, t, v] log p[b, t, v],  p = softmax(z[b, t])
and drops them. Each chunk is wrapped in `jax.checkpoint`, so the backward pass
recomputes the chunk's logits instead of keeping them: memory is O(B C V), whatever T.
Chunks run along the sequence, not the vocabulary: the vocabulary is the dimension the
LM head is sharded over (`vocab -> tensor`), the sequence is not sharded at all.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def logp_entropy_from_logits(logits_btv: jax.Array, targets_bt: jax.Array):
    """(log p(targets) [B, T], entropy [B, T]) in float32 from logits [B, T, V]."""
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    return logp_bt, entropy_bt


def chunked_logp_entropy(
    head: Callable[[jax.Array], jax.Array],
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    chunk: int,
):
    """`logp_entropy_from_logits(head(hidden), targets)` without [B, T, V] at once.

    `head` maps hidden states [B, C, D] to float32 logits [B, C, V]. `chunk` tokens per
    step (0, or >= T: one step, no scan). T is padded up to a multiple of `chunk`.
    """
    b, t, d = hidden_btd.shape
    if chunk <= 0 or t <= chunk:
        return logp_entropy_from_logits(head(hidden_btd), targets_bt)
    n = -(-t // chunk)
    pad = n * chunk - t
    h_nbcd = jnp.moveaxis(
        jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d), 1, 0
    )
    y_nbc = jnp.moveaxis(jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk), 1, 0)

    @jax.checkpoint
    def one(h_bcd, y_bc):
        return logp_entropy_from_logits(head(h_bcd), y_bc)

    _, (logp_nbc, ent_nbc) = jax.lax.scan(lambda c, xs: (c, one(*xs)), None, (h_nbcd, y_nbc))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * chunk)[:, :t]
    return unchunk(logp_nbc), unchunk(ent_nbc)
