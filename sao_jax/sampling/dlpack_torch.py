"""A jax.Array as a torch tensor over the same memory (DLPack), for the GPU weight sync.

The GPU sync (weight_sync_nccl.py) broadcasts each exported tensor with NCCL from the
trainer's GPU. NCCL sends from a device pointer, so the tensor must be one contiguous
buffer on one device; `torch.from_dlpack` wraps the jax buffer without a copy (same
device, same bytes), and torch is imported only here, when called: the trainer imports
this module without torch where no GPU sync runs.

Verified on CPU (tests/test_weight_payloads.py): bfloat16 and float32 arrays convert bit
for bit with the tensor's data pointer equal to the jax buffer's (no copy). On a GPU the
same call wraps the CUDA buffer (DLPack's device type kDLCUDA): not run here.
"""

from __future__ import annotations

import jax


def single_device(x: jax.Array, device: jax.Device) -> jax.Array:
    """`x` whole on `device` (a device-to-device gather when it is sharded; nothing when
    it is already there)."""
    if x.devices() == {device} and x.is_fully_addressable:
        return x
    return jax.device_put(x, device)


def to_torch(x: jax.Array):
    """`x` (one device) as a torch tensor over its buffer; a contiguous copy on the same
    device only when the wrapped tensor is not contiguous (NCCL sends numel elements from
    data_ptr). RuntimeError naming the cause without torch."""
    try:
        import torch  # the trainer's torch: CPU build in .venv, a CUDA build on GPU hosts
    except ImportError as e:
        raise RuntimeError(f"the GPU weight sync needs torch in the trainer's env: {e}") from e
    if len(x.devices()) != 1:
        raise ValueError(f"to_torch: a one-device array, got one on {len(x.devices())} devices")
    t = torch.from_dlpack(x)
    return t if t.is_contiguous() else t.contiguous()


def shares_memory(x: jax.Array, t) -> bool:
    """Whether tensor `t` views `x`'s buffer (DLPack zero-copy)."""
    return x.unsafe_buffer_pointer() == t.data_ptr()
