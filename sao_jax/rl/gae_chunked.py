"""Observation-skipping GAE as one linear recurrence, solved in blocks with two matmuls.

The masked-carry recursion of sao_jax/rl/gae.py (docs/method.md section 4) has a closed
form. Let a_0 = t < a_1 < ... be the action tokens from t on, gl = gamma * lam (per row).
Then A_t = sum_k gl^k delta(a_k), and collecting terms per token gives, on action tokens,

    A_t = x_t - V_t,   R_t = A_t + V_t = x_t,   where  x_t = d_t + c_t x_{t+1},
    d_t = r_t + (gamma - gl) m_{t+1} V_{t+1},   c_t = gl if m_{t+1} else 1,
    x_T = gamma * last_value,

(rewards on observations ride along undiscounted until the next action, exactly the
"parked" credit of the masked-carry form; V enters at the next action only). One
first-order recurrence, no next-action lookups, and every coefficient is gl^(0 or 1).

In the natural [B, T] layout (no transposes: on XLA:CPU a transpose costs ~4x a copy),
cut T into blocks of L = 32 tokens. With e_i = the number of gl factors before position i
of the block (a popcount of the block's mask bits, packed into one uint32 per block),

    x_i = sum_{j >= i} gl^(e_j - e_i) d_j + gl^(n - e_i) x_in,   n = factors in the block,

which is separable: gl^(e_j - c) * gl^(c - e_i) with c = L / 2, so the sum is ONE matmul
with a fixed triangular ones matrix. Exponents stay in [-L/2, L/2], representable while
gl >= `MIN_DISCOUNT`; rows below it (gl = 0: lam = 0 or gamma = 0) take the reverse
scan instead (gae.py switches with `lax.cond`, so the common case pays nothing).
The block inputs x_in follow from a short reverse scan over the T / L block summaries:
X_j = x_0 of block j + gl^(n_j) X_(j+1). Memory traffic: the inputs once, the matmul's
operand and result, one more read of v, m for the outputs (about 2.5x a copy of the
inputs and outputs), and two exponentials per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32  # L: tokens per block, the bits of one uint32 (docs/benchmarks.md, "GAE")
MIN_DISCOUNT = 1e-2  # gl^(+-L/2) must stay a normal float32: 0.01^16 = 1e-32
_HI = jax.lax.Precision.HIGHEST  # exact float32 sums on every backend (no bf16 passes)


def next_action_bits(m_bjl):
    """[B, nb] uint32 words: bit i of block j is m at token j L + i + 1 (the NEXT token),
    i.e. whether step i -> i + 1 enters an action (0 past the last token)."""
    size = m_bjl.shape[-1]
    shifts_l = jnp.arange(size, dtype=jnp.uint32)
    word_bj = jnp.sum(m_bjl.astype(jnp.uint32) << shifts_l, axis=-1, dtype=jnp.uint32)
    first_bj = jnp.pad(word_bj[:, 1:] & 1, ((0, 0), (0, 1)))  # next block's token 0
    return (word_bj >> 1) | (first_bj << (size - 1))


def factors_before(bits_bj, size: int):
    """e [B, nb, L]: the number of gl factors before position i of its block, popcount of
    the bits below i (exact integers, as float32)."""
    below_l = (jnp.uint32(1) << jnp.arange(size, dtype=jnp.uint32)) - 1
    return jax.lax.population_count(bits_bj[:, :, None] & below_l).astype(jnp.float32)


def suffix_sums(w_bjl):
    """s_i = sum_{k >= i} w_k within each block: one matmul with a triangular ones matrix."""
    size = w_bjl.shape[-1]
    upper_kl = jnp.tril(jnp.ones((size, size), w_bjl.dtype))  # [k, i]: k >= i
    return jnp.einsum("bjk,ki->bji", w_bjl, upper_kl, precision=_HI)


def block_inputs(x0_bj, carry_bj, x_end_b):
    """X_bj = x at the first token AFTER block j: X_(last) = x_end, and going back
    X_(j-1) = x0_j + carry_j X_j (carry_j = gl^(n_j)): a reverse scan over T / L blocks."""

    def step(x_after_b, inp):
        x0_b, carry_b = inp
        return x0_b + carry_b * x_after_b, x_after_b

    _, after_jb = jax.lax.scan(step, x_end_b, (x0_bj.T, carry_bj.T), reverse=True, unroll=8)
    return after_jb.T


def gae_chunked(r_bt, v_bt, m_bt, gamma, lam_b, last_b):
    """(advantages, returns) [B, T] of the masked-carry GAE (0 off actions); requires
    gamma * lam_b >= MIN_DISCOUNT on rows with actions (gae.py checks and falls back)."""
    b, t = r_bt.shape
    size, c = BLOCK, BLOCK // 2
    nb = -(-t // size)
    if nb * size != t:  # pad with non-action tokens: x passes through them unchanged
        pad = ((0, 0), (0, nb * size - t))
        a_bt, ret_bt = gae_chunked(
            jnp.pad(r_bt, pad), jnp.pad(v_bt, pad), jnp.pad(m_bt, pad), gamma, lam_b, last_b
        )
        return a_bt[:, :t], ret_bt[:, :t]
    gl_b = gamma * lam_b
    log_gl_b = jnp.log(jnp.maximum(gl_b, MIN_DISCOUNT))[:, None]  # rows below: scan instead
    bits_bj = next_action_bits(m_bt.reshape(b, nb, size))
    mnext_bt = jnp.pad(m_bt[:, 1:], ((0, 0), (0, 1)))
    vnext_bt = jnp.pad(v_bt[:, 1:], ((0, 0), (0, 1)))
    d_bt = r_bt + jnp.where(mnext_bt, (gamma - gl_b)[:, None] * vnext_bt, 0.0)
    e_bjl = factors_before(bits_bj, size)
    s_bjl = suffix_sums(jnp.exp((e_bjl - c) * log_gl_b[..., None]) * d_bt.reshape(b, nb, size))
    n_bj = jax.lax.population_count(bits_bj).astype(jnp.float32)
    x0_bj = jnp.exp(c * log_gl_b) * s_bjl[:, :, 0]  # x at each block's first token, local
    after_bj = block_inputs(x0_bj, jnp.exp(n_bj * log_gl_b), gamma * last_b)
    tail_bj = jnp.exp((n_bj - c) * log_gl_b) * after_bj  # gl^(n - c) X_after
    x_bjl = jnp.exp((c - e_bjl) * log_gl_b[..., None]) * (s_bjl + tail_bj[:, :, None])
    a_bt = jnp.where(m_bt, x_bjl.reshape(b, t) - v_bt, 0.0)
    return a_bt, jnp.where(m_bt, a_bt + v_bt, 0.0)  # returns = A + V, as the other forms
