"""Routing replay: the sampler records each token's experts; training can force them.

Rollouts come from the real engine (record_routing=True) on a tiny MoE policy. The
trainer's forward pass with `forced_experts_btlk = batch['forced_experts']` must route
exactly as the sampler did and reproduce its log-probs; a slightly changed router
changes free routing but not replayed routing; and the update step runs with replay on.
"""

import functools

import jax
import numpy as np
import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.metrics import pair_means as reduce_metrics
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.passes import policy_pass, token_logp_entropy
from sao_jax.rl.update import Learner
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.trajectory import pad_batch
from sao_jax.schema import ConfigError
from tests.sampling_support import FakeTokenizer, TurnEnv, prompts

L_MAX = 48
ROUTER = ("trunk", "layers", 1, "mlp", "gate", "kernel")  # the MoE layer's router [D, E]


def _config():
    c = base.get_config()
    c.model.update(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=32, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,), initializer_range=0.1,
    )  # fmt: skip
    c.rl.batch_size = 8
    c.rl.routing_replay = True
    c.sampling.record_routing = True
    c.optim.critic.warmup_steps = 0
    return config_lib.validate(c)


@pytest.fixture(scope="module")
def setup():
    config = _config()
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    cfg = EngineConfig(num_slots=4, max_len=L_MAX, max_turn_tokens=8, record_routing=True)
    engine = Engine.create(models.policy_def, FakeTokenizer(), TurnEnv, cfg, seed=3)
    trajs, drops = engine.run(models.policy, prompts(8, seed=5, turns=3), version=0)
    assert not drops and len(trajs) == 8
    batch = pad_batch(trajs, length_bucket=16, with_routing=True)
    return config, models, trajs, batch


@functools.cache
def _jitted(policy_def, replay: bool):
    """The training forward (free routing, or `replay`: forced experts) as one jitted
    program, as the update step runs it (op by op, every primitive compiled for its
    shapes, the module's forwards took several seconds of CPU)."""
    if replay:
        return jax.jit(
            lambda p, tok, pos, seg, forced: policy_def.bind(p)(
                tok, pos, seg, forced_experts_btlk=forced
            )
        )
    return jax.jit(lambda p, tok, pos, seg: policy_def.bind(p)(tok, pos, seg))


def _forward(models, params, batch, forced):
    args = (params, batch["tokens"], batch["positions"], batch["segment_ids"])
    if forced is None:
        return _jitted(models.policy_def, False)(*args)
    return _jitted(models.policy_def, True)(*args, forced)


def _with_router(params, fn):
    out = jax.tree.map(lambda x: x, params)  # new containers, same leaves
    node = out
    for k in ROUTER[:-1]:
        node[k] = dict(node[k])
        node = node[k]
    node[ROUTER[-1]] = fn(np.asarray(node[ROUTER[-1]]))
    return out


def _recorded_mask(trajs, batch) -> np.ndarray:
    """[B, T] tokens whose routing the sampler computed: all real tokens but the last."""
    mask = np.zeros(batch["tokens"].shape, bool)
    for b, tr in enumerate(trajs):
        assert (tr.experts[:-1] >= 0).all() and (tr.experts[-1] < 0).all()
        mask[b, : tr.length - 1] = True
    return mask


def test_replayed_routing_and_logp_equal_the_samplers(setup):
    _, models, trajs, batch = setup
    forced = batch["forced_experts"]  # [B, T, L_moe, k]
    assert forced.shape[2:] == (1, 2)
    rec = _recorded_mask(trajs, batch)
    free = _forward(models, models.policy, batch, None)
    replay = _forward(models, models.policy, batch, forced)
    # The routing a training forward computes on the same params is the recorded one ...
    np.testing.assert_array_equal(np.asarray(free.experts_btlk)[rec], forced[rec])
    # ... and replay uses exactly the recorded experts (and 0..k-1 where none was recorded).
    np.testing.assert_array_equal(np.asarray(replay.experts_btlk), forced)
    am = batch["action_mask"]
    real = batch["segment_ids"] != 0
    np.testing.assert_allclose(np.asarray(replay.out)[rec], np.asarray(free.out)[rec], atol=1e-5)
    logp, _ = jax.jit(token_logp_entropy)(replay.out, batch["tokens"])
    np.testing.assert_allclose(np.asarray(logp)[am], batch["rollout_logp"][am], atol=1e-4)
    # The update step's own pass (rl/passes.py) with replay gives the same log-probs.
    pdef = models.policy_def
    out = jax.jit(lambda p, b: policy_pass(pdef.bind(p), b, replay=True))(models.policy, batch)
    np.testing.assert_allclose(np.asarray(out["logp"])[am], batch["rollout_logp"][am], atol=1e-4)
    assert real.sum() == rec.sum() + len(trajs)


def test_replay_pins_routing_when_the_router_changes(setup):
    _, models, trajs, batch = setup
    forced = batch["forced_experts"]
    rec = _recorded_mask(trajs, batch)
    noise = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    moved = _with_router(models.policy, lambda k: k + 0.05 * noise)
    free = np.asarray(_forward(models, moved, batch, None).experts_btlk)
    changed = np.any(np.sort(free, -1) != np.sort(forced, -1), axis=(-1, -2))[rec]  # [N]
    print(f"router perturbed: {changed.mean():.1%} of recorded tokens route differently")
    assert 0 < changed.mean() < 0.5  # a small change, but the routing moved
    replay = np.asarray(_forward(models, moved, batch, forced).experts_btlk)
    np.testing.assert_array_equal(replay, forced)


def test_update_step_runs_with_routing_replay(setup):
    config, models, _, batch = setup
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, Sharder())
    state = learner.new_state(models.policy, models.critic, seed=0)
    learner.check_batch(batch)
    state, metrics = learner.update_step(state, batch, jax.random.key(0))
    m = reduce_metrics(metrics)
    assert int(state.step) == 1 and int(state.skipped_steps) == 0
    assert np.isfinite(m["policy/loss"]) and np.isfinite(m["critic/value_loss"])
    # pi_theta == the sampler's policy at this step, routing replayed: log-probs agree.
    assert abs(m["policy/logp_gap"]) < 1e-4
    with pytest.raises(ConfigError, match="forced_experts"):
        learner.check_batch({k: v for k, v in batch.items() if k != "forced_experts"})
