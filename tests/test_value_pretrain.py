"""Value pretraining (sao_jax/run/value_pretrain.py): Monte-Carlo targets, a stream of fresh
rollouts with a held-out set never trained on, the plateau stop, and independence from
every RL-time setting (rows that differ only in those get bit-identical critics)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.rl.gae import monte_carlo_returns
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.run.settings import pretraining_fields
from sao_jax.run.value_pretrain import STEP_KEY, PlateauStop, ValuePretrainer, pretrain
from sao_jax.schema import ConfigError
from tests.closeness import assert_steps_close

B, T, V = 8, 24, 32


def _config(**vp):
    c = base.get_config()
    c.model.update(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, head_dim=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=(0,), router_aux_loss_coef=0.0,
    )  # fmt: skip
    c.rl.batch_size = B
    c.optim.critic.lr = 1e-2
    c.value_pretrain.update(
        dict(steps=6, batch_size=B, heldout_rollouts=2 * B, eval_every=2, patience=0), **vp
    )
    return c


class Stream:
    """A fake sampler: rollout i is the int i of prompt i % `prompts`. Its batches are
    synthetic rows whose return is planted where a critic sees it at once: rows with
    outcome 1 have only even action tokens, the others only odd ones."""

    def __init__(self, prompts: int = 1000):
        self.next, self.prompts, self.trained = 0, prompts, []

    def take(self, n):
        out = list(range(self.next, self.next + n))
        self.next += n
        return out

    def uid(self, i):
        return i % self.prompts

    def batch_of(self, items):
        self.trained.append(list(items))
        batch = synthetic_batch(len(items), T, V, seed=items[0], truncated_fraction=0.0)
        m = batch["action_mask"]
        good = batch["outcome"] > 0
        tokens = batch["tokens"] // 2 * 2 + np.where(good, 0, 1)[:, None]  # parity = outcome
        batch["tokens"] = np.where(m, np.maximum(tokens, 1), batch["tokens"]).astype(np.int32)
        batch["tokens"] = np.where(m & ~good[:, None] & (batch["tokens"] % 2 == 0), 1,
                                   batch["tokens"]).astype(np.int32)  # fmt: skip
        return batch


@pytest.fixture(scope="module")
def setup():
    """(models, trainer) of the default config, compiled once for the module."""
    config = config_lib.validate(_config())
    models = init_models(ModelConfig.from_config(config.model), Sharder(), seed=0)
    return models, ValuePretrainer(config, models.critic_def, Sharder())


def _run(setup, config=None, stream=None, **kw):
    models, trainer = setup
    compiled = ("trainable", "lr", "warmup_steps")  # the rest are host-loop settings
    if config is not None and any(config.value_pretrain[k] != trainer.vp[k] for k in compiled):
        trainer = ValuePretrainer(config_lib.validate(config), models.critic_def, Sharder())
    stream = stream or Stream()
    records = []
    result = pretrain(
        trainer,
        jax.tree.map(jnp.copy, models.critic),  # pretrain donates the critic it starts from
        take=stream.take,
        batch_of=stream.batch_of,
        write=lambda step, scalars: records.append((step, scalars)),
        uid=stream.uid,
        loop=None if config is None else config_lib.validate(config).value_pretrain,
        **kw,
    )
    return result, records, stream


def test_monte_carlo_returns_against_a_loop():
    rng = np.random.default_rng(0)
    m = rng.random((3, 10)) < 0.6
    r = np.where(m, rng.normal(size=(3, 10)), 0.0).astype(np.float32)
    for gamma in (1.0, 0.9):
        got = np.asarray(monte_carlo_returns(r, m, gamma))
        want = np.zeros_like(r)
        for b in range(3):
            acc = 0.0
            for t in reversed(range(10)):
                if m[b, t]:  # observation tokens are skipped, not discounted
                    acc = r[b, t] + gamma * acc
                    want[b, t] = acc
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_plateau_stop_hand_checked():
    p = PlateauStop(patience=2, min_delta=0.01)
    for step, ev in ((0, 0.0), (10, 0.2), (20, 0.205), (30, 0.3), (40, 0.305)):
        p.update(step, ev)
        assert not p.done
    p.update(50, 0.29)
    assert p.done and p.best == 0.3  # the last gain of at least 0.01 (0.305 is not one)
    assert (p.top, p.top_step) == (0.305, 40)
    never = PlateauStop(patience=0, min_delta=0.01)
    for step in range(10):
        never.update(step, 0.0)
    assert not never.done


def test_rows_differing_in_rl_time_settings_get_bit_identical_critics(setup):
    """K, the RL critic's trainable set and warm-up, lam_critic and the policy loss do not
    touch value pretraining (before, the K=1 row got half the critic steps and
    no_frozen_attention another trainable set)."""
    sao = _config()
    other = _config()
    other.rl.k_critic = 1
    other.rl.lam_critic = 0.9
    other.rl.policy_loss = "ppo_clip"
    other.rl.ppo_epochs, other.rl.minibatches = 2, 4
    other.optim.critic.freeze_attention = False
    other.optim.critic.trainable = "all_but_attention"
    other.optim.critic.warmup_steps = 0
    assert pretraining_fields(sao) == pretraining_fields(other)
    models = init_models(ModelConfig.from_config(sao.model), Sharder(), seed=0)
    trainer = ValuePretrainer(config_lib.validate(other), models.critic_def, Sharder())
    a, _, _ = _run(setup)  # compiled from the default (SAO) config
    b, _, _ = _run((models, trainer))
    jax.tree.map(np.testing.assert_array_equal, a.critic, b.critic)
    assert a.summary["heldout_ev_final"] == b.summary["heldout_ev_final"]
    changed = _config(trainable="moe")
    assert pretraining_fields(changed) != pretraining_fields(sao)


def test_streams_fresh_rollouts_and_never_trains_on_heldout_prompts(setup):
    stream = Stream(prompts=40)  # prompts recur after 40 rollouts
    result, records, _ = _run(setup, _config(steps=6), stream)
    held = stream.trained[:2]  # the first two batches: the held-out set
    trained = [i for batch in stream.trained[2:] for i in batch]
    held_uids = {stream.uid(i) for batch in held for i in batch}
    assert len(trained) == len(set(trained)) == 6 * B  # every step new rollouts
    assert not {stream.uid(i) for i in trained} & held_uids
    assert result.summary["skipped_heldout_prompts"] > 0
    assert result.summary["rollouts"] == 6 * B and result.summary["steps"] == 6
    assert [s for s, _ in records] == list(range(7))  # one record per step, step 0 too
    assert [r[STEP_KEY] for r in result.history] == list(range(7))
    evals = [s for s, x in records if "value_pretrain/heldout/explained_variance" in x]
    assert evals == [0, 2, 4, 6]
    first = records[1][1]
    for name in ("batch/explained_variance", "batch/value_loss", "lr", "grad_norm", "rollouts"):
        assert np.isfinite(first[f"value_pretrain/{name}"]), name
    assert records[1][1]["value_pretrain/lr"] == 0.0  # its own warm-up starts at 0
    assert result.summary["stop_reason"] == "reached value_pretrain.steps=6"


def test_reuse_trains_on_each_batch_several_times(setup):
    stream = Stream()
    result, _, _ = _run(setup, _config(steps=6, reuse=3), stream)
    assert len(stream.trained) == 2 + 2  # held-out + 6 steps / 3
    assert result.summary["rollouts"] == 2 * B


def test_learns_a_planted_return_and_stops_on_the_plateau(setup):
    config = _config(steps=200, eval_every=5, patience=3, min_delta=0.01)
    result, records, _ = _run(setup, config)
    s = result.summary
    evs = [x["value_pretrain/heldout/explained_variance"] for _, x in records
           if "value_pretrain/heldout/explained_variance" in x]  # fmt: skip
    print(f"held-out EV every 5 steps: {np.round(evs, 3).tolist()}; {s['stop_reason']}")
    assert s["heldout_ev_start"] == 0.0  # the value head starts at 0
    assert s["heldout_ev_best"] > 0.3  # the return is a function of the first action token
    assert s["stop_reason"].startswith("plateau") and s["steps"] < 200


def test_bad_settings_are_named():
    for field, value in (("heldout_rollouts", 12), ("trainable", "attention"), ("reuse", 0)):
        with pytest.raises(ConfigError, match=f"value_pretrain.{field}"):
            config_lib.validate(_config(**{field: value}))


def test_sharded_and_microbatched_equals_unsharded_whole_batch(setup):
    ref, _, _ = _run(setup, _config(steps=3, eval_every=3))
    config = _config(steps=3, eval_every=3)
    config.rl.microbatches = 2
    sharder = Sharder(build_mesh((2, 1, 2, 2)))  # batch over data x expert, tensor 2
    models = init_models(ModelConfig.from_config(config.model), sharder, seed=0)
    trainer = ValuePretrainer(config_lib.validate(config), models.critic_def, sharder)
    got, _, _ = _run((models, trainer), config)
    start = jax.tree.map(np.asarray, setup[0].critic)  # 3 Adam steps from here
    assert_steps_close(
        jax.tree.map(np.asarray, got.critic), jax.tree.map(np.asarray, ref.critic), start
    )
    assert got.summary["heldout_ev_final"] == pytest.approx(
        ref.summary["heldout_ev_final"], abs=1e-4
    )
