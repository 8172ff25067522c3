"""Analytic parameter and FLOP counts of the policy, the critic and one SAO update step.

Counts follow the model code (sao_jax/models): D = hidden_size, L = num_hidden_layers,
N / K = query / key-value heads, H = head_dim, F = intermediate_size (dense layers),
F_e = moe_intermediate_size, E / k = experts / experts per token, V = vocab_size.

FLOPs are matmul FLOPs (2 per multiply-add) of what the code executes:
  forward  = 2 x matmul_params x B x T  +  attention scores,
  backward = 2 x forward (gradients with respect to inputs and to weights),
so one forward + backward pass = 6 x matmul_params x tokens + 3 x attention scores.
`matmul_params` are the active parameters that multiply every token: the top-k of the
experts, not the embedding table (a gather; it counts once as the LM head when tied),
not the RMSNorm scales or the value bias (elementwise). Attention scores are
2 x 2 x B x T^2 x N x H per layer (q k^T, then probs @ v) over the full T x T square,
which is what `grouped_attention` computes (a masked square, no causal skipping);
`causal=True` halves them to the useful work of a causal mask; `attention_block` counts
the blocks the causal blockwise kernel computes (the diagonal ones whole). Softmaxes, norms, RoPE,
the router's top-k and the MoE sort/gather are not counted. B x T counts every
position of the padded batch, since the model computes on all of them.

These are the USEFUL FLOPs. What a backend executes can be more: `expert_factor` = rows
an MoE implementation multiplies per useful (token, slot) row (1: only the useful work;
`dense`: E / k; `grouped`: its tiles' rows over the useful rows, under 1 + E R / (N k);
XLA:CPU's `ragged_dot`: E) turns a count into the EXECUTED FLOPs of that implementation.
"""

from __future__ import annotations

from sao_jax.models.config import ModelConfig
from sao_jax.plan import shapes
from sao_jax.schema import ConfigError

HEADS = shapes.HEADS

ORDERS = ("critic_first", "policy_first")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"argument {name}: must be a positive int, got {v!r}")


def attention_proj_params(cfg: ModelConfig) -> int:
    """q, k, v, o projections of one layer: 2 D N H + 2 D K H (q/k norms not included)."""
    return shapes.attention_proj_params(cfg)


def param_counts(cfg: ModelConfig, head: str = "policy") -> dict[str, int]:
    """Parameter counts by the categories of sao_jax.plan.shapes (zero ones omitted), from
    the model's own parameter shapes; for Qwen3-MoE that is

    attention = L (2 D N H + 2 D K H + 2 H)      (projections + per-head q/k norms)
    router    = L_moe D E;  experts = L_moe 3 E D F_e;  dense mlp = L_dense 3 D F
    norms     = 2 L D + D                          (two per layer + the final norm)
    embedding + lm_head = V D (+ D V for an untied policy head); value head = D + 1
    """
    return shapes.param_counts(cfg, head)


def total_params(cfg: ModelConfig, head: str = "policy") -> int:
    """Every parameter of the policy (or critic): the sum of `param_counts`."""
    return sum(param_counts(cfg, head).values())


def active_params(cfg: ModelConfig, head: str = "policy") -> int:
    """Parameters a token touches: all non-expert parameters + k / E of the experts."""
    counts = param_counts(cfg, head)
    experts = counts.get("experts", 0)
    return (
        total_params(cfg, head)
        - experts
        + experts * cfg.num_experts_per_tok // max(cfg.num_experts, 1)
    )


def matmul_params(cfg: ModelConfig, head: str = "policy") -> int:
    """Active parameters that multiply every token in a matmul (see the module docstring),
    from the model's shapes (`sao_jax.plan.shapes.matmul_params`); for Qwen3-MoE

    L (2 D N H + 2 D K H) + L_dense 3 D F + L_moe (D E + 3 k D F_e) + head, where the
    head is D V for the policy (tied or not) and D for the critic's value head.
    """
    return shapes.matmul_params(cfg, head)


