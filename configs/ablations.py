r"""The paper's ablation rows (Tables 4 and 5) and the staleness x learning-rate grid.

Every row is configs/sao.py (the embedded calculator task) with only the fields its
name says changed (`VARIANTS`; tests/test_ablations_config.py diffs them field by field):

  sao                  SAO: obs-skipping GAE, DIS, K=2, frozen-attention critic
  no_faster_value      rl.k_critic = 1 (no TTUR)
  no_frozen_attention  optim.critic.freeze_attention = False (full-parameter critic)
  vanilla_vapo         rl.policy_loss = 'ppo_clip' (clip vs pi_old = the behaviour policy),
                       PPO's loop: PPO_LOOP (1 epoch x 4 minibatch optimizer steps)
  moving_average       rl.advantage = 'moving_average' (R - mean of last 128; no critic)
  moving_average_160   the same, rl.moving_average_window = 160 (2.5 batches of 64;
                       moving_average's 128 is 2 batches)
  moving_average_per_level  the oracle per-level baseline: the same estimator with one
                       window of 128 per difficulty level (rl.baseline_key = 'level',
                       rl.moving_average_keys = 5: levels 1-4 index windows 1-4, window 0
                       unused); R - mean of the last 128 outcomes of the prompt's level
  grpo                 rl.advantage = 'grpo', rl.policy_loss = 'ppo_clip', 8 x 8 groups,
                       PPO_LOOP
  grpo_dis             rl.advantage = 'grpo', 8 x 8 groups, DIS
  step_mean            rl.advantage = 'step_mean' (one value per turn: mean of its tokens)
  step_last            rl.advantage = 'step_last' (one value per turn: its last token)
  cross_observation    rl.advantage = 'cross_observation' (GAE through observation tokens)
  estr                 rl.policy_loss = 'estr' (keep iff |log r| <= sqrt(tau (H + eps)))
  icepop               rl.policy_loss = 'icepop' (IcePop's band on pi_old / pi_rollout; with
                       SAO's one step per batch pi_old is the current policy and the PPO
                       clip never binds: a fixed band in r, weighted by r, as DIS)
  sao_brace            rl.critic_target = 'brace' (the critic regresses BRACE-style targets:
                       its first k residuals importance-corrected, docs/method.md section 8;
                       it needs rl.advantage = 'gae' and rl.lam_critic = 1, SAO's own)

  python -m experiments.train --config=configs/ablations.py:grpo --workdir=workdirs/grpo
  python -m experiments.train --config=configs/ablations.py:step_last,smoke,seed=1 \
      --workdir=/tmp/step_last

Variant keys (`:a,b=1`): one row name (default sao), smoke, sync, seed=N.

`get_sweep('table=table4|gae|staleness_lr|baseline_ceiling|staleness_law|mask_pilot|
brace_staleness,mode=smoke|quick|full')` returns the experiment's sao_jax.sweep.SweepSpec
(docs/experiments.md has the budgets); `get_sweep('table=mask_budget,mode=...,
calibration=<file>')` the matched-mask-budget table, its rules' parameters read from the
calibration file experiments/mask_budget/ writes from the `mask_pilot` runs' token dumps
(sao_jax/rl/mask_budget.py).

Why the per-level row keeps a window of 128 per level. The level is what a per-prompt
baseline would know here (alone it explains about half the return's variance, README),
so the mean outcome of the prompt's level is close to the ideal per-prompt baseline a
critic could learn. The row changes one thing against moving_average, what the window is
keyed by, and keeps its size, the paper's 128: each baseline is a mean of 128 outcomes
(SE at most 0.044, at a success rate of 0.5), like the global one. The price is
staleness: the training stream draws the four levels alike, about 16 of a batch of 64
each, so a level's window spans about 8 batches against the global window's 2 (a window
of 32 per level would match the global staleness at twice the SE). moving_average_160
(2.5 batches) shows how much a longer global window alone changes the global row.
"""

