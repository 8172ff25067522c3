"""V0 from the first critic step's own forward: bit-identical to a separate V0 pass."""

import jax
import numpy as np
import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner
from tests.learner_variants import SeparateV0Learner

B, T, V = 8, 20, 32


def _config(experts=4, **rl):
    c = base.get_config()
    c.model.update(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, head_dim=8, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, moe_intermediate_size=8,
        num_experts=experts, num_experts_per_tok=2, mlp_only_layers=(),
    )  # fmt: skip
    c.rl.batch_size = B
    c.optim.critic.warmup_steps = 0
    c.optim.critic.lr = 1e-2  # large enough that the critic steps move V
    c.rl.update(rl)
    return config_lib.validate(c)


def _run(config, separate: bool):
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    cls = SeparateV0Learner if separate else Learner
    learner = cls(config.rl, config.optim, models.policy_def, models.critic_def, Sharder())
    state = learner.new_state(models.policy, models.critic, seed=0)
    metrics = []
    for i in range(2):
        batch = synthetic_batch(B, T, V, seed=i, version=int(state.step), max_lag=1)
        state, m = learner.update_step(state, batch, jax.random.key(i))
        metrics.append(m)
    return jax.tree.map(np.asarray, (state, metrics))


@pytest.mark.parametrize(
    "rl",
    [
        dict(),  # SAO's defaults (critic_first, K = 2, one microbatch), MoE layer
        dict(  # a dense layer: the MoE path is covered above, this one compiles faster
            experts=0,
            order="policy_first",
            k_critic=3,
            microbatches=2,
            value_clip=0.2,
            advantage="step_mean",
        ),
    ],
    ids=["default", "policy_first,k3,mb2,clip,step_mean"],
)
def test_fused_v0_is_bit_identical_to_a_separate_pass(rl):
    config = _config(**rl)
    fused = _run(config, separate=False)
    separate = _run(config, separate=True)
    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(separate), strict=True)
    for path, a, b in zip(paths, jax.tree.leaves(fused), leaves, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    critic_moved = fused[0].critic["value_head"]
    assert np.any(critic_moved != 0)  # the critic trained: the comparison is not vacuous
