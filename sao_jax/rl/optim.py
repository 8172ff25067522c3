"""Optimizers for policy and critic: AdamW with warm-up schedules, clipping and freezing.

The frozen-attention critic is built with `optax.multi_transform`: frozen parameters get
`optax.set_to_zero()` (no state at all), everything else gets AdamW, whose moments are
allocated only for the trainable leaves. Which leaves train is a named set
(`TRAINABLE_SETS`, docs/method.md section 3):

  "moe"                the feed-forward block of every decoder layer (MoE experts and
                       router; the dense MLP of `mlp_only_layers`, the feed-forward block
                       of those layers) and the value head. The seed's frozen-attention
                       critic and the default of `optim.critic.trainable`.
  "all_but_attention"  everything but attention (embedding and every RMSNorm scale too).
  "all"                every parameter (`optim.critic.freeze_attention=False` during RL).

Attention is `frozen_patterns` (q/k/v/o projections and the q/k norms by default).
A schedule may count its optimizer's steps in larger units (`every`): the critic takes
K = rl.k_critic optimizer steps per RL step and its warm-up counts RL steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from sao_jax.parallel.partition import Params, path_str
from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

# Attention of every decoder layer: q/k/v/o projections and the q/k norms.
ATTENTION_PATTERNS = (r"(^|\.)attn\.",)
# What the "moe" set trains: each layer's feed-forward block (experts, router, or the
# dense MLP of mlp_only_layers) and the value head (weight and bias).
MOE_PATTERNS = (r"(^|\.)mlp\.", r"^value_(head|bias)$")
TRAINABLE_SETS = ("moe", "all_but_attention", "all")


def frozen_labels(params: Params, patterns: Sequence[str]) -> Params:
    """Pytree of 'frozen' / 'train' labels by regex search on dotted parameter paths."""
    compiled = [re.compile(p) for p in patterns]
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if any(c.search(path_str(path)) for c in compiled) else "train",
        params,
    )


def schedule(cfg: ConfigDict, *, every: int = 1) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then constant or cosine decay.

    The schedule's step is the optimizer's update count // `every` (the critic: K
    optimizer steps per RL step, so warm-up and decay count RL steps).
    """
    warm = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    if cfg.decay == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        after = optax.cosine_decay_schedule(cfg.lr, max(cfg.decay_steps, 1), cfg.final_lr_ratio)
    base = (
        after if cfg.warmup_steps <= 0 else optax.join_schedules([warm, after], [cfg.warmup_steps])
    )
    if every == 1:
        return base
    return lambda count: base(count // every)


def make_optimizer(
    cfg: ConfigDict, *, frozen: Params | None = None, every: int = 1
) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW on `schedule(cfg, every)`; `frozen` labels skip
    leaves (no moments for them)."""
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity(),
        optax.adamw(
            schedule(cfg, every=every),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        ),
    )
    if frozen is None:
        return tx
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, frozen)


def apply_updates(params: Params, updates: Params, frozen: Params | None) -> Params:
    """optax.apply_updates, leaving frozen leaves bit-identical (not p + 0)."""
    if frozen is None:
        return optax.apply_updates(params, updates)
    return jax.tree.map(
        lambda lab, p, u: p if lab == "frozen" else (p + u).astype(p.dtype),
        frozen,
        params,
        updates,
    )


def update_count(opt_state) -> jax.Array:
    """The number of updates an optimizer of `make_optimizer` has applied (int32 scalar)."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return found[0][1] if found else jnp.zeros((), jnp.int32)


def trainable_labels(
    params: Params, trainable: str, attention_patterns: Sequence[str] = ATTENTION_PATTERNS
) -> Params | None:
    """'frozen' / 'train' labels of the named set (module doc); None for "all".

    Raises ConfigError when the set would freeze nothing or train nothing (patterns that
    match no parameter would silently change what the method trains).
    """
    if trainable not in TRAINABLE_SETS:
        raise ConfigError(f"trainable set {trainable!r}: must be one of {TRAINABLE_SETS}")
    if trainable == "all":
        return None
    attention = [re.compile(p) for p in attention_patterns]
    moe = [re.compile(p) for p in MOE_PATTERNS]

    def label(path) -> str:
        name = path_str(path)
        if any(c.search(name) for c in attention):
            return "frozen"
        if trainable == "moe" and not any(c.search(name) for c in moe):
            return "frozen"
        return "train"

    labels = jax.tree_util.tree_map_with_path(lambda p, _: label(p), params)
    names = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    if not any(c.search(n) for c in attention for n in names):
        raise ConfigError(
            f"trainable set {trainable!r}: attention patterns {tuple(attention_patterns)} "
            "match no parameter (optim.critic.frozen_patterns)"
        )
    if "train" not in jax.tree.leaves(labels):
        raise ConfigError(f"trainable set {trainable!r}: no parameter would train")
    return labels


def critic_trainable(cfg: ConfigDict) -> str:
    """The RL critic's trainable set: `cfg.trainable` with frozen attention, else "all"."""
    return cfg.trainable if cfg.freeze_attention else "all"


def critic_frozen_labels(critic_params: Params, cfg: ConfigDict) -> Params | None:
    """Labels of the RL critic (`optim.critic`): `trainable_labels` of `critic_trainable`.

    Raises ConfigError naming optim.critic.frozen_patterns when freezing is on but the
    patterns match no parameter.
    """
    try:
        return trainable_labels(critic_params, critic_trainable(cfg), cfg.frozen_patterns)
    except ConfigError as e:
        raise ConfigError(
            f"config field optim.critic.frozen_patterns: {e} (set "
            "optim.critic.freeze_attention=False to train everything)"
        ) from None


def _check_section(c: ConfigDict, name: str) -> None:
    require(c.lr > 0, f"{name}.lr", f"must be > 0, got {c.lr}")
    require(0 <= c.b1 < 1 and 0 <= c.b2 < 1, f"{name}.b1", "b1 and b2 must be in [0, 1)")
    require(c.eps > 0, f"{name}.eps", f"must be > 0, got {c.eps}")
    require(c.weight_decay >= 0, f"{name}.weight_decay", f"must be >= 0, got {c.weight_decay}")
    require(c.max_grad_norm >= 0, f"{name}.max_grad_norm", f"must be >= 0, got {c.max_grad_norm}")
    require(c.warmup_steps >= 0, f"{name}.warmup_steps", f"must be >= 0, got {c.warmup_steps}")
    require(c.decay in ("constant", "cosine"), f"{name}.decay", f"unknown decay {c.decay!r}")


@register_validator("optim")
def _validate_section(config: ConfigDict) -> None:
    _check_section(config.optim.policy, "optim.policy")
    _check_section(config.optim.critic, "optim.critic")
    crit = config.optim.critic
    require(
        crit.trainable in TRAINABLE_SETS[:2],
        "optim.critic.trainable",
        f"must be one of {TRAINABLE_SETS[:2]} (what trains while attention is frozen; "
        f"freeze_attention=False trains everything), got {crit.trainable!r}",
    )
    if crit.freeze_attention:
        require(
            len(crit.frozen_patterns) > 0,
            "optim.critic.frozen_patterns",
            "empty frozen set while freeze_attention is on",
        )
        for p in crit.frozen_patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(
                    f"config field optim.critic.frozen_patterns: bad regex {p!r}: {e}"
                ) from e
