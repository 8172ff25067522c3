"""Checkpoint integrity: per-tensor fingerprints and per-file digests.

Orbax and TensorStore keep no checksum of the array data (a few overwritten bytes in an
OCDBT data file restore silently), so every checkpoint carries two of its own:

* **Tensor fingerprints** (the `checksums` item, saved with the step, so atomic with it):
  for every leaf x, two 32-bit sums over its raw words w_i (the bits of each element;
  bf16 / int8 / bool widened, 64-bit split in two):

      h_k(x) = sum_i mix(w_i) * m_k(i)  mod 2**32,   mix(w) = w ^ (w >> 16),
      m_1(i) = (i * 0x9E3779B1 + 0x7F4A7C15) | 1,  m_2(i) = (i * 0x85EBCA77 + 0x165667B1) | 1

  computed on device, in one jitted program over the sharded state (integer sums: the
  same on any mesh). m_k(i) is odd, hence invertible mod 2**32, and mix is a bijection, so
  any change to one word changes both sums; more changes escape with probability ~2**-64.
  Restore recomputes them on the restored arrays: a mismatch names the tensor.
* **File digests** (`integrity.process_<p>.json`, written once the step is committed;
  files, not a directory, which orbax would take for an item):
  the size and CRC-32 of every file of the step directory, each process the files it
  wrote (`ocdbt.process_<p>/...`; process 0 the rest). Restore checks them before it
  reads anything: a truncated or altered file is named (size, or CRC mismatch).

A step without them (written before this module) restores with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.parallel.partition import path_str

CHECKSUMS = "checksums"  # the orbax JSON item holding the tensor fingerprints
JSON_ITEM_FILE = "metadata"  # the file orbax's JsonCheckpointHandler writes in an item dir
DIGESTS = "integrity.process_{}.json"  # per-process file digests in a committed step
FORMAT = 1
_PROCESS_DIR = re.compile(r"^ocdbt\.process_(\d+)$")
_CHUNK = 1 << 22


def _words(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(w, i): x's raw bits as uint32 words and each word's flat index (uint32), both
    shaped like x (64-bit types: a trailing axis of 2); no reshape of sharded axes."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size == 4:
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif size < 4:
        w = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
    else:  # 8 bytes -> [..., 2] words
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    idx = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride)
        stride = (stride * w.shape[d]) & 0xFFFFFFFF
    return w, idx


def leaf_fingerprint(x: jax.Array) -> jax.Array:
    """[2] uint32: (h_1, h_2) of the module docstring."""
    w, i = _words(x)
    v = w ^ (w >> 16)
    m1 = (i * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
    m2 = (i * jnp.uint32(0x85EBCA77) + jnp.uint32(0x165667B1)) | jnp.uint32(1)
    return jnp.stack([jnp.sum(v * m1, dtype=jnp.uint32), jnp.sum(v * m2, dtype=jnp.uint32)])


def leaf_fingerprint_reference(x: np.ndarray) -> tuple[int, int]:
    """The same sums with Python integers, element by element (the tests' slow check)."""
    a = np.asarray(x)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    size = a.dtype.itemsize
    words = a.view(np.dtype(f"uint{8 * size}")).astype(np.uint64) if size <= 4 else None
    if words is None:
        words = a.view(np.uint32)  # 8 bytes: little-endian halves, last axis of 2
        words = words.reshape(*a.shape, 2) if a.ndim else words
    h1 = h2 = 0
    for i, w in enumerate(np.asarray(words).reshape(-1).tolist()):
        v = w ^ (w >> 16)
        h1 += v * (((i * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF) | 1)
        h2 += v * (((i * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF) | 1)
    return h1 & 0xFFFFFFFF, h2 & 0xFFFFFFFF


@jax.jit
def _fingerprints(tree):
    return jax.tree.map(leaf_fingerprint, tree)


def fingerprint(tree: Any) -> dict[str, list[int]]:
    """{tensor name: [h_1, h_2]} of every array leaf (collective with several processes:
    every process calls it on the same global arrays)."""
    out = _fingerprints(tree)
    leaves = jax.tree_util.tree_flatten_with_path(out)[0]
    return {path_str(p): [int(v) for v in np.asarray(h.addressable_data(0))] for p, h in leaves}


def checksums_payload(tree: Any) -> dict[str, Any]:
    return {"format": FORMAT, "tensors": fingerprint(tree)}


def first_mismatch(stored: dict[str, Any], restored_tree: Any) -> str | None:
    """None when every restored tensor has its stored fingerprint, else a description
    naming the first that does not."""
    want = stored.get("tensors", {})
    got = fingerprint(restored_tree)
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            stored, read = want.get(name), got.get(name)
            return f"tensor {name} does not match its checksum (stored {stored}, read {read})"
    return None


# ----------------------------------------------------------------------------- files


def _owner(rel: pathlib.PurePath) -> int:
    """The process that wrote a file of the step directory (ocdbt.process_<p>/: p; else 0)."""
    for part in rel.parts:
        m = _PROCESS_DIR.match(part)
        if m:
            return int(m.group(1))
    return 0


def _crc(path: pathlib.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _is_digest(rel: pathlib.PurePath) -> bool:
    return len(rel.parts) == 1 and rel.name.startswith("integrity.process_")


def write_digests(step_dir: pathlib.Path, process: int) -> pathlib.Path:
    """Writes integrity.process_<process>.json: {relative path: [size, crc32]} of the
    files this process wrote. Atomic (a sibling, then rename)."""
    files = {}
    for path in sorted(step_dir.rglob("*")):
        rel = path.relative_to(step_dir)
        if path.is_file() and not _is_digest(rel) and _owner(rel) == process:
            files[rel.as_posix()] = [path.stat().st_size, _crc(path)]
    out = step_dir / DIGESTS.format(process)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "files": files}, sort_keys=True))
    os.replace(tmp, out)
    return out


def check_digests(step_dir: pathlib.Path, process: int, count: int) -> tuple[bool, str | None]:
    """(has digests, problem): the files listed in this process's share of the digest
    files (integrity.process_<k>.json for k = process, process + count, ...) against
    their size and CRC; `problem` names the first damaged or missing file."""
    digests = sorted(step_dir.glob(DIGESTS.format("*")))
    if not digests:
        return False, None
    for d in digests:
        k = int(d.name.removeprefix("integrity.process_").removesuffix(".json"))
        if k % count != process:
            continue
        try:
            files = json.loads(d.read_text())["files"]
        except (OSError, ValueError, KeyError) as e:
            return True, f"{d.relative_to(step_dir)}: unreadable digest file ({e})"
        for rel, (size, crc) in sorted(files.items()):
            path = step_dir / rel
            try:
                have = path.stat().st_size
            except OSError:
                return True, f"{rel}: missing"
            if have != size:
                return True, f"{rel}: {have} bytes, written with {size} (truncated or extended)"
            if _crc(path) != crc:
                return True, f"{rel}: contents changed (CRC-32 mismatch)"
    return True, None


def stored_digest(directory: str | os.PathLike) -> str | None:
    """A short digest (16 hex) of the tensor fingerprints stored with the newest committed
    step under a Checkpointer's `directory`, read from disk (nothing restored): two
    checkpoints with one digest hold the same tensors (to ~2**-64 per tensor). None when
    there is no committed step or it stores no fingerprints."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return None
    steps = [int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit()]
    if not steps:
        return None
    path = root / str(max(steps)) / CHECKSUMS / JSON_ITEM_FILE
    try:
        tensors = json.loads(path.read_text())["tensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    blob = json.dumps(tensors, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
