"""Helpers of tests/test_train.py: shrunken run configs, the absl entry point as a
subprocess, checkpoint restores and metric comparisons."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from sao_jax import checkpointing, metrics
from sao_jax.config import load_config
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel.mesh import sharder_from_config
from sao_jax.rl.update import Learner
from sao_jax.schema import ConfigDict
from sao_jax.sweep.spec import set_field

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILE = "configs/sao.py"

# Shrinks of configs/sao.py:smoke: the fewest stages and prompts that still run each one.
# Batches stay 8 (the 8 fake devices of tests/conftest.py split them).
SHRINK: dict[str, Any] = {
    "env.eval_size": 4,
    "sft.steps": 2,
    "value_pretrain.steps": 1,
    "train.eval_sampled": False,
    "train.report": False,
}
# Logged values that measure time, not training.
TIME_KEYS = frozenset({"time", "perf/action_tokens_per_s", "eval/seconds"})


def small_config(variant: str = "smoke", **overrides: Any) -> ConfigDict:
    """configs/sao.py:<variant> with SHRINK and `overrides` (dotted names, '.' as '__')."""
    config = load_config(f"{REPO / CONFIG_FILE}:{variant}")
    return with_fields(config, {**SHRINK, **overrides})


def with_fields(config: ConfigDict, values: dict[str, Any]) -> ConfigDict:
    """`config` with each field set (dotted names, '.' as '__'; sao_jax/sweep/spec.py
    `set_field`: an unknown field is a ConfigError)."""
    for name, value in values.items():
        set_field(config, name.replace("__", "."), value)
    return config


def flags_of(variant: str = "smoke", **overrides: Any) -> list[str]:
    """The absl flags that build `small_config(variant, **overrides)`."""
    values = {**SHRINK, **{k.replace("__", "."): v for k, v in overrides.items()}}
    return [f"--config={REPO / CONFIG_FILE}:{variant}"] + [
        f"--config.{k}={v}" for k, v in values.items()
    ]


# ----------------------------------------------------------------- compilation cache


def _cache_settings(directory: pathlib.Path) -> dict[str, Any]:
    """jax.config settings that cache every compiled program in `directory`."""
    return {
        "jax_compilation_cache_dir": str(directory),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }


def cache_env_vars(directory: pathlib.Path) -> dict[str, str]:
    """Environment variables that make a subprocess cache every program in `directory`."""
    return {n.upper(): str(v) for n, v in _cache_settings(directory).items()}


@contextlib.contextmanager
def persistent_compilation_cache(directory: pathlib.Path) -> Iterator[dict[str, str]]:
    """Caches every compiled program in `directory` (this process and, through the
    returned environment variables, subprocesses); restores the old settings after."""
    new = _cache_settings(directory)
    old = {n: getattr(jax.config, n) for n in new}
    for n, v in new.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()  # re-reads the settings at the next compile
    env = cache_env_vars(directory)
    env["JAX_DEFAULT_MATMUL_PRECISION"] = str(jax.config.jax_default_matmul_precision)
    try:
        yield env
    finally:
        for n, v in old.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()


# ------------------------------------------------------------------- subprocesses


def entry_point(flags: Sequence[str], workdir: pathlib.Path, env: dict[str, str], log_file):
    """`python -m experiments.train <flags> --workdir=<workdir>` started in the repo root."""
    cmd = [sys.executable, "-m", "experiments.train", *flags, f"--workdir={workdir}"]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, **env},
        stdout=log_file,
        stderr=subprocess.STDOUT,
        text=True,
    )


def sigterm_after_step(proc: subprocess.Popen, workdir: pathlib.Path, step: int, timeout: float):
    """Sends SIGTERM once workdir/metrics.jsonl holds a train record of `step` or later."""
    path = workdir / metrics.METRICS_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run exited (code {proc.returncode}) before step {step}")
        if path.exists():
            records = metrics.read_jsonl(path)
            if any(r["step"] >= step and "policy/loss" in r for r in records):
                proc.send_signal(signal.SIGTERM)
                return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no train record of step {step} within {timeout} s")


# ----------------------------------------------------------------- checkpoints, logs


def restore_target(config: ConfigDict):
    """The restore target of a run's TrainState (its Learner's abstract state)."""
    sharder = sharder_from_config(config)
    cfg = ModelConfig.from_config(config.model)
    learner = Learner(
        config.rl, config.optim, policy_def(cfg, sharder), critic_def(cfg, sharder), sharder
    )
    return checkpointing.abstract_like(learner.abstract_state, learner.state_shardings)


def restore(target, workdir: pathlib.Path, step: int | None = None) -> tuple[Any, dict]:
    """(TrainState, meta) of checkpoint `step` (default: the newest) of a run."""
    with checkpointing.Checkpointer(workdir / "checkpoints") as ckpt:
        return ckpt.restore(target, step=step)


def saved_steps(workdir: pathlib.Path, subdir: str = "checkpoints") -> list[int]:
    with checkpointing.Checkpointer(workdir / subdir) as ckpt:
        return ckpt.all_steps()


def tree_max_diff(a, b) -> float:
    """max |a - b| over every leaf (keys compared by their data); 0.0 iff equal."""

    def diff(x, y) -> float:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, (x.shape, y.shape)
        return float(np.max(np.abs(x - y), initial=0.0))

    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(jax.tree.leaves(jax.tree.map(diff, a, b)), default=0.0)


def timeless(records: Sequence[dict]) -> list[dict]:
    """Metric records without the values that measure time."""
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in records]


def read_metrics(workdir: pathlib.Path) -> list[dict]:
    return metrics.read_jsonl(workdir / metrics.METRICS_FILE)


def read_strict_json(path: pathlib.Path) -> Any:
    """json.loads that refuses NaN / Infinity (not JSON)."""

    def refuse(token: str):
        raise ValueError(f"{path}: non-JSON constant {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def unbalanced(counters: dict) -> str | None:
    """None if generated == trained + dropped_stale + discarded + in_flight, else why."""
    c = counters
    rhs = c["trained"] + c["dropped_stale"] + c["discarded"] + c["in_flight"]
    if c["generated"] == rhs and min(c.values()) >= 0:
        return None
    return f"generated {c['generated']} != trained + dropped_stale + discarded + in_flight {c}"
