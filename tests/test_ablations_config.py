"""The ablation rows differ from SAO only in the fields their names say; sweeps validate."""

import dataclasses

import numpy as np
import pytest

from configs import ablations, online_shift, sao
from sao_jax import config as config_lib
from sao_jax import sweep
from sao_jax.checkpointing.workdir import flatten_config
from sao_jax.config import ConfigError
from sao_jax.rl import mask_budget


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
    assert v["sao_brace"] == {"rl.critic_target": "brace"}  # its validator's needs are SAO's
    brace = ablations.get_config("sao_brace")
    assert (brace.rl.advantage, brace.rl.lam_critic) == ("gae", 1.0)
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


def test_online_shift_rows_change_only_the_fields_their_names_say():
    base = _flat(online_shift.get_config("sao"))
    assert base["env.name"] == "user_style" and base["env.group_size"] == 1
    expect = {
        "moving_average": {"rl.advantage"},  # the default window is the paper's 128
        "moving_average_w8": {"rl.advantage", "rl.moving_average_window"},
        "moving_average_per_user": {
            "rl.advantage", "rl.baseline_key", "rl.moving_average_keys",
            "rl.moving_average_window",
        },
        "sao_lambda1": {"rl.lam_mode", "rl.lam_fixed"},
        "sao_policy_first": {"rl.order"},
        "ceiling": {"rl.privileged_critic", "env.params.pretrain_targets"},
        "sao_brace": {"rl.critic_target"},
        "track_lr_k": {"optim.critic.lr", "rl.k_critic"},
        "track_attn_noclip": {"optim.critic.freeze_attention", "optim.critic.max_grad_norm"},
        "track_lr_k_attn_noclip": {
            "optim.critic.lr", "rl.k_critic", "optim.critic.freeze_attention",
            "optim.critic.max_grad_norm",
        },
    }  # fmt: skip
    for row, fields in expect.items():
        assert _differing(base, _flat(online_shift.get_config(row))) == fields, row
    assert _flat(online_shift.get_config("moving_average"))["rl.moving_average_window"] == 128
    w8 = online_shift.get_config("moving_average_w8")
    assert w8.rl.moving_average_window == 8 * w8.rl.batch_size  # 8 steps of rewards
    assert online_shift.get_config("moving_average_w8,smoke").rl.moving_average_window == 8 * 8
    config_lib.validate(online_shift.get_config("ceiling,smoke"))
    config_lib.validate(online_shift.get_config("sao_brace,smoke"))
    assert online_shift.get_config("sao_brace").rl.critic_target == "brace"
    assert "sao_brace" not in online_shift.MAIN_ROWS + online_shift.TABLES["tracking"]


def test_online_shift_tracking_cells_are_the_half_fraction():
    cells = online_shift.TRACK_CELLS
    assert len(cells) == 7  # 2^(4-1) cells, SAO being the eighth (every factor low)
    for name in cells:
        assert len(name.split("_")[1:]) % 2 == 0, name  # I = ABCD: an even number high
    # each factor high in exactly 4 of the 8 cells (SAO included): balanced main effects
    for factor in online_shift.TRACK_FACTORS:
        assert sum(factor in n.split("_") for n in cells) == 4


def test_online_shift_rows_share_the_pretrained_critic_except_the_ceiling():
    from sao_jax.sweep.runner import shares_critic

    sao = online_shift.get_config("sao")
    for row in (*online_shift.TRACK_CELLS, "sao_lambda1", "sao_policy_first", "sao_brace"):
        assert shares_critic(sao, online_shift.get_config(row)), row
    assert not shares_critic(sao, online_shift.get_config("ceiling"))  # it pretrains its own


def _point_config(point: sweep.Point):
    return config_lib.validate(
        sweep.point_config(point.config_path, point.seed, point.all_overrides())
    )


SWEEPS = [
    (ablations, f"table={t},mode={m}")
    for t in ablations.TABLES
    for m in ablations.MODES
    if t != "mask_budget"  # needs a calibration file: test_mask_budget_sweep_...
] + [(online_shift, f"table={t},mode={m}") for t in online_shift.TABLES for m in online_shift.MODES]


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


