"""Memory plan of the full-size Qwen3-30B-A3B on an abstract 64-chip mesh (shapes only)."""

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from configs import base
from configs.models import qwen3_30b_a3b
from sao_jax.models.config import ModelConfig
from sao_jax.plan.memory import format_plan, memory_plan, parse_mesh
from sao_jax.schema import ConfigError

CFG = ModelConfig.from_config(qwen3_30b_a3b.get_config())
MESH_64 = dict(data=1, fsdp=8, expert=8, tensor=1)


@pytest.fixture(scope="module")
def plan():
    return memory_plan(CFG, base.get_config().optim, MESH_64)


def _counts(c: ModelConfig) -> dict[str, int]:
    """Parameter counts of Qwen3-30B-A3B written out by hand."""
    d, n, k, h, layers = 2048, 32, 4, 128, 48
    e, m, v = 128, 768, 151936
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (d, n, k, h)
    assert (c.num_experts, c.moe_intermediate_size, c.vocab_size) == (e, m, v)
    return dict(
        attention=layers * (2 * d * n * h + 2 * d * k * h + 2 * h),  # q, o, k, v, q/k norms
        experts=layers * 3 * e * d * m,
        router=layers * d * e,
        norms=layers * 2 * d + d,
        embed_head=2 * v * d,
    )


def test_parameter_counts_match_the_published_model(plan):
    n = _counts(CFG)
    total = sum(n.values())
    assert plan.policy_total.count == total
    assert 30.4e9 < total < 30.6e9  # "30.5B total"
    assert plan.policy["attention"].count == n["attention"]
    assert plan.policy["experts"].count == n["experts"]
    active = total - n["experts"] + n["experts"] * 8 // 128
    assert plan.active_params == active and 3.2e9 < active < 3.4e9  # "3.3B activated"
    assert plan.critic_total.count == total - 151936 * 2048 + 2048 + 1  # no LM head; value head


def test_per_device_bytes_follow_the_shardings(plan):
    n = _counts(CFG)
    assert plan.policy_total.global_bytes == 4 * plan.policy_total.count  # float32 params
    # Experts split 64 ways (expert x fsdp); attention, embeddings and router 8 ways
    # (fsdp on the model dim; tensor=1); norms replicated.
    split8 = n["attention"] - 48 * 2 * 128 + n["embed_head"] + n["router"]
    replicated = n["norms"] + 48 * 2 * 128
    want = 4 * (n["experts"] // 64 + split8 // 8 + replicated)
    assert plan.policy_total.device_bytes == want
    # AdamW: two float32 moments per parameter plus two int32 step counts.
    assert plan.policy_opt.global_bytes == 2 * plan.policy_total.global_bytes + 8


def test_frozen_attention_saves_exactly_its_moments(plan):
    attn = plan.critic["attention"]
    full, frozen = plan.critic_opt_full, plan.critic_opt_frozen
    assert full.global_bytes - frozen.global_bytes == 2 * attn.count * 4
    assert full.device_bytes - frozen.device_bytes == 2 * attn.device_bytes
    # The configured set ('moe', the default) also leaves embedding and norms untrained.
    assert plan.critic_trainable == "moe"
    trained = plan.critic_opt_trainable
    assert trained.global_bytes < frozen.global_bytes
    assert plan.total(False).device_bytes - plan.total(True).device_bytes == (
        full.device_bytes - trained.device_bytes
    )
    text = format_plan(plan)
    for row in ("policy params", "critic AdamW state, attention frozen", "attention share"):
        assert row in text
    assert "fsdp=8 expert=8" in text and "(64 devices)" in text


def test_kv_heads_not_divisible_by_tensor_is_named():
    one_layer = dataclasses.replace(CFG, num_hidden_layers=1)  # same dims, faster trace
    with pytest.raises(ConfigError, match=r"trunk\.layers\.0\.attn\.k_proj.*'kv_heads', size 4"):
        memory_plan(one_layer, base.get_config().optim, dict(data=1, fsdp=8, expert=1, tensor=8))


def test_parse_mesh():
    assert parse_mesh("fsdp=8", 8) == dict(data=1, fsdp=8, expert=1, tensor=1)
    assert parse_mesh("expert=8,fsdp=-1", 64) == dict(data=1, fsdp=8, expert=8, tensor=1)
    with pytest.raises(ConfigError, match="--mesh.*pipeline"):
        parse_mesh("pipeline=2", 8)
    with pytest.raises(ConfigError, match="covers 16 devices, not 64"):
        parse_mesh("fsdp=2,expert=8", 64)


def test_entry_point_runs_on_the_tiny_model():
    flags = ["--config=configs/models/tiny.py", "--mesh=fsdp=2,expert=4", "--devices=8"]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.memory_plan", *flags],
        cwd=pathlib.Path(__file__).parents[1],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "total, critic trains 'moe'" in out and "(8 devices)" in out


@pytest.mark.parametrize(
    "freeze, trainable", [(True, "moe"), (True, "all_but_attention"), (False, "moe")]
)
def test_plan_rows_match_a_live_train_state(freeze, trainable):
    """The plan's critic AdamW row for the configured set is the live optimizer state's
    size (experiments.bench.update_step prints this check)."""
    from configs import sao
    from experiments.bench import update_parts
    from sao_jax import config as config_lib
    from sao_jax.models.factory import critic_def, init_models, policy_def
    from sao_jax.parallel.mesh import Sharder
    from sao_jax.rl.update import Learner

    c = sao.get_config("smoke")
    c.optim.critic.freeze_attention, c.optim.critic.trainable = freeze, trainable
    c = config_lib.validate(c)
    cfg, sharder = ModelConfig.from_config(c.model), Sharder()
    learner = Learner(c, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder)
    models = init_models(cfg, sharder, seed=0)
    state = learner.new_state(models.policy, models.critic, seed=0)
    sizes, live_ok = update_parts.state_bytes(cfg, c.optim, state)
    assert live_ok, sizes
    if freeze and trainable == "moe":  # embedding and norms frozen too: smaller still
        assert sizes["critic AdamW, live"] < sizes["critic AdamW, attention frozen"]
