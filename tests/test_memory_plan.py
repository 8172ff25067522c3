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
    learner = Learner(c.rl, c.optim, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder)
    models = init_models(cfg, sharder, seed=0)
    state = learner.new_state(models.policy, models.critic, seed=0)
    sizes, live_ok = update_parts.state_bytes(cfg, c.optim, state)
    assert live_ok, sizes
    if freeze and trainable == "moe":  # embedding and norms frozen too: smaller still
        assert sizes["critic AdamW, live"] < sizes["critic AdamW, attention frozen"]


def test_kv_pool_plan_literal():
    """Per-token KV bytes, dense and paged pool sizes, and the live-token model on a
    near-constant length (T ~ 1000: a rollout in flight holds u T, u uniform, plus the
    decode lookahead, rounded up to pages: 500 + 1 + 16 / 2 on average)."""
    from sao_jax.plan.kv_pool import EpisodeLengths, in_flight, kv_bytes_per_token, pool_plan

    assert kv_bytes_per_token(dataclasses.replace(CFG, dtype="bfloat16")) == 48 * 2 * 4 * 128 * 2
    sampling = dict(num_slots=32, max_len=2048, kv_layout="dense", page_size=16, num_pages=0)
    dense = pool_plan(CFG, sampling, devices=4)
    assert dense.tokens == 32 * 2048 and dense.device_bytes == 32 * 2048 * dense.token_bytes / 4
    paged = pool_plan(CFG, {**sampling, "kv_layout": "paged", "num_pages": 1100}, devices=4)
    assert paged.tokens == 1100 * 16
    f = in_flight(paged, EpisodeLengths(1000, 1001), trials=500)
    assert abs(f.mean_live - 509) < 5, f
    assert 32 * 509 / 16 < f.pages_q < 32 * 1001 / 16 and 0 < f.short < 0.5
    with pytest.raises(ValueError, match="num_pages"):
        pool_plan(CFG, {**sampling, "kv_layout": "paged", "num_pages": 100}, devices=4)


def test_paged_30b_variant_plans_512_rollouts_in_flight_on_64_chips():
    """configs/qwen3_30b_a3b_sao.py:paged: 16 hosts x 32 rollouts in flight at 32k
    max_len, the pool short of pages < 0.5% of the time at the assumed episode lengths,
    and the per-chip sum (update step + sampler copy + KV pool) within a v5p's 95 GiB."""
    from sao_jax import config as config_lib
    from sao_jax.parallel.mesh import Sharder
    from sao_jax.plan.kv_pool import EpisodeLengths, in_flight, pool_plan
    from sao_jax.plan.memory import abstract_mesh
    from sao_jax.plan.step_memory import step_plan_lines

    c = config_lib.validate(config_lib.load_config("configs/qwen3_30b_a3b_sao.py:paged"))
    assert c.sampling.kv_layout == "paged" and c.sampling.max_len == 32768
    cfg = ModelConfig.from_config(c.model)
    pool = pool_plan(cfg, c.sampling, devices=4)  # one engine per 4-chip host
    assert (64 // pool.devices) * pool.slots >= 512
    f = in_flight(pool, EpisodeLengths(4096, 32768))
    assert f.pages_q <= pool.pages and f.short < 0.005, f
    sharder = Sharder(abstract_mesh(MESH_64))
    plan = memory_plan(cfg, c.optim, MESH_64)
    lines = step_plan_lines(cfg, plan, sharder, length=32768, rows_per_device=1,
                            microbatches=c.rl.microbatches, slots_per_host=pool.slots,
                            devices_per_host=4, pool=pool)  # fmt: skip
    total = next(line for line in lines if line.startswith("sum:"))
    assert float(total.split()[-1]) < 95, lines
    kv = next(line for line in lines if line.startswith("KV cache, paged"))
    assert abs(float(kv.split()[-1]) - 6.94) < 0.01


def test_entry_point_plans_a_paged_pool_and_names_bad_flags():
    base_flags = ["--config=configs/sao.py:smoke", "--mesh=fsdp=2", "--devices=2"]

    def plan(*flags):
        return subprocess.run(
            [sys.executable, "-m", "experiments.memory_plan", *base_flags, *flags],
            cwd=pathlib.Path(__file__).parents[1],
            capture_output=True,
            text=True,
        )

    out = plan("--pool_devices=1", "--config.sampling.kv_layout=paged", "--episode_median=40",
               "--episode_p99=90")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "2 engine(s) x 8 slots = 16 rollouts in flight" in out.stdout
    assert "KV pool paged: 48 pages x 16 positions" in out.stdout
    bad = plan("--pool_devices=3")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "memory_plan: flag --pool_devices: 3 does not divide --devices"
    ]
