"""Test fixtures for chats and datasets: a Qwen3-like chat template, a byte-level BPE
tokenizer built offline with `tokenizers`, and GSM8K-style JSONL rows with \\boxed{} answers.

The template follows Qwen3's (tools in the system turn, `<tool_call>` JSON in assistant
turns, tool results as `<tool_response>` inside user turns, `<|im_end|>` ending every turn,
`enable_thinking=False` adding an empty think block) without its reasoning-content logic.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN3_LIKE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call functions. Signatures in <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nCall one within <tool_call></tool_call> tags:\\n<tool_call>\\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
# A chat template without tool support: it never looks at `tools` (assistant turns end at
# eos, so it loads; the run refuses it when tools are configured).
NO_TOOLS_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>"]
ADDED += ["</think>"]


def corpus(n: int = 400) -> list[str]:
    rng = np.random.default_rng(0)
    words = [
        "what",
        "is",
        "the",
        "answer",
        "plus",
        "minus",
        "times",
        "of",
        "a",
        "and",
        "to",
        "print",
        "python",
        "code",
        "output",
    ]
    lines = []
    for _ in range(n):
        a, b = rng.integers(0, 1000, 2)
        text = " ".join(rng.choice(words, 6))
        lines.append(f'{text} {a} + {b} = \\boxed{{{a + b}}} {{"code": "print({a})"}}\n')
    return lines


def write_tokenizer(path: pathlib.Path, *, template: str | None = QWEN3_LIKE_TEMPLATE) -> int:
    """A byte-level BPE tokenizer (+ Qwen-style special tokens) in `path`; returns its size."""
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens(ADDED)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return tok.get_vocab_size(with_added_tokens=True)


def gsm8k_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """GSM8K-format rows: question, answer with the reasoning then '#### <number>'."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(2, 50, 2))
        rows.append(
            {
                "id": f"q{i}",
                "question": f"what is {a} plus {b}?",
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
            }
        )
    return rows


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
