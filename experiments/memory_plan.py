"""Per-device memory of policy, critic and AdamW states on a (fake) mesh; no allocation.

    python -m experiments.memory_plan --config=configs/models/qwen3_30b_a3b.py \\
        --mesh=data=1,fsdp=8,expert=8,tensor=1 --devices=64
    python -m experiments.memory_plan --config=configs/models/qwen3_30b_a3b.py \\
        --mesh=fsdp=8 --devices=8                       # 8 x H200

--config is a model section (configs/models/*.py; the optimizer sections then come from
configs/base.py) or a full run config with `model`, `optim` and `mesh.rules`. Override
fields as usual: --config.param_dtype=bfloat16.

With a run config (or --length), the update step's temporaries are added from the analytic
model of sao_jax/plan/step_memory.py (activations, gradients, scan copies, LM-head
chunk) with the sampler's policy copy and KV cache: the per-device sum the run needs.
With a run config, the rollout pool follows (sao_jax/plan/kv_pool.py): one engine per
--pool_devices devices (default: per host), its dense cache or paged pool
(sampling.kv_layout), and for a paged pool the rollouts in flight at an assumed
log-normal episode-length distribution (--episode_median, --episode_p99).
--compile also compiles the step for this mesh on fake CPU devices at reduced shapes
(--compile_layers, --compile_length) and prints XLA's figure next to the model's.
"""

import math
import os

from absl import app, flags
from ml_collections import config_flags

from sao_jax import cli
from sao_jax.configs import base
from sao_jax.models.config import ModelConfig
from sao_jax.parallel.mesh import DEFAULT_RULES, Sharder
from sao_jax.plan.kv_pool import EpisodeLengths, pool_plan, pool_plan_lines
from sao_jax.plan.memory import abstract_mesh, format_plan, memory_plan, parse_mesh
from sao_jax.plan.step_memory import (
    StepBytes,
    analytic_step_bytes,
    compile_update_step,
    step_plan_lines,
)
from sao_jax.schema import ConfigDict, ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "model or run config file")
_MESH = flags.DEFINE_string("mesh", "fsdp=-1", "axis sizes, e.g. data=1,fsdp=8,expert=8,tensor=1")
_DEVICES = flags.DEFINE_integer("devices", 8, "number of devices in the mesh")
_LENGTH = flags.DEFINE_integer("length", None, "trajectory length T (default sampling.max_len)")
_PER_HOST = flags.DEFINE_integer("devices_per_host", 4, "devices per host (sampler, KV cache)")
_POOL = flags.DEFINE_integer(
    "pool_devices", None, "devices one sampler engine's slots and pages split over (per host)"
)
_SHARDS = flags.DEFINE_integer(
    "pool_shards", 1, "slot shards of an engine (1: KV heads over tensor, one shared pool)"
)
_MEDIAN = flags.DEFINE_float("episode_median", 4096, "median episode length (tokens), paged plan")
_P99 = flags.DEFINE_float("episode_p99", 32768, "99th percentile of episode lengths (tokens)")
_MOE = flags.DEFINE_string("moe_impl", "ragged", "MoE path to plan for: ragged | dense")
_COMPILE = flags.DEFINE_bool("compile", False, "also compile reduced shapes on fake devices")
_C_LAYERS = flags.DEFINE_integer("compile_layers", 2, "layers of the compiled check")
_C_LENGTH = flags.DEFINE_integer("compile_length", 2048, "T of the compiled check")


