"""The payloads of one weight sync to vLLM on an accelerator: what is sent, in what order.

Shared by the GPU sync (weight_sync_nccl.py: one NCCL broadcast per payload) and the TPU
sync (weight_sync_tpu.py: one reshard per payload). Both walk models/hf.py's `hf_entries`
with `on_device=True`: the one export mapping the CPU sync (weight_staging.stage_weights)
and `save_hf_checkpoint` use, producing each Hugging Face tensor as a jax.Array on the
params' devices (no host copy).

`update_info(plan)` is the per-round message vLLM's own NCCL weight-transfer receiver takes
(vLLM 0.32 `vllm/distributed/weight_transfer/nccl_engine.py`, NCCLWeightTransferUpdateInfo:
`names`, `dtype_names` as torch dtype names, `shapes`); the receiver in
vllm_worker_nccl.py reads the same fields. Sender and receiver agree on the order of the
broadcasts only through this list, so it is built once per sync and checked against every
produced tensor before it is sent (`checked`): a mismatch is an error naming the tensor,
not a hang inside NCCL.

Verified on CPU (tests/test_weight_payloads.py): the plan covers every tensor of the HF
export once, with its names, shapes and dtypes; the device-produced tensors equal
save_hf_checkpoint's bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import jax
import numpy as np

from sao_jax.models import hf
from sao_jax.models import safetensors_io as st
from sao_jax.models.config import ModelConfig
from sao_jax.parallel.partition import Params

# numpy dtype names (ml_dtypes for bfloat16) -> torch dtype names (getattr(torch, name))
TORCH_DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}


@dataclasses.dataclass(frozen=True)
class Payload:
    """One tensor of a sync: its Hugging Face name, shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # 'bfloat16' | 'float32' | 'float16' (numpy and torch spell them alike)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(st_dtype(self.dtype)).itemsize


def st_dtype(name: str) -> np.dtype:
    """A dtype name -> numpy dtype (bfloat16 from ml_dtypes)."""
    return np.dtype(st.DTYPES["BF16"]) if name == "bfloat16" else np.dtype(name)


def device_entries(cfg: ModelConfig, params: Params, dtype: str) -> list[st.Entry]:
    """models/hf.py's export with every tensor produced on the params' devices."""
    return hf.hf_entries(cfg, params, dtype=dtype, on_device=True)


def payload_plan(entries: Iterable[st.Entry]) -> list[Payload]:
    """The ordered payloads of `entries` (what the receiver allocates, in send order)."""
    plan = [
        Payload(e.name, tuple(int(n) for n in e.shape), np.dtype(e.dtype).name) for e in entries
    ]
    seen: set[str] = set()
    for p in plan:
        if p.dtype not in TORCH_DTYPE_NAMES:
            raise ValueError(
                f"weight sync: tensor {p.name} has dtype {p.dtype}, not one of "
                f"{sorted(TORCH_DTYPE_NAMES)}"
            )
        if p.name in seen:
            raise ValueError(f"weight sync: tensor {p.name} is planned twice")
        seen.add(p.name)
    return plan


def update_info(plan: Iterable[Payload]) -> dict:
    """The plan as vLLM's NCCL update info: {'names', 'dtype_names', 'shapes'}."""
    plan = list(plan)
    return dict(
        names=[p.name for p in plan],
        dtype_names=[TORCH_DTYPE_NAMES[p.dtype] for p in plan],
        shapes=[list(p.shape) for p in plan],
    )


def checked(entries: Iterable[st.Entry], plan: list[Payload]) -> Iterator[tuple[str, jax.Array]]:
    """(name, array) of each entry, produced one at a time, each checked against its
    payload (name, shape, dtype); ValueError naming the first that differs, or a count
    that differs, before anything of it is sent."""
    n = 0
    for e, p in zip(entries, plan, strict=False):
        x = e.produce()
        got = Payload(e.name, tuple(x.shape), np.dtype(x.dtype).name)
        if got != p:
            raise ValueError(f"weight sync: payload {n} planned as {p}, produced {got}")
        n += 1
        yield e.name, x
    if n != len(plan):
        raise ValueError(f"weight sync: {n} tensors produced, {len(plan)} planned")
