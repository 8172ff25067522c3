r"""Train on your own data, end to end on CPU, as a new user does: a checkpoint, a tokenizer,
a JSONL, the README's fields, the export.

A tiny random Qwen3-MoE checkpoint saved by transformers (hidden 48, its own eos / pad ids
and max_position_embeddings), a `tokenizers`-built byte-level BPE tokenizer with a
Qwen3-like chat template in the same folder, and 64 problems with \boxed{} answers in a
JSONL file. Through the installed console scripts (sao-train, sao-export) of a wheel
built from this checkout, run outside it with only the installed copy on the path, and
with only the README's "Train on your own data" fields (one training process):

* a few SAO steps run (init.tokenizer left at its default: the checkpoint's), logging the
  start-up summary, writing samples.jsonl and W&B rows (a fake `wandb` package, offline),
  a workdir whose config.json holds the checkpoint's shapes and which keeps copies of the
  tokenizer and the checkpoint's config.json;
* running it again from the same flags does nothing (one line, not a byte changed; in
  process, through the entry points' flag parser);
* the export works with the source folder moved away, keeps the source config.json's
  fields, and transformers loads it (model and tokenizer) with logits matching the JAX
  policy of the exported step.

Its start-up refusals (an HF init whose folder holds no tokenizer, a prompt longer than
max_len, ...) are tests/test_preflight.py's, in process; the one line and exit 2 of a
refusal, tests/test_cli_errors.py's.
"""

import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import tokenizers
import torch
from absl import flags
from ml_collections import config_flags
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao_jax import cli, export, train
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import policy_def
from sao_jax.parallel.mesh import Sharder
from sao_jax.schema import ConfigError
from tests import train_support as ts
from tests.chat_support import write_jsonl, write_tokenizer

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = ("sao_jax", "configs", "experiments", "pyproject.toml", "README.md", "LICENSE")
# A stand-in `wandb` package (the real one is optional and not a test dependency): it
# records init / log / finish calls as JSON lines in $FAKE_WANDB_LOG.
FAKE_WANDB = """import json, os
def _record(*entry):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(entry, default=str) + "\\n")
class _Run:
    def log(self, row, step):
        _record("log", step, row)
    def finish(self):
        _record("finish")
def init(**kwargs):
    _record("init", kwargs)
    return _Run()
"""


def _checkpoint(path: pathlib.Path, vocab: int, eos: int, pad: int) -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(str(path))


def _rows(n=64, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(2, 50, 2))
        out.append({"id": i, "question": f"what is {a} plus {b}?", "answer": f"\\boxed{{{a + b}}}"})
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("own_data")
    ckpt = root / "Qwen3-tiny"
    vocab = write_tokenizer(ckpt)  # tokenizer files beside the weights, as on the Hub
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    _checkpoint(ckpt, vocab + (-vocab % 16), eos, pad)
    data = write_jsonl(root / "problems.jsonl", _rows())
    return root, ckpt, data


def _flags(ckpt, data, *more):
    """A dataset run of a Hugging Face checkpoint with the README's own-data fields, on
    the shipped smoke config (init.tokenizer left at its default: the checkpoint's)."""
    return [
        "--config=configs/sao.py:smoke",
        "--config.init.kind=hf",
        f"--config.init.hf_path={ckpt}",
        "--config.sft.steps=0",
        "--config.env.name=answer",
        "--config.env.params={'reward': 'math'}",
        f"--config.data.train={data}",
        "--config.data.fields.prompt=question",
        "--config.data.prompt_format={prompt} Answer in \\boxed{{}}.",
        "--config.data.template_kwargs={'enable_thinking': False}",
        "--config.env.eval_size=4",
        "--config.value_pretrain.steps=1",
        "--config.value_pretrain.batch_size=8",
        "--config.value_pretrain.heldout_rollouts=8",
        "--config.train.total_steps=2",
        "--config.train.eval_sampled=False",
        "--config.train.report=False",
        "--config.sampling.max_len=96",
        "--config.sampling.max_turn_tokens=16",
        *more,
    ]


