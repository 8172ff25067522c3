"""A checkpoint's chat template, rendered with jinja2 as Hugging Face transformers does.

The template comes from the tokenizer directory: `chat_template.jinja` (what recent
transformers writes) or the `chat_template` field of tokenizer_config.json (a string, or
a list of {"name", "template"} from which "default" is used). It is compiled in jinja2's
immutable sandbox with transformers' settings (trim_blocks, lstrip_blocks, loop controls),
globals (`raise_exception`, `strftime_now`), filter (`tojson` with its keyword arguments)
and a no-op `{% generation %}` block, and rendered with `messages`, `tools`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
and any extra keyword (`enable_thinking=False`).

Token in, token out (`ChatFormat`): the rollout engine keeps every token the policy
conditioned on and emitted; a turn is never re-tokenized from text. Between turns only
the NEW template text is tokenized: `ChatFormat.observation(messages)` is the text that
follows an assistant turn in the template (starting with the end-of-turn token, which
the engine drops when the policy already emitted it), the new tool/user messages, and the
generation prompt of the next assistant turn. It is computed once per call from a fixed
two-message conversation, so earlier turns are never rendered again.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
_SENTINEL = "\u2063SAO-ASSISTANT-TURN\u2063"  # never produced by a real template
_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A chat template is missing, malformed or fails to render; the message says which."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses the
    block to mark assistant tokens; the rollout engine knows them already)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's API)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def compile_template(source: str, origin: str = "chat template") -> jinja2.Template:
    """The template compiled as transformers compiles it; ChatTemplateError on bad syntax."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{origin}: line {e.lineno}: {e.message}") from None


def read_template(tokenizer_dir: str | pathlib.Path) -> tuple[str | None, str]:
    """(template source or None, where it came from) of a tokenizer directory."""
    root = pathlib.Path(tokenizer_dir)
    jinja_file = root / TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    cfg_file = root / CONFIG_FILE
    if not cfg_file.is_file():
        return None, str(cfg_file)
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{cfg_file}: cannot read: {e}") from None
    value = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"{cfg_file}: field 'chat_template' is not a template string")
    return value, f"{cfg_file} (chat_template)"


class ChatTemplate:
    """A compiled chat template plus the special tokens its context carries."""

    def __init__(self, source: str, *, origin: str = "chat template", **specials: str | None):
        self.source = source
        self.origin = origin
        self.specials = {k: v for k, v in specials.items() if v is not None}
        self._template = compile_template(source, origin)

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation as text; ChatTemplateError naming the template on failure."""
        context = dict(self.specials)
        context.update(kwargs)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.origin}: failed to render: {e}") from None
        except Exception as e:  # a template bug (a bad filter argument, a type error)
            raise ChatTemplateError(
                f"{self.origin}: failed to render: {type(e).__name__}: {e}"
            ) from None


class ChatFormat:
    """What environments use to talk through a chat template, token-in-token-out.

    Args:
      template: the checkpoint's ChatTemplate.
      eos_text: the text of the token that ends the policy's turns (the tokenizer's eos);
        the template must end assistant messages with it.
      system_prompt: a system message put first in every conversation ("" = none).
      template_kwargs: extra template variables (e.g. {"enable_thinking": False}).
    """

    def __init__(
        self,
        template: ChatTemplate,
        eos_text: str,
        *,
        system_prompt: str = "",
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        self.template = template
        self.eos_text = eos_text
        self.system_prompt = system_prompt
        self.kwargs = dict(template_kwargs or {})
        self._turn_end: dict[bool, int] = {}
        self.observation([{"role": "user", "content": "check"}])  # fails now, not mid-run

    def messages(self, prompt_text: str | None = None, messages=None) -> list[dict[str, Any]]:
        """[system] + (messages, or one user message with `prompt_text`)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if messages:
            if self.system_prompt and messages[0].get("role") == "system":
                out = []  # the data's own system message wins
            return out + [dict(m) for m in messages]
        return [*out, {"role": "user", "content": prompt_text or ""}]

    def prompt(self, messages: Sequence[Message], tools=None) -> str:
        """The opening context: the conversation plus the assistant generation prompt."""
        return self.template.render(
            messages, add_generation_prompt=True, tools=tools, **self.kwargs
        )

    def _base(self, with_tool_calls: bool) -> list[dict[str, Any]]:
        assistant: dict[str, Any] = {"role": "assistant", "content": _SENTINEL}
        if with_tool_calls:
            call = {"name": "tool", "arguments": {}}
            assistant["tool_calls"] = [{"type": "function", "function": call}]
        return [*self.messages("hi"), assistant]

    def observation(self, new_messages: Sequence[Message], tools=None) -> str:
        """The text after an assistant turn: the end-of-turn token, `new_messages` (tool
        results, a user reply) and the next generation prompt.

        Rendered after a fixed two-message conversation and cut where its assistant turn
        ends, so it depends on the new messages only. ChatTemplateError when the template
        does not end assistant turns with `eos_text` or renders the prefix differently
        once messages follow.
        """
        tool_turn = any(m.get("role") == "tool" for m in new_messages)
        base = self._base(with_tool_calls=tool_turn)
        before = self.template.render(base, tools=tools, **self.kwargs)
        at = before.rfind(_SENTINEL)
        end = before.find(self.eos_text, at) if at >= 0 and self.eos_text else -1
        if end < 0:
            raise ChatTemplateError(
                f"{self.template.origin}: an assistant turn does not end with the eos token "
                f"{self.eos_text!r} (the policy's turns end at eos)"
            )
        full = self.template.render(
            [*base, *new_messages], add_generation_prompt=True, tools=tools, **self.kwargs
        )
        if not full.startswith(before[:end]):
            raise ChatTemplateError(
                f"{self.template.origin}: rendering later messages changes an earlier turn; "
                "turn-by-turn (token-in-token-out) rendering needs a prefix-stable template"
            )
        return full[end:]


