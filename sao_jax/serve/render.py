"""Messages to token ids and sampled ids to text, for the gateway.

`ChatRenderer` holds the chat template and the tokenizer:

* `prompt_ids(messages, tools, kwargs)`: a whole conversation plus the generation prompt
  (a session's first call, or after a break);
* `observation_ids(new_messages, tools, kwargs, after_eos)`: only the template text that
  follows an assistant turn (its end-of-turn token unless the policy sampled it, the new
  tool / user messages, the next generation prompt), so earlier turns are never rendered
  or tokenized again (sao_jax/text/chat_template.py `ChatFormat.observation`);
* `forced_prefix(tool_choice)`: the text a `required` / named tool_choice puts at the start
  of the assistant turn (observation tokens: the policy did not choose them);
* `token_text(id)`: one token's text, special tokens included (for logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sao_jax.envs.tool_calls import OPEN
from sao_jax.serve.errors import invalid
from sao_jax.text.chat_template import ChatFormat, ChatTemplate, ChatTemplateError


class ChatRenderer:
    def __init__(self, template: ChatTemplate, tokenizer):
        eos_text = getattr(tokenizer, "eos_text", None)
        if not eos_text:
            raise ValueError("the gateway needs a tokenizer with an eos token text (a chat one)")
        self.template = template
        self.tok = tokenizer
        self.eos_id = tokenizer.eos_id
        self.eos_text = eos_text
        ChatFormat(template, eos_text)  # fails now, naming the template, if turns do not end at eos
        self._specials = {
            int(i): t
            for t in getattr(tokenizer, "specials", {}).values()
            for i in tokenizer.encode(t)[:1]
            if len(tokenizer.encode(t)) == 1
        }

    def _render(self, messages, *, tools, kwargs, generation: bool) -> str:
        try:
            return self.template.render(
                messages, add_generation_prompt=generation, tools=tools, **kwargs
            )
        except ChatTemplateError as e:
            raise invalid("messages", f"the chat template cannot render them: {e}") from None

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode(text)]

    def prompt_ids(self, messages: Sequence[dict], tools=None, kwargs=None) -> list[int]:
        text = self._render(messages, tools=tools, kwargs=kwargs or {}, generation=True)
        ids = self.encode(text)
        bos = getattr(self.tok, "bos_id", None)
        return [bos, *ids] if bos is not None else ids

    def observation_ids(
        self, new_messages: Sequence[dict], tools=None, kwargs=None, *, after_eos: bool
    ) -> list[int]:
        """Ids of the template text after an assistant turn (module docstring)."""
        try:
            text = ChatFormat(self.template, self.eos_text, template_kwargs=kwargs).observation(
                list(new_messages), tools=tools
            )
        except ChatTemplateError as e:
            raise invalid("messages", f"the chat template cannot render them: {e}") from None
        if after_eos and text.startswith(self.eos_text):
            text = text[len(self.eos_text) :]
        return self.encode(text)

    @staticmethod
    def forced_prefix(tool_choice: Any) -> str:
        if tool_choice == "required":
            return OPEN + "\n"
        if isinstance(tool_choice, dict):
            return OPEN + '\n{"name": "' + tool_choice["function"]["name"] + '", "arguments": '
        return ""

    def text(self, ids: Sequence[int]) -> str:
        """The text of sampled ids, markup tokens included, the eos token dropped."""
        return self.tok.decode([int(i) for i in ids])

    def token_text(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id in self._specials:
            return self._specials[token_id]
        return self.tok.decode([token_id])
