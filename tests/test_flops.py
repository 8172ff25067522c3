"""Analytic parameter and FLOP counts against the real param trees and hand-worked cases."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from configs import base
from configs.models import tiny
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.plan import flops
from sao_jax.plan.memory import memory_plan, parse_mesh
from sao_jax.rl.optim import TRAINABLE_SETS, trainable_labels
from sao_jax.rl.passes import critic_pass
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.schema import ConfigError

TINY = ModelConfig.from_config(tiny.get_config())
# Dense and sparse layers mixed by decoder_sparse_step and mlp_only_layers, tied head.
MIXED = ModelConfig(
    vocab_size=40, hidden_size=24, num_hidden_layers=5, num_attention_heads=6,
    num_key_value_heads=3, head_dim=6, intermediate_size=20, moe_intermediate_size=12,
    num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=(3,),
    tie_word_embeddings=True,
)  # fmt: skip
DENSE = ModelConfig(
    vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, head_dim=4, intermediate_size=16, num_experts=0,
)  # fmt: skip
CONFIGS = {"tiny": TINY, "mixed": MIXED}


def _formula_counts(cfg: ModelConfig, head: str) -> dict[str, int]:
    """The Qwen3-MoE parameter counts written out by hand (the literal reference)."""
    d, h, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    moe = len(cfg.moe_layers)
    proj = 2 * d * cfg.num_attention_heads * h + 2 * d * cfg.num_key_value_heads * h
    counts = {
        "attention": layers * (proj + 2 * h),
        "router": moe * d * cfg.num_experts,
        "experts": moe * 3 * cfg.num_experts * d * cfg.moe_intermediate_size,
        "dense mlp": (layers - moe) * 3 * d * cfg.intermediate_size,
        "norms": 2 * layers * d + d,
        "embedding + lm_head": cfg.vocab_size * d,
        "value head": d + 1 if head == "critic" else 0,
    }
    if head == "policy" and not cfg.tie_word_embeddings:
        counts["embedding + lm_head"] += d * cfg.vocab_size
    return {k: v for k, v in counts.items() if v}


def _formula_matmul_params(cfg: ModelConfig, head: str) -> int:
    d, moe = cfg.hidden_size, len(cfg.moe_layers)
    n = cfg.num_hidden_layers * flops.attention_proj_params(cfg)
    n += (cfg.num_hidden_layers - moe) * 3 * d * cfg.intermediate_size
    n += moe * (d * cfg.num_experts + 3 * cfg.num_experts_per_tok * d * cfg.moe_intermediate_size)
    return n + (d * cfg.vocab_size if head == "policy" else d)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("head", flops.HEADS)
@pytest.mark.parametrize("scan", [False, True], ids=["per_layer", "stacked"])
def test_counts_from_the_model_shapes_match_the_formulas(name, head, scan):
    cfg = dataclasses.replace(CONFIGS[name], scan_layers=scan)
    want = _formula_counts(cfg, head)
    assert flops.param_counts(cfg, head) == want
    assert flops.total_params(cfg, head) == sum(want.values())
    d, h = cfg.hidden_size, cfg.head_dim
    proj = 2 * d * cfg.num_attention_heads * h + 2 * d * cfg.num_key_value_heads * h
    assert flops.attention_proj_params(cfg) == proj
    assert flops.matmul_params(cfg, head) == _formula_matmul_params(cfg, head)
    experts = want["experts"]
    want_active = sum(want.values()) - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    assert flops.active_params(cfg, head) == want_active


@pytest.mark.parametrize("name", list(CONFIGS))
def test_active_params_agree_with_the_memory_plan(name):
    cfg = CONFIGS[name]
    plan = memory_plan(cfg, base.get_config().optim, parse_mesh("", 1))
    assert flops.active_params(cfg) == plan.active_params
    assert flops.total_params(cfg) == plan.policy_total.count
    assert flops.total_params(cfg, "critic") == plan.critic_total.count


def test_mixed_config_really_mixes_layers():
    assert MIXED.moe_layers == (1,) and TINY.moe_layers == (1, 2)
    m = dataclasses.replace(MIXED, mlp_only_layers=())
    assert m.moe_layers == (1, 3)
    assert flops.param_counts(m)["experts"] == 2 * flops.param_counts(MIXED)["experts"]


def test_dense_by_hand():
    # attention 2*8*2*4 + 2*8*1*4 = 192 + q/k norms 8; mlp 3*8*16 = 384; norms 2*8 + 8;
    # embedding 10*8 and an untied head 8*10.
    assert flops.param_counts(DENSE) == {
        "attention": 200,
        "dense mlp": 384,
        "norms": 24,
        "embedding + lm_head": 160,
    }
    assert flops.total_params(DENSE) == flops.active_params(DENSE) == 768
    assert flops.total_params(DENSE, "critic") == 768 - 80 + 9
    assert flops.matmul_params(DENSE) == 192 + 384 + 80
    assert flops.matmul_params(DENSE, "critic") == 192 + 384 + 8
    # B=2, T=3: 2 * 656 * 6 = 7872 matmul + scores 2 * 2 * 2 * 9 * 2 * 4 = 576.
    assert flops.attention_score_flops(DENSE, 2, 3) == 576
    assert flops.attention_score_flops(DENSE, 2, 3, causal=True) == 288
    assert flops.model_pass_flops(DENSE, 2, 3, backward=False) == 8448
    assert flops.model_pass_flops(DENSE, 2, 3, backward=True) == 3 * 8448
    # frozen attention: no weight gradients of the 192 projection params, 6 tokens.
    frozen = flops.model_pass_flops(DENSE, 2, 3, backward=True, trainable="all_but_attention")
    assert frozen == 3 * 8448 - 2 * 192 * 6
    # "moe": nothing below layer 0's MLP trains, so no backward of its attention (input
    # gradients 2 * 192 * 6, scores 2 * 576) and no input gradient of its gate and up
    # projections (2 * 2 * 8 * 16 * 6).
    moe = flops.model_pass_flops(DENSE, 2, 3, backward=True, trainable="moe")
    assert frozen - moe == 2 * 192 * 6 + 2 * 576 + 2 * 2 * 8 * 16 * 6


def test_blockwise_attention_flops_count_the_blocks_on_or_below_the_diagonal():
    per_pair = flops.attention_score_flops(DENSE, 2, 1)  # one (query, key) pair per row
    for t, b in [(3, 1), (3, 2), (3, 3), (96, 32), (100, 32), (512, 128)]:
        n = -(-t // b)  # blocks, the last one padded
        pairs = sum(b * b for i in range(n) for j in range(n) if j <= i)  # literal loop
        assert flops.attention_score_flops(DENSE, 2, t, block=b) == per_pair * pairs
    assert flops.attention_score_flops(DENSE, 2, 3, block=3) == 576  # one block: the square


def test_moe_by_hand():
    cfg = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8)
    counts = flops.param_counts(cfg)
    assert counts["experts"] == 3 * 4 * 8 * 8 and counts["router"] == 8 * 4
    assert "dense mlp" not in counts
    # one of four experts active: 768 / 4 = 192
    assert flops.active_params(cfg) == flops.total_params(cfg) - 768 + 192
    assert flops.matmul_params(cfg) == 192 + 32 + 192 + 80


def test_update_step_counts_every_pass():
    b, t = 4, 16
    fwd_c = flops.model_pass_flops(TINY, b, t, backward=False, head="critic")
    step_c = flops.model_pass_flops(TINY, b, t, backward=True, head="critic", trainable="moe")
    step_p = flops.model_pass_flops(TINY, b, t, backward=True)
    passes = flops.update_step_passes(TINY, b, t, 2)  # V0 from the first critic step
    assert list(passes.values()) == [step_c, step_c, fwd_c, step_p]
    assert flops.update_step_flops(TINY, b, t, 2) == fwd_c + 2 * step_c + step_p
    separate = flops.update_step_passes(TINY, b, t, 2, separate_v0=True)
    assert list(separate.values()) == [fwd_c, step_c, step_c, fwd_c, step_p]
    first = flops.update_step_passes(TINY, b, t, 3, order="policy_first", old_logp=True)
    assert len(first) == 1 + 1 + 3 and "critic forward (recompute)" not in first
    # Executed FLOPs of an MoE path that multiplies every expert (E / k = 4x the rows).
    experts = flops.expert_forward_flops(TINY, b, t)
    assert experts == len(TINY.moe_layers) * 6 * 2 * 64 * 64 * b * t
    dense = flops.update_step_flops(TINY, b, t, 2, expert_factor=4.0)
    assert dense - flops.update_step_flops(TINY, b, t, 2) == 3 * experts * (1 + 2 * 3 + 3)
    full = flops.update_step_flops(TINY, b, t, 2, critic_trainable="all")
    wide = flops.update_step_flops(TINY, b, t, 2, critic_trainable="all_but_attention")
    assert full - wide == 2 * (
        2 * TINY.num_hidden_layers * flops.attention_proj_params(TINY) * b * t
    )
    assert wide - flops.update_step_flops(TINY, b, t, 2) == 2 * (
        flops.first_layer_skipped_backward(TINY, b, t)
    )


@pytest.mark.parametrize("first", ["dense", "moe"])
def test_critic_backward_matches_what_xla_compiles(first):
    """The trainable sets' backward FLOPs against XLA's own count of the compiled gradient
    (naive attention and the dense MoE path, so XLA executes exactly the counted work: the
    differences between sets are matmuls; elementwise work (softmax, norm, RoPE gradients)
    keeps them within 4%). Widened so that matmuls dominate the elementwise work."""
    cfg = dataclasses.replace(
        TINY, attention_impl="naive", moe_impl="dense", logits_chunk=0,
        mlp_only_layers=(0,) if first == "dense" else (),
        hidden_size=256, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
    )  # fmt: skip
    assert (0 in cfg.moe_layers) == (first == "moe")
    b, t = 2, 32
    models = init_models(cfg, Sharder(), seed=0)
    batch = jax.device_put(synthetic_batch(b, t, cfg.vocab_size, seed=0))

    def xla_flops(trainable):
        labels = trainable_labels(models.critic, trainable)

        def loss(params):
            if labels is not None:
                sg = lambda lab, p: jax.lax.stop_gradient(p) if lab == "frozen" else p
                params = jax.tree.map(sg, labels, params)
            return jnp.sum(critic_pass(models.critic_def.bind(params), batch)["values"] ** 2)

        cost = jax.jit(jax.grad(loss)).lower(models.critic).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    factor = cfg.num_experts / cfg.num_experts_per_tok  # the dense path: every expert
    analytic = {
        k: flops.model_pass_flops(
            cfg, b, t, backward=True, head="critic", trainable=k, expert_factor=factor
        )
        for k in flops.TRAINABLE
    }
    xla = {k: xla_flops(k) for k in flops.TRAINABLE}
    assert set(flops.TRAINABLE) == set(TRAINABLE_SETS)
    for wider, narrower in [("all", "all_but_attention"), ("all_but_attention", "moe")]:
        want = analytic[wider] - analytic[narrower]
        assert want > 0
        assert xla[wider] - xla[narrower] == pytest.approx(want, rel=0.04), (wider, narrower)


def test_bad_arguments_named():
    with pytest.raises(ConfigError, match="argument head"):
        flops.total_params(TINY, "value")
    with pytest.raises(ConfigError, match="argument length"):
        flops.model_pass_flops(TINY, 2, 0, backward=False)
    with pytest.raises(ConfigError, match="argument k_critic"):
        flops.update_step_flops(TINY, 2, 4, 0)
    with pytest.raises(ConfigError, match="argument order"):
        flops.update_step_flops(TINY, 2, 4, 1, order="both")
