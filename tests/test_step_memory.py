"""The analytic update-step memory model against XLA's compiled figures.

Each case compiles the update step from shapes (remat='full', blockwise attention, layers
scanned: the long-context setting) and compares XLA's per-device temporaries with
`analytic_step_bytes`. The model's multiplicities were read off other shapes (the `larger`
benchmark model at T = 1024 and 2048, a dense-MLP model with 256-token attention blocks);
these differ in width, depth, MoE vs dense MLP, vocabulary, attention block and sharding,
and in which half of a layer (attention or MLP) peaks. Two programs cover those axes
here: the MoE model sharded one row per device over 8 devices, and a dense-MLP model on
one device (the unsharded MoE model, a third compile, checked neither axis alone).
"""

import pytest

from configs import base
from sao_jax import config as config_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, policy_def
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.plan.memory import abstract_mesh, memory_plan
from sao_jax.plan.step_memory import (
    StepBytes,
    analytic_step_bytes,
    compile_update_step,
    step_plan_lines,
)
from sao_jax.rl.update import Learner

LONG = dict(attention_impl="blockwise", remat="full", scan_layers=True)
CASES = {
    "dense_mlp_d128": (dict(num_experts=0, hidden_size=128, num_hidden_layers=4), None, 1),
    "tiny_8_devices": (dict(), (2, 2, 2, 1), 8),  # one row per device
}


@pytest.mark.parametrize("name", list(CASES))
def test_analytic_model_within_25_percent(name):
    model, mesh, rows = CASES[name]
    t = 1024
    c = base.get_config()
    c.model.update(LONG, **model)
    c.rl.batch_size = rows
    c = config_lib.validate(c)
    cfg = ModelConfig.from_config(c.model)
    sharder = Sharder() if mesh is None else Sharder(build_mesh(mesh))
    pdef, cdef = policy_def(cfg, sharder), critic_def(cfg, sharder)
    learner = Learner(c.rl, c.optim, pdef, cdef, sharder)
    compiled = StepBytes.of(compile_update_step(learner, cfg, rows, t, fast=True)).temp
    sizes = dict(zip(("data", "fsdp", "expert", "tensor"), mesh or (1, 1, 1, 1)))
    plan = memory_plan(cfg, c.optim, sizes)
    predicted = analytic_step_bytes(
        cfg,
        pdef,
        cdef,
        sharder,
        critic_opt_bytes=plan.critic_opt_frozen.device_bytes,
        rows_per_device=rows // sharder.axis_size("batch"),
        length=t,
    ).total
    assert 0.75 <= predicted / compiled <= 1.25, (name, predicted, compiled)


def test_plan_lines_add_up_and_warn_outside_the_model():
    """memory_plan's table (tiny model, 8-device abstract mesh): the sum line is the sum
    of its parts, and a config the model does not describe (remat='none') is flagged."""
    sizes = dict(data=1, fsdp=4, expert=2, tensor=1)
    for remat, warned in (("full", False), ("none", True)):
        c = base.get_config()
        c.model.update(LONG, remat=remat)
        cfg = ModelConfig.from_config(config_lib.validate(c).model)
        plan = memory_plan(cfg, c.optim, sizes)
        sharder = Sharder(abstract_mesh(sizes))
        lines = step_plan_lines(
            cfg,
            plan,
            sharder,
            length=4096,
            rows_per_device=1,
            microbatches=2,
            slots_per_host=8,
            devices_per_host=4,
        )
        gib = {
            line[:60].strip(): float(line[60:]) for line in lines if line[60:].strip()[:1].isdigit()
        }
        update = gib["params + AdamW (above) + temporaries: the update step"]
        parts = [v for k, v in gib.items() if k.startswith(("sampler", "KV cache"))]
        total = gib["sum: update step + sampler (one copy) + KV cache"]
        assert abs(update + sum(parts) - total) < 0.02, lines
        assert any(line.startswith("warning:") for line in lines) == warned
