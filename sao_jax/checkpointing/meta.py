r"""JSON codec of a checkpoint's `meta` item (and of the workdir's config.json).

JSON has no bytes and only string object keys; the loop's meta has both (a grain
iterator state may be bytes, a histogram may be keyed by int). They are tagged:

    b"\x00\x01"        -> {"__bytes__": "AAE="}              (base64)
    {0: 5, 1: 3}       -> {"__dict_items__": [[0, 5], [1, 3]]}

and `decode_meta` reverses the tags. Tuples are stored as lists and numpy scalars as
Python scalars (these two do not come back as they went in).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

_BYTES, _ITEMS = "__bytes__", "__dict_items__"


def encode_meta(meta: Any, where: str = "meta") -> Any:
    """A JSON-able copy of `meta`, raising TypeError naming the first unsupported value.

    bytes -> {"__bytes__": base64}; a dict with int keys -> {"__dict_items__": [[k, v]]};
    tuples -> lists; numpy scalars -> Python scalars. `decode_meta` inverts all but the
    last two (tuples come back as lists, numpy scalars as int/float/bool).
    """
    if isinstance(meta, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(bytes(meta)).decode("ascii")}
    if isinstance(meta, np.generic):
        return meta.item()
    if meta is None or isinstance(meta, (bool, int, float, str)):
        return meta
    if isinstance(meta, (list, tuple)):
        return [encode_meta(v, f"{where}[{i}]") for i, v in enumerate(meta)]
    if isinstance(meta, dict):
        out = {}
        for k, v in meta.items():
            key = k.item() if isinstance(k, np.integer) else k
            if key in (_BYTES, _ITEMS):
                raise ValueError(f"{where}: key {k!r} is reserved by the checkpoint meta codec")
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"{where}: dict key {k!r} is not a str or int")
            out[key] = encode_meta(v, f"{where}[{k!r}]")
        if all(isinstance(k, str) for k in out):
            return out
        return {_ITEMS: [[k, v] for k, v in out.items()]}
    raise TypeError(f"{where}: {type(meta).__name__} is not JSON-serialisable")


def decode_meta(data: Any) -> Any:
    """Inverse of `encode_meta` on its JSON output."""
    if isinstance(data, list):
        return [decode_meta(v) for v in data]
    if isinstance(data, dict):
        if set(data) == {_BYTES}:
            return base64.b64decode(data[_BYTES])
        if set(data) == {_ITEMS}:
            return {k: decode_meta(v) for k, v in data[_ITEMS]}
        return {k: decode_meta(v) for k, v in data.items()}
    return data
