"""Checks of the `rl` config section, the algorithm of one update step.

Its defaults (SAO's, docs/method.md sections 2-5), with a comment per field, are
`rl_section` in sao_jax/defaults.py; `loss_params` and `estimator_params` read the
configured loss's and estimator's parameters, `target_params` the critic target's.
"""

from __future__ import annotations

import math

from sao_jax.registry import RegistryError
from sao_jax.rl import advantages, critic_targets, gae, losses
from sao_jax.rl.batch import check_divisible
from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

ORDERS = ("critic_first", "policy_first")
LAMBDA_MODES = ("adaptive", "fixed")
# Ranges of the policy losses' parameters, keyed on the registry's parameter names (any
# loss using the name gets the check); a name not listed must be finite and >= 0.
LOSS_PARAM_RANGES = {
    "eps_l": (lambda v: 0 <= v < 1, "in [0, 1) (the keep band's lower edge 1 - eps_l > 0)"),
    "eps_low": (lambda v: 0 <= v < 1, "in [0, 1) (the clip's lower edge 1 - eps_low > 0)"),
    "eps_h": (lambda v: v > 0, "> 0"),
    "eps_high": (lambda v: v >= 0, ">= 0"),
    "tau": (lambda v: v > 0, "> 0 (0 keeps no token)"),
    "eps": (lambda v: v >= 0, ">= 0"),
    "band_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "band_high": (lambda v: v > 1, "> 1"),
}

# Values the estimators' parameters may take (registry parameter name -> choices); a name
# not listed is checked for its type only (against its default, sao_jax.config.check_fields).
ESTIMATOR_PARAM_CHOICES = {"impl": ("auto", *gae.GAE_IMPLS)}
_NUMBER = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
# Ranges of the critic targets' parameters (registry parameter name -> check, text).
TARGET_PARAM_RANGES = {
    "k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an int >= 0"),
    "c_bar": (lambda v: _NUMBER(v) and v > 0, "a finite number > 0"),
    "rho_bar": (lambda v: _NUMBER(v) and v > 0, "a finite number > 0"),
    "tail": (lambda v: v in critic_targets.TAILS, f"one of {critic_targets.TAILS}"),
}


def loss_params(rl: ConfigDict) -> dict:
    """Keyword parameters of the configured policy loss."""
    return dict(rl.losses[rl.policy_loss]) if rl.policy_loss in rl.losses else {}


def estimator_params(rl: ConfigDict) -> dict:
    """Keyword parameters of the configured advantage estimator."""
    return dict(rl.estimators[rl.advantage]) if rl.advantage in rl.estimators else {}


def target_params(rl: ConfigDict) -> dict:
    """Keyword parameters of the configured critic target."""
    name = rl.critic_target
    return dict(rl.critic_targets[name]) if name in rl.critic_targets else {}


def _validate_baseline_keys(rl: ConfigDict) -> None:
    """The keyed moving average: a key field and K >= 2 keys go together, and only an
    estimator with a baseline state reads them."""
    keys, field = rl.moving_average_keys, rl.baseline_key
    require(
        isinstance(keys, int) and not isinstance(keys, bool) and keys >= 0,
        "rl.moving_average_keys",
        f"must be an int >= 0 (0 or 1: one global window), got {keys!r}",
    )
    require(isinstance(field, str), "rl.baseline_key", f"must be a str, got {field!r}")
    if field:
        require(
            keys >= 2,
            "rl.moving_average_keys",
            f"must be >= 2 (the number of keys) when rl.baseline_key={field!r}, got {keys}",
        )
        require(
            advantages.ESTIMATORS.get(rl.advantage).needs_state,
            "rl.baseline_key",
            f"keys the moving-average baseline, but rl.advantage={rl.advantage!r} keeps none",
        )
    else:
        require(
            keys < 2,
            "rl.baseline_key",
            f"names no prompt meta field, but rl.moving_average_keys={keys} asks for one "
            "window per key",
        )


