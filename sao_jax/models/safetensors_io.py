"""Streaming safetensors: parse headers, read slices through a memory map, write tensor by tensor.

The format is small enough to handle directly, which lets bfloat16 load without torch
(numpy has no bfloat16; `ml_dtypes` provides it) and lets a reader copy out only the
slice a device needs:

    [8-byte little-endian header size n][n bytes of JSON header][data buffer]

The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, with
offsets relative to the data buffer; an optional "__metadata__" maps str to str. Tensors
are stored row-major and tile the buffer without gaps.

`Source` describes a parameter as a reshaped, transposed (and per-expert stacked) view of
stored tensors; `read_target` reads any block of it touching only that block's bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from sao_jax.schema import ConfigError

# safetensors dtype code -> numpy dtype (floating point only: these files hold weights).
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the reference implementation's limit


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: `start` is its absolute byte offset in `file`."""

    name: str
    file: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parses one file's header: ({name: TensorInfo}, metadata). Reads no tensor data.

    Raises ConfigError naming the file (and tensor) for a truncated or malformed header,
    an unsupported dtype, or offsets that do not match dtype x shape or the file size.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ConfigError(f"{path}: header size {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base, buffer = 8 + n, size - 8 - n
    out, spans = {}, []
    for name, entry in header.items():
        where = f"tensor {name} in {path}"
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: malformed header entry {entry!r}") from e
        if code not in DTYPES:
            raise ConfigError(f"{where}: unsupported dtype {code}; supported: {sorted(DTYPES)}")
        want = math.prod(shape) * DTYPES[code].itemsize
        if not 0 <= begin <= end <= buffer or end - begin != want:
            raise ConfigError(
                f"{where}: data_offsets [{begin}, {end}] do not hold {code}{list(shape)} "
                f"({want} bytes) inside the {buffer}-byte data buffer"
            )
        out[name] = TensorInfo(name, path, code, shape, base + begin, want)
        spans.append((begin, end, name))
    for (_, e0, a), (b1, _, b) in zip(sorted(spans), sorted(spans)[1:]):
        if b1 < e0:
            raise ConfigError(f"{path}: tensors {a} and {b} overlap in the data buffer")
    return out, metadata


class Reader:
    """Reads slices of tensors through one read-only memory map per file.

    Only the requested elements are copied into a new array; the map itself is backed by
    the page cache, not by process memory. Use as a context manager to close the maps.
    """

    def __init__(self):
        self._maps: dict[str, mmap.mmap] = {}

    def view(self, info: TensorInfo) -> np.ndarray:
        """A read-only zero-copy view of the whole tensor (no bytes read yet)."""
        if info.file not in self._maps:
            with open(info.file, "rb") as f:
                self._maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.ndarray(
            info.shape, info.np_dtype, buffer=self._maps[info.file], offset=info.start
        )

    def read(self, info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
        """A fresh array holding `tensor[index]` (basic slices only)."""
        return np.array(self.view(info)[index])

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view still alive (in a traceback, say)
                m.close()
        self._maps.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor to write: `produce()` returns it (host array) only when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def write_file(path: str, entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> None:
    """Writes one safetensors file, producing and writing one tensor at a time.

    The header is computed from the declared shapes first, so at most one tensor is on
    the host at once. Raises ValueError when a produced tensor's shape differs from the
    declared one.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for e in entries:
        code = CODES.get(np.dtype(e.dtype))
        if code is None:
            raise ValueError(f"tensor {e.name}: cannot write dtype {np.dtype(e.dtype)}")
        header[e.name] = {
            "dtype": code,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data buffer to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for e in entries:
            arr = np.ascontiguousarray(np.asarray(e.produce()).astype(e.dtype, copy=False))
            if arr.shape != tuple(e.shape):
                raise ValueError(f"tensor {e.name}: produced shape {arr.shape}, declared {e.shape}")
            arr.tofile(f)
            del arr


def plan_shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Splits entries, in order, into files of at most `max_shard_bytes` (a tensor larger
    than that gets a file of its own)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


# ------------------------------------------------------------ layout transforms


@dataclasses.dataclass(frozen=True)
class Source:
    """How one parameter is read from checkpoint tensor(s) (the inverse writes them back).

    target = transpose(reshape(tensor, view)[select], perm), where `split[i]` splits tensor
    dimension i row-major into view dimensions, `select = (view dim, index)` fixes one
    view dimension (the gate or up half of a fused tensor) and target dimension j is the
    kept view dimension perm[j]. With `stacked`, `names` holds one tensor per expert and
    the target is their stack along a new leading axis.
    """

    names: tuple[str, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    select: tuple[int, int] | None = None
    stacked: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.split)


def _flat(starts, sizes) -> int:
    """Row-major offset of multi-index `starts` in a block of `sizes`."""
    off = 0
    for s, n in zip(starts, sizes):
        off = off * n + s
    return off


def read_block(reader: Reader, info: TensorInfo, src: Source, index) -> np.ndarray:
    """target[index] of one (non-stacked) source, reading only the rows it needs.

    `index` is a tuple of step-1 slices with explicit bounds, one per target dimension.
    For each tensor dimension, the view slices are one contiguous range when every view
    dimension after the first one cut to more than one element is whole (the usual case:
    heads sharded, head_dim whole); otherwise that tensor dimension is read whole and cut after.
    """
    sizes = [s for g in src.split for s in g]
    kept = [v for v in range(len(sizes)) if src.select is None or v != src.select[0]]
    view_idx: list[slice] = [slice(0, n) for n in sizes]
    for j, sl in enumerate(index):
        view_idx[kept[src.perm[j]]] = sl
    if src.select is not None:
        view_idx[src.select[0]] = slice(src.select[1], src.select[1] + 1)
    hf_idx, block, post, v = [], [], [], 0
    for group in src.split:
        sl = view_idx[v : v + len(group)]
        lens = [s.stop - s.start for s in sl]
        first = next((k for k, n in enumerate(lens) if n > 1), len(group))
        if all(lens[k] == group[k] for k in range(first + 1, len(group))):
            start = _flat([s.start for s in sl], group)
            hf_idx.append(slice(start, start + math.prod(lens)))
            block += lens
            post += [slice(None)] * len(group)
        else:
            hf_idx.append(slice(None))
            block += list(group)
            post += sl
        v += len(group)
    x = reader.read(info, tuple(hf_idx)).reshape(block)[tuple(post)]
    if src.select is not None:
        x = x.squeeze(src.select[0])
    return np.transpose(x, src.perm)


def read_target(reader, tensors, src: Source, index, dtype) -> np.ndarray:
    """target[index] in `dtype`; stacked sources read one expert tensor per index row."""
    if not src.stacked:
        return np.ascontiguousarray(read_block(reader, tensors[src.names[0]], src, index), dtype)
    out = None
    experts = range(index[0].start, index[0].stop)
    for row, e in enumerate(experts):
        x = read_block(reader, tensors[src.names[e]], src, index[1:])
        if out is None:
            out = np.empty((len(experts), *x.shape), dtype)
        out[row] = x
    return out


def to_source_view(src: Source, t):
    """Inverse of `read_block` on a whole target: back to the view (selected dim kept).
    Array methods only, so a jax.Array stays on its devices (models/hf.py `on_device`)."""
    x = t.transpose(tuple(int(a) for a in np.argsort(src.perm)))
    if src.select is None:
        return x
    k = src.select[0]
    return x.reshape((*x.shape[:k], 1, *x.shape[k:]))