from __future__ import annotations

from typing import Any

from sao_jax.config import ConfigError, parse_arg
from sao_jax.configs import sao
from sao_jax.rl import mask_budget
from sao_jax.sweep import SweepSpec, axis, set_field

# The PPO rows' loop, as veRL and OpenRLHF run it by default: the batch split into 4
# minibatches, one optimizer step each, one epoch (veRL: ppo_epochs 1, ppo_mini_batch_size
# = train_batch_size / 4). The clip then binds; SAO's DIS rows keep one step per batch.
PPO_LOOP = {"rl.minibatches": 4}  # rl.ppo_epochs stays 1
# Value pretraining reads none of the fields below (sao_jax.run.settings.PRETRAIN_READS):
# the rows with a critic start RL from the same pretrained critic (shared per seed).
# Row name -> the dotted fields it changes relative to sao (nothing else may differ).
VARIANTS: dict[str, dict[str, Any]] = {
    "sao": {},
    "no_faster_value": {"rl.k_critic": 1},
    "no_frozen_attention": {"optim.critic.freeze_attention": False},
    "vanilla_vapo": {"rl.policy_loss": "ppo_clip", **PPO_LOOP},
    "moving_average": {"rl.advantage": "moving_average"},
    "moving_average_160": {"rl.advantage": "moving_average", "rl.moving_average_window": 160},
    "moving_average_per_level": {
        "rl.advantage": "moving_average",
        "rl.baseline_key": "level",  # sao_jax/envs/levels.py puts 1..4 in the prompt meta
        "rl.moving_average_keys": 5,  # keys 0..4: the levels 1-4 (0 unused)
    },
    "grpo": {
        "rl.advantage": "grpo",
        "rl.policy_loss": "ppo_clip",
        "env.group_size": 8,
        **PPO_LOOP,
    },
    "grpo_dis": {"rl.advantage": "grpo", "env.group_size": 8},
    "step_mean": {"rl.advantage": "step_mean"},
    "step_last": {"rl.advantage": "step_last"},
    "cross_observation": {"rl.advantage": "cross_observation"},
    "estr": {"rl.policy_loss": "estr"},
    "icepop": {"rl.policy_loss": "icepop"},
    "sao_brace": {"rl.critic_target": "brace"},
}

TABLES = {
    "table4": (
        "sao",
        "no_faster_value",
        "no_frozen_attention",
        "vanilla_vapo",
        "moving_average",
        "grpo_dis",
        "grpo",
    ),
    "gae": ("sao", "step_mean", "step_last", "cross_observation"),
    "staleness_lr": ("sao", "vanilla_vapo"),  # with DIS / without DIS (PPO clip vs pi_old)
    # SAO's critic against its ceiling: the global moving average (2 and 2.5 batches) and
    # the oracle per-level one (experiments/baseline_ceiling/)
    "baseline_ceiling": (
        "sao",
        "moving_average",
        "moving_average_160",
        "moving_average_per_level",
    ),
    "staleness_law": ("sao", "vanilla_vapo"),  # the same pair, more learning rates
    "mask_pilot": ("sao",),  # DIS at its default band: the batches calibration reads
    "mask_budget": ("sao", "estr", "icepop"),  # each keep rule at matched mask budgets
    # lambda = 1 vs BRACE-style critic targets on the staleness grid's cells (its `sao`
    # points: the same commands; experiments/critic_correction/)
    "brace_staleness": ("sao", "sao_brace"),
}
# Smoke mode (the test suite) runs one row per code path: critic + DIS, groups + PPO
# clip, another advantage estimator (GAE's cross_observation row: the same command as
# experiments/observation_signal/'s graded-task row, so a shared sweep dir runs it once;
# every estimator's math is tested in process, tests/test_advantages.py).
SMOKE_ROWS = {
    "table4": ("sao", "grpo"),
    "gae": ("sao", "cross_observation"),
    "staleness_lr": TABLES["staleness_lr"],
    "baseline_ceiling": ("sao", "moving_average_per_level"),  # + the keyed baseline
    "staleness_law": TABLES["staleness_law"],
    "mask_pilot": TABLES["mask_pilot"],
    # DIS at its calibrated band; every rule's calibration is computed and reported, the
    # ESTR and IcePop losses run in process (tests/test_update.py test_variants_run)
    "mask_budget": ("sao",),
    "brace_staleness": TABLES["brace_staleness"],
}
MODES = ("smoke", "quick", "full")

