"""Tokenizers: a built-in character tokenizer for the embedded tasks, and HF `tokenizers`.

The sampler owns tokenisation (envs see text). Both tokenizers expose the same small
surface (`Tokenizer`): `encode` never adds special tokens, `decode` drops pad/eos/bos.

`CharTokenizer` is sized for the embedded model (vocab 64): ids 0..3 are
`<pad> <bos> <eos> <unk>`, then one id per character of `CHAR_ALPHABET`, in order.
Any other character encodes to `<unk>`; `<unk>` decodes to U+FFFD.
"""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import tokenizers

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
# 60 characters: digits, lowercase letters, space and newline, the arithmetic operators
# and parentheses, and the punctuation the env formats use (':' tags, '`' fences, '<>'
# tags, '~' and '!?' for the style task, quotes, brackets, '=', '_', '%' for tiny code).
CHAR_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz \n+-*/():=.,!?'\"_<>`[]%~"
UNK_TEXT = "\ufffd"  # what <unk> decodes to


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping pad, eos and bos."""
        ...


# Hugging Face tokenizers also carry `path` (their directory), `specials` (token strings:
# eos_token, ...) and `eos_text`, which chat templates use (sao_jax/text/chat_template.py).


class CharTokenizer:
    """One id per character of `CHAR_ALPHABET`; vocab_size = 4 + 60 = 64."""

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.alphabet = CHAR_ALPHABET
        self.vocab_size = len(CHAR_SPECIALS) + len(CHAR_ALPHABET)
        self._ids = {c: i + len(CHAR_SPECIALS) for i, c in enumerate(CHAR_ALPHABET)}
        self._skip = frozenset((self.pad_id, self.bos_id, self.eos_id))
        self.eos_text = None  # no chat template for the built-in tokenizer
        self.specials: dict[str, str] = {}

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, self.unk_id) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"decode: id {i} out of range [0, {self.vocab_size})")
            if i in self._skip:
                continue
            out.append(UNK_TEXT if i == self.unk_id else CHAR_ALPHABET[i - len(CHAR_SPECIALS)])
        return "".join(out)


def _special_token(config: dict[str, Any], field: str, file: pathlib.Path) -> str | None:
    """`eos_token` etc. from tokenizer_config.json: a string, {"content": ...} or null."""
    value = config.get(field)
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{file}: field {field!r} is not a token string: {value!r}")
    return value


class HFTokenizer:
    """`tokenizers.Tokenizer` from `<path>/tokenizer.json`, specials from tokenizer_config.json.

    eos is required; pad falls back to eos when the config names none; bos may be None.
    """

    def __init__(self, path: str | pathlib.Path) -> None:
        root = pathlib.Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer: {tok_file} does not exist")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust error type is not importable
            raise ValueError(f"tokenizer: cannot read {tok_file}: {e}") from e
        cfg_file = root / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"tokenizer: cannot read {cfg_file}: {e}") from e
            if not isinstance(config, dict):
                raise ValueError(f"tokenizer: {cfg_file} is not a JSON object")
        ids, self.specials = {}, {}
        for field in ("eos_token", "pad_token", "bos_token", "unk_token"):
            token = _special_token(config, field, cfg_file)
            ids[field] = None if token is None else self._tok.token_to_id(token)
            if token is not None and ids[field] is None:
                raise ValueError(f"tokenizer: {cfg_file} {field}={token!r} is not in {tok_file}")
            if token is not None:
                self.specials[field] = token  # chat templates see them (eos_token, ...)
        if ids["eos_token"] is None:
            raise ValueError(f"tokenizer: no eos token; set 'eos_token' in {cfg_file}")
        self.path = root
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = int(ids["eos_token"])
        self.pad_id = int(ids["pad_token"] if ids["pad_token"] is not None else self.eos_id)
        self.bos_id = None if ids["bos_token"] is None else int(ids["bos_token"])
        self.eos_text = self.specials["eos_token"]  # ends the policy's turns in a chat
        self._skip = frozenset(i for i in (self.pad_id, self.eos_id, self.bos_id) if i is not None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        keep = [int(i) for i in ids if int(i) not in self._skip]
        return self._tok.decode(keep, skip_special_tokens=False)


def load_tokenizer(spec: str) -> Tokenizer:
    """ "char" -> CharTokenizer; "harness" -> the harness demo's local BPE with the
    Qwen3-style template (sao_jax/text/harness_tokenizer.py, built once per process); a
    directory holding tokenizer.json -> HFTokenizer."""
    if spec == "char":
        return CharTokenizer()
    if spec == "harness":
        return HFTokenizer(_harness_dir())
    if pathlib.Path(spec).is_dir():
        return HFTokenizer(spec)
    raise ValueError(
        f"tokenizer spec {spec!r}: expected 'char' or a directory containing tokenizer.json"
    )


@functools.cache
def _harness_dir() -> pathlib.Path:
    """The harness tokenizer's files, built into a temporary folder of this process
    (deterministic: the same files every time, in about half a second)."""
    import atexit
    import shutil
    import tempfile

    from sao_jax.text.harness_tokenizer import write_harness_tokenizer

    path = pathlib.Path(tempfile.mkdtemp(prefix="sao-harness-tokenizer-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return write_harness_tokenizer(path)
