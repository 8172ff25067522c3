"""The `rl` config section: the algorithm of one update step, with its defaults and checks.

SAO's defaults (docs/method.md sections 2-4): observation-skipping GAE, DIS policy loss with
keep band (0.7, 6.0), K=2 critic steps per policy step, lam_critic = 1, length-adaptive
policy lambda with alpha = 1.5, gamma = 1, no whitening, no value clipping, one policy
optimizer step per batch. PPO-style rows take `ppo_epochs` x `minibatches` policy steps
per batch (docs/method.md section 5).
"""

from __future__ import annotations

import math

from sao_jax.rl import advantages, losses
from sao_jax.schema import ConfigDict, register_validator, require

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


def rl_section() -> ConfigDict:
    c = ConfigDict()
    c.batch_size = 128  # finished single trajectories per update (paper: 128 prompts x 1)
    c.advantage = "gae"  # estimator name (sao_jax.rl.advantages registry)
    c.policy_loss = "dis"  # loss name (sao_jax.rl.losses registry)
    c.k_critic = 2  # TTUR: critic optimizer steps per policy step (1 = ablation)
    c.order = "critic_first"  # 'critic_first': targets -> K critic steps -> recompute V ->
    # advantages -> policy step; 'policy_first': advantages from the current critic ->
    # policy step -> K critic steps
    c.gamma = 1.0  # discount [open]
    c.lam_critic = 1.0  # lambda of the critic's value targets (decoupled lambda)
    c.lam_mode = "adaptive"  # policy lambda: 'adaptive' = 1 - 1/(alpha * l) per row
    c.lam_alpha = 1.5  # alpha of the adaptive policy lambda (SAO 1.5; VAPO 0.05)
    c.lam_fixed = 0.95  # policy lambda when lam_mode == 'fixed'
    c.whiten_advantages = False  # masked whitening over action tokens [open]
    c.value_clip = 0.0  # value-loss clipping around the pre-update values; 0 = off [open]
    c.critic_only_steps = 0  # critic warm-up read as N critic-only updates (policy frozen)
    c.ppo_epochs = 1  # passes of the policy over each batch (SAO/DIS: 1; PPO rows: more)
    c.minibatches = 1  # policy OPTIMIZER steps per epoch, each on batch_size / minibatches
    # rows reshuffled per epoch (veRL's ppo_mini_batch_size = batch_size / minibatches)
    c.microbatches = 1  # gradient ACCUMULATION inside one optimizer step (memory only: the
    # step is the same as on the whole (mini)batch); not to be confused with minibatches
    c.max_consecutive_skips = 10  # abort after this many non-finite steps in a row
    c.routing_replay = False  # force the policy's MoE routing recorded at rollout time
    c.moving_average_window = 128  # window of the moving-average baseline
    c.group_eps = 1e-6  # epsilon of group std normalisation (GRPO)
    # Parameters of every policy loss, defaults from the loss registry (one source):
    # dis: keep r in (1 - eps_l, 1 + eps_h) = (0.7, 6.0); ppo_clip: eps_low/eps_high vs
    # pi_old = the behaviour (rollout) log-probs; icepop: + weight k = pi_train/pi_infer in
    # the band (icepop_mask: mask only); estr: keep |log r| <= sqrt(tau (H+eps)).
    c.losses = ConfigDict(
        {
            name: dict(losses.LOSSES.get(name).params)
            for name in losses.LOSSES.names()
            if losses.LOSSES.get(name).kind == "policy" and losses.LOSSES.get(name).params
        }
    )
    return c


def loss_params(rl: ConfigDict) -> dict:
    """Keyword parameters of the configured policy loss."""
    return dict(rl.losses[rl.policy_loss]) if rl.policy_loss in rl.losses else {}


@register_validator("rl")
def _validate_section(config: ConfigDict) -> None:
    rl = config.rl
    require(rl.batch_size >= 1, "rl.batch_size", f"must be >= 1, got {rl.batch_size}")
    require(
        rl.advantage in advantages.ESTIMATORS.names(),
        "rl.advantage",
        f"unknown estimator {rl.advantage!r}; known: {advantages.ESTIMATORS.names()}",
    )
    policy_losses = [n for n in losses.LOSSES.names() if losses.LOSSES.get(n).kind == "policy"]
    require(
        rl.policy_loss in policy_losses,
        "rl.policy_loss",
        f"unknown policy loss {rl.policy_loss!r}; known: {policy_losses}",
    )
    require(rl.k_critic >= 1, "rl.k_critic", f"must be >= 1, got {rl.k_critic}")
    require(rl.order in ORDERS, "rl.order", f"must be one of {ORDERS}, got {rl.order!r}")
    for name in ("gamma", "lam_critic", "lam_fixed"):
        v = rl[name]
        require(0.0 <= v <= 1.0, f"rl.{name}", f"must be in [0, 1], got {v}")
    require(rl.lam_mode in LAMBDA_MODES, "rl.lam_mode", f"must be one of {LAMBDA_MODES}")
    require(rl.lam_alpha > 0, "rl.lam_alpha", f"must be > 0, got {rl.lam_alpha}")
    require(rl.value_clip >= 0, "rl.value_clip", f"must be >= 0, got {rl.value_clip}")
    require(rl.critic_only_steps >= 0, "rl.critic_only_steps", "must be >= 0")
    require(rl.microbatches >= 1, "rl.microbatches", f"must be >= 1, got {rl.microbatches}")
    require(rl.ppo_epochs >= 1, "rl.ppo_epochs", f"must be >= 1, got {rl.ppo_epochs}")
    require(rl.minibatches >= 1, "rl.minibatches", f"must be >= 1, got {rl.minibatches}")
    require(
        rl.batch_size % rl.minibatches == 0,
        "rl.minibatches",
        f"{rl.minibatches} does not divide rl.batch_size={rl.batch_size}",
    )
    require(
        (rl.batch_size // rl.minibatches) % rl.microbatches == 0,
        "rl.microbatches",
        f"{rl.microbatches} does not divide the minibatch of rl.batch_size / rl.minibatches = "
        f"{rl.batch_size // rl.minibatches} rows",
    )
    require(rl.max_consecutive_skips >= 1, "rl.max_consecutive_skips", "must be >= 1")
    require(rl.moving_average_window >= 1, "rl.moving_average_window", "must be >= 1")
    for name, params in rl.losses.items():
        for key, value in params.items():
            field = f"rl.losses.{name}.{key}"
            number = isinstance(value, int | float) and not isinstance(value, bool)
            require(
                number and math.isfinite(value), field, f"must be a finite number, got {value!r}"
            )
            ok, what = LOSS_PARAM_RANGES.get(key, (lambda v: v >= 0, ">= 0"))
            require(ok(value), field, f"must be {what}, got {value}")
    if rl.routing_replay and "sampling" in config:
        require(
            config.sampling.record_routing,
            "rl.routing_replay",
            "needs sampling.record_routing=True (the sampler must record the experts to replay)",
        )