def main(argv):
    del argv
    if _COMPILE.value:  # before the backend starts: one fake CPU device per mesh device
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={_DEVICES.value}"
        )
    config = _CONFIG.value
    if "model" in config:
        model, optim = config.model, config.optim
        rules = config.mesh.rules if "mesh" in config else DEFAULT_RULES
    else:
        model, optim, rules = config, base.get_config().optim, DEFAULT_RULES
    try:
        mesh = parse_mesh(_MESH.value, _DEVICES.value)
        plan = memory_plan(ModelConfig.from_config(model), optim, mesh, rules)
    except ConfigError as e:
        raise SystemExit(f"memory_plan: {e}") from None
    print(format_plan(plan))
    length = _LENGTH.value or (config.sampling.max_len if "sampling" in config else 0)
    if not length:
        return
    rl = config.rl if "rl" in config else base.get_config().rl
    cfg = ModelConfig.from_config(model)
    sharder = Sharder(abstract_mesh(mesh), tuple(map(tuple, rules)))
    shards = sharder.axis_size("batch")
    rows = max(rl.batch_size // (rl.microbatches * shards), 1)
    slots = config.sampling.num_slots if "sampling" in config else 32
    pool = None
    if "sampling" in config:
        pool_devices = _POOL.value or _PER_HOST.value
        if pool_devices < 1 or _DEVICES.value % pool_devices:
            cli.input_error_exit(
                ConfigError(f"flag --pool_devices: {pool_devices} does not divide --devices"),
                "memory_plan",
            )
        try:
            pool = pool_plan(cfg, config.sampling, pool_devices, _SHARDS.value)
        except ValueError as e:
            cli.input_error_exit(ConfigError(f"flag --pool_shards / sampling: {e}"), "memory_plan")
    lines = step_plan_lines(
        cfg,
        plan,
        sharder,
        length=length,
        rows_per_device=rows,
        microbatches=rl.microbatches,
        slots_per_host=slots,
        devices_per_host=_PER_HOST.value,
        frozen=optim.critic.freeze_attention,
        moe_impl=_MOE.value,
        pool=pool,
    )
    print("\n".join(lines))
    if pool is not None:
        try:
            lengths = EpisodeLengths(_MEDIAN.value, _P99.value)
        except ValueError as e:
            cli.input_error_exit(
                ConfigError(f"flags --episode_median/--episode_p99: {e}"), "memory_plan"
            )
        engines = _DEVICES.value // pool.devices
        print("\n".join(pool_plan_lines(pool, lengths, engines)))
    if _COMPILE.value:
        print("\n".join(compiled_check(config, cfg, mesh, rules, rows)))


def compiled_check(config, cfg, mesh, rules, rows) -> list[str]:
    """XLA's temporaries for this mesh at --compile_layers / --compile_length (fake CPU
    devices, moe_impl='dense': what a CPU compiles) next to the analytic model's."""
    import dataclasses

    import jax

    from sao_jax.models.factory import critic_def, policy_def
    from sao_jax.parallel.mesh import build_mesh
    from sao_jax.rl.update import Learner

    n = math.prod(mesh.values())
    if jax.device_count() < n:
        raise SystemExit(f"memory_plan --compile: {n} devices needed, {jax.device_count()} seen")
    small = dataclasses.replace(
        cfg, num_hidden_layers=_C_LAYERS.value, mlp_only_layers=(), moe_impl="dense"
    )
    run = config.copy_and_resolve_references()
    run.model = ConfigDict(dataclasses.asdict(small))
    run.model.mlp_only_layers = ()
    run.rl.batch_size = rows * math.prod(mesh[a] for a in ("data", "fsdp", "expert"))
    run.rl.microbatches = 1
    mesh_obj = build_mesh(tuple(mesh.values()), devices=jax.devices()[:n])
    sharder = Sharder(mesh_obj, tuple(map(tuple, rules)))
    pdef, cdef = policy_def(small, sharder), critic_def(small, sharder)
    learner = Learner(run.rl, run.optim, pdef, cdef, sharder)
    got = StepBytes.of(
        compile_update_step(learner, small, run.rl.batch_size, _C_LENGTH.value, fast=True)
    )
    plan = memory_plan(small, run.optim, mesh, rules)
    opt = plan.critic_opt_trainable if run.optim.critic.freeze_attention else plan.critic_opt_full
    want = analytic_step_bytes(
        small,
        pdef,
        cdef,
        sharder,
        critic_opt_bytes=opt.device_bytes,
        rows_per_device=rows,
        length=_C_LENGTH.value,
    ).total
    return [
        "",
        f"compiled check ({_C_LAYERS.value} layers, T = {_C_LENGTH.value}, {n} fake CPU "
        f"devices, moe_impl='dense'): XLA temporaries {got.temp / 2**30:.2f} GiB per device, "
        f"analytic {want / 2**30:.2f} GiB ({want / got.temp:.2f}x)",
    ]


def cli_main() -> None:
    """The `sao-memory-plan` console script (a missing config file: one line, exit 2)."""
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=cli.parse_config_flags)


if __name__ == "__main__":
    cli_main()