def load_chat_format(
    tokenizer_dir: str | pathlib.Path,
    specials: Mapping[str, str | None],
    *,
    source: str = "auto",
    system_prompt: str = "",
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatFormat | None:
    """The ChatFormat of a tokenizer directory per `source` (config init.chat_template):

    'auto': the directory's template when it has one, else None (raw text prompts);
    'none': None; 'tokenizer': the directory's template, ChatTemplateError when missing;
    any other value: a path to a .jinja file.
    """
    if source == "none":
        return None
    if source in ("auto", "tokenizer"):
        text, origin = read_template(tokenizer_dir)
        if text is None:
            if source == "auto":
                return None
            raise ChatTemplateError(
                f"tokenizer {tokenizer_dir}: no chat template (neither {TEMPLATE_FILE} nor "
                f"a 'chat_template' in {CONFIG_FILE}); one is required here"
            )
    else:
        path = pathlib.Path(source)
        if not path.is_file():
            raise ChatTemplateError(f"chat template file {source!r} does not exist")
        text, origin = path.read_text(encoding="utf-8"), str(path)
    eos = specials.get("eos_token")
    template = ChatTemplate(text, origin=origin, **{k: specials.get(k) for k in _SPECIALS})
    return ChatFormat(
        template, eos or "", system_prompt=system_prompt, template_kwargs=template_kwargs
    )


def run_chat_format(config, tokenizer) -> ChatFormat | None:
    """The ChatFormat of a run (config init.chat_template, data.system_prompt,
    data.template_kwargs) for its tokenizer; None for raw text. ConfigError naming the
    field: a required template that is missing or broken, chat messages without one."""
    from sao_jax.schema import ConfigError

    source, data = config.init.chat_template, config.get("data")
    needs = bool(data is not None and data.fields.messages)
    path = getattr(tokenizer, "path", None)
    if path is None:  # the built-in character tokenizer
        if source in ("auto", "none") and not needs:
            return None
        raise ConfigError(
            f"config field init.chat_template: {source!r} needs a Hugging Face tokenizer "
            f"directory (init.tokenizer={config.init.tokenizer!r} has no chat template)"
        )
    kwargs = {} if data is None else data.template_kwargs.to_dict()
    try:
        chat = load_chat_format(
            path,
            tokenizer.specials,
            source=source,
            system_prompt="" if data is None else data.system_prompt,
            template_kwargs=kwargs,
        )
    except ChatTemplateError as e:
        raise ConfigError(f"config field init.chat_template: {e}") from None
    if chat is None and needs:
        raise ConfigError(
            f"config field data.fields.messages: chat messages need a chat template and "
            f"tokenizer {path} has none (set init.chat_template to a .jinja file)"
        )
    return chat
