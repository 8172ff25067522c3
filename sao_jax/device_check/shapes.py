"""What the device check runs at: the full shapes (one accelerator, <= 8 minutes with
compiles) and the smoke shapes (CPU, seconds, inside the test suite), and the time cap of
each phase.

The full update-step model keeps Qwen3-30B-A3B's widths (D 2048, 32 query / 4 key-value
heads of 128, experts of 768, top-8, the 151,936-token vocabulary, layers stacked and
scanned, remat, 1024-token LM-head chunks, bf16 compute over float32 master weights) with
12 layers of 32 experts instead of 48 of 128: 1.30 B active parameters per token (0.99 B
in matmuls), 2.66 B in all. Policy and critic with AdamW states take 52 GiB, the update
step's temporaries at 4 x 4096 tokens ~48 GiB more (sao_jax/plan/memory.py and
step_memory.py): ~100 GiB, within one 141 GB H200 (experiments/device_check.py raises
XLA_PYTHON_CLIENT_MEM_FRACTION to 0.95 unless it is set).
"""

from __future__ import annotations

import dataclasses

from sao_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Shapes and caps of one device-check mode."""

    # MoE paths: tokens, width, expert width, local experts, top-k
    moe: tuple[int, int, int, int, int]
    # attention paths: batch, length, query heads, kv heads, head width, block
    attention: tuple[int, int, int, int, int, int]
    dtype_model: ModelConfig  # bf16 vs fp32 update step
    dtype_batch: tuple[int, int]  # rows, length
    bench_model: ModelConfig  # MFU, decode, weight sync
    bench_batch: tuple[int, int]
    decode_slots: tuple[int, ...]
    decode_len: int  # cache length; every slot reads all of it
    decode_steps: int  # tokens per slot per decode call
    timed_repeats: int  # timed calls after the first (compile + warm-up) one
    caps_s: dict[str, float]  # phase -> time cap (their sum is the budget)


_QWEN3_WIDTHS = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    vocab_size=151936,
    rope_theta=1_000_000.0,
)
_LONG = dict(remat="full", scan_layers=True, logits_chunk=1024, attention_impl="auto")
PHASES = ("moe_paths", "attention_paths", "update_dtype", "weight_sync", "decode", "update_mfu")

FULL = Shapes(
    moe=(8192, 2048, 768, 32, 8),
    attention=(2, 4096, 32, 4, 128, 512),
    dtype_model=ModelConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, moe_intermediate_size=256, num_experts=16,
        num_experts_per_tok=4, **_LONG,
    ),
    dtype_batch=(8, 1024),
    bench_model=ModelConfig(
        **_QWEN3_WIDTHS, num_hidden_layers=12, num_experts=32, dtype="bfloat16", **_LONG
    ),
    bench_batch=(4, 4096),
    decode_slots=(64, 256),
    decode_len=2048,
    decode_steps=8,
    timed_repeats=3,
    caps_s=dict(moe_paths=50, attention_paths=50, update_dtype=80, weight_sync=30,
                decode=110, update_mfu=160),
)  # fmt: skip

_TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
    num_experts_per_tok=2, **_LONG,
)  # fmt: skip
# Smoke: the bench model is the bf16 update-step model and its batch the same, so the
# MFU phase reuses the program the bf16-vs-fp32 phase compiled (`paths.Learners`).
SMOKE = Shapes(
    moe=(64, 32, 16, 8, 2),
    attention=(2, 128, 4, 2, 32, 128),
    dtype_model=_TINY,
    dtype_batch=(4, 32),
    bench_model=dataclasses.replace(_TINY, dtype="bfloat16"),
    bench_batch=(4, 32),
    decode_slots=(4, 8),
    decode_len=32,
    decode_steps=2,
    timed_repeats=2,
    caps_s=dict.fromkeys(PHASES, 600.0),  # time is not what smoke checks (a loaded CI box)
)  # fmt: skip

MODES = {"full": FULL, "smoke": SMOKE}