def _run(cmd, cwd, env, timeout=420):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _check_export(out_dir: pathlib.Path, workdir: pathlib.Path, step: int) -> None:
    """transformers loads the export; its fp32 logits match the JAX policy's (1e-4)."""
    record = json.loads((out_dir / export.EXPORT_FILE).read_text())
    assert record["step"] == step
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is 2 plus 3?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits.float().numpy()
    config = export.run_config(workdir)
    policy, restored, cfg = export.restore_policy(workdir, config, step)
    assert restored == step
    mdef = policy_def(cfg, Sharder())
    got = np.asarray(jax.jit(lambda p, t: mdef.bind(p)(t).out)(policy, np.array([ids])))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(want).max() > 1e-3  # not trivially zero


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _wheel(tmp: pathlib.Path) -> pathlib.Path:
    """A wheel of this checkout, built from a copy (the build writes build/ beside it)."""
    src = tmp / "src"
    src.mkdir()
    for name in (*SHIPPED, "requirements.txt"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
           "-w", str(tmp / "dist"), str(src)]  # fmt: skip
    _run(cmd, tmp, dict(os.environ))
    return next((tmp / "dist").glob("sao_jax-*.whl"))


def _parsed_config(argv: list[str]):
    """The run config the entry points build from `argv` (their flag parser)."""
    fv = flags.FlagValues()
    argv = ["sao-train", *argv]
    config_flags.DEFINE_config_file("config", None, "run config", flag_values=fv, sys_argv=argv)
    cli.parse_config_flags(argv, flag_values=fv)
    return fv.config


