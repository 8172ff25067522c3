"""Optimizers for policy and critic: AdamW with warm-up schedules, clipping and freezing.

The frozen-attention critic is built with `optax.multi_transform`: parameters whose path
matches a frozen pattern get `optax.set_to_zero()` (no state at all), everything else
gets AdamW, whose moments are allocated only for the trainable leaves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import optax

from sao_jax.parallel.partition import Params, path_str
from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

# Attention of every decoder layer: q/k/v/o projections and the q/k norms.
ATTENTION_PATTERNS = (r"(^|\.)attn\.",)


def frozen_labels(params: Params, patterns: Sequence[str]) -> Params:
    """Pytree of 'frozen' / 'train' labels by regex search on dotted parameter paths."""
    compiled = [re.compile(p) for p in patterns]
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if any(c.search(path_str(path)) for c in compiled) else "train",
        params,
    )


def frozen_paths(params: Params, patterns: Sequence[str]) -> list[str]:
    labels = frozen_labels(params, patterns)
    return [path_str(p) for p, v in jax.tree_util.tree_leaves_with_path(labels) if v == "frozen"]


def schedule(cfg: ConfigDict) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup_steps`, then constant or cosine decay."""
    warm = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
    if cfg.decay == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        after = optax.cosine_decay_schedule(cfg.lr, max(cfg.decay_steps, 1), cfg.final_lr_ratio)
    if cfg.warmup_steps <= 0:
        return after
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(
    cfg: ConfigDict, *, frozen: Params | None = None
) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW on `schedule(cfg)`; `frozen` labels skip leaves."""
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity(),
        optax.adamw(
            schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
        ),
    )
    if frozen is None:
        return tx
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, frozen)


def critic_frozen_labels(critic_params: Params, cfg: ConfigDict) -> Params | None:
    """Labels for the critic: attention frozen unless `freeze_attention` is off.

    Raises ConfigError when freezing is on but the patterns match no parameter (an empty
    frozen set would silently train the attention the method says to freeze).
    """
    if not cfg.freeze_attention:
        return None
    labels = frozen_labels(critic_params, cfg.frozen_patterns)
    if not any(v == "frozen" for v in jax.tree.leaves(labels)):
        raise ConfigError(
            f"config field optim.critic.frozen_patterns: {tuple(cfg.frozen_patterns)} matches "
            "no critic parameter (set optim.critic.freeze_attention=False to train everything)"
        )
    return labels


def optimizer_section(lr: float, **overrides) -> ConfigDict:
    """Defaults for one optimizer section (policy or critic)."""
    c = ConfigDict()
    c.lr = lr  # peak learning rate (AdamW)
    c.b1 = 0.9
    c.b2 = 0.999
    c.eps = 1e-8
    c.weight_decay = 0.0
    c.max_grad_norm = 1.0  # global-norm clip; 0 disables
    c.warmup_steps = 0  # linear LR warm-up steps of this optimizer
    c.decay = "constant"  # 'constant' | 'cosine' after warm-up
    c.decay_steps = 1000  # cosine length (when decay == 'cosine')
    c.final_lr_ratio = 0.1  # cosine floor as a fraction of lr
    c.update(overrides)
    return c


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