@pytest.mark.parametrize("mode", online_shift.MODES)
def test_online_shift_offsets_reach_every_run_and_warm_start(mode):
    spread = online_shift.get_sweep(f"mode={mode}")
    narrow_payouts = _point_config(sweep.expand(spread)[0]).env.params.payouts
    assert "env.params.payouts" not in spread.fixed  # the pre-registered runs, unchanged
    users = online_shift.USER_BUDGETS[mode]["users"]
    assert spread == online_shift.get_sweep(f"mode={mode},offsets=spread")  # the default
    offsets = online_shift.OFFSET_SETS["spread"][:users]
    assert spread.fixed["env.params.offsets"] == offsets  # recorded, as its full runs were
    for p in [sweep.expand(spread)[-1], sweep.warm_start_point(spread, spread.seeds[0])]:
        c = _point_config(p)
        assert tuple(c.env.params.offsets) == offsets and c.env.params.payouts == narrow_payouts
    first = online_shift.get_sweep(f"mode={mode},offsets=none")  # the first per-user design
    for p in [sweep.expand(first)[0], sweep.warm_start_point(first, first.seeds[0])]:
        assert tuple(_point_config(p).env.params.offsets) == (0.0,) * users
    with pytest.raises(ConfigError, match="offsets"):
        online_shift.get_sweep("offsets=huge")


def test_online_shift_config_defaults_to_the_offsets_design():
    users = online_shift.USER_BUDGETS["full"]["users"]
    c = online_shift.get_config()
    assert tuple(c.env.params.offsets) == online_shift.OFFSET_SETS["spread"][:users]
    first = online_shift.get_config("offsets=none,moving_average_w8")
    assert tuple(first.env.params.offsets) == (0.0,) * users
    with pytest.raises(ConfigError, match="offsets='huge'"):
        online_shift.get_config("offsets=huge")


def test_full_tables_have_five_seeds_and_share_sao_runs():
    t4 = ablations.get_sweep("table=table4,mode=full")
    gae = ablations.get_sweep("table=gae,mode=full")
    grid = ablations.get_sweep("table=staleness_lr,mode=full")
    shift = online_shift.get_sweep("mode=full")
    for spec in (t4, gae, grid, shift):
        assert len(spec.seeds) >= 5, spec.name
    assert len(shift.seeds) >= 10  # the online shift's pre-registered family
    assert t4.seeds == gae.seeds == grid.seeds  # one warm start per seed serves all three
    sao4 = {p.name: p for p in sweep.expand(t4) if p.variant == "sao"}
    sao5 = {p.name: p for p in sweep.expand(gae) if p.variant == "sao"}
    assert sao4 == sao5  # one set of SAO runs serves both tables


def _calibration(path, mode):
    """A calibration file for `mode`'s budgets, from random tokens."""
    rng = np.random.default_rng(0)
    lr, h = rng.normal(0, 0.1, 2000), rng.exponential(0.5, 2000)
    cals = [
        mask_budget.calibrate(r, lr, h, f)
        for f in ablations.MASK_BUDGETS[mode]
        for r in mask_budget.RULES
    ]
    return mask_budget.write_calibration(path, cals, {})


@pytest.mark.parametrize("mode", ablations.MODES)
def test_mask_budget_sweep_sets_each_rule_to_its_calibrated_band(tmp_path, mode):
    path = _calibration(tmp_path / "cal.json", mode)
    spec = ablations.get_sweep(f"table=mask_budget,mode={mode},calibration={path}")
    points = sweep.expand(spec)
    seeds, budgets = len(spec.seeds), len(ablations.MASK_BUDGETS[mode])
    assert len(points) == len(spec.variants) * budgets * seeds
    levels = mask_budget.read_levels(path, ablations.MASK_BUDGETS[mode])
    s, lr = ablations.MASK_CELL[mode]
    for p in points:
        c = _point_config(p)
        assert (c.sampling.max_staleness, c.optim.policy.lr, c.train.log_every) == (s, lr, 1)
        loss = c.rl.policy_loss
        assert loss == {"sao": "dis", "estr": "estr", "icepop": "icepop"}[p.variant]
        level = next(lv for lv in levels if all(dict(p.overrides)[k] == v for k, v in lv.items()))
        own = {k.rsplit(".", 1)[1]: v for k, v in level.items() if f".{loss}." in k}
        assert {k: c.rl.losses[loss][k] for k in own} == own
    with pytest.raises(ConfigError, match="needs calibration"):
        ablations.get_sweep(f"table=mask_budget,mode={mode}")


