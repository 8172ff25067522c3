r"""Train on your own data, end to end on CPU: a checkpoint, a tokenizer, a JSONL, the export.

A tiny random Qwen3-MoE checkpoint saved by transformers, a `tokenizers`-built byte-level
BPE tokenizer with a Qwen3-like chat template in the same folder, and 64 problems with
\boxed{} answers in a JSONL file. A few SAO steps run through `--config` overrides only,
the run is exported, and transformers loads the export (model and tokenizer) with logits
matching the JAX policy of the exported step. The same again through the installed
console scripts (sao-train, sao-export) of a wheel built from this checkout, run outside
it with only the installed copy on the path.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao_jax import export
from sao_jax.models.factory import policy_def
from sao_jax.parallel.mesh import Sharder
from tests import train_support as ts
from tests.chat_support import write_jsonl, write_tokenizer

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = ("sao_jax", "configs", "experiments", "pyproject.toml", "README.md", "LICENSE")


def _checkpoint(path: pathlib.Path, vocab: int) -> None:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        eos_token_id=None,
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
    _checkpoint(ckpt, vocab + (-vocab % 16))
    data = write_jsonl(root / "problems.jsonl", _rows())
    return root, ckpt, data


def _flags(ckpt, data):
    """A dataset run of a Hugging Face checkpoint, from the shipped smoke config."""
    return [
        "--config=configs/sao.py:smoke",
        "--config.init.kind=hf",
        f"--config.init.hf_path={ckpt}",
        f"--config.init.tokenizer={ckpt}",
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


def test_train_and_export_from_the_checkout(inputs, tmp_path):
    root, ckpt, data = inputs
    workdir, out_dir = tmp_path / "run", tmp_path / "export"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with ts.persistent_compilation_cache(root / "jax_cache") as cache_env:
        env.update(cache_env)
        log = _run([sys.executable, "-m", "experiments.train", *_flags(ckpt, data),
                    f"--workdir={workdir}"], REPO, env)  # fmt: skip
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval/greedy_success" in summary["after"], log
    printed = _run(
        [sys.executable, "-m", "experiments.export", f"--workdir={workdir}", f"--out={out_dir}"],
        REPO,
        env,
    )
    assert f"exported step 2 of {workdir} to {out_dir}" in printed
    assert (out_dir / "tokenizer.json").is_file() and (out_dir / "tokenizer_config.json").is_file()
    _check_export(out_dir, workdir, 2)
    again = subprocess.run(
        [sys.executable, "-m", "experiments.export", f"--workdir={workdir}", f"--out={out_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0, again.stderr
    assert "already holds safetensors files" in again.stderr


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


def test_installed_entry_points_outside_the_checkout(inputs, tmp_path):
    root, ckpt, data = inputs
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
    workdir, out_dir = outside / "run", outside / "export"
    with ts.persistent_compilation_cache(root / "jax_cache") as cache_env:
        env.update(cache_env)
        _run([sys.executable, str(site / "bin" / "sao-train"), *_flags(ckpt, data),
              f"--workdir={workdir}"], outside, env)  # fmt: skip
    printed = _run(
        [sys.executable, str(site / "bin" / "sao-export"), f"--workdir={workdir}",
         f"--out={out_dir}", "--step=2"], outside, env,
    )  # fmt: skip
    assert "exported step 2" in printed
    _check_export(out_dir, workdir, 2)
    missing = subprocess.run(
        [sys.executable, str(site / "bin" / "sao-train"), "--config=configs/nope.py",
         f"--workdir={outside / 'w2'}"], cwd=outside, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: config file 'configs/nope.py' does not exist"
