"""Trajectories per second of the SAO loop by sampler placement: a pipeline model, and the
decode roofline that feeds it at scale (a plan from shapes and published figures).

The loop (sao_jax/train.py) consumes B trajectories per update. Per placement:

  work   = (B * roll, update + exposed * sync)
  period = max(max(work), sum(work) / concurrency)

  colocated:     the pool decodes on the trainer's devices, and an accelerator runs one
                 program at a time: concurrency 1, so period = B * roll + update + sync;
  disaggregated: pool and trainer run at once; the pool swaps versions between engine
                 steps (double buffering, sampling/params_store.py), so the two only meet
                 in the queue: concurrency 2 on separate chips.

  trajectories/s = B / period

`roll`: device seconds per trajectory on that device set (decode + prefill + the host's
per-trajectory work, at its slot count); `update`: one update step; `sync`: the weight
sync (cast + transfer of the bf16 policy). `concurrency`: how much of the sampler's and
the learner's work runs at full speed at once: 1 or 2 by the rule above on chips; on a
CPU the cores are shared by both placements (experiments/bench/placement.py uses 1 for
both on 2 cores, where the sampler's host work and every device program contend for
them). `exposed`: the
share of the sync that costs trainer time: 1 where the CPU copies the bytes, 0 where a DMA
engine / the interconnect moves them while the next update runs (the sync then bounds
only the staleness: ceil(sync / update) versions of lag).

At scale (`decode_step_s`, `rollout_s`, `update_s`, `sync_s`), decoding is memory-bound:
each step reads the weights the slots touch (for an MoE, the distinct experts that S x k
routing choices hit) and every slot's KV cache, so a pool replica with more free HBM
holds more slots and reads its weights for more tokens. That is what disaggregation buys:
a pool chip holds no optimizer state and no update temporaries.
"""

from __future__ import annotations

import dataclasses
import math

from sao_jax.models.config import ModelConfig
from sao_jax.parallel.placement import PLACEMENTS
from sao_jax.plan import flops as flops_lib
from sao_jax.plan import roofline
from sao_jax.plan.hardware import Peak, peak_for
from sao_jax.plan.kv_pool import kv_bytes_per_token
from sao_jax.schema import ConfigError


def pipeline_rate(
    placement: str,
    batch: int,
    roll_s: float,
    update_s: float,
    sync_s: float,
    *,
    concurrency: float | None = None,
    sync_exposed: float | None = None,
) -> float:
    """Trajectories per second (module docstring): B / period, with period =
    max(max(work), sum(work) / concurrency), work = (B roll, update + exposed sync).

    Defaults: colocated concurrency 1 and exposed 1 (a device runs one program at a
    time: period = B roll + update + sync); disaggregated concurrency 2 and exposed 0
    (separate chips, the sync moved by the interconnect). On a CPU both placements share
    the cores: pass the machine's own (experiments/bench/placement.py).
    """
    if placement not in PLACEMENTS:
        raise ConfigError(f"argument placement: must be one of {PLACEMENTS}, got {placement!r}")
    colocated = placement == "colocated"
    c = (1.0 if colocated else 2.0) if concurrency is None else concurrency
    exposed = (1.0 if colocated else 0.0) if sync_exposed is None else sync_exposed
    if not 1.0 <= c <= 2.0:
        raise ValueError(f"concurrency: must be in [1, 2], got {c}")
    work = (batch * roll_s, update_s + exposed * sync_s)
    return batch / max(max(work), sum(work) / c)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip's published figures (sao_jax/plan/hardware.py) and the link a weight sync
    crosses, with the link's source."""

    peak: Peak
    link_bw: float  # bytes/s per chip, one direction, trainer -> pool
    link: str
    chips_per_host: int
    link_source: str

    name = property(lambda self: self.peak.name)
    peak_flops = property(lambda self: self.peak.bf16_flops)  # bf16 dense FLOP/s
    hbm_bytes = property(lambda self: self.peak.hbm_bytes)
    hbm_bw = property(lambda self: self.peak.hbm_bytes_per_s)  # bytes/s
    source = property(lambda self: f"{self.peak.source}; {self.link_source}")


HARDWARE = {
    "tpu-v5p": Hardware(
        peak_for("TPU v5p"), 4800e9 / 8 / 2, "ICI (4800 Gbps per chip, half one way)", 4,
        "ICI 4800 Gbps per chip (the same page)",
    ),
    "h200": Hardware(
        peak_for("NVIDIA H200"), 400e9 / 8, "InfiniBand NDR (400 Gb/s per GPU)", 8,
        "NDR 400 Gb/s ConnectX-7 per GPU",
    ),
    "h100": Hardware(
        peak_for("NVIDIA H100 80GB HBM3"), 400e9 / 8, "InfiniBand NDR (400 Gb/s per GPU)", 8,
        "NDR 400 Gb/s ConnectX-7 per GPU",
    ),
}  # fmt: skip


def decode_step_s(
    cfg: ModelConfig,
    slots: int,
    context: float,
    chips: int,
    hw: Hardware,
    *,
    bw_efficiency: float = 0.7,
    mfu: float = 0.4,
) -> float:
    """One decode step of `slots` slots at mean `context` on a replica of `chips` chips:
    max(bytes / (chips x HBM bw x eff), FLOPs / (chips x peak x mfu)); bytes = weights
    touched + every slot's KV in bf16 (sao_jax/plan/roofline.py); FLOPs = 2 x active
    matmul params x slots + attention 4 x slots x context x N x H x L.
    Collectives (the expert all-to-all) not counted."""
    read = roofline.decode_step_bytes(cfg, slots, context)["total"]
    attn = 4 * slots * context * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    work = 2 * flops_lib.matmul_params(cfg) * slots + attn
    return max(read / (chips * hw.hbm_bw * bw_efficiency), work / (chips * hw.peak_flops * mfu))


