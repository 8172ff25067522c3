"""RL: the pure update step and the math it runs (docs/method.md).

The face: `Learner` (update_step / value_step, jitted once per config, model pair and
mesh) over a `TrainState`; advantage estimators (`compute_advantages`, by name from
`ESTIMATORS`) and losses (`policy_loss`, `value_loss`, by name from `LOSSES`), both
registries of sao_jax/registry.py; observation-skipping GAE and the length-adaptive
lambda; the batch's checks; the optimizers; metrics as (sum, count) pairs, averaged on the
host by `sao_jax.metrics.pair_means`. Each name comes from the module that holds it.
"""

from sao_jax.batch_schema import BATCH_FIELDS
from sao_jax.rl.advantages import ESTIMATORS, Advantages, compute_advantages, whiten_advantages
from sao_jax.rl.batch import check_batch, check_divisible
from sao_jax.rl.checks import checked_mode
from sao_jax.rl.gae import length_adaptive_lambda, skip_observation_gae
from sao_jax.rl.losses import LOSSES, policy_loss, value_loss
from sao_jax.rl.optim import make_optimizer
from sao_jax.rl.state import TrainState
from sao_jax.rl.update import Learner, NonFiniteError

__all__ = [
    "BATCH_FIELDS",
    "ESTIMATORS",
    "LOSSES",
    "Advantages",
    "Learner",
    "NonFiniteError",
    "TrainState",
    "check_batch",
    "check_divisible",
    "checked_mode",
    "compute_advantages",
    "length_adaptive_lambda",
    "make_optimizer",
    "policy_loss",
    "skip_observation_gae",
    "value_loss",
    "whiten_advantages",
]
