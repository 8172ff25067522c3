"""Published peaks by device kind and the roofline arithmetic (sao_jax/plan/hardware.py,
roofline.py), against hand-computed numbers."""

import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.plan import hardware, roofline

# Untied, every layer MoE: attention 3104, router 128, experts 3072, norms 80, V D 512 x 2.
CFG = ModelConfig(
    vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, moe_intermediate_size=8, num_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip


@pytest.mark.parametrize(
    "kind, name",
    [("NVIDIA H200", "NVIDIA H200"), ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
     ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"), ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
     ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"), ("TPU v5 lite", "TPU v5e"),
     ("TPU v5", "TPU v5p"), ("TPU v5p", "TPU v5p"), ("TPU v6 lite", "TPU v6e"),
     ("TPU v4", "TPU v4")],
)  # fmt: skip
def test_peak_by_device_kind(kind, name):
    assert hardware.peak_for(kind).name == name


def test_published_figures_and_unknown_kinds():
    h200, h100 = hardware.peak_for("NVIDIA H200"), hardware.peak_for("NVIDIA H100 80GB HBM3")
    assert h200.bf16_flops == h100.bf16_flops == 989e12  # dense (1,979 with sparsity)
    assert (h100.hbm_bytes_per_s, h200.hbm_bytes_per_s) == (3.35e12, 4.8e12)
    assert hardware.peak_for("TPU v5 lite").bf16_flops == 197e12
    assert hardware.peak_for("cpu") is None  # no guess for an unlisted kind


def test_decode_step_bytes_by_hand():
    assert roofline.expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert roofline.expected_experts_touched(4, 2, 3) == pytest.approx(3.5)  # 4 (1 - 1/8)
    got = roofline.decode_step_bytes(CFG, slots=3, context=10)
    # weights: 3104 + 128 + 80 (dense) + 512 (head) + 3 x 16 (rows) + 2 x 3.5 x 384 experts
    assert got["weights"] == 2 * (3312 + 512 + 48 + 2688)
    assert got["kv"] == 3 * 10 * (2 * 2 * 2 * 8 * 2)  # slots x context x L 2 K H x 2 bytes
    assert got["total"] == got["weights"] + got["kv"]
    bound = roofline.decode_tokens_per_s_bound(got["total"], 3, 1e12)
    assert bound == pytest.approx(3 * 1e12 / 16960)
    assert roofline.mfu(500e12, 2.0, 1000e12) == 0.25
