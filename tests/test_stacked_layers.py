"""Stacked decoder layers (`model.scan_layers=True`) against the per-layer layout.

The same seed gives the same weights in both layouts (`stack_params` maps one to the
other); one full update step, the critic's trainable set, the memory plan, Hugging Face
files and orbax checkpoints all agree after that mapping, and the stacked forward and
gradients on 8 fake devices equal one device's. Forward values and gradients against
the layer loop under each remat policy: tests/test_layer_stack.py; decoding in the
stacked layout (prefill, decode steps, engine rollouts) against the per-layer one:
tests/test_stacked_decode.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import base
from sao_jax import checkpointing as ckpt
from sao_jax import config as config_lib
from sao_jax.models import hf
from sao_jax.models.config import ModelConfig, run_overrides
from sao_jax.models.factory import critic_def, init_models, policy_def
from sao_jax.models.layer_stack import layer_runs, stack_params, stacked_key
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import ModelDef, path_str
from sao_jax.plan.memory import memory_plan
from sao_jax.plan.step_memory import abstract_batch
from sao_jax.rl.optim import TRAINABLE_SETS, trainable_labels
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner
from sao_jax.schema import ConfigError
from tests.closeness import assert_steps_close

# Dense layer 0, then a run of two MoE layers: two stacks, [1, ...] and [2, ...] (three
# layers: the per-layer update step, unrolled, compiles in proportion to the depth).
MODEL = dict(
    vocab_size=32, hidden_size=32, num_hidden_layers=3, head_dim=8, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
    num_experts_per_tok=2, mlp_only_layers=(0,), attention_block=8,
)  # fmt: skip
CFG = ModelConfig(**MODEL)
STACKED = dataclasses.replace(CFG, scan_layers=True)


def _leaves(tree) -> dict:
    return {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_close(got, want, **tol):
    got, want = _leaves(got), _leaves(want)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], err_msg=name, **(tol or {"atol": 0}))


@functools.cache
def _models(cfg, sharder=None):
    """Read-only models (cached): an update step donates its state, so it builds its own."""
    return init_models(cfg, sharder or Sharder(), seed=0)


def test_layout_axes_and_same_weights_from_one_seed():
    per, st = _models(CFG), _models(STACKED)
    assert sorted(st.policy["trunk"]) == ["embed", "final_norm", "stacks"]
    q = st.policy["trunk"]["stacks"][1]["attn"]["q_proj"]
    assert q.shape == (2, 32, 4, 8)  # [L_run, D, N, H]
    axes = st.policy_def.axes()["trunk"]["stacks"]
    assert axes[1]["mlp"]["experts"]["gate_proj"] == ("layers", "expert", "embed", "expert_mlp")
    assert axes[0]["mlp"]["gate_proj"] == ("layers", "embed", "mlp")  # the dense run
    _assert_close(st.policy, stack_params(CFG, per.policy))
    _assert_close(st.critic, stack_params(CFG, per.critic))
    _assert_close(stack_params(CFG, st.policy, to_stacked=False), per.policy)


def _batch(b=4, t=12):
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, CFG.vocab_size)
    seg = jnp.ones((b, t), jnp.int32).at[1, 9:].set(0)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return tokens, pos, seg


def _value_and_grads(cfg, params, sharder, remat="none"):
    cfg = dataclasses.replace(cfg, remat=remat)
    mdef = ModelDef.of(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(0)))
    tokens, pos, seg = _batch()

    def loss(p):
        out = mdef.bind(p)(tokens, pos, seg)
        return jnp.sum(jnp.where((seg != 0)[..., None], out.out, 0.0) ** 2) + out.aux_loss, (
            out.experts_btlk
        )

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def test_sharded_equals_unsharded_stacked():
    """8 fake devices: the layer axis unsharded, every other axis as in the per-layer layout."""
    sharder = Sharder(build_mesh((2, 2, 2, 1)))
    st = _models(STACKED, sharder)
    per = policy_def(CFG, sharder).shardings(sharder)  # the per-layer layout's: no init
    spec = lambda p: {path_str(k): getattr(v, "sharding", v).spec
                      for k, v in jax.tree_util.tree_leaves_with_path(p)}  # fmt: skip
    got, want = spec(st.policy), spec(per)
    for name, s in got.items():
        if ".stacks." in name:
            r = int(name.split(".")[2])
            first = name.replace(f"stacks.{r}.", f"layers.{layer_runs(CFG)[r][0]}.")
            assert s[0] is None and tuple(s[1:]) == tuple(want[first]), name
    assert got["trunk.stacks.1.mlp.experts.gate_proj"][1] == "expert"  # really sharded
    unsharded = jax.device_get(st.policy)
    (want_v, want_e), want_g = _value_and_grads(STACKED, unsharded, Sharder())
    (got_v, got_e), got_g = _value_and_grads(STACKED, st.policy, sharder)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    np.testing.assert_array_equal(got_e, want_e)
    _assert_close(got_g, want_g, atol=1e-5, rtol=1e-4)


def _config(scan: bool, **model):
    c = base.get_config()
    c.model.update(MODEL, scan_layers=scan, **model)
    c.rl.batch_size = 8
    c.optim.policy.lr = 1e-3
    c.optim.critic.lr = 1e-3
    c.optim.critic.warmup_steps = 0
    return config_lib.validate(c)


@pytest.fixture(scope="module")
def learners():
    """{scan_layers: (Learner, fresh state maker)}, each compiled once for the module (the
    models are _models's: a new state copies them, so the donated state is its own)."""
    out = {}
    for scan in (False, True):
        config = _config(scan)
        models = _models(ModelConfig.from_config(config.model))
        learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, Sharder())
        out[scan] = learner, functools.partial(learner.new_state, models.policy, models.critic, 0)
    return out


