r"""Online learning with a moving target (docs/method.md section 6) on the embedded style task.

One judged line per prompt (single turn, one trajectory per prompt: GRPO cannot run
here); reward = r_quality * r_style from the offline lexicon judge, whose target style
switches cute -> chuunibyou -> classical at `env.params.switch_steps` (the paper: ~150
and 300; here scaled to the laptop budget). The next style is reachable from a policy
trained on the current one: consecutive styles share 3 of their 12 marker words, so
about one line in eight of the old style already scores under the new one, and the SFT
warm start imitates all three styles. Rows: sao (configs/sao.py's algorithm) and
moving_average (rl.advantage = 'moving_average', R - mean of the last 128 rewards, no
critic); nothing else differs. sao_sync and moving_average_sync are the same two rows
with synchronous rollouts (train.rollouts = 'sync': every batch sampled from the current
policy, staleness 0), which removes the staleness confound of the async pair (SAO's
slower steps train on staler rollouts); the sweep runs them in full mode only. Every
seed's rows share the warm start (and its pretrained critic), so the table's differences
from SAO are paired by seed.

  python -m experiments.online_shift --mode=quick
  python -m experiments.train --config=configs/online_shift.py:moving_average \
      --workdir=workdirs/shift_ma

Variant keys (`:a,b=1`): sao | moving_average | sao_sync | moving_average_sync, smoke,
sync, seed=N.
`get_sweep('mode=smoke|quick|full')` is the experiment's sao_jax.sweep.SweepSpec.
"""

from __future__ import annotations

from typing import Any

from sao_jax.config import ConfigDict, ConfigError, parse_arg
from sao_jax.configs import sao
from sao_jax.sweep import SweepSpec, set_field

VARIANTS: dict[str, dict[str, Any]] = {
    "sao": {},
    "moving_average": {"rl.advantage": "moving_average"},
    "sao_sync": {"train.rollouts": "sync"},
    "moving_average_sync": {"rl.advantage": "moving_average", "train.rollouts": "sync"},
}
# Rows each mode runs: the synchronous pair only in full mode (quick keeps its budget).
MODE_VARIANTS = {
    "smoke": ("sao", "moving_average"),
    "quick": ("sao", "moving_average"),
    "full": tuple(VARIANTS),
}
MODES = ("smoke", "quick", "full")
# Per mode: seeds, RL steps and the two switch steps of the target style. Phases of 50
# steps: at 30, no row got back to its pre-switch reward within a phase (results/full of
# the previous task). Full: 5 seeds x (a 600-step style SFT + four runs of 150 steps: SAO,
# moving average and their synchronous pair); docs/experiments.md, "Budgets", has the times.
BUDGETS = {
    "smoke": dict(seeds=(0,), steps=4, switch_steps=(1, 2)),
    "quick": dict(seeds=(0, 1), steps=90, switch_steps=(30, 60)),
    "full": dict(seeds=(0, 1, 2, 3, 4), steps=150, switch_steps=(50, 100)),
}


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, sync=False, seed=0, **dict.fromkeys(VARIANTS, False))
    chosen = [v for v in VARIANTS if arg[v]]
    if len(chosen) > 1:
        raise ConfigError(f"configs/online_shift.py: pick one row, got {chosen}")
    c = sao.get_config(f"smoke={arg.smoke},sync={arg.sync},seed={arg.seed}")
    c.env.name = "style"
    c.env.params = ConfigDict(
        dict(switch_steps=BUDGETS["full"]["switch_steps"])  # target style by step
    )
    c.env.prompts = ConfigDict(dict(n_topics=(1, 2)))  # one or two topics per prompt
    c.env.eval_size = 8 if arg.smoke else 40  # the held-out split has ~45 prompts
    c.sft.steps = 4 if arg.smoke else 600  # 200 left ~2% reward: too sparse to learn from
    c.sampling.max_turn_tokens = 64  # one line of up to ~60 characters
    c.sampling.max_len = 96
    c.train.total_steps = 4 if arg.smoke else BUDGETS["full"]["steps"]
    c.train.log_every = 1 if arg.smoke else 2  # reward curve resolution
    c.train.eval_every = 0  # held-out eval only before/after (the style moves)
    for field, value in VARIANTS[chosen[0] if chosen else "sao"].items():
        set_field(c, field, value)
    return c


def get_sweep(arg=None) -> SweepSpec:
    arg = parse_arg(arg, mode="quick")
    if arg.mode not in MODES:
        raise ConfigError(f"get_sweep mode={arg.mode!r}: one of {MODES}")
    b = BUDGETS[arg.mode]
    return SweepSpec(
        name="online_shift",
        config="configs/online_shift.py",
        variants=MODE_VARIANTS[arg.mode],
        seeds=b["seeds"],
        fixed={
            "train.total_steps": b["steps"],
            "train.checkpoint_every": b["steps"],
            "env.params.switch_steps": b["switch_steps"],
            "train.progress": False,
        },
        common_arg="smoke" if arg.mode == "smoke" else "",
    )
