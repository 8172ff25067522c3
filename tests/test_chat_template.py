"""Chat templates as transformers renders them, and token-in-token-out multi-turn rollouts.

The rollout engine runs here with scripted decode outputs (no model): the policy "emits"
fixed token ids, so the trajectory can be compared token by token with one rendering of
the whole conversation through the same template.
"""

import json
import types

import numpy as np
import pytest
from transformers import AutoTokenizer

from sao_jax.envs.answer import PYTHON_TOOL, AnswerEnv
from sao_jax.envs.base import Prompt
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.generate import DecodeOut
from sao_jax.sampling.page_pool import KVLayout
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.text import chat_template as C
from sao_jax.text.tokenizer import CharTokenizer, HFTokenizer
from tests.chat_support import write_tokenizer

CALL = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "what is 2 plus 3?"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done \\boxed{1}"},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HFTokenizer(tok_dir)


@pytest.fixture(scope="module")
def chat(tok_dir, tok):
    return C.load_chat_format(tok_dir, tok.specials)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, [PYTHON_TOOL]])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_renders_as_transformers_does(tok_dir, chat, messages, tools, kwargs):
    ref = AutoTokenizer.from_pretrained(str(tok_dir))
    for gen in (False, True):
        want = ref.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
        )
        got = chat.template.render(messages, tools=tools, add_generation_prompt=gen, **kwargs)
        assert got == want


def test_transformers_globals_and_filters():
    source = (
        "{{ messages[0].content | tojson(indent=1) }}|{{ strftime_now('%Y') | length }}"
        "|{{ bos_token }}{% generation %}g{% endgeneration %}"
        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}x{% endfor %}"
    )
    t = C.ChatTemplate(source, bos_token="<s>")
    out = t.render([{"role": "user", "content": {"a": "é"}}, {"role": "user", "content": ""}])
    assert out == '{\n "a": "é"\n}|4|<s>gx'
    bad = C.ChatTemplate("{{ raise_exception('no system role') }}", origin="T.jinja")
    with pytest.raises(C.ChatTemplateError, match=r"^T.jinja: failed to render: no system role$"):
        bad.render([])
    with pytest.raises(C.ChatTemplateError, match=r"^T.jinja: line 1: "):
        C.ChatTemplate("{% for %}", origin="T.jinja")
    broken = C.ChatTemplate("{{ messages[0].content + 1 }}", origin="B")
    with pytest.raises(C.ChatTemplateError, match="^B: failed to render: TypeError"):
        broken.render([{"role": "user", "content": "a"}])


def test_template_sources(tmp_path, tok):
    plain = tmp_path / "plain"
    write_tokenizer(plain, template=None)
    assert C.load_chat_format(plain, tok.specials) is None  # auto: raw text
    with pytest.raises(C.ChatTemplateError, match="no chat template"):
        C.load_chat_format(plain, tok.specials, source="tokenizer")
    (plain / C.TEMPLATE_FILE).write_text("{{ messages[0].content }}{{ eos_token }}")
    text, origin = C.read_template(plain)
    assert origin.endswith(C.TEMPLATE_FILE) and text.startswith("{{")
    named = tmp_path / "named"
    write_tokenizer(named, template=None)
    cfg = json.loads((named / C.CONFIG_FILE).read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": "d"},
    ]
    (named / C.CONFIG_FILE).write_text(json.dumps(cfg))
    assert C.read_template(named)[0] == "d"
    with pytest.raises(C.ChatTemplateError, match="does not exist"):
        C.load_chat_format(plain, tok.specials, source=str(tmp_path / "missing.jinja"))


def test_observation_is_the_new_text_only(chat):
    obs = chat.observation([{"role": "tool", "content": "42"}])
    assert obs == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    user = chat.observation([{"role": "user", "content": "more?"}])
    assert user == "<|im_end|>\n<|im_start|>user\nmore?<|im_end|>\n<|im_start|>assistant\n"
    no_eos = C.ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    with pytest.raises(C.ChatTemplateError, match="does not end with the eos token"):
        C.ChatFormat(no_eos, "<|im_end|>")