@pytest.mark.slow  # a module with one starts early (tests/conftest.py)
def test_update_step_equals_per_layer_and_opt_state_is_per_run(learners):
    (l_per, new_per), (l_st, new_st) = learners[False], learners[True]
    s_per, s_st = new_per(), new_st()
    start = jax.tree.map(np.asarray, s_per)
    count = lambda s: len(jax.tree.leaves(s.policy_opt)) + len(jax.tree.leaves(s.critic_opt))
    assert count(s_st) < count(s_per)  # one moment per parameter kind per run
    for i in range(2):
        batch = synthetic_batch(8, 16, 32, seed=i, version=i)
        s_per, _ = l_per.update_step(s_per, batch, jax.random.key(i))
        s_st, _ = l_st.update_step(s_st, batch, jax.random.key(i))
    assert int(s_st.step) == 2 and int(s_st.skipped_steps) == 0
    for part in ("policy", "critic"):  # two Adam steps: the k-step bound (tests/closeness.py)
        got = stack_params(CFG, getattr(s_st, part), to_stacked=False)
        assert_steps_close(got, getattr(s_per, part), getattr(start, part), err_msg=part)
    # The frozen-attention critic really froze attention in the stacked layout.
    q = s_st.critic["trunk"]["stacks"][1]["attn"]["q_proj"]
    np.testing.assert_array_equal(
        q, _models(STACKED).critic["trunk"]["stacks"][1]["attn"]["q_proj"]
    )


def test_update_step_program_does_not_grow_with_depth(learners):
    """Lowered update step (stacked): the same ops and TrainState leaves at 3 and 7 layers.
    At 3 layers, the module's stacked learner: its update step is traced already for the
    same shapes, so only the 7-layer program is traced here."""

    def program(learner, cfg):
        batch = abstract_batch(8, 16, cfg)
        key = jax.eval_shape(lambda: jax.random.key(0))
        text = learner.update_step.lower(learner.abstract_state, batch, key).as_text()
        ops = sum(1 for line in text.splitlines() if " = " in line and "stablehlo." in line)
        return ops, len(jax.tree.leaves(learner.abstract_state))

    config = _config(True, num_hidden_layers=7)
    cfg = ModelConfig.from_config(config.model)
    pdef, cdef = policy_def(cfg, Sharder()), critic_def(cfg, Sharder())
    deep = Learner(config.rl, config.optim, pdef, cdef, Sharder())
    assert program(learners[True][0], STACKED) == program(deep, cfg)


@pytest.mark.parametrize("trainable", TRAINABLE_SETS[:2])
def test_trainable_sets_select_the_same_parameters(trainable):
    per, st = _models(CFG).critic, _models(STACKED).critic
    want = _label_table(trainable_labels(per, trainable))
    got = _label_table(trainable_labels(st, trainable))
    assert "frozen" in want.values() and "train" in want.values()
    seen = set()
    for name, label in want.items():  # trunk.layers.<i>.X has the label of trunk.stacks.<r>.X
        if name.startswith("trunk.layers."):
            i, rest = name.split(".", 3)[2:]
            r, _ = stacked_key(CFG, int(i))
            name = f"trunk.stacks.{r}.{rest}"
        assert got[name] == label, name
        seen.add(name)
    assert seen == set(got)


def _label_table(labels) -> dict:
    return {path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(labels)}


def test_memory_plan_counts_the_same_bytes():
    sizes = dict(data=1, fsdp=2, expert=2, tensor=2)
    optim = base.get_config().optim
    per, st = memory_plan(CFG, optim, sizes), memory_plan(STACKED, optim, sizes)
    for frozen in (False, True):
        assert per.total(frozen).device_bytes == st.total(frozen).device_bytes
    assert per.policy_total.count == st.policy_total.count


def test_hf_round_trip_stacked(tmp_path):
    per = _models(CFG).policy
    stacked = stack_params(CFG, per)
    hf.save_hf_checkpoint(tmp_path / "st", STACKED, stacked, max_shard_bytes=40_000)
    hf.save_hf_checkpoint(tmp_path / "per", CFG, per, max_shard_bytes=40_000)
    files = lambda d: {f.name: f.read_bytes() for f in sorted((tmp_path / d).iterdir())}
    assert files("st") == files("per")  # the Hugging Face side does not change
    # An init.kind='hf' run takes remat, scan_layers, dtypes, ... from config.model.
    run = run_overrides(_config(True).model)
    cfg, _, loaded = hf.load_hf_policy(tmp_path / "st", **run)
    assert cfg.scan_layers and "stacks" in loaded["trunk"]
    _assert_close(loaded, stacked)
    sharder = Sharder(build_mesh((1, 2, 2, 2)))
    _, _, sharded = hf.load_hf_policy(tmp_path / "per", sharder=sharder, scan_layers=True)
    _assert_close(sharded, stacked)


def test_checkpoint_round_trip_and_layout_error(tmp_path, learners):
    (l_per, _), (l_st, new_st) = learners[False], learners[True]
    s_st = new_st()
    masked = lambda x: isinstance(x, optax.MaskedNode)  # the frozen-attention critic's state
    assert any(map(masked, jax.tree.leaves(s_st.critic_opt, is_leaf=masked)))
    with ckpt.Checkpointer(tmp_path / "c", async_save=False) as ck:
        ck.save(1, s_st, {})
        restored, _ = ck.restore(ckpt.abstract_like(l_st.abstract_state, l_st.state_shardings))
        _assert_close(restored, s_st)
        with pytest.raises(ConfigError, match=r"model\.scan_layers: .* stacked \(trunk\.stacks\)"):
            ck.restore(ckpt.abstract_like(l_per.abstract_state, l_per.state_shardings))
