"""The harness demo's tokenizer: a small byte-level BPE built locally, never downloaded.

`write_harness_tokenizer(path)` trains a byte-level BPE (vocabulary `BPE_VOCAB`) on a
fixed, generated corpus (arithmetic questions, tool-call JSON, the chat template's own
tool preamble) with Qwen3's special tokens, then adds the markup tokens of
sao_jax/text/qwen3_template.py as single tokens, and writes `tokenizer.json`,
`tokenizer_config.json` (eos `<|im_end|>`, pad `<|endoftext|>`) and `chat_template.jinja`
(the project's Qwen3-style template). Deterministic: the same files on every machine.
Any text encodes (bytes), so non-ASCII costs tokens but never fails.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sao_jax.text.qwen3_template import (
    EOS_TOKEN,
    MARKUP_TOKENS,
    QWEN3_TOOLS_TEMPLATE,
    SPECIAL_TOKENS,
    qwen3_tools_template,
)

BPE_VOCAB = 500  # merges + bytes + specials; the markup tokens come on top (<= 512 in all)
WORDS = ["what", "is", "the", "answer", "plus", "minus", "times", "of", "a", "number", "call",
         "tool", "calculator", "result", "please", "compute", "sum", "value"]  # fmt: skip
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Lines like the demo's traffic: questions, tool calls, results, the tool preamble."""
    rng = np.random.default_rng(seed)
    preamble = qwen3_tools_template().render(
        [{"role": "user", "content": "hi"}], tools=[CALCULATOR_TOOL], add_generation_prompt=True
    )
    lines = [preamble] * 20
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 1000, 2))
        op = str(rng.choice(["+", "-", "*"]))
        words = " ".join(rng.choice(WORDS, 6))
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}})
        lines.append(f"{words} {a} {op} {b}?\n<tool_call>\n{call}\n</tool_call>\n{a + b}\n")
    return lines


def write_harness_tokenizer(path: str | pathlib.Path) -> pathlib.Path:
    """Writes the tokenizer files into `path` (created); returns it."""
    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens(list(MARKUP_TOKENS))
    tok.save(str(root / "tokenizer.json"))
    config = {
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (root / "chat_template.jinja").write_text(QWEN3_TOOLS_TEMPLATE)
    return root
