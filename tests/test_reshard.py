"""Weight sync (sao_jax/parallel/reshard.py): params cast to bf16 and moved to a sampler's
shardings, bit-identical to the cast, on 8 fake CPU devices: to other devices (a pool
beside the trainer) and to another mesh over the same devices (one program)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import init_params
from sao_jax.parallel.reshard import (
    cast_and_reshard,
    cast_floating,
    first_divisible_spec,
    host_split_shardings,
    reshard_program,
)

CFG = ModelConfig(
    vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, moe_intermediate_size=8, num_experts=4,
    num_experts_per_tok=2,
)  # fmt: skip


def _trainer_params(devices):
    sharder = Sharder(build_mesh((1, len(devices), 1, 1), devices=devices))  # fsdp
    _, params = init_params(lambda: Policy(CFG, sharder=sharder, rngs=nnx.Rngs(0)), sharder)
    return params


def _assert_delivered(got, params, targets):
    want = cast_floating(jax.device_get(params), jnp.bfloat16)  # numpy's cast, on the host
    for g, w, t in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(targets)):
        assert g.dtype == jnp.bfloat16 and g.sharding == t
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w.view(np.uint16))


def test_first_divisible_spec():
    assert first_divisible_spec((3, 8, 16), "local", 4) == P(None, "local")
    assert first_divisible_spec((2, 6), "local", 4) == P()
    assert first_divisible_spec((4,), "local", 4) == P("local")


def test_cast_floating_keeps_integer_leaves():
    tree = {"w": jnp.ones((2,), jnp.float32), "ids": jnp.arange(3)}
    out = cast_floating(tree, jnp.bfloat16)
    assert (out["w"].dtype, out["ids"].dtype) == (jnp.bfloat16, tree["ids"].dtype)
    assert cast_floating(tree)["w"].dtype == jnp.float32  # no dtype: unchanged


def test_to_a_pool_on_other_devices():
    """Trainer on devices 0-3 (fsdp), pool on 4-7 (host-local split): cast, then moved."""
    devices = jax.devices()
    params = _trainer_params(devices[:4])
    pool = Mesh(np.array(devices[4:]).reshape(1, 4), ("hosts", "local"))
    targets = host_split_shardings(params, pool, "local")
    got = cast_and_reshard(params, targets, jnp.bfloat16)
    _assert_delivered(got, params, targets)


def test_to_another_mesh_over_the_same_devices_is_one_program():
    devices = jax.devices()
    params = _trainer_params(devices)
    pool = Mesh(np.array(devices).reshape(2, 4), ("hosts", "local"))
    targets = host_split_shardings(params, pool, "local")
    program = reshard_program(targets, jnp.bfloat16)
    assert reshard_program(targets, "bfloat16") is program  # built once per targets
    got = cast_and_reshard(params, targets, jnp.bfloat16)
    _assert_delivered(got, params, targets)
    replicated = jax.tree.map(lambda _: NamedSharding(pool, P()), params)
    _assert_delivered(cast_and_reshard(params, replicated, jnp.bfloat16), params, replicated)
    # The same devices in another order: one program cannot span two orders (device_put).
    reversed_pool = Mesh(np.array(devices[::-1]).reshape(2, 4), ("hosts", "local"))
    targets = host_split_shardings(params, reversed_pool, "local")
    _assert_delivered(cast_and_reshard(params, targets, jnp.bfloat16), params, targets)
