"""Shared inputs of the attention tests: layouts of positions and segment ids, random
q/k/v, the naive reference, and values with q/k/v gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.attention import attention_mask, grouped_attention

B, T, N, K, H = 2, 40, 4, 2, 8


def layout_of(kind: str):
    """positions, segment ids [B, T] of a padded, a packed or an unordered layout."""
    if kind == "padded":  # one trajectory per row, then padding
        lengths = (T - 5, T)
        seg = np.array([[1] * n + [0] * (T - n) for n in lengths])
        pos = np.broadcast_to(np.arange(T), (B, T))
    elif kind == "packed":  # three / two trajectories per row, positions restart
        runs = [(1, 11), (2, 17), (3, 7)], [(5, 30), (6, 10)]
        seg, pos = np.zeros((B, T), int), np.zeros((B, T), int)
        for b, row in enumerate(runs):
            t = 0
            for sid, n in row:
                seg[b, t : t + n], pos[b, t : t + n] = sid, np.arange(n)
                t += n
    else:  # segment ids that decrease along the row (still a valid layout)
        seg = np.array([[2] * 20 + [1] * 20, [1] * 10 + [3] * 25 + [0] * 5])
        pos = np.concatenate([np.arange(20), np.arange(20)])[None].repeat(B, 0)
    return jnp.asarray(pos, jnp.int32), jnp.asarray(seg, jnp.int32)


def qkv(seed=0, t=T, dtype=jnp.float32):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, t, N, H), dtype)
    k = jax.random.normal(kk, (B, t, K, H), dtype)
    v = jax.random.normal(kv, (B, t, K, H), dtype)
    return q, k, v, jax.random.normal(kc, (B, t, N, H), jnp.float32)


def naive(q, k, v, pos, seg):
    return grouped_attention(q, k, v, attention_mask(pos, pos, seg, seg))


def value_and_grads(fn, q, k, v, pos, seg, ct):
    """Output and d(sum(out * ct))/d(q, k, v), with ct zero on padding queries."""
    ct = ct * (seg != 0)[:, :, None, None]
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, pos, seg).astype(jnp.float32) * ct)
    return fn(q, k, v, pos, seg), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
