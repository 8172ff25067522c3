r"""Observation-skipping vs cross-observation GAE where the observation is the signal.

The question (docs/experiments.md, "Observation signal"): does SAO's GAE, which skips
observation tokens (docs/method.md section 4), lose signal when the environment's output
decides the outcome? Two rows, nothing else different (configs/ablations.py's rows of
the same names): `sao` (observation-skipping GAE) and `cross_observation` (GAE through
the observation tokens with the same critic, rl.advantage = 'cross_observation'). Two
tasks, each with its own warm start per seed, so every difference is paired by seed:

- `code` (this file's config): sao_jax/envs/code_feedback.py, one line of Python per
  turn against hidden unit tests. The spec's constant is stale half the time, which only
  the failing test's message shows, and the passing run prints the value to report:
  the observation carries what the policy needs, and the outcome moves across it.
- `levels`: the graded calculator task as configs/ablations.py runs it (its points are
  Table 5's `sao` and `cross_observation` points, reused in a shared sweep dir when the
  budgets match): the calculator's results follow from the call.

  python -m experiments.observation_signal --mode=quick
  python -m experiments.train --config=configs/observation_signal.py:cross_observation \
      --workdir=workdirs/obs_cross

Variant keys (`:a,b=1`): sao | cross_observation, smoke, sync, seed=N.
`get_sweep('task=code|levels,mode=smoke|quick|full')` is one task's SweepSpec;
`sweeps(mode)` both, as the experiment runs them.
"""

from __future__ import annotations

from typing import Any

from sao_jax.config import ConfigDict, ConfigError, parse_arg
from sao_jax.configs import ablations, sao
from sao_jax.sweep import SweepSpec, set_field

ROWS = ("sao", "cross_observation")  # obs-skipping GAE (SAO) vs GAE through observations
VARIANTS: dict[str, dict[str, Any]] = {row: ablations.VARIANTS[row] for row in ROWS}
TASKS = ("code", "levels")
# Smoke mode (the test suite) trains one run per code path: the code task with SAO (its
# env, the tool's spans and the obs/ metrics), the graded task with both estimators (the
# pool's runs: GAE's smoke rows; cross_observation in training also there). The code
# task's cross_observation row is left to quick and full.
SMOKE_ROWS = {"code": ("sao",), "levels": ROWS}
MODES = ("smoke", "quick", "full")
# Per mode: seeds, RL steps, eval cadence and held-out prompts, the same for both tasks.
# Full: 5 seeds x 2 tasks x (a warm start + 2 runs of 60 steps); quick: one seed, 30
# steps, one evaluation (docs/experiments.md, "Budgets", has the measured costs).
BUDGETS = {
    "smoke": dict(seeds=(0,), steps=2, eval_every=2, eval_size=8, report=False),
    "quick": dict(seeds=(0,), steps=30, eval_every=30, eval_size=256),
    "full": dict(seeds=(0, 1, 2, 3, 4), steps=60, eval_every=30, eval_size=512),
}


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, sync=False, seed=0, **dict.fromkeys(VARIANTS, False))
    chosen = [v for v in VARIANTS if arg[v]]
    if len(chosen) > 1:
        raise ConfigError(f"configs/observation_signal.py: pick one row, got {chosen}")
    c = sao.get_config(f"smoke={arg.smoke},sync={arg.sync},seed={arg.seed}")
    c.env.name = "code_feedback"
    # The task's defaults: one retry (spare_turns=1), tests evaluated in process
    # (executor='inline'; 'sandbox' runs them in the sandbox, ~0.2 s a run here).
    c.env.params = ConfigDict()
    c.env.prompts = ConfigDict(dict(stale_rate=0.5))  # share of specs whose constant is stale
    if not arg.smoke:
        c.sft.steps = 600  # one copy per line: configs/sao.py's 1000 are not needed
    c.sft.error_rate = 0.3  # demos slip a first line at this rate, a retry at 2 x, typos at 0.1 x
    if not arg.smoke:  # smoke keeps configs/sao.py's shapes: the graded task's programs
        c.sampling.max_len = 128  # prompt <= 17 tokens + code, test output, fix, output, answer
    c.sampling.max_turn_tokens = 24  # the longest correct line, f=lambda x:x*9+108, is 19
    for field, value in VARIANTS[chosen[0] if chosen else "sao"].items():
        set_field(c, field, value)
    return c


def get_sweep(arg=None) -> SweepSpec:
    arg = parse_arg(arg, task="code", mode="quick")
    if arg.task not in TASKS:
        raise ConfigError(f"get_sweep task={arg.task!r}: one of {TASKS}")
    if arg.mode not in MODES:
        raise ConfigError(f"get_sweep mode={arg.mode!r}: one of {MODES}")
    b = BUDGETS[arg.mode]
    config = "configs/observation_signal.py" if arg.task == "code" else "configs/ablations.py"
    return SweepSpec(
        name=arg.task,  # the report tells the tasks apart by their sweeps' names
        config=config,
        variants=SMOKE_ROWS[arg.task] if arg.mode == "smoke" else ROWS,
        seeds=b["seeds"],
        fixed=ablations.budget_overrides(b),
        common_arg="smoke" if arg.mode == "smoke" else "",
    )


def sweeps(mode: str) -> tuple[SweepSpec, ...]:
    """The experiment's sweeps: the code task's, then the graded task's."""
    return tuple(get_sweep(f"task={task},mode={mode}") for task in TASKS)
