"""The in-place vLLM weight sync's buffer, without vLLM (default suite, in process).

sao_jax/sampling/weight_staging.py `stage_weights` writes models/hf.py's export (hf_entries)
into one flat buffer; sampling/vllm_worker_ext.py's shared_tensors reads it back inside
vLLM as torch views.
Checked here on a tiny Qwen3-MoE (dense and sparse layers, tied embeddings): the tensors
read back are bit for bit those save_hf_checkpoint writes (the same names, shapes and
bf16 values: one export mapping), each aligned; a failed tensor leaves no buffer behind.
"""

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sao_jax.models import hf
from sao_jax.sampling.vllm_worker_ext import shared_tensors
from sao_jax.sampling.weight_staging import ALIGN, stage_weights, staged_size
from tests.tiny_moe import save_tiny_moe


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = save_tiny_moe(str(tmp_path_factory.mktemp("tiny")))
    cfg, _, params = hf.load_hf_policy(path)
    return cfg, params


def test_the_staged_buffer_reads_back_as_the_exported_checkpoint(policy, tmp_path):
    cfg, params = policy
    hf.save_hf_checkpoint(str(tmp_path / "ckpt"), cfg, params, dtype="bfloat16")
    want = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    entries = hf.hf_entries(cfg, params, dtype="bfloat16")
    path = str(tmp_path / "stage.bin")
    manifest = stage_weights(entries, path, "bfloat16")
    assert (tmp_path / "stage.bin").stat().st_size == staged_size(entries)
    assert all(t["offset"] % ALIGN == 0 for t in manifest)
    with open(path, "rb") as f:
        got = dict(shared_tensors(bytearray(f.read()), manifest))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16 and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


def test_a_failed_tensor_leaves_no_buffer(policy, tmp_path):
    cfg, params = policy
    entries = hf.hf_entries(cfg, params, dtype="bfloat16")
    bad = dataclasses.replace(entries[-1], produce=lambda: np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match=f"{entries[-1].name}: produced"):
        stage_weights([*entries[:-1], bad], str(tmp_path / "stage.bin"), "bfloat16")
    assert not (tmp_path / "stage.bin").exists()
