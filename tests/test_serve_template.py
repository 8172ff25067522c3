"""The project's Qwen3-style template (sao_jax/text/qwen3_template.py) renders as
transformers' `apply_chat_template` does (tools with nested schemas, non-ASCII text,
reasoning, tool calls with nested arguments, tool results), is prefix-stable, and the reply
parser (sao_jax/serve/reply.py) turns what it renders back into the OpenAI message."""

import json

import pytest
from transformers import AutoTokenizer

from sao_jax.serve.reply import parse_reply, split_reasoning
from sao_jax.text.chat_template import ChatFormat
from sao_jax.text.qwen3_template import EOS_TOKEN, QWEN3_TOOLS_TEMPLATE, qwen3_tools_template
from sao_jax.text.tokenizer import HFTokenizer
from tests.chat_support import write_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Cherche un mot — 単語を探す",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "the word, ü allowed"},
                    "filters": {
                        "type": "object",
                        "properties": {"lang": {"type": "array", "items": {"type": "string"}}},
                    },
                },
                "required": ["query"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
ARGS = {"query": "café ☕", "filters": {"lang": ["fr", "日本語"], "depth": {"n": [1, 2]}}}
MESSAGES = [
    {"role": "system", "content": "Sei hilfreich."},
    {"role": "user", "content": "Qu'est-ce que « café » ? 😀"},
    {
        "role": "assistant",
        "reasoning_content": "I should look it up.",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": ARGS}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"def": "コーヒー"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "C'est du café."},
    {"role": "user", "content": [{"type": "text", "text": "Merci"}]},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, template=QWEN3_TOOLS_TEMPLATE)
    return path


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("cut", [2, 5, 7])
def test_renders_as_transformers_does(tok_dir, tools, kwargs, cut):
    ref = AutoTokenizer.from_pretrained(str(tok_dir))
    ours = qwen3_tools_template()
    for gen in (False, True):
        msgs = MESSAGES[:cut]
        want = ref.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
        )
        assert ours.render(msgs, tools=tools, add_generation_prompt=gen, **kwargs) == want
    if tools:
        assert "単語を探す" in want and '"lang"' in want  # non-ASCII and nesting as is
        assert json.dumps(ARGS, ensure_ascii=False) in want or cut < 3


def test_prefix_stable_and_special_tokens(tok_dir):
    chat = ChatFormat(qwen3_tools_template(), EOS_TOKEN)
    obs = chat.observation([{"role": "tool", "content": "42"}], tools=TOOLS)
    want = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    assert obs == want + "<|im_start|>assistant\n"
    tok = HFTokenizer(tok_dir)
    for markup in ("<tool_call>", "</tool_call>", "<think>", "</think>", EOS_TOKEN):
        assert len(tok.encode(markup)) == 1, markup


def test_parse_reply_round_trip():
    """What the template renders for an assistant message parses back to it."""
    ours = qwen3_tools_template()
    msg = MESSAGES[2]
    text = ours.render([msg])
    text = text[len("<|im_start|>assistant\n") : -len("<|im_end|>\n")]
    reply = parse_reply(text)
    assert reply.malformed is None
    assert reply.reasoning == "I should look it up."
    assert reply.content is None
    assert [c["function"]["name"] for c in reply.tool_calls] == ["lookup", "now"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == ARGS
    assert "café ☕" in reply.tool_calls[0]["function"]["arguments"]  # not \\u-escaped
    ids = [c["id"] for c in reply.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert all(c["type"] == "function" for c in reply.tool_calls)
    # re-rendered from the parsed message: the same text (canonical form)
    again = ours.render([reply.message()])
    assert again == ours.render([msg])


@pytest.mark.parametrize(
    "text, why",
    [
        ('<tool_call>{"name": "x", "arguments": {}}', "not closed"),
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "not a JSON object"),
    ],
)
def test_malformed_call_is_text(text, why):
    reply = parse_reply("ok " + text)
    assert reply.tool_calls == [] and reply.content == "ok " + text
    assert why in reply.malformed


def test_reasoning_and_plain_text():
    assert split_reasoning("<think>\nhm\n</think>\n\nanswer") == ("hm", "answer")
    assert split_reasoning("hm</think>answer") == ("hm", "answer")  # opened by the prompt
    assert split_reasoning("<think>cut off") == ("cut off", "")
    assert split_reasoning("plain") == (None, "plain")
    call = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    reply = parse_reply(call, tools_allowed=False)
    assert reply.tool_calls == [] and reply.malformed is None and "<tool_call>" in reply.content
    reply = parse_reply('a <tool_call>{"name": "x", "arguments": "{\\"k\\": 1}"}</tool_call>')
    assert reply.content == "a" and reply.tool_calls[0]["function"]["arguments"] == '{"k": 1}'
