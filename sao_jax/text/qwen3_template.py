"""A Qwen3-style chat template with tools and reasoning, written for this project.

The layout is Qwen3's (`<|im_start|>role\\n ... <|im_end|>\\n` turns; the tool schemas as
JSON lines inside `<tools></tools>` in the system turn; assistant tool calls as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; tool results as
`<tool_response>` blocks inside one user turn; reasoning as `<think>\\n...\\n</think>\\n\\n`
before the content), with one deliberate difference: an assistant message's
`reasoning_content` is rendered in every turn, not only after the last user message, so
rendering later messages never changes an earlier turn (prefix-stable, what token-in-
token-out rendering in sao_jax/text/chat_template.py `ChatFormat.observation` checks). The
gateway (sao_jax/serve/) keeps the sampled ids anyway, so a template that drops past
reasoning would not fork an episode either.

`enable_thinking=False` opens the assistant turn with an empty think block, as Qwen3's.
Rendered with sao_jax/text/chat_template.py's `ChatTemplate`, it equals transformers'
`apply_chat_template` (tests/test_serve_template.py).

Special tokens it expects in the tokenizer: `<|im_start|>`, `<|im_end|>` (eos: it ends
every assistant turn), `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>`, `</think>`.
"""

from __future__ import annotations

from sao_jax.text.chat_template import ChatTemplate

EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

QWEN3_TOOLS_TEMPLATE = """\
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for part in content %}
            {%- if part.type == 'text' %}
                {{- part.text }}
            {%- else %}
                {{- raise_exception('only text content parts are supported') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none %}
        {{- raise_exception('message content must be a string or a list of text parts') }}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) }}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.reasoning_content is string %}
            {{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- render_content(message.content) }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role != 'system' %}
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


def qwen3_tools_template() -> ChatTemplate:
    """The template compiled, with its eos token in the context."""
    return ChatTemplate(
        QWEN3_TOOLS_TEMPLATE, origin="qwen3_tools (sao_jax/text/qwen3_template.py)",
        eos_token=EOS_TOKEN,
    )  # fmt: skip