class ScriptedFns:
    """GenerateFns stand-in: decode returns the next scripted token (one slot)."""

    def __init__(self, tokens, vocab_size, max_len):
        self.num_slots, self.max_len, self.steps = 1, max_len, 1
        self.model_cfg = types.SimpleNamespace(vocab_size=vocab_size)
        self.record_routing, self.routing_shape = False, None
        self.per_token_keys, self.layout = False, KVLayout()  # one key per step, dense cache
        self._tokens = list(tokens)
        self.fed: list[int] = []

    def init_cache(self, params):
        return None

    def prefill(self, params, cache, tokens_sc, positions_sc, spans=None, *, block_table=None):
        return cache, None

    def decode(self, params, cache, tokens_s, positions_s, key, sampling, spans=None, **_):
        self.fed.append(int(tokens_s[0]))
        token = self._tokens.pop(0)
        zeros = np.zeros((1, 1), np.float32)
        return cache, DecodeOut(np.array([[token]], np.int32), zeros, zeros, None, None)


def test_trajectory_tokens_are_what_the_policy_saw_and_emitted(tok, chat):
    """One rendering of the whole conversation vs the engine's trajectory: identical except
    the template's "\\n" after the final <|im_end|>, which the policy never emits (its turn
    ends at eos). Earlier turns are never re-tokenized: the emitted ids stay as sampled."""
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(20 + 22)"}}\n</tool_call>'
    answer = "The sum is \\boxed{42}."
    turns = [[*tok.encode(call), tok.eos_id], [*tok.encode(answer), tok.eos_id]]
    fns = ScriptedFns([t for turn in turns for t in turn], tok.vocab_size, max_len=512)
    env = lambda: AnswerEnv(reward="math", tools=("python",), chat=chat)
    engine = Engine(fns, tok, env, EngineConfig(num_slots=1, max_len=512, max_turn_tokens=128))
    prompt = Prompt("p", "what is 20 plus 22?", answer="42")
    [traj], dropped = engine.run(None, [prompt])
    assert not dropped and traj.outcome == 1.0 and traj.info["success"]
    emitted = [int(t) for t in traj.tokens[traj.action_mask]]
    assert emitted == turns[0] + turns[1]  # the sampled ids, unchanged
    conversation = [
        {"role": "user", "content": prompt.text},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "python",
                                              "arguments": {"code": "print(20 + 22)"}}}]},
        {"role": "tool", "content": "42\n"},
        {"role": "assistant", "content": answer},
    ]  # fmt: skip
    whole = tok.encode(chat.template.render(conversation, tools=[PYTHON_TOOL]))
    assert tok.decode(whole[-1:]) == "\n"  # the one difference, documented above
    assert [int(t) for t in traj.tokens] == whole[:-1]
    # The engine fed back exactly the tokens it recorded (no re-tokenization between turns).
    assert fns.fed[-len(turns[1]) + 1 :] == turns[1][:-1]


def test_a_turn_cut_before_eos_gets_the_end_token_from_the_observation(tok, chat):
    """A turn that ends without eos (max_turn_tokens) is closed by the observation's
    <|im_end|>, so the next turn still starts where the template says."""
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    first = tok.encode(call)  # no eos: the budget cuts the turn
    answer = [*tok.encode("\\boxed{1}"), tok.eos_id]
    fns = ScriptedFns(first + answer, tok.vocab_size, max_len=512)
    env = lambda: AnswerEnv(reward="math", tools=("python",), chat=chat)
    cfg = EngineConfig(num_slots=1, max_len=512, max_turn_tokens=len(first))
    engine = Engine(fns, tok, env, cfg)
    [traj], _ = engine.run(None, [Prompt("p", "one?", answer="1")])
    text = tok._tok.decode([int(t) for t in traj.tokens], skip_special_tokens=False)
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1\n" in text
    assert traj.outcome == 1.0


def test_run_chat_format_errors(tok_dir, tok):
    def config(chat_template="auto", messages=""):
        c = ConfigDict()
        c.init = ConfigDict(dict(chat_template=chat_template, tokenizer="char"))
        c.data = ConfigDict(dict(system_prompt="", template_kwargs={}))
        c.data.fields = ConfigDict(dict(messages=messages))
        return c

    assert C.run_chat_format(config(), CharTokenizer()) is None
    with pytest.raises(ConfigError, match="config field init.chat_template: 'tokenizer' needs"):
        C.run_chat_format(config("tokenizer"), CharTokenizer())
    with pytest.raises(ConfigError, match="init.chat_template"):
        C.run_chat_format(config(messages="messages"), CharTokenizer())
    assert C.run_chat_format(config("tokenizer"), tok) is not None
    assert C.run_chat_format(config("none"), tok) is None