# Per mode: seeds, RL steps, eval cadence (the fixed step budgets) and eval prompts.
# Sized from measured per-step costs (docs/experiments.md, "Budgets"). Held-out prompts
# are cheap next to RL steps, so the full mode evaluates 512 (binomial SE of one run's
# score ~2 points instead of ~4 at 128), and the differences are paired by seed.
BUDGETS = {
    "smoke": dict(seeds=(0,), steps=2, eval_every=2, eval_size=8, report=False),
    "quick": dict(seeds=(0,), steps=40, eval_every=20, eval_size=256),
    "full": dict(seeds=(0, 1, 2, 3, 4), steps=60, eval_every=30, eval_size=512),
}
# baseline_ceiling: 10 seeds in full mode (the recovered share is a ratio of two paired
# differences of ~2 points each: 5 seeds would leave its interval unbounded), at Table
# 4's steps and eval sizes, so its SAO and moving-average points are Table 4's (reused
# from the same sweep dir; a seed's cost: docs/experiments.md).
CEILING_SEEDS = {"smoke": (0,), "quick": (0,), "full": tuple(range(10))}
# staleness_lr grid: the sampler may run `s` versions ahead (queue of (s + 1) batches)
# and trajectories more than `s` versions old are dropped (0 = synchronous rollouts);
# policy lr x 1 (configs/sao.py) and x 10. The grid goes to S = 8 and lr 1e-3 so that the
# DIS band binds (at the default async settings it keeps nearly every token; the keep
# rate is reported per cell, results/full/README.md). The `brace_staleness` table is this grid
# with the rows sao and sao_brace: its sao points are the grid's (one command each).
STALENESS = {"smoke": (1,), "quick": (8,), "full": (0, 8)}
POLICY_LRS = {"smoke": (1e-4,), "quick": (1e-4, 1e-3), "full": (1e-4, 1e-3)}
# smoke: 3 logged steps, the collapse rule's patience (experiments/ablations/collapse.py),
# so that the staleness law, which runs these points in smoke, reads collapse times
STALENESS_STEPS = {"smoke": 3, "quick": 30, "full": 40}
STALENESS_SEEDS = {"smoke": (0,), "quick": (0,), "full": (0, 1, 2, 3, 4)}
# staleness_law: the same pair over more learning rates, each cell run until most runs
# without DIS collapse (the full staleness grid's collapses: docs/experiments.md) so that
# the collapse step can be read against lr; S = 2 and 8
# so that S x lr varies in both factors. Logged every step (collapse resolution); the
# level `log_every=1` also keeps these points' names apart from the staleness grid's.
# Smoke's cell is the staleness grid's smoke cell, with the same commands (log_every=1 a
# shared override, not a grid level): a sweep dir shared with experiments/staleness_lr/
# runs its two points once.
LAW_STALENESS = {"smoke": (1,), "quick": (8,), "full": (2, 8)}
LAW_LRS = {"smoke": (1e-4,), "quick": (1e-3, 4e-3), "full": (5e-4, 1e-3, 2e-3, 4e-3)}
LAW_STEPS = {"smoke": STALENESS_STEPS["smoke"], "quick": 30, "full": 40}
# mask_budget: DIS (symmetric band), ESTR and IcePop, each calibrated to mask the same
# share of the action tokens of the same batches, at the staleness grid's S = 8 and high
# lr 1e-3 (where the default DIS band binds and runs collapse within the budget:
# docs/experiments.md). The calibration batches are the first ones that can carry the full staleness
# S: steps S + 1 ... S + 4 of a DIS pilot run per seed (step 1, staleness 0, is dumped
# too: there every ratio is 1 up to rounding, so no budget can be set on it).
MASK_CELL = {"smoke": (1, 1e-3), "quick": (8, 1e-3), "full": (8, 1e-3)}  # (S, lr)
MASK_BUDGETS = {"smoke": (0.05,), "quick": (0.05,), "full": (0.01, 0.05)}
MASK_STEPS = {"smoke": 2, "quick": 30, "full": 60}
MASK_RULES = {"dis": "sao", "estr": "estr", "icepop": "icepop"}  # rule -> row
# The pilot logs every step; its held-out score is not read (8 prompts).
PILOT_FIXED = {"train.log_every": 1, "env.eval_size": 8}