def test_open_question_sweeps_keep_their_names_apart_and_share_warm_starts():
    names = {}
    for table in ("staleness_lr", "staleness_law", "mask_pilot"):
        for mode in ("quick", "full"):
            for p in sweep.expand(ablations.get_sweep(f"table={table},mode={mode}")):
                assert names.setdefault(p.name, table) == table, p.name  # no shared names
    # smoke: the law's points are the staleness grid's, the same commands (run once)
    grid, law = (
        ablations.get_sweep(f"table={t},mode=smoke") for t in ("staleness_lr", "staleness_law")
    )
    argv = lambda spec: {p.name: sweep.point_argv(p, "w") for p in sweep.expand(spec)}
    assert argv(law) == argv(grid)
    law = ablations.get_sweep("table=staleness_law,mode=full")
    pilot = ablations.get_sweep("table=mask_pilot,mode=full")
    t4 = ablations.get_sweep("table=table4,mode=full")
    for spec in (law, pilot):
        assert spec.seeds == t4.seeds
        assert sweep.warm_start_name(spec, 0) == sweep.warm_start_name(t4, 0)
        assert sweep.warm_start_point(spec, 0) == sweep.warm_start_point(t4, 0)
    assert ablations.pilot_dump_steps("full") == (1, 9, 10, 11, 12)
    c = _point_config(sweep.expand(pilot)[0])
    assert c.train.token_dump_steps == (1, 9, 10, 11, 12) and c.train.total_steps == 12


@pytest.mark.parametrize("mode", ablations.MODES)
def test_brace_tables_share_their_sao_points_and_warm_starts(mode):
    """The critic-correction sweeps add only sao_brace runs to a sweep dir that holds the
    staleness grid and the online main table: same point names, same commands."""
    pairs = (
        (ablations.get_sweep(f"table=brace_staleness,mode={mode}"),
         ablations.get_sweep(f"table=staleness_lr,mode={mode}")),
        (online_shift.get_sweep(f"table=brace,mode={mode},offsets=none"),
         online_shift.get_sweep(f"table=main,mode={mode},offsets=none")),
    )  # fmt: skip
    for brace, other in pairs:
        assert brace.variants == ("sao", "sao_brace")
        assert set(brace.seeds) <= set(other.seeds)
        theirs = {p.name: p for p in sweep.expand(other)}
        ours = sweep.expand(brace)
        for p in ours:
            if p.variant == "sao":
                assert theirs[p.name] == p, p.name  # one command: reused, never rerun
            else:  # the sao point of the same cell and seed, only the row changed
                twin = theirs[p.name.replace("__sao_brace__", "__sao__")]
                assert p.name not in theirs and dataclasses.replace(p, variant="sao") == twin
        assert {p.variant for p in ours} == {"sao", "sao_brace"}
        for seed in brace.seeds:
            assert sweep.warm_start_point(brace, seed) == sweep.warm_start_point(other, seed)
            assert sweep.warm_start_name(brace, seed) == sweep.warm_start_name(other, seed)
    if mode == "full":
        grid, online = pairs[0][0], pairs[1][0]
        assert len(grid.seeds) >= 5 and len(online.seeds) >= 5
        cells = {(c.sampling.max_staleness, c.optim.policy.lr, c.train.rollouts)
                 for c in map(_point_config, sweep.expand(grid))}  # fmt: skip
        assert cells == {(0, 1e-4, "sync"), (0, 1e-3, "sync"), (8, 1e-4, "async"),
                         (8, 1e-3, "async")}  # fmt: skip
