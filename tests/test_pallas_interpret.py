"""Every Pallas kernel the project runs, in Pallas interpret mode on CPU, against the
project's reference; and its TPU (Mosaic) lowering.

The one Pallas kernel the project selects is splash attention (`model.attention_impl`
'splash', what 'auto' runs on TPU; sao_jax/models/attention_backends.py). Here it runs
its own kernel code in interpret mode, forward and backward (the dq and dkv kernels),
against the naive attention (`grouped_attention` + `attention_mask`, which materialises
the scores), on padded rows, packed rows and rows whose segment ids decrease (those take
the blockwise fallback inside the same call). Tolerances, per dtype, on every query
that sees a key:
  float32   |splash - naive| <= 2e-5 (values and q/k/v gradients);
  bfloat16  |splash - naive| <= 2e-2 x max |naive| (naive in float32 on the same
            bf16-rounded inputs; measured <= 8.5e-3, one bf16 rounding is 3.9e-3).
The whole attention layer with 'splash' is checked in tests/test_attention.py.

No Pallas grouped-matmul kernel is used: the MoE's GPU/TPU path is XLA's `ragged_dot`
(lowered for both in tests/test_lowering.py; compared with the grouped path on the
device by experiments/device_check.py), its CPU path pure JAX (tests/test_moe_grouped.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import attention_backends as backends
from tests.attention_support import layout_of, naive, qkv, value_and_grads

TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}  # absolute; bf16: relative to max |ref|


def _splash(q, k, v, pos, seg):
    return backends.splash_attention(q, k, v, pos, seg, block=128)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["padded", "packed", "unordered"])
def test_splash_interpret_equals_naive(layout, dtype):
    pos, seg = layout_of(layout)
    q, k, v, ct = qkv()
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    rounded = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_g = value_and_grads(naive, *rounded, pos, seg, ct)
    got, got_g = value_and_grads(jax.jit(_splash), q, k, v, pos, seg, ct)
    real = np.asarray(seg != 0)[:, :, None, None]
    for name, g, w in [("out", got, want), *zip(("dq", "dk", "dv"), got_g, want_g)]:
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name == "out":
            g, w = np.where(real, g, 0), np.where(real, w, 0)
        scale = 1.0 if dtype == "float32" else float(np.max(np.abs(w)))
        np.testing.assert_allclose(g, w, atol=TOLERANCE[dtype] * scale, rtol=0, err_msg=name)


def test_splash_lowers_for_tpu():
    """The TPU kernels (forward, dq, dkv) lower to Mosaic custom calls without a TPU."""
    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def loss(q, k, v, pos, seg):
        out = backends.splash_attention(q, k, v, pos, seg, block=128, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss)).trace(q, k, k, p, p).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") == 3
