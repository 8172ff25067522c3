"""Sweeps: a spec -> named points -> one training process per point -> collected results.

A `SweepSpec` (a config file's `get_sweep(arg)`) is a product: config variants x grid
levels x seeds, plus overrides every point shares. Each point is one `python -m
experiments.train --config=<file>:<variant> --workdir=<sweep_dir>/<name> --config.seed=<n>
--config.<field>=<value> ...` process; `run_sweep` runs `parallel` of them at a time
(each point as soon as its seed's warm start is done; several sweeps as one set) and
never stops for a failed one. Names: `<config stem>__<variant>__<field>=<value>...__seed=<n>`.

Resumable: a point is finished when its workdir holds `summary.json` and the runner's
`<sweep_dir>/_sweep/<name>.point.json` records the same command (the interpreter's path
aside); it is then skipped. An unfinished workdir resumes (the trainer restores its last
checkpoint). A workdir whose recorded command, or whose config.json, differs from what
the point builds now is refused, never reused nor overwritten. A failure writes
`_sweep/<name>.failed.json` (exit code, stderr tail) and is retried by the next call.

Shared warm start: with `spec.warm_start`, each seed first gets one run of SFT and value
pretraining (`warm_start__<config>__<arg>__seed=<n>`, `train.total_steps=0`) whose
`<workdir>/warm_start` policy every point of that seed loads (`init.kind=params`), and
whose `<workdir>/warm_start_critic` every point with a critic that reads the same
pretraining fields loads (`init.critic_path`; `shares_critic`): the K=1 and no-frozen-
attention rows start RL from the very critic SAO does, pretrained once per seed.

Pods: `launcher='tpu'|'gpu'` hands each point's command to experiments/launch.py
(`launcher_argv`); everything else is unchanged.

Modules: `spec` (SweepSpec, points and their names, the warm-start point), `runner`
(commands, processes, resuming, launcher hand-off), `results` (side files, collect).
"""

from sao_jax.run.settings import WARM_START_CRITIC_SUBDIR
from sao_jax.sweep.results import (
    FAILED_FILE,
    POINT_FILE,
    SIDE_DIR,
    STDERR_FILE,
    STDOUT_FILE,
    SUMMARY_FILE,
    PointResult,
    collect,
    side_file,
)
from sao_jax.sweep.runner import (
    LAUNCH_MODULE,
    LAUNCHERS,
    STDERR_TAIL_LINES,
    Job,
    SweepStopped,
    check_workdir,
    has_output,
    is_finished,
    launcher_argv,
    point_argv,
    point_config,
    point_overrides,
    pretrains_critic,
    run_jobs,
    run_sweep,
    seed_order,
    shares_critic,
    sweep_env,
    sweep_jobs,
)
from sao_jax.sweep.spec import (
    TRAIN_MODULE,
    WARM_START_OVERRIDES,
    WARM_START_PREFIX,
    WARM_START_SECTIONS,
    WARM_START_SUBDIR,
    Level,
    Point,
    SweepSpec,
    affects_warm_start,
    axis,
    expand,
    flag_value,
    load_sweep,
    set_field,
    warm_start_name,
    warm_start_point,
)

__all__ = [
    "FAILED_FILE",
    "LAUNCHERS",
    "LAUNCH_MODULE",
    "POINT_FILE",
    "SIDE_DIR",
    "STDERR_FILE",
    "STDERR_TAIL_LINES",
    "STDOUT_FILE",
    "SUMMARY_FILE",
    "TRAIN_MODULE",
    "WARM_START_CRITIC_SUBDIR",
    "WARM_START_OVERRIDES",
    "WARM_START_PREFIX",
    "WARM_START_SECTIONS",
    "WARM_START_SUBDIR",
    "Job",
    "Level",
    "Point",
    "PointResult",
    "SweepSpec",
    "SweepStopped",
    "affects_warm_start",
    "axis",
    "check_workdir",
    "collect",
    "expand",
    "flag_value",
    "has_output",
    "is_finished",
    "launcher_argv",
    "load_sweep",
    "point_argv",
    "point_config",
    "point_overrides",
    "pretrains_critic",
    "run_jobs",
    "run_sweep",
    "seed_order",
    "set_field",
    "shares_critic",
    "side_file",
    "sweep_env",
    "sweep_jobs",
    "warm_start_name",
    "warm_start_point",
]
