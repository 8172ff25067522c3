r"""Online learning with a moving target (docs/method.md section 6).

Default design, `user_style` (sao_jax/envs/user_style.py): the prompt names a user and one
or two topics; the model writes one judged line (single turn, one trajectory per prompt:
GRPO cannot run here). User u wants its own style and switches it at its own steps
(`staggered`: users' switches are spread over the run), a correct line pays the user's own
payout, and every line of user u also earns the user's offset (`offsets=spread`, the
default: prompt-level reward variance that only a baseline telling users apart removes), so
the current target and the expected reward are predictable from the prompt: a critic can
track them per user, a global reward average cannot. The variant `offsets=none` is the
first per-user design (payouts only); what each design's runs showed is in
results/online_shift/README.md and results/online_shift_offsets/README.md. The warm start
(SFT) writes each user's initial style half the time (`sft.error_rate` 0.5: the other
half in another style), so the trunk the critic is copied from reads the user tag.
Value pretraining has its own lr and clip (`value_pretrain.lr`, `.max_grad_norm`), so the
rows that change the RL critic's lr or clip start from the seed's shared critic.

Rows (`VARIANTS`; every row is `sao` with only the fields its name says changed):
  sao                       SAO (configs/sao.py's algorithm)
  moving_average            R - mean of the last 128 rewards (the paper's window; 2 steps
                            at batch 64), no critic
  moving_average_w<N>       the same with a window of N steps of rewards (N x batch)
  moving_average_per_user   an oracle baseline: one moving average per user (it knows
                            who switched), each over 128 / users rewards of its user (the
                            paper's ~2 steps): how much a per-prompt baseline alone gives
  sao_lambda1               policy lambda 1 (no bootstrapping from a possibly stale critic)
  sao_policy_first          rl.order = 'policy_first' (advantages before the critic steps)
  ceiling                   the critic reads the user's current target as a digit in
                            place of every space (rl.privileged_critic), and its value
                            pretraining draws each episode's target at random (so that it
                            learns to read the digit): what tracking could give
  track_<factors>           the critic-tracking sweep: a half fraction (I = ABCD) of critic
                            lr x4, K = 4, trained attention, no critic clip
  sao_brace                 rl.critic_target = 'brace' (BRACE-style critic targets,
                            docs/method.md section 8): only in the table `brace`
                            (experiments/critic_correction/), not in `main`

  python -m experiments.online_shift --mode=quick
  python -m experiments.train --config=configs/online_shift.py:moving_average_w8 \
      --workdir=workdirs/shift_ma8

Variant keys (`:a,b=1`): one row name, smoke, sync, seed=N, offsets=spread|none
(default spread).
`get_sweep('table=main|tracking|brace,mode=smoke|quick|full,offsets=none|spread')` is the
experiment's sao_jax.sweep.SweepSpec. `brace`: sao and sao_brace (its sao points are
`main`'s, the same commands); `offsets`: a shared override of env.params, always set
(default spread: every sweep records which design it ran).
"""

from __future__ import annotations

import itertools
from typing import Any

from sao_jax.config import ConfigDict, ConfigError, parse_arg
from sao_jax.configs import sao
from sao_jax.envs.user_style import BIN_STEPS, RECOVERY_STEPS, staggered
from sao_jax.sweep import SweepSpec, set_field

PAPER_WINDOW = 128  # rewards in the paper's moving average (its batch: 128 prompts)
WINDOW_STEPS = (1, 8, 32)  # other windows, in steps of rewards (x rl.batch_size); with the
# paper's (2 steps) they span 1 to 32
USERS = 6
PAYOUTS = (1.0, 0.75, 0.5, 0.5, 0.75, 1.0)  # the quality factor of user u (style-free)
# `get_sweep('offsets=spread')`: every line of user u also earns OFFSET_SETS[...][u], judged
# or not (sao_jax/envs/user_style.py): prompt-level variance (+-1 around the mean, against a
# within-prompt Bernoulli variance <= 0.25) that only a baseline telling users apart removes;
# each pair of users sharing a style sequence (u, u + 3) has two different offsets
OFFSET_SETS = {"none": (0.0,) * USERS, "spread": (0.0, 1.0, 2.0, 1.0, 2.0, 0.0)}
DEFAULT_OFFSETS = "spread"  # get_config's and get_sweep's; none: the first per-user design
# get_sweep sets the offsets as a shared override of every point, also the default's, so
# that runs recorded without the override (the first per-user design's) are never taken
# for a default sweep's by --add_to.
OFFSETS_FIELD = "env.params.offsets"