def _validate_critic_target(rl: ConfigDict) -> None:
    try:
        critic_targets.CRITIC_TARGETS.get(rl.critic_target)
    except RegistryError as e:
        raise ConfigError(f"config field rl.critic_target: {e}") from None
    if rl.critic_target != "lambda":  # brace: token-level, observation-skipping, lambda = 1
        require(
            rl.advantage == "gae",
            "rl.critic_target",
            f"{rl.critic_target!r} replaces the observation-skipping GAE's critic targets: "
            f"needs rl.advantage='gae', got {rl.advantage!r}",
        )
        require(
            rl.lam_critic == 1.0,
            "rl.lam_critic",
            f"must be 1.0 with rl.critic_target={rl.critic_target!r} (its horizon is "
            f"rl.critic_targets.{rl.critic_target}.k), got {rl.lam_critic}",
        )
    for name, params in rl.critic_targets.items():
        for key, value in params.items():
            field = f"rl.critic_targets.{name}.{key}"
            ok, what = TARGET_PARAM_RANGES.get(key, (lambda v: True, ""))
            require(ok(value), field, f"must be {what}, got {value!r}")


@register_validator("rl")
def _validate_section(config: ConfigDict) -> None:
    rl = config.rl
    require(rl.batch_size >= 1, "rl.batch_size", f"must be >= 1, got {rl.batch_size}")
    for field, registry in (("advantage", advantages.ESTIMATORS), ("policy_loss", losses.LOSSES)):
        try:
            registry.get(rl[field])
        except RegistryError as e:
            raise ConfigError(f"config field rl.{field}: {e}") from None
    require(
        losses.LOSSES.get(rl.policy_loss).kind == "policy",
        "rl.policy_loss",
        f"{rl.policy_loss!r} is a {losses.LOSSES.get(rl.policy_loss).kind} loss, not a policy loss",
    )
    _validate_critic_target(rl)
    require(rl.k_critic >= 1, "rl.k_critic", f"must be >= 1, got {rl.k_critic}")
    require(rl.order in ORDERS, "rl.order", f"must be one of {ORDERS}, got {rl.order!r}")
    for name in ("gamma", "lam_critic", "lam_fixed"):
        v = rl[name]
        require(0.0 <= v <= 1.0, f"rl.{name}", f"must be in [0, 1], got {v}")
    require(rl.lam_mode in LAMBDA_MODES, "rl.lam_mode", f"must be one of {LAMBDA_MODES}")
    require(rl.lam_alpha > 0, "rl.lam_alpha", f"must be > 0, got {rl.lam_alpha}")
    require(rl.value_clip >= 0, "rl.value_clip", f"must be >= 0, got {rl.value_clip}")
    require(rl.critic_only_steps >= 0, "rl.critic_only_steps", "must be >= 0")
    require(isinstance(rl.privileged_critic, bool), "rl.privileged_critic", "must be True or False")
    require(
        not rl.privileged_critic or advantages.estimator(rl.advantage).needs_values,
        "rl.privileged_critic",
        f"needs a critic, but rl.advantage={rl.advantage!r} uses none",
    )
    require(rl.microbatches >= 1, "rl.microbatches", f"must be >= 1, got {rl.microbatches}")
    require(rl.ppo_epochs >= 1, "rl.ppo_epochs", f"must be >= 1, got {rl.ppo_epochs}")
    require(rl.minibatches >= 1, "rl.minibatches", f"must be >= 1, got {rl.minibatches}")
    check_divisible(  # the mesh's shards too: sao_jax/run/settings.check_run
        rl.batch_size,
        "config field rl.batch_size",
        minibatches=rl.minibatches,
        microbatches=rl.microbatches,
    )
    require(rl.max_consecutive_skips >= 1, "rl.max_consecutive_skips", "must be >= 1")
    require(rl.moving_average_window >= 1, "rl.moving_average_window", "must be >= 1")
    _validate_baseline_keys(rl)
    for name, params in rl.losses.items():
        for key, value in params.items():
            field = f"rl.losses.{name}.{key}"
            number = isinstance(value, int | float) and not isinstance(value, bool)
            require(
                number and math.isfinite(value), field, f"must be a finite number, got {value!r}"
            )
            ok, what = LOSS_PARAM_RANGES.get(key, (lambda v: v >= 0, ">= 0"))
            require(ok(value), field, f"must be {what}, got {value}")
    for name, params in rl.estimators.items():
        for key, value in params.items():
            choices = ESTIMATOR_PARAM_CHOICES.get(key)
            if choices is not None:
                field = f"rl.estimators.{name}.{key}"
                require(value in choices, field, f"must be one of {choices}, got {value!r}")
    if rl.routing_replay and "sampling" in config:
        require(
            config.sampling.record_routing,
            "rl.routing_replay",
            "needs sampling.record_routing=True (the sampler must record the experts to replay)",
        )
