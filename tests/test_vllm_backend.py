"""sampling.backend='vllm' (sao_jax/sampling/backend_vllm.py) against vLLM's CPU build.

One module-scoped vLLM server (the vLLM env of `make vllm-env`, 1 OpenMP thread, a small
KV space, free ports) on a tiny Qwen3-MoE built here with transformers (no downloads), in
the shapes vLLM's CPU kernels take (hidden and MoE widths multiples of 32, head_dim 64).
Checked: token ids in and out (a non-canonical id sequence comes back as given and is
continued), the recorded log-probs against the JAX model's recomputation on the same
tokens, a weight publication moving the engine to the new weights, cancel.

Parity bound: vLLM runs bf16 (fp32 MoE is refused on CPU), the JAX reference fp32 on the
same bf16-rounded weights; bf16 activations carry a relative error of 2^-8 per rounding,
which over two layers and logits of a few nats gives |delta logp| of a few 1e-2. The test
asserts max |delta| < PARITY_TOL = 0.1 nats (and prints the median / max it measured);
the publication changes log-probs by far more than that, so a skipped sync fails.

Without the vLLM env the module FAILS naming `make vllm-env` (a skip would check nothing).
"""

import os
import time

import jax
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao_jax.models import hf
from sao_jax.sampling.backend import GenRequest
from sao_jax.sampling.vllm_config import VllmConfig

pytestmark = pytest.mark.vllm  # out of the default run (pyproject.toml): pytest -m vllm
PARITY_TOL = 0.1  # nats, bf16 engine vs fp32 recomputation (module docstring)
VLLM_PYTHON = os.path.abspath(".vllm-venv/bin/python")
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
)


def _tiny_checkpoint(path, seed=0):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    model.save_pretrained(path)


def _logp_of(mdef, params, ids):
    """log_softmax(logits[t - 1])[ids[t]] for t >= 1, fp32 ([T - 1])."""
    logits = jax.jit(lambda p, t: mdef.bind(p)(t).out)(params, np.asarray([ids], np.int32))
    logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
    return np.asarray([logp[t - 1, ids[t]] for t in range(1, len(ids))])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail(f"{VLLM_PYTHON} missing: run `make vllm-env` (docs/vllm.md)")
    from sao_jax.sampling.backend_vllm import VllmBackend

    src = str(tmp_path_factory.mktemp("tiny"))
    _tiny_checkpoint(src)
    cfg, mdef, params = hf.load_hf_policy(src)
    cfg_vllm = VllmConfig(python=VLLM_PYTHON, kv_cache_gib=1, max_num_seqs=4)
    workdir = str(tmp_path_factory.mktemp("vllm"))
    start = time.perf_counter()
    backend = VllmBackend(cfg_vllm, cfg, params, workdir=workdir, max_len=128)
    print(f"vLLM start {time.perf_counter() - start:.1f} s")
    # the reference reads the weights vLLM got (bf16-rounded), in fp32
    _, _, exported = hf.load_hf_policy(os.path.join(workdir, "weights", "v0"))
    yield backend, cfg, mdef, params, exported
    backend.close()


PROMPT = (5, 17, 17, 3, 99, 42, 8)  # no tokenizer would produce it from text: ids only


def test_token_ids_round_trip_and_logps_match_jax(served):
    backend, _, mdef, _, exported = served
    handle = backend.submit(GenRequest(PROMPT, max_tokens=12))
    result = handle.future.result(timeout=60)
    assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert result.versions == [0] * 12
    assert result.sampled_logp == result.rollout_logp  # temperature 1, no truncation
    want = _logp_of(mdef, exported, list(PROMPT) + result.token_ids)[len(PROMPT) - 1 :]
    delta = np.abs(np.asarray(result.rollout_logp) - want)
    print(f"|delta logp| median {np.median(delta):.4f} max {delta.max():.4f}")
    assert delta.max() < PARITY_TOL, delta


def test_publication_moves_the_engine_to_the_new_weights(served):
    backend, _, mdef, params, _ = served
    new = jax.tree.map(lambda x: x * 1.5, params)  # logits move by nats, not 1e-2
    start = time.perf_counter()
    backend.publish(new, version=1)
    print(f"publish {time.perf_counter() - start:.2f} s")
    assert backend.version == 1
    result = backend.submit(GenRequest(PROMPT, max_tokens=8)).future.result(timeout=60)
    assert result.versions == [1] * 8
    ids = list(PROMPT) + result.token_ids
    new_bf16 = jax.tree.map(lambda x: np.asarray(x, jax.numpy.bfloat16).astype(np.float32), new)
    want_new = _logp_of(mdef, new_bf16, ids)[len(PROMPT) - 1 :]
    want_old = _logp_of(mdef, params, ids)[len(PROMPT) - 1 :]
    got = np.asarray(result.rollout_logp)
    assert np.abs(got - want_new).max() < PARITY_TOL
    assert np.abs(want_new - want_old).max() > 5 * PARITY_TOL  # a skipped sync would fail


def test_cancel_frees_the_request(served):
    backend = served[0]
    handle = backend.submit(GenRequest(PROMPT, max_tokens=100))
    handle.cancel()
    result = handle.future.result(timeout=60)
    assert result.finish_reason in ("cancelled", "length")
    assert result.finish_reason == "cancelled" and len(result.token_ids) < 100
    assert backend.stats()["active_requests"] == 0