# The critic-tracking factors: level 'high' of each (SAO's own level is 'low').
TRACK_FACTORS = {
    "lr": {"optim.critic.lr": 4e-3},  # x4 (value pretraining keeps its own lr)
    "k": {"rl.k_critic": 4},
    "attn": {"optim.critic.freeze_attention": False},
    "noclip": {"optim.critic.max_grad_norm": 0.0},  # 1.0 throttled critics elsewhere
}


def _track_cells() -> dict[str, dict[str, Any]]:
    """The half fraction I = ABCD of the 2^4 design: every cell with an even number of
    factors at 'high' (SAO, with none, is the all-low cell), so main effects are clear of
    two-factor interactions."""
    out = {}
    for k in (2, 4):
        for names in itertools.combinations(TRACK_FACTORS, k):
            out["track_" + "_".join(names)] = {
                f: v for n in names for f, v in TRACK_FACTORS[n].items()
            }
    return out


TRACK_CELLS = _track_cells()


def _window(steps: int):
    return lambda c: steps * c.rl.batch_size


USER_VARIANTS: dict[str, dict[str, Any]] = {
    "sao": {},
    "moving_average": {"rl.advantage": "moving_average", "rl.moving_average_window": PAPER_WINDOW},
    **{
        f"moving_average_w{n}": {
            "rl.advantage": "moving_average",
            "rl.moving_average_window": _window(n),
        }
        for n in WINDOW_STEPS
    },
    "moving_average_per_user": {
        "rl.advantage": "moving_average",
        "rl.baseline_key": "user",  # sao_jax/envs/user_style.py puts the user in the meta
        "rl.moving_average_keys": lambda c: c.env.prompts.users,
        "rl.moving_average_window": lambda c: max(1, PAPER_WINDOW // c.env.prompts.users),
    },
    "sao_lambda1": {"rl.lam_mode": "fixed", "rl.lam_fixed": 1.0},
    "sao_policy_first": {"rl.order": "policy_first"},
    "ceiling": {"rl.privileged_critic": True, "env.params.pretrain_targets": "uniform"},
    **TRACK_CELLS,
    "sao_brace": {"rl.critic_target": "brace"},
}
VARIANTS = USER_VARIANTS
MAIN_ROWS = (
    "sao",
    "moving_average",
    *(f"moving_average_w{n}" for n in WINDOW_STEPS),
    "moving_average_per_user",
    "sao_lambda1",
    "sao_policy_first",
    "ceiling",
)
TABLES = {"main": MAIN_ROWS, "tracking": ("sao", *TRACK_CELLS), "brace": ("sao", "sao_brace")}
MODES = ("smoke", "quick", "full")

# Per mode (user design), sized from the pilot (docs/experiments.md, results/online_shift/
# pilot/): rows, seeds, RL steps and the staggered schedule (first switch,
# stagger between users, period between a user's two switches). Full: the main table at
# 10 seeds (the pre-registered family needs them), the tracking half fraction at 5 (each
# main effect averages 4 cells against 4: 20 runs a side), the brace table at 5 (seeds
# 0-4 of main's warm starts and sao runs; its full run fits 2 hours with the graded
# task's, docs/experiments.md).
USER_BUDGETS = {
    "smoke": dict(
        seeds=(0,), tracking_seeds=(0,), brace_seeds=(0,), steps=4, first=1, stagger=1,
        period=2, users=2, rows=("sao", "moving_average", "ceiling"),
        tracking_rows=("sao", "track_lr_k"), report=False,
    ),
    "quick": dict(  # one seed: a look, not a test; the ceiling (its own value pretraining,
        # the longest run) starts beside SAO, so the whole fits 20 minutes
        seeds=(0,), tracking_seeds=(0,), brace_seeds=(0,), steps=90, first=15, stagger=3,
        period=35, users=USERS, rows=("sao", "ceiling", "moving_average", "moving_average_w32"),
        tracking_rows=("sao", "track_lr_k"),
    ),
    "full": dict(
        seeds=tuple(range(10)), tracking_seeds=tuple(range(5)), brace_seeds=tuple(range(5)),
        steps=90, first=15, stagger=3, period=35, users=USERS, rows=MAIN_ROWS,
        tracking_rows=TABLES["tracking"],
    ),
}  # fmt: skip


def schedule(mode: str) -> tuple[tuple[int, ...], ...]:
    """Each user's switch steps in `mode` (user design)."""
    b = USER_BUDGETS[mode]
    return staggered(b["users"], b["first"], b["stagger"], b["period"])


def get_config(arg=None):
    arg = parse_arg(
        arg,
        smoke=False,
        sync=False,
        seed=0,
        offsets=DEFAULT_OFFSETS,
        **dict.fromkeys(VARIANTS, False),
    )
    if arg.offsets not in OFFSET_SETS:
        raise ConfigError(
            f"configs/online_shift.py: offsets={arg.offsets!r}, one of {sorted(OFFSET_SETS)}"
        )
    chosen = [v for v in VARIANTS if arg[v]]
    if len(chosen) > 1:
        raise ConfigError(f"configs/online_shift.py: pick one row, got {chosen}")
    row = chosen[0] if chosen else "sao"
    c = sao.get_config(f"smoke={arg.smoke},sync={arg.sync},seed={arg.seed}")
    c.sampling.max_turn_tokens = 64  # one line of up to ~60 characters
    c.sampling.max_len = 96
    c.sft.steps = 4 if arg.smoke else 600  # fewer leave too sparse a reward (docs/experiments.md)
    c.train.eval_every = 0  # held-out eval only before/after (the target moves)
    mode = "smoke" if arg.smoke else "full"
    b = USER_BUDGETS[mode]
    c.env.name = "user_style"
    c.env.params = ConfigDict(
        dict(
            switch_steps=schedule(mode),  # per user, staggered
            payouts=PAYOUTS[: b["users"]],
            offsets=OFFSET_SETS[arg.offsets][: b["users"]],
            recovery_steps=RECOVERY_STEPS,
            bin_steps=BIN_STEPS,
            pretrain_targets="schedule",  # value pretraining judges the schedule's start
        )
    )
    c.env.prompts = ConfigDict(dict(users=b["users"], n_topics=(1, 2), dialects=True))
    c.env.eval_size = 8 if arg.smoke else 48
    c.sft.error_rate = 0.5  # demos: the user's initial style half the time
    c.value_pretrain.lr = c.optim.critic.lr  # its own: the tracking rows change RL's
    c.value_pretrain.max_grad_norm = c.optim.critic.max_grad_norm
    c.train.total_steps = b["steps"]
    c.train.log_every = 1  # per-step records: the recovery bins pool exact counts
    if arg.smoke:  # the sampler one batch ahead, not the whole 4-step run judged at
        c.sampling.queue_size = c.rl.batch_size  # step 0 while the first update compiles
    for field, value in VARIANTS[row].items():
        set_field(c, field, value(c) if callable(value) else value)
    return c


def get_sweep(arg=None) -> SweepSpec:
    arg = parse_arg(arg, mode="quick", table="main", offsets=DEFAULT_OFFSETS)
    if arg.mode not in MODES:
        raise ConfigError(f"get_sweep mode={arg.mode!r}: one of {MODES}")
    if arg.offsets not in OFFSET_SETS:
        raise ConfigError(f"get_sweep offsets={arg.offsets!r}: one of {sorted(OFFSET_SETS)}")
    if arg.table not in TABLES:
        raise ConfigError(f"get_sweep table={arg.table!r}: one of {sorted(TABLES)}")
    b = USER_BUDGETS[arg.mode]
    rows, seeds = {
        "main": (b["rows"], b["seeds"]),
        "tracking": (b["tracking_rows"], b["tracking_seeds"]),
        "brace": (TABLES["brace"], b["brace_seeds"]),
    }[arg.table]
    return SweepSpec(
        name=f"online_shift_{arg.table}",
        config="configs/online_shift.py",
        variants=rows,
        seeds=seeds,
        fixed={
            "train.total_steps": b["steps"],
            "train.checkpoint_every": b["steps"],
            "env.params.switch_steps": schedule(arg.mode),
            "train.progress": False,
            OFFSETS_FIELD: OFFSET_SETS[arg.offsets][: b["users"]],
            **({} if b.get("report", True) else {"train.report": False}),  # smoke: no plots
        },
        common_arg="smoke" if arg.mode == "smoke" else "",
    )
