"""Per-device memory of policy, critic and AdamW states on a (fake) mesh; no allocation.

    python -m experiments.memory_plan --config=configs/models/qwen3_30b_a3b.py \\
        --mesh=data=1,fsdp=8,expert=8,tensor=1 --devices=64
    python -m experiments.memory_plan --config=configs/models/qwen3_30b_a3b.py \\
        --mesh=fsdp=8 --devices=8                       # 8 x H200

--config is a model section (configs/models/*.py; the optimizer sections then come from
configs/base.py) or a full run config with `model`, `optim` and `mesh.rules`. Override
fields as usual: --config.param_dtype=bfloat16.
"""

from absl import app, flags
from ml_collections import config_flags

from sao_jax import cli
from sao_jax.configs import base
from sao_jax.models.config import ModelConfig
from sao_jax.parallel.memory import format_plan, memory_plan, parse_mesh
from sao_jax.parallel.mesh import DEFAULT_RULES
from sao_jax.schema import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "model or run config file")
_MESH = flags.DEFINE_string("mesh", "fsdp=-1", "axis sizes, e.g. data=1,fsdp=8,expert=8,tensor=1")
_DEVICES = flags.DEFINE_integer("devices", 8, "number of devices in the mesh")


def main(argv):
    del argv
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


def cli_main() -> None:
    """The `sao-memory-plan` console script (a missing config file: one line, exit 2)."""
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=lambda argv: app.parse_flags_with_usage(cli.config_argv(argv)))


if __name__ == "__main__":
    cli_main()
