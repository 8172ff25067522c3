"""Tokenizers: the char alphabet fits the embedded model, round trips, HF wrapper on a tiny
tokenizer built and saved inside the test (no downloads)."""

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from sao_jax.text.tokenizer import (
    CHAR_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)


def test_char_vocab_fits_embedded_model():
    tok = CharTokenizer()
    assert tok.vocab_size <= 64
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert len(set(CHAR_ALPHABET)) == len(CHAR_ALPHABET)
    assert isinstance(tok, Tokenizer)
    ids = tok.encode(CHAR_ALPHABET)
    assert sorted(ids) == list(range(4, tok.vocab_size))


def test_char_round_trip_env_formats():
    tok = CharTokenizer()
    texts = [
        "q:(12*7)+5\nc:12*7\nr:84\nc:84+5\nr:89\na:89\n",
        "e:bad\ne:div0\n",
        "```python\nprint(3//2, 5%2, [1,2], 'x', \"y\", a_b<=c>d)\n```\n```output\n1\n```\n",
        "w:moon tea\nnya the moon is fluffy and sweet~! or? thee.\n",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert tok.unk_id not in ids, text
        assert tok.decode(ids) == text


def test_char_unknown_and_specials():
    tok = CharTokenizer()
    ids = tok.encode("A\u00e9\x00\udcff{")
    assert ids == [tok.unk_id] * 5
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id, tok.pad_id]) == "ab"
    assert tok.decode([tok.unk_id]) == "\ufffd"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([64])


def _save_tiny_hf(path, *, config):
    vocab = {"[PAD]": 0, "[UNK]": 1, "<s>": 2, "</s>": 3, "hello": 4, "world": 5, "!": 6}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[PAD]", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_specials_and_decode(tmp_path):
    config = {"eos_token": "</s>", "pad_token": {"content": "[PAD]"}, "bos_token": "<s>"}
    _save_tiny_hf(tmp_path, config=config)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 2, 3, 7)
    ids = tok.encode("hello world !")
    assert ids == [4, 5, 6]
    assert tok.decode([2, *ids, 3, 0, 0]) == tok.decode(ids)
    assert "hello" in tok.decode(ids) and "<s>" not in tok.decode([2, *ids])


def test_hf_tokenizer_defaults_and_errors(tmp_path):
    _save_tiny_hf(tmp_path, config={"eos_token": "</s>", "bos_token": None})
    tok = HFTokenizer(tmp_path)
    assert tok.pad_id == tok.eos_id == 3 and tok.bos_id is None
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token='<nope>'"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no eos token.*tokenizer_config.json"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("garbage")
    with pytest.raises(ValueError, match="cannot read .*tokenizer.json"):
        HFTokenizer(tmp_path)
    with pytest.raises(ValueError, match="tokenizer.json does not exist"):
        HFTokenizer(tmp_path / "missing")


def test_load_tokenizer_spec():
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    with pytest.raises(ValueError, match="expected 'char' or a directory"):
        load_tokenizer("/no/such/dir")
