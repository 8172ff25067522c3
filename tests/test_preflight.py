"""Start-up checks against the real inputs (sao_jax/run/preflight.py): prompt lengths with
the chat template, tokenizer vs model vocabulary, an HF init's tokenizer, a template that
drops `tools`, W&B without wandb. Each fails in `train.run` before the workdir exists,
naming the field and the numbers; nothing compiles. And the start-up summary
(sao_jax/report/startup.py) built from the same inputs."""

import json
import sys

import pytest

from sao_jax import train
from sao_jax.models.config import ModelConfig
from sao_jax.parallel.mesh import sharder_from_config
from sao_jax.parallel.placement import placement_from_config
from sao_jax.report.startup import startup_lines
from sao_jax.run import preflight
from sao_jax.run.inputs import read_inputs, resolved_config
from sao_jax.schema import ConfigError
from tests import train_support as ts
from tests.chat_support import NO_TOOLS_TEMPLATE, write_jsonl, write_tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    vocab = write_tokenizer(root / "tok")
    write_tokenizer(root / "no_tools_tok", template=NO_TOOLS_TEMPLATE)
    rows = [{"question": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]
    rows[5]["question"] = "what is the answer of " * 12 + "5 plus 5?"  # the longest prompt
    data = write_jsonl(root / "rows.jsonl", rows)
    ckpt = root / "ckpt"  # config.json only: enough for the start-up checks
    ckpt.mkdir()
    hf = ModelConfig(vocab_size=vocab + (-vocab % 16), hidden_size=48, num_experts=4).to_hf()
    (ckpt / "config.json").write_text(json.dumps(hf))
    return root, data, ckpt


def _config(root, data, tok="tok", **overrides):
    fields = dict(
        init__tokenizer=str(root / tok) if tok != "char" else "char",
        sft__steps=0,
        env__name="answer",
        data__train=str(data),
        data__fields__prompt="question",
        data__template_kwargs={"enable_thinking": False},
        model__vocab_size=512,
    )
    return ts.small_config(**{**fields, **overrides})


def _refused(config, tmp_path, match):
    with pytest.raises(ConfigError, match=match) as e:
        train.run(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_lengths_are_measured_with_the_template(files):
    root, data, _ = files
    config = resolved_config(_config(root, data, sampling__max_len=256))
    lengths = preflight.check_inputs(config, read_inputs(config))
    assert lengths.longest_uid == "rows:5" and lengths.rendering == "chat template"
    assert lengths.train_rows == 11 and lengths.measured == 11 + 1  # eval: 10% of 12 rows
    assert (lengths.too_long, lengths.no_room) == (0, 0)
    raw = resolved_config(_config(root, data, "char", model__vocab_size=64))
    raw_lengths = preflight.measure_prompts(raw, read_inputs(raw))
    assert raw_lengths.rendering == "raw text + BOS" and raw_lengths.longest < 300


def test_a_prompt_longer_than_max_len_is_refused(files, tmp_path):
    root, data, _ = files
    message = _refused(
        _config(root, data, sampling__max_len=40, sampling__max_turn_tokens=8),
        tmp_path,
        r"config field sampling.max_len: 40 tokens cannot hold the longest prompt \(\d+ tokens: "
        r"'rows:5', chat template\); 1 of 12 prompts",
    )
    assert "set sampling.max_len >= " in message


def test_a_prompt_leaving_less_than_a_turn_is_refused(files, tmp_path):
    root, data, _ = files
    config = resolved_config(_config(root, data, sampling__max_len=256))
    longest = preflight.measure_prompts(config, read_inputs(config)).longest
    _refused(
        _config(root, data, sampling__max_len=longest + 4, sampling__max_turn_tokens=8),
        tmp_path,
        rf"config field sampling.max_len: the longest prompt \({longest} tokens: 'rows:5', "
        rf"chat template\) leaves 4 of max_len={longest + 4} tokens to generate, fewer than "
        rf"sampling.max_turn_tokens=8; .*sampling.max_len >= {longest + 8} or "
        r"sampling.max_turn_tokens <= 4",
    )


def test_a_tokenizer_larger_than_the_model_is_refused(files, tmp_path):
    root, data, _ = files
    _refused(
        _config(root, data, model__vocab_size=64),
        tmp_path,
        r"config field model.vocab_size: 64 < the \d+ tokens of init.tokenizer=",
    )


def test_hf_init_defaults_to_the_checkpoints_tokenizer_or_refuses(files, tmp_path):
    root, data, ckpt = files
    hf = dict(init__kind="hf", init__hf_path=str(ckpt))
    _refused(  # the checkpoint folder holds no tokenizer.json
        _config(root, data, "char", **hf),
        tmp_path,
        r"config field init.tokenizer: 'char' .* cannot drive the checkpoint .*tokenizer.json",
    )
    with_tok = root / "ckpt_with_tok"
    with_tok.mkdir()
    (with_tok / "config.json").write_text((ckpt / "config.json").read_text())
    write_tokenizer(with_tok)
    config = resolved_config(
        _config(root, data, "char", init__kind="hf", init__hf_path=str(with_tok))
    )
    assert config.init.tokenizer == str(with_tok)
    assert config.model.hidden_size == 48 and config.model.num_experts == 4  # the checkpoint's
    assert config.model.vocab_size % 16 == 0 and config.model.vocab_size != 512
    small = root / "ckpt_small_vocab"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(ModelConfig(vocab_size=64).to_hf()))
    _refused(
        _config(root, data, init__kind="hf", init__hf_path=str(small)),
        tmp_path,
        r"config field init.tokenizer: .* has \d+ tokens, more than the 64 rows of the "
        r"embedding of the checkpoint",
    )


def test_a_template_that_ignores_tools_is_refused(files, tmp_path):
    root, data, _ = files
    tools = {"reward": "math", "tools": ("python",)}
    _refused(
        _config(root, data, "no_tools_tok", env__params=tools, sampling__max_len=256),
        tmp_path,
        r"config field init.chat_template: .*no_tools_tok.* ignores `tools`: prompt .* "
        r"the schemas of \['python'\] \(env.params.tools\)",
    )
    config = resolved_config(_config(root, data, env__params=tools, sampling__max_len=512))
    lengths = preflight.check_inputs(config, read_inputs(config))  # Qwen3-like: renders them
    assert lengths.rendering == "chat template + tool schemas"


def test_wandb_without_the_package_is_refused(files, tmp_path, monkeypatch):
    root, data, _ = files
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, installed or not
    _refused(
        _config(root, data, sampling__max_len=256, train__wandb_project="sao"),
        tmp_path,
        r"config field train.wandb_project: 'sao' needs the wandb package, which is not "
        r"installed: pip install wandb",
    )


def test_startup_summary_names_what_the_run_trains_on(files):
    root, data, _ = files
    config = resolved_config(
        _config(root, data, sampling__max_len=256, data__system_prompt="Be brief.")
    )
    inputs = read_inputs(config)
    lengths = preflight.check_inputs(config, inputs)
    placement = placement_from_config(config)
    lines = startup_lines(config, inputs, lengths, sharder_from_config(config), placement)
    assert [line.split(":")[0] for line in lines] == [
        "model", "tokenizer", "template", "prompts", "lengths", "devices",
    ]  # fmt: skip
    model, tok, template, prompts, length, devices = lines
    assert "random init + 0 SFT steps: 2 layers, hidden 32, 4 experts top-2, vocab 512" in model
    assert f"tokenizer: {root / 'tok'}: " in tok and "eos '<|im_end|>'" in tok
    assert "tokenizer_config.json (chat_template): system prompt 9 chars" in template
    assert "{'enable_thinking': False}, tools none" in template
    assert f"prompts: 11 training rows of {data}, 1 held-out prompts from a 0.1 split" in prompts
    assert f"lengths: longest prompt {lengths.longest} tokens ('rows:5'; chat template + " in length
    assert "vs sampling.max_len=256, sampling.max_turn_tokens=" in length
    assert "devices: 8 x cpu (cpu), 1 process(es); mesh {'data': 8" in devices
    assert "placement colocated: sampler on the trainer's 8 devices" in devices