# its in-process re-run parses the config file with config_flags, which loads it with
# importlib's deprecated load_module() (as tests/test_cli_errors.py notes)
@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")
def test_installed_entry_points_train_and_export_outside_the_checkout(
    inputs, tmp_path, jax_cache_dir, caplog, monkeypatch
):
    """One training process (the installed sao-train, outside the checkout, a fake wandb
    on the path), its re-run from the same flags (in process), the export with the source
    checkpoint moved away (sao-export) and a missing config file (exit 2); the checkout's
    `sao_jax.experiments` alias, in process (the same modules as `python -m
    experiments.train`, tests/test_train.py)."""
    for module in ("sao_jax.experiments.train", "sao_jax.experiments.export"):
        alias = importlib.util.find_spec(module)  # found, not imported
        assert pathlib.Path(alias.origin) == REPO / "experiments" / f"{module.split('.')[-1]}.py"
    _, ckpt, data = inputs
    wheel = _wheel(tmp_path)
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
          "--target", str(site), str(wheel)], tmp_path, dict(os.environ))  # fmt: skip
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy only, not the checkout
    where = _run([sys.executable, "-c", "import sao_jax.configs.sao as m; print(m.__file__)"],
                 outside, env)  # fmt: skip
    assert where.strip().startswith(str(site))
    fake = tmp_path / "fake_site"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    wandb_log = tmp_path / "wandb_calls.jsonl"
    env.update(PYTHONPATH=f"{site}{os.pathsep}{fake}", FAKE_WANDB_LOG=str(wandb_log))

    workdir, out_dir = outside / "run", outside / "export"
    wandb = ["--config.train.wandb_project=sao-e2e", "--config.train.wandb_mode=offline"]
    cmd = [sys.executable, str(site / "bin" / "sao-train"), *_flags(ckpt, data, *wandb),
           f"--workdir={workdir}"]  # fmt: skip
    with ts.persistent_compilation_cache(jax_cache_dir) as cache_env:
        env.update(cache_env)
        log = _run(cmd, outside, env)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval/greedy_success" in summary["after"], log
    # The start-up summary, before anything compiles.
    lines = [line.split(" ", 1)[1] for line in log.splitlines() if line[:1].isdigit()]
    assert lines[0].startswith(f"checking the config and the inputs (workdir {workdir})")
    assert lines[1] == f"init.tokenizer: the checkpoint's ({ckpt})"
    lines = lines[2:]
    heads = [line.split(":")[0] for line in lines[:7]]
    assert heads == ["model", "tokenizer", "template", "prompts", "lengths", "devices",
                     "building the policy, the critic and the learner"], lines  # fmt: skip
    assert f"model: checkpoint {ckpt}: 2 layers, hidden 48, 4 experts top-2" in lines[0]
    assert f"tokenizer: {ckpt}: " in lines[1] and "(chat_template)" in lines[2]
    assert "prompts: 58 training rows of" in lines[3], lines[3]
    # The workdir: the model it trained, copies of its sources, rollout samples.
    stored = json.loads((workdir / "config.json").read_text())
    source = json.loads((ckpt / "config.json").read_text())
    want = ModelConfig.from_hf(source)
    assert {k: stored["model"][k] for k in ("vocab_size", "hidden_size", "num_experts")} == {
        "vocab_size": want.vocab_size, "hidden_size": 48, "num_experts": 4,
    }  # fmt: skip
    assert stored["init"]["tokenizer"] == str(ckpt)  # the checkpoint's, by default
    assert (workdir / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((workdir / "hf_base" / "config.json").read_text()) == source
    samples = [json.loads(x) for x in (workdir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [2] * 4  # train.samples_per_log per log step
    assert "<|im_start|>user" in samples[0]["prompt"] and samples[0]["turns"]
    calls = [json.loads(x) for x in wandb_log.read_text().splitlines()]
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline"
    assert [c[1] for c in calls if c[0] == "log"] == [0, 2, 2]  # eval, train, eval
    assert calls[-1] == ["finish"]
    # Again, from the same flags (parsed as the entry points parse them), in process:
    # nothing to do, nothing written (a run's process exiting 0: tests/test_train.py)
    before = _tree(workdir)
    monkeypatch.syspath_prepend(str(fake))  # train.wandb_project: the package is found
    with caplog.at_level(logging.INFO, logger="sao_jax"):
        assert train.run(_parsed_config(_flags(ckpt, data, *wandb)), workdir) == summary
    assert "already finished at step 2 (train.total_steps=2): nothing to do" in caplog.text
    assert _tree(workdir) == before

    moved = ckpt.with_name(ckpt.name + "_moved")  # export from the workdir alone
    ckpt.rename(moved)
    try:
        printed = _run(
            [sys.executable, str(site / "bin" / "sao-export"), f"--workdir={workdir}",
             f"--out={out_dir}", "--step=2"], outside, env,
        )  # fmt: skip
    finally:
        moved.rename(ckpt)
    assert f"exported step 2 of {workdir} to {out_dir}" in printed
    assert (out_dir / "tokenizer.json").is_file() and (out_dir / "tokenizer_config.json").is_file()
    exported = json.loads((out_dir / "config.json").read_text())
    kept = {k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}
    assert {k: exported.get(k) for k in kept} == kept  # eos/pad ids, max_position_embeddings
    assert (exported["eos_token_id"], exported["max_position_embeddings"]) == (
        source["eos_token_id"], 512,
    )  # fmt: skip
    _check_export(out_dir, workdir, 2)
    # again into the same folder: refused (the entry points' one line and exit 2 for a
    # ConfigError: tests/test_cli_errors.py)
    with pytest.raises(ConfigError, match="--out: .* already holds safetensors files"):
        export.export_run(str(workdir), str(out_dir))
    missing = subprocess.run(
        [sys.executable, str(site / "bin" / "sao-train"), "--config=configs/nope.py",
         f"--workdir={outside / 'w2'}"], cwd=outside, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: config file 'configs/nope.py' does not exist"
