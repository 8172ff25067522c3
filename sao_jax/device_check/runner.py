"""The device check: every phase once, in budget, results on disk as they come.

Phases, in order (cheap and decisive first, the longest compile last):
  moe_paths, attention_paths, update_dtype   (sao_jax/device_check/paths.py)
  weight_sync, decode, update_mfu            (sao_jax/device_check/throughput.py)
each under its time cap (sao_jax/device_check/shapes.py; the caps of the full mode sum to
the 8-minute budget), with a watchdog over the whole budget (record.py). Writes
<out>/device_check.json (after every phase) and <out>/device_check.md, and returns the
exit code: 0 all passed, 1 a path failed (the first is named), 3 out of time.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import jax

from sao_jax.device_check import paths, throughput
from sao_jax.device_check.record import Record
from sao_jax.device_check.shapes import MODES, PHASES
from sao_jax.parallel import platform
from sao_jax.plan.hardware import peak_for
from sao_jax.schema import ConfigDict, ConfigError


def run(
    config: ConfigDict,
    *,
    mode: str,
    out_dir: str,
    budget_s: float | None = None,
    phases: Sequence[str] = PHASES,
) -> int:
    """Runs the `phases` of `mode` ('full' | 'smoke') with `config`'s RL and optimizer
    settings; returns the exit code (module docstring). `budget_s` defaults to the sum of
    the mode's caps."""
    if mode not in MODES:
        raise ConfigError(f"flag --mode: {mode!r} is not one of {tuple(MODES)}")
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ConfigError(f"flag --phases: {unknown[0]!r} is not one of {PHASES}")
    s = MODES[mode]
    device = jax.devices()[0]
    peak = peak_for(device.device_kind)
    meta = dict(
        mode=mode,
        started_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        platform=platform.backend(),
        device_kind=device.device_kind,
        device_count=jax.device_count(),
        jax_version=jax.__version__,
        peak=None if peak is None else vars(peak),
    )
    record = Record(out_dir, budget_s or sum(s.caps_s.values()), meta)
    record.start_watchdog()
    learners = paths.Learners(config)
    work = {
        "moe_paths": lambda p: paths.moe_paths(p, s),
        "attention_paths": lambda p: paths.attention_paths(p, s),
        "update_dtype": lambda p: paths.update_dtype(p, s, learners),
        "weight_sync": lambda p: throughput.weight_sync(p, s),
        "decode": lambda p: throughput.decode(p, s, peak),
        "update_mfu": lambda p: throughput.update_mfu(p, s, learners, peak),
    }
    for name in PHASES:
        if name in phases:
            record.run(name, s.caps_s[name], work[name])
    return record.finish()
