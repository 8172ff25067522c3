r"""Online learning with a moving target (docs/method.md section 6) on the embedded style task.

One judged line per prompt (single turn, one trajectory per prompt: GRPO cannot run
here); reward = r_quality * r_style from the offline lexicon judge, whose target style
switches cute -> chuunibyou -> classical at `env.params.switch_steps` (the paper: ~150
and 300; here scaled to the laptop budget). The SFT warm start imitates demonstrations
in all three styles, so every style is reachable by RL. Rows: sao (configs/sao.py's
algorithm) and moving_average (rl.advantage = 'moving_average', R - mean of the last
128 rewards, no critic); nothing else differs.

  python -m experiments.online_shift --mode=quick
  python -m experiments.train --config=configs/online_shift.py:moving_average \
      --workdir=workdirs/shift_ma

Variant keys (`:a,b=1`): sao | moving_average, smoke, sync, seed=N.
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
}
MODES = ("smoke", "quick", "full")
# Per mode: seeds, RL steps and the two switch steps of the target style.
BUDGETS = {
    "smoke": dict(seeds=(0,), steps=4, switch_steps=(1, 2)),
    "quick": dict(seeds=(0,), steps=60, switch_steps=(20, 40)),
    "full": dict(seeds=(0, 1), steps=90, switch_steps=(30, 60)),
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
        variants=tuple(VARIANTS),
        seeds=b["seeds"],
        fixed={
            "train.total_steps": b["steps"],
            "train.checkpoint_every": b["steps"],
            "env.params.switch_steps": b["switch_steps"],
            "train.progress": False,
        },
        common_arg="smoke" if arg.mode == "smoke" else "",
    )
