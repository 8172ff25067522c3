"""The placement throughput model (sao_jax/plan/throughput.py) against hand-computed numbers."""

import math

import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.plan import flops, roofline
from sao_jax.plan import throughput as tp
from sao_jax.plan.hardware import Peak
from sao_jax.plan.kv_pool import kv_bytes_per_token
from sao_jax.schema import ConfigError


def test_pipeline_rate_by_placement():
    # B = 8, 0.1 s per trajectory, 0.4 s update, 0.05 s sync
    assert tp.pipeline_rate("colocated", 8, 0.1, 0.4, 0.05) == pytest.approx(8 / 1.25)
    # separate chips: the longer of 0.8 s rollouts and 0.4 s update (sync overlapped)
    assert tp.pipeline_rate("disaggregated", 8, 0.1, 0.4, 0.05) == pytest.approx(10.0)
    # one shared core: the sum, sync included when the CPU copies it
    shared = tp.pipeline_rate("disaggregated", 8, 0.1, 0.4, 0.05, concurrency=1.0,
                              sync_exposed=1.0)  # fmt: skip
    assert shared == pytest.approx(8 / 1.25)
    half = tp.pipeline_rate("disaggregated", 8, 0.1, 0.4, 0.0, concurrency=1.5)
    assert half == pytest.approx(8 / (1.2 / 1.5))
    with pytest.raises(ConfigError, match="placement"):
        tp.pipeline_rate("pooled", 8, 0.1, 0.4, 0.0)
    # a CPU: colocated threads interleave too (measured concurrency), sync still exposed
    assert tp.pipeline_rate("colocated", 8, 0.1, 0.4, 0.05, concurrency=2.0) == pytest.approx(
        8 / 0.8
    )
    with pytest.raises(ValueError, match="concurrency"):
        tp.pipeline_rate("disaggregated", 8, 0.1, 0.4, 0.0, concurrency=3.0)


def _cfg(**kw):
    base = dict(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=4, intermediate_size=16,
                moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2,
                mlp_only_layers=(), tie_word_embeddings=False)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def _hw(**kw):
    peak = dict(bf16_flops=1e3, hbm_bytes=1e9, hbm_bytes_per_s=1e3)
    link = dict(link_bw=1.0)
    for k, v in kw.items():
        (peak if k in peak else link)[k] = v
    return tp.Hardware(Peak("toy", source="-", **peak), link="-", chips_per_host=1,
                       link_source="-", **link)  # fmt: skip


def test_decode_bytes_and_flops_by_hand():
    cfg = _cfg()
    assert kv_bytes_per_token(cfg, 2) == 2 * 2 * 1 * 4 * 2
    counts = flops.param_counts(cfg)
    experts = 2 * 3 * 4 * 8 * 4  # L_moe x 3 x E x D x F_e
    assert counts["experts"] == experts
    rest = sum(counts.values()) - experts - 100 * 8  # the table: only the slots' rows read
    # 2 slots touch 4 (1 - (1 - 2/4)^2) = 3 of the 4 experts
    weights = (rest + 2 * 8 + experts * 3 / 4) * 2
    assert roofline.decode_step_bytes(cfg, 2, 10)["weights"] == pytest.approx(weights)
    hw = _hw()
    read = weights + 2 * 10 * kv_bytes_per_token(cfg, 2)
    work = 2 * flops.matmul_params(cfg) * 2 + 4 * 2 * 10 * 2 * 4 * 2
    want = max(read / (2 * 1e3 * 0.5), work / (2 * 1e3 * 0.25))
    got = tp.decode_step_s(cfg, 2, 10, 2, hw, bw_efficiency=0.5, mfu=0.25)
    assert got == pytest.approx(want)
    roll = tp.rollout_s(cfg, 2, 10, 6, 3, 2, hw, bw_efficiency=0.5, mfu=0.25)
    prefill = 2 * flops.matmul_params(cfg) * 3 / (2 * 1e3 * 0.25)
    assert roll == pytest.approx(6 * want / 2 + prefill)
    # sync: 3 replicas need 3 copies out of 4 trainer links, or 1/2 copy into each pool chip
    assert tp.sync_s(100.0, 4, 6, 3, hw) == pytest.approx(max(300 / 4, 50.0))


def test_split_rate_disaggregation_frees_pool_memory():
    cfg = _cfg()
    hw = _hw(bf16_flops=1e9, hbm_bytes=1e6, hbm_bytes_per_s=1e6, link_bw=1e6)
    work = tp.Workload(batch=4, generated=10, prefilled=5, context=8, row_length=16,
                       k_critic=2, state_bytes=2.5e5, state_chips=4, temp_bytes=2e5,
                       reserve_bytes=0.0)  # fmt: skip
    col = tp.split_rate(cfg, hw, work, 4, 0, 1)
    dis = tp.split_rate(cfg, hw, work, 4, 2, 1)
    copy = flops.total_params(cfg) * 2
    kv = 8 * kv_bytes_per_token(cfg, 2)
    assert col["slots"] == 4 * math.floor((1e6 - 2.5e5 - 2e5 - copy) / kv)
    assert dis["slots"] == 2 * math.floor((1e6 - copy) / kv)  # a pool chip holds no state
    assert dis["update_s"] == pytest.approx(2 * col["update_s"])  # half the trainer chips
    assert tp.split_rate(cfg, hw, work, 4, 3, 1) is None  # 1 trainer chip: 1e6 + 2e5 > 1e6
    capped = tp.split_rate(cfg, hw, tp.Workload(**{**work.__dict__, "max_in_flight": 6}),
                           4, 2, 1)  # fmt: skip
    assert capped["slots"] == 6