def rollout_s(
    cfg: ModelConfig,
    slots: int,
    context: float,
    generated: float,
    prefilled: float,
    chips: int,
    hw: Hardware,
    **kw,
) -> float:
    """Replica seconds per trajectory: its `generated` tokens decoded S at a time, plus its
    `prefilled` tokens (prompt, observations) at compute speed."""
    mfu = kw.get("mfu", 0.4)
    prefill = 2 * flops_lib.matmul_params(cfg) * prefilled / (chips * hw.peak_flops * mfu)
    return generated * decode_step_s(cfg, slots, context, chips, hw, **kw) / slots + prefill


def update_s(
    cfg: ModelConfig, tokens: float, row_length: int, k_critic: int, chips: int, hw: Hardware,
    *, mfu: float = 0.4,
) -> float:  # fmt: skip
    """One update step on packed rows of `row_length` (useful FLOPs, causal attention, the
    critic training its 'moe' set: sao_jax/plan/flops.py) at `mfu` of the chips' peak."""
    rows = math.ceil(tokens / row_length)
    work = flops_lib.update_step_flops(cfg, rows, row_length, k_critic, causal=True)
    return work / (chips * hw.peak_flops * mfu)


def sync_s(policy_bytes: float, trainer_chips: int, pool_chips: int, replicas: int, hw) -> float:
    """The weight sync over `hw.link`: bounded by the trainer's egress (every pool replica
    needs one copy: replicas x bytes over trainer_chips links) and by each pool chip's
    ingress (its 1 / (pool_chips / replicas) share of one copy)."""
    egress = replicas * policy_bytes / (trainer_chips * hw.link_bw)
    ingress = policy_bytes / (pool_chips / replicas) / hw.link_bw
    return max(egress, ingress)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one update consumes and what the trainer holds (the assumptions of a plan)."""

    batch: int  # trajectories per update
    generated: float  # mean generated tokens per trajectory
    prefilled: float  # mean prompt + observation tokens per trajectory
    context: float  # mean live context of a decoding slot (its KV tokens)
    row_length: int  # packed update rows
    k_critic: int
    state_bytes: float  # trainer params + optimizer states, per chip at `state_chips`
    state_chips: int
    temp_bytes: float  # update-step temporaries per chip (independent of the chip count)
    reserve_bytes: float = 4e9  # per chip: programs, workspace, fragmentation
    max_in_flight: int | None = None  # rollouts in flight at most (a staleness budget)


def split_rate(
    cfg: ModelConfig,
    hw: Hardware,
    work: Workload,
    chips: int,
    pool_chips: int,
    replica: int,
    **kw,
) -> dict[str, float] | None:
    """Predicted trajectories/s of `chips` chips with `pool_chips` of them in the pool (0:
    colocated), decoding in replicas of `replica` chips (each holding a bf16 policy copy and
    the KV of its slots, paged: slots = free HBM / (context x KV bytes per token), at most
    `work.max_in_flight` over all replicas). None
    when the trainer's share cannot hold its state and temporaries."""
    copy = flops_lib.total_params(cfg) * 2  # the bf16 policy each replica holds
    trainer = chips - pool_chips
    held = work.state_bytes * work.state_chips / trainer + work.temp_bytes
    if held + work.reserve_bytes > hw.hbm_bytes:
        return None
    if pool_chips:  # a pool chip holds its share of the copy and KV
        free, pool = hw.hbm_bytes - copy / replica - work.reserve_bytes, pool_chips
    else:  # colocated: the KV shares HBM with the training state and temporaries
        free, pool = hw.hbm_bytes - held - copy / replica - work.reserve_bytes, chips
    replicas = pool // replica
    slots = int(free * replica // (work.context * kv_bytes_per_token(cfg, 2)))
    if work.max_in_flight is not None:
        slots = min(slots, work.max_in_flight // replicas)
    if slots < 1:
        return None
    per_traj = rollout_s(
        cfg, slots, work.context, work.generated, work.prefilled, replica, hw, **kw
    )
    roll = per_traj / replicas
    upd = update_s(
        cfg, work.batch * (work.generated + work.prefilled), work.row_length, work.k_critic,
        trainer, hw, mfu=kw.get("mfu", 0.4),
    )  # fmt: skip
    if pool_chips:
        sync = sync_s(copy, trainer, pool_chips, replicas, hw)
        rate = pipeline_rate("disaggregated", work.batch, roll, upd, sync)
    else:  # the host-local copy: one HBM read and write of each chip's share
        sync = 2 * copy / replica / (hw.hbm_bw * kw.get("bw_efficiency", 0.7))
        rate = pipeline_rate("colocated", work.batch, roll, upd, sync)
    return dict(
        slots=slots * replicas,
        step_ms=1e3 * decode_step_s(cfg, slots, work.context, replica, hw, **kw),
        roll_s=work.batch * roll,
        update_s=upd,
        sync_s=sync,
        rate=rate,
    )