def attention_score_flops(
    cfg: ModelConfig, batch: int, length: int, *, causal: bool = False, block: int | None = None
):
    """Forward FLOPs of q k^T and probs @ v over all layers: L x 2 x 2 B T^2 N H
    (halved when `causal`: only the lower triangle is useful work). `block`: what the
    causal blockwise kernel executes instead, the n (n + 1) / 2 blocks of b x b on or
    below the diagonal, n = ceil(T / b): L x 2 x 2 B N H b^2 n (n + 1) / 2."""
    _check_positive(batch=batch, length=length)
    per_pair = 2 * 2 * batch * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    if block is not None:
        _check_positive(block=block)
        n = -(-length // block)
        return per_pair * block * block * n * (n + 1) // 2
    total = per_pair * length * length
    return total // 2 if causal else total


def expert_forward_flops(cfg: ModelConfig, batch: int, length: int) -> int:
    """Useful FLOPs of the routed experts in one forward: L_moe x 2 x 3 k D F_e x B x T."""
    _check_positive(batch=batch, length=length)
    per_token = 2 * shapes.expert_params_per_token(cfg)
    return len(cfg.moe_layers) * per_token * batch * length


TRAINABLE = ("all", "all_but_attention", "moe")  # = sao_jax.rl.optim.TRAINABLE_SETS


def first_layer_skipped_backward(
    cfg: ModelConfig,
    batch: int,
    length: int,
    *,
    causal: bool = False,
    attention_block: int | None = None,
    expert_factor: float = 1.0,
) -> int:
    """Backward FLOPs that a critic training only the "moe" set never computes.

    With the embedding, every norm and every attention frozen, no gradient flows below
    the first layer's feed-forward block: that layer's attention has no backward at all
    (the input gradients of its q/k/v/o projections, 2 P_attn B T, and of its scores,
    2 x one layer's scores), and its feed-forward block needs no gradient with respect to
    its input (dense: gate and up, 2 x 2 D F B T; MoE: the router, 2 D E B T, and the
    experts' gate and up, 2 x 2 k D F_e B T, times `expert_factor` rows).
    """
    tokens = batch * length
    d = cfg.hidden_size
    skipped = 2 * attention_proj_params(cfg) * tokens
    scores = attention_score_flops(cfg, batch, length, causal=causal, block=attention_block)
    skipped += 2 * scores // cfg.num_hidden_layers
    if 0 in cfg.moe_layers:
        experts = 2 * 2 * cfg.num_experts_per_tok * d * cfg.moe_intermediate_size * tokens
        skipped += 2 * d * cfg.num_experts * tokens + round(expert_factor * experts)
    else:
        skipped += 2 * 2 * d * cfg.intermediate_size * tokens
    return skipped


def model_pass_flops(
    cfg: ModelConfig,
    batch: int,
    length: int,
    *,
    backward: bool,
    head: str = "policy",
    trainable: str = "all",
    causal: bool = False,
    attention_block: int | None = None,
    expert_factor: float = 1.0,
) -> int:
    """FLOPs of one pass of the policy (or critic) over a [batch, length] batch.

    forward = 2 P B T + S with P = matmul_params(cfg, head), S = attention scores;
    with `backward`, 3 x forward, less what the `trainable` set (sao_jax/rl/optim.py
    TRAINABLE_SETS; frozen leaves are stop_gradient'ed) never computes: a frozen
    attention ("all_but_attention", "moe") skips the weight gradients of the q/k/v/o
    projections, - 2 L P_attn B T; "moe" also skips `first_layer_skipped_backward`.
    `expert_factor` != 1 adds (factor - 1) x the expert FLOPs (executed, not useful).
    """
    _check_positive(batch=batch, length=length)
    if trainable not in TRAINABLE:
        raise ConfigError(f"argument trainable: must be one of {TRAINABLE}, got {trainable!r}")
    tokens = batch * length
    forward = 2 * matmul_params(cfg, head) * tokens
    forward += attention_score_flops(cfg, batch, length, causal=causal, block=attention_block)
    forward += round((expert_factor - 1) * expert_forward_flops(cfg, batch, length))
    if not backward:
        return forward
    total = 3 * forward
    if trainable != "all":
        total -= 2 * cfg.num_hidden_layers * attention_proj_params(cfg) * tokens
    if trainable == "moe":
        total -= first_layer_skipped_backward(
            cfg,
            batch,
            length,
            causal=causal,
            attention_block=attention_block,
            expert_factor=expert_factor,
        )
    return total


def update_step_passes(
    cfg: ModelConfig,
    batch: int,
    length: int,
    k_critic: int,
    *,
    order: str = "critic_first",
    critic_trainable: str = "moe",
    old_logp: bool = False,
    causal: bool = False,
    attention_block: int | None = None,
    separate_v0: bool = False,
    expert_factor: float = 1.0,
) -> dict[str, int]:
    """FLOPs of each model pass of one `update_step` (sao_jax/rl/update.py), in order.

    critic_first (SAO's default): K critic forward + backward steps (V0 for the targets
    comes from step 1's forward), critic forward recompute (V1), policy forward +
    backward. policy_first: the policy step, then the K critic steps.
    `separate_v0`: V0 by its own critic forward first (a Learner whose `initial_values` runs it,
    the form before issue 16). `old_logp`: one more policy forward for pi_old (losses
    that need it, e.g. icepop; `rl.critic_target='brace'` runs the same pass for its ratio,
    and with both the learner runs it twice). `critic_trainable`: what the critic trains during RL
    (`sao_jax.rl.optim.critic_trainable`; "moe", SAO's default, see model_pass_flops).
    `expert_factor`: see the module docstring. `causal` / `attention_block`: the attention
    scores' count (attention_score_flops).
    """
    _check_positive(k_critic=k_critic)
    if order not in ORDERS:
        raise ConfigError(f"argument order: must be one of {ORDERS}, got {order!r}")
    fwd = dict(batch=batch, length=length, causal=causal, backward=False)
    fwd.update(attention_block=attention_block, expert_factor=expert_factor)
    bwd = dict(fwd, backward=True)
    critic_fwd = model_pass_flops(cfg, head="critic", **fwd)
    critic_step = model_pass_flops(cfg, head="critic", trainable=critic_trainable, **bwd)
    passes = {"critic forward (targets)": critic_fwd} if separate_v0 else {}
    critic_steps = {f"critic step {i + 1} (fwd+bwd)": critic_step for i in range(k_critic)}
    policy = {}
    if old_logp:
        policy["policy forward (old logp)"] = model_pass_flops(cfg, head="policy", **fwd)
    policy["policy step (fwd+bwd)"] = model_pass_flops(cfg, head="policy", **bwd)
    if order == "critic_first":
        passes.update(critic_steps)
        passes["critic forward (recompute)"] = critic_fwd
        passes.update(policy)
    else:
        passes.update(policy)
        passes.update(critic_steps)
    return passes


def update_step_flops(
    cfg: ModelConfig,
    batch: int,
    length: int,
    k_critic: int,
    **options,
) -> int:
    """Total FLOPs of one update step: the sum of `update_step_passes` (same options)."""
    return sum(update_step_passes(cfg, batch, length, k_critic, **options).values())
