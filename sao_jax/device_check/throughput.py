"""What the device does with the paths once they are right: update-step MFU, decode
tokens/s against the HBM roofline, weight-sync bandwidth.

  update_mfu   the bf16 update step of the bench model (sao_jax/device_check/shapes.py:
               the recipe's widths, >= 1 B active parameters) under the run config's RL
               settings: compile time, step time (median of the timed steps), useful
               FLOPs (sao_jax/plan/flops.py, causal attention) per second, and MFU
               against the device's published dense bf16 peak (sao_jax/plan/hardware.py).
  decode       the sampler's decode program (bf16 weights, `GenerateFns`) at each slot
               count, every slot reading the whole cache: tokens/s, and the fraction of
               the HBM roofline (sao_jax/plan/roofline.py) it reaches.
  weight_sync  `parallel.reshard.cast_and_reshard` of the bench policy (float32 -> bf16)
               from device 0 to device 1 (a pool on its own device), and from its trainer
               layout (fsdp over devices 0, 1) to the host-local sampler layout over the
               same two (one program): GB/s of bf16 bytes delivered, and that the delivered
               params are exactly the cast ones. Needs two devices (one device: skipped).
Every timing is a median over `Shapes.timed_repeats` calls after a first (compiling) one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.device_check.paths import Learners, run_config
from sao_jax.device_check.record import Phase, timed
from sao_jax.device_check.shapes import Shapes
from sao_jax.models.factory import init_models
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.parallel.partition import init_params, tree_bytes
from sao_jax.parallel.reshard import cast_and_reshard, cast_floating, host_split_shardings
from sao_jax.plan import flops, roofline
from sao_jax.plan.hardware import Peak
from sao_jax.rl.optim import critic_trainable
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.sampling.generate import GenerateFns, SamplingParams, Spans


def update_mfu(p: Phase, s: Shapes, learners: Learners, peak: Peak | None) -> None:
    cfg = s.bench_model
    rows, length = s.bench_batch
    learner = learners.get(cfg, rows)
    run = run_config(learners.config, cfg, rows)
    models = init_models(cfg, Sharder(), seed=0)
    state = [learner.new_state(models.policy, models.critic, seed=0)]
    del models  # the state holds the only copy (donated at every step)
    batch = jax.device_put(synthetic_batch(rows, length, cfg.vocab_size, seed=1))
    key = jax.random.key(0)
    useful = flops.update_step_flops(
        cfg,
        rows,
        length,
        run.rl.k_critic,
        critic_trainable=critic_trainable(run.optim.critic),
        causal=True,
    )
    p.results.update(
        active_params_b=flops.active_params(cfg) / 1e9,
        matmul_params_b=flops.matmul_params(cfg) / 1e9,
        tokens=rows * length,
        useful_tflop=useful / 1e12,
    )

    def step():
        state[0], metrics = learner.update_step(state[0], batch, key)
        return metrics

    r = timed(step, s.timed_repeats, p)
    p.results.update(
        first_call_s=r["first_s"],
        step_s=r["median_s"],
        tokens_per_s=rows * length / r["median_s"],
        achieved_tflops=useful / r["median_s"] / 1e12,
    )
    if peak is not None:
        p.results["mfu"] = roofline.mfu(useful, r["median_s"], peak.bf16_flops)
    else:
        p.note("no published peak for this device kind: no MFU")


def decode(p: Phase, s: Shapes, peak: Peak | None) -> None:
    cfg = dataclasses.replace(s.bench_model, param_dtype="bfloat16")  # the sampler's copy
    mdef, params = init_params(lambda: Policy(cfg, rngs=nnx.Rngs(0)), Sharder())
    length, steps = s.decode_len, s.decode_steps
    key, sampling = jax.random.key(0), SamplingParams()
    for slots in s.decode_slots:
        if p.time_left() <= 0:
            p.skip(f"decode at {slots} slots")
            continue
        fns = GenerateFns(mdef, num_slots=slots, max_len=length, steps=steps)
        cache = [fns.init_cache(params)]
        tokens = jnp.ones((slots,), jnp.int32)
        positions = jnp.full((slots,), length - steps, jnp.int32)  # every slot reads all

        def call(fns=fns, cache=cache, tokens=tokens, positions=positions):
            cache[0], out = fns.decode(
                params, cache[0], tokens, positions, key, sampling, Spans(length)
            )
            return out.tokens_ns

        r = timed(call, s.timed_repeats, p)
        step_bytes = roofline.decode_step_bytes(cfg, slots, length)
        got = dict(
            first_call_s=r["first_s"],
            call_s=r["median_s"],
            tokens_per_s=slots * steps / r["median_s"],
            step_gb=step_bytes["total"] / 1e9,
        )
        if peak is not None:
            bound = roofline.decode_tokens_per_s_bound(
                step_bytes["total"], slots, peak.hbm_bytes_per_s
            )
            got.update(roofline_tokens_per_s=bound, of_roofline=got["tokens_per_s"] / bound)
        p.results[f"slots_{slots}"] = got
        del cache


def _on(mesh: Mesh, tree):
    """Replicated NamedShardings on `mesh` for every leaf of `tree`."""
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


def weight_sync(p: Phase, s: Shapes) -> None:
    devices = jax.devices()
    if len(devices) < 2:
        p.note("one device: nothing to sync between")
        return
    cfg = s.bench_model
    trainer = Sharder(build_mesh((1, 2, 1, 1), devices=devices[:2]))  # fsdp over 0, 1
    _, params = init_params(lambda: Policy(cfg, sharder=trainer, rngs=nnx.Rngs(0)), trainer)
    want = cast_floating(jax.device_get(params), jnp.bfloat16)  # on the host: numpy's cast
    nbytes = tree_bytes(want)
    p.results["bf16_gb"] = nbytes / 1e9
    pool = Mesh(np.array(devices[:2]).reshape(1, 2), ("hosts", "local"))
    device_0 = jax.device_put(params, _on(Mesh(np.array(devices[:1]), ("d",)), params))
    cases = (  # (name, params, target shardings)
        ("device 0 -> device 1", device_0, _on(Mesh(np.array(devices[1:2]), ("d",)), params)),
        ("trainer fsdp -> host-local split", params, host_split_shardings(params, pool, "local")),
    )
    for name, source, targets in cases:
        if p.time_left() <= 0:
            p.skip(name)
            continue
        r = timed(
            lambda a=source, t=targets: cast_and_reshard(a, t, jnp.bfloat16), s.timed_repeats, p
        )
        exact = all(
            np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
            for a, b in zip(jax.tree.leaves(jax.device_get(r["out"])), jax.tree.leaves(want))
        )
        p.check(f"{name}: bf16 params bit-identical", 0.0 if exact else 1.0, 0.0)
        p.results[f"{name} GB/s"] = nbytes / r["median_s"] / 1e9