def calibration_steps(mode: str) -> tuple[int, ...]:
    """The steps whose batches the mask budget is calibrated on: S + 1 ... S + 4."""
    s = MASK_CELL[mode][0]
    return tuple(range(s + 1, s + 5)) if mode != "smoke" else (s + 1,)


def pilot_dump_steps(mode: str) -> tuple[int, ...]:
    """Steps the pilot dumps: 1 (no staleness yet) and the calibration steps."""
    return tuple(sorted({1, *calibration_steps(mode)}))


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, sync=False, seed=0, **dict.fromkeys(VARIANTS, False))
    chosen = [v for v in VARIANTS if arg[v]]
    if len(chosen) > 1:
        raise ConfigError(f"configs/ablations.py: pick one row, got {chosen}")
    c = sao.get_config(f"smoke={arg.smoke},sync={arg.sync},seed={arg.seed}")
    for field, value in VARIANTS[chosen[0] if chosen else "sao"].items():
        set_field(c, field, value)
    return c


def staleness_level(s: int, batch: int) -> dict[str, Any]:
    """Overrides for max staleness `s`: 0 = synchronous rollouts (exactly on-policy);
    else async with the sampler up to `s` versions ahead, older trajectories dropped."""
    if s == 0:
        return {"sampling.max_staleness": 0, "train.rollouts": "sync"}
    return {"sampling.max_staleness": s, "sampling.queue_size": (s + 1) * batch}


def budget_overrides(budget: dict[str, Any]) -> dict[str, Any]:
    """The overrides every point of a sweep shares for a `BUDGETS` entry: RL steps, the
    eval cadence (checkpoints at each eval), held-out prompts, no progress bar; in smoke
    mode (`report=False`) no per-run report either (its plots are ~3 s of a ~15 s run; the
    table reads metrics and summaries)."""
    out = {
        "train.total_steps": budget["steps"],
        "train.eval_every": budget["eval_every"],
        "train.checkpoint_every": budget["eval_every"],
        "env.eval_size": budget["eval_size"],
        "train.progress": False,
    }
    if not budget.get("report", True):
        out["train.report"] = False
    return out


def _batch(mode: str) -> int:
    return 8 if mode == "smoke" else sao.get_config().rl.batch_size


def _budget(fixed: dict[str, Any], steps: int, **more: Any) -> dict[str, Any]:
    """`fixed` with a `steps` RL budget and one evaluation at its end, plus `more`
    (dotted field -> value)."""
    fixed = dict(fixed, **{"train.total_steps": steps}, **more)
    fixed["train.eval_every"] = fixed["train.checkpoint_every"] = steps
    return fixed


