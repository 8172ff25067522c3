"""The in-place weight sync's buffer: models/hf.py's export (`hf_entries`, Hugging Face
names and shapes in the sync's dtype) written into one flat file, each tensor ALIGN-byte
aligned, with the manifest (name, dtype, shape, offset) that the vLLM server's worker
extension (sao_jax/sampling/vllm_worker_ext.py) reads to view each tensor in place.
sao_jax/sampling/backend_vllm.py stages it in /dev/shm (shared memory) when there is room.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

ALIGN = 64  # bytes: each staged tensor starts on a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def staged_size(entries) -> int:
    """Bytes of the buffer `stage_weights` writes for `entries`."""
    return sum(_aligned(e.nbytes) for e in entries)


def stage_weights(entries, path: str, dtype: str) -> list[dict]:
    """Writes `entries` (models/hf.py hf_entries, produced one at a time) into one flat
    buffer file at `path`, each tensor ALIGN-byte aligned; returns the manifest
    (name, dtype, shape, offset) that sampling/vllm_worker_ext.py reads. The file is
    removed if a tensor fails."""
    manifest, size = [], 0
    for e in entries:
        manifest.append(dict(name=e.name, dtype=dtype, shape=list(e.shape), offset=size))
        size += _aligned(e.nbytes)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path, "w+b") as f:
            f.truncate(max(size, 1))
            with mmap.mmap(f.fileno(), max(size, 1)) as buf:
                for e, t in zip(entries, manifest, strict=True):
                    arr = np.ascontiguousarray(np.asarray(e.produce()).astype(e.dtype))
                    if arr.shape != tuple(e.shape):
                        raise ValueError(f"{e.name}: produced {arr.shape}, declared {e.shape}")
                    buf[t["offset"] : t["offset"] + e.nbytes] = arr.reshape(-1).view(np.uint8)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return manifest
