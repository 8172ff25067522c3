"""The ablation rows differ from SAO only in the fields their names say; sweeps validate."""

import pytest

from configs import ablations, online_shift, sao
from sao_jax import config as config_lib
from sao_jax import sweep
from sao_jax.checkpointing.workdir import flatten_config
from sao_jax.config import ConfigError


def _flat(c) -> dict:
    return flatten_config(c.to_dict())


def _differing(a: dict, b: dict) -> set[str]:
    assert set(a) == set(b), "variants must not add or remove fields"
    return {k for k in a if a[k] != b[k]}


def test_sao_row_is_configs_sao():
    assert _flat(ablations.get_config("sao")) == _flat(sao.get_config())
    assert _flat(ablations.get_config()) == _flat(sao.get_config())
    assert _flat(ablations.get_config("sao,smoke,seed=3")) == _flat(sao.get_config("smoke,seed=3"))


@pytest.mark.parametrize("variant", sorted(ablations.VARIANTS))
@pytest.mark.parametrize("extra", ["", ",smoke"])
def test_variant_differs_only_in_declared_fields(variant, extra):
    base = _flat(ablations.get_config("sao" + extra))
    row = _flat(ablations.get_config(variant + extra))
    declared = ablations.VARIANTS[variant]
    assert _differing(base, row) == set(declared)
    for field, value in declared.items():
        assert row[field] == value


@pytest.mark.parametrize("variant", sorted(ablations.VARIANTS))
def test_every_row_validates(variant):
    config_lib.validate(ablations.get_config(variant))


def test_group_rows_keep_the_batch_as_prompts_times_group():
    for variant in ("grpo", "grpo_dis"):
        c = ablations.get_config(variant)
        assert c.env.group_size == 8 and c.rl.batch_size == 64  # 8 prompts x 8 rollouts


def test_variant_definitions_match_the_brief():
    v = ablations.VARIANTS
    assert v["no_faster_value"] == {"rl.k_critic": 1}
    assert v["no_frozen_attention"] == {"optim.critic.freeze_attention": False}
    assert v["vanilla_vapo"] == {"rl.policy_loss": "ppo_clip", "rl.minibatches": 4}
    assert v["grpo"]["rl.policy_loss"] == "ppo_clip" and "rl.policy_loss" not in v["grpo_dis"]
    for row in ("vanilla_vapo", "grpo"):  # veRL's default PPO loop: 1 epoch x 4 minibatches
        c = ablations.get_config(row)
        assert (c.rl.ppo_epochs, c.rl.minibatches) == (1, 4), row
    for row in ("sao", "grpo_dis", "no_faster_value", "no_frozen_attention"):  # DIS: one step
        c = ablations.get_config(row)
        assert (c.rl.ppo_epochs, c.rl.minibatches) == (1, 1), row
    sao_cfg = sao.get_config()
    assert (sao_cfg.rl.advantage, sao_cfg.rl.policy_loss, sao_cfg.rl.k_critic) == ("gae", "dis", 2)
    assert sao_cfg.optim.critic.freeze_attention and sao_cfg.rl.lam_mode == "adaptive"


def test_bad_variant_args_are_refused():
    with pytest.raises(ConfigError, match="pick one row"):
        ablations.get_config("grpo,step_last")
    with pytest.raises(ConfigError, match="unknown config variant key"):
        ablations.get_config("grpoo")
    with pytest.raises(ConfigError, match="table"):
        ablations.get_sweep("table=table9")
    with pytest.raises(ConfigError, match="mode"):
        online_shift.get_sweep("mode=huge")


def test_online_shift_rows_differ_only_in_the_estimator():
    a = _flat(online_shift.get_config("sao"))
    b = _flat(online_shift.get_config("moving_average"))
    assert _differing(a, b) == {"rl.advantage"}
    assert a["env.name"] == "style" and a["env.group_size"] == 1
    config_lib.validate(online_shift.get_config("moving_average,smoke"))


@pytest.mark.parametrize(
    ("row", "base"), [("sao_sync", "sao"), ("moving_average_sync", "moving_average")]
)
def test_online_shift_sync_rows_differ_only_in_the_rollout_mode(row, base):
    from sao_jax.sweep.runner import shares_critic

    a, b = online_shift.get_config(base), online_shift.get_config(row)
    assert _differing(_flat(a), _flat(b)) == {"train.rollouts"}
    assert a.train.rollouts == "async" and b.train.rollouts == "sync"
    # the row = the base under configs/sao.py's :sync, except that :sync also makes value
    # pretraining deterministic (its sampler sync); the rows keep the base's pretraining
    row_smoke, sync_smoke = (
        _flat(online_shift.get_config(v)) for v in (f"{row},smoke", f"{base},smoke,sync")
    )
    assert _differing(row_smoke, sync_smoke) == {"value_pretrain.sampler"}
    if row == "sao_sync":  # the pair starts from the seed's shared pretrained critic
        assert shares_critic(a, b)


def test_online_shift_runs_the_synchronous_pair_in_full_mode_only():
    variants = {m: sweep.expand(online_shift.get_sweep(f"mode={m}")) for m in online_shift.MODES}
    assert {p.variant for p in variants["full"]} == set(online_shift.VARIANTS)
    for mode in ("smoke", "quick"):
        assert {p.variant for p in variants[mode]} == {"sao", "moving_average"}


def _point_config(point: sweep.Point):
    return config_lib.validate(
        sweep.point_config(point.config_path, point.seed, point.all_overrides())
    )


SWEEPS = [(ablations, f"table={t},mode={m}") for t in ablations.TABLES for m in ablations.MODES] + [
    (online_shift, f"mode={m}") for m in online_shift.MODES
]


@pytest.mark.parametrize(("module", "arg"), SWEEPS, ids=[a for _, a in SWEEPS])
def test_every_sweep_point_and_warm_start_validates(module, arg):
    spec = module.get_sweep(arg)
    points = sweep.expand(spec)
    assert {p.variant for p in points} <= set(module.VARIANTS)
    assert len({p.name for p in points}) == len(points)
    for p in points:
        _point_config(p)
    for seed in spec.seeds:
        c = _point_config(sweep.warm_start_point(spec, seed))
        assert c.train.total_steps == 0


def test_full_tables_have_five_seeds_and_share_sao_runs():
    t4 = ablations.get_sweep("table=table4,mode=full")
    gae = ablations.get_sweep("table=gae,mode=full")
    grid = ablations.get_sweep("table=staleness_lr,mode=full")
    shift = online_shift.get_sweep("mode=full")
    for spec in (t4, gae, grid, shift):
        assert len(spec.seeds) >= 5, spec.name
    assert t4.seeds == gae.seeds == grid.seeds  # one warm start per seed serves all three
    sao4 = {p.name: p for p in sweep.expand(t4) if p.variant == "sao"}
    sao5 = {p.name: p for p in sweep.expand(gae) if p.variant == "sao"}
    assert sao4 == sao5  # one set of SAO runs serves both tables