def get_sweep(arg=None) -> SweepSpec:
    arg = parse_arg(arg, table="table4", mode="quick", calibration="")
    if arg.table not in TABLES:
        raise ConfigError(f"get_sweep table={arg.table!r}: one of {sorted(TABLES)}")
    if arg.mode not in MODES:
        raise ConfigError(f"get_sweep mode={arg.mode!r}: one of {MODES}")
    b = BUDGETS[arg.mode]
    fixed = budget_overrides(b)
    common = "smoke" if arg.mode == "smoke" else ""
    rows = (SMOKE_ROWS if arg.mode == "smoke" else TABLES)[arg.table]
    if arg.table in ("mask_pilot", "mask_budget", "staleness_law"):
        return _open_question_sweep(arg, rows, fixed, common)
    if arg.table not in ("staleness_lr", "brace_staleness"):
        ceiling = arg.table == "baseline_ceiling"
        return SweepSpec(
            name=arg.table,
            config="configs/ablations.py",
            variants=rows,
            seeds=CEILING_SEEDS[arg.mode] if ceiling else b["seeds"],
            fixed=fixed,
            common_arg=common,
        )
    batch = _batch(arg.mode)
    staleness = tuple(staleness_level(s, batch) for s in STALENESS[arg.mode])
    fixed["train.total_steps"] = STALENESS_STEPS[arg.mode]
    fixed["train.eval_every"] = fixed["train.checkpoint_every"] = STALENESS_STEPS[arg.mode]
    fixed["train.log_every"] = 1 if arg.mode == "smoke" else 2
    return SweepSpec(
        name=arg.table,
        config="configs/ablations.py",
        variants=rows,
        seeds=STALENESS_SEEDS[arg.mode],
        grid=(staleness, axis("optim.policy.lr", POLICY_LRS[arg.mode])),
        fixed=fixed,
        common_arg=common,
    )


def _open_question_sweep(arg, rows, fixed, common) -> SweepSpec:
    """The sweeps of experiments/staleness_law/ and experiments/mask_budget/."""
    mode, batch = arg.mode, _batch(arg.mode)
    if arg.table == "staleness_law":
        grid = (
            tuple(staleness_level(s, batch) for s in LAW_STALENESS[mode]),
            axis("optim.policy.lr", LAW_LRS[mode]),
        )
        if mode == "smoke":  # the staleness grid's smoke points (LAW_STALENESS)
            fixed = _budget(fixed, LAW_STEPS[mode], **{"train.log_every": 1})
        else:
            grid, fixed = (*grid, axis("train.log_every", (1,))), _budget(fixed, LAW_STEPS[mode])
        return SweepSpec(
            name="staleness_law",
            config="configs/ablations.py",
            variants=rows,
            seeds=STALENESS_SEEDS[mode],
            grid=grid,
            fixed=fixed,
            common_arg=common,
        )
    s, lr = MASK_CELL[mode]
    cell = ((staleness_level(s, batch),), axis("optim.policy.lr", (lr,)))
    if arg.table == "mask_pilot":  # eval_size: the pilot's held-out score is not read
        return SweepSpec(
            name="mask_pilot",
            config="configs/ablations.py",
            variants=rows,
            seeds=STALENESS_SEEDS[mode],
            grid=(*cell, axis("train.token_dump_steps", (pilot_dump_steps(mode),))),
            fixed=_budget(fixed, max(pilot_dump_steps(mode)), **PILOT_FIXED),
            common_arg=common,
        )
    if not arg.calibration:
        raise ConfigError(
            "get_sweep table=mask_budget: needs calibration=<file>, the rules' parameters "
            "calibrated on the mask_pilot runs (experiments/mask_budget/ writes it)"
        )
    return SweepSpec(
        name="mask_budget",
        config="configs/ablations.py",
        variants=rows,
        seeds=STALENESS_SEEDS[mode],
        grid=(*cell, mask_budget.read_levels(arg.calibration, MASK_BUDGETS[mode])),
        fixed=_budget(fixed, MASK_STEPS[mode], **{"train.log_every": 1}),
        common_arg=common,
    )
