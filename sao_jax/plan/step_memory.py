"""Memory of the compiled update step: XLA's own figures, and an analytic model of them.

`compile_update_step` lowers and compiles `Learner.update_step` from shapes alone
(abstract state, abstract batch; on fake CPU devices when a mesh is given), and
`StepBytes.of` reads `compiled.memory_analysis()`: per device, the arguments (state and
batch), the outputs (aliased with the donated state) and the temporaries, which hold
every activation, gradient and scratch buffer of the step.

`analytic_step_bytes` predicts those temporaries from the model's shapes, so that a
full-size model at 32k tokens can be planned without compiling it (a CPU compile of 48
layers x 128 experts x 32k tokens is slow, and its ragged_dot lowering is not the one a
GPU/TPU runs). It is written for the long-context setting (`remat='full'`, a flash
kernel, chunked log-probs) and the phase that peaks, the policy step:

  temp = critic carry + grads + saved layer inputs + one layer's working set + LM head

  critic carry    the critic's params and moments, carried over the K critic steps
  grads           gradients in param dtype (x2 with microbatches: accumulator + the
                  current microbatch's)
  saved inputs    L x tokens x D x compute bytes (remat='full': each layer's input)
  layer working   one layer recomputed and differentiated: the residual stream plus the
                  larger of the attention half (q/k/v projections and the kernel's score
                  blocks) and the MLP half (SwiGLU, or the MoE dispatch buffers)
  LM head         a chunk of logits [rows, C, V] float32, a few copies

The multiplicities (module constants below) were read off XLA's buffer assignment; they
are what a CPU compiles. The 'ragged' MoE path (grouped matmuls, what GPU/TPU run) is
counted from its shapes only: a CPU lowers ragged_dot to a dense loop, so no compiled
figure checks it.

Every term is per device: parameter terms from the shardings, token terms from the rows a
device holds (`tokens` = rows per device per microbatch x T). tests/test_step_memory.py
checks the model against compiled figures on several shapes (within 25%).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from sao_jax import batch_schema
from sao_jax.models.config import ModelConfig
from sao_jax.models.moe.dispatch import resolve_impl
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef

_SHAPE = re.compile(r"\b(pred|s8|s16|s32|s64|u8|u16|u32|u64|bf16|f16|f32|f64)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Per-device bytes of one compiled program (XLA's memory analysis)."""

    temp: int
    argument: int
    output: int
    alias: int
    code: int

    @classmethod
    def of(cls, compiled) -> StepBytes:
        m = compiled.memory_analysis()
        return cls(
            temp=int(m.temp_size_in_bytes),
            argument=int(m.argument_size_in_bytes),
            output=int(m.output_size_in_bytes),
            alias=int(m.alias_size_in_bytes),
            code=int(m.generated_code_size_in_bytes),
        )

    @property
    def peak(self) -> int:
        """Arguments + non-aliased outputs + temporaries: what the step needs at once."""
        return self.argument + self.output - self.alias + self.temp


def abstract_batch(rows: int, length: int, cfg: ModelConfig, sharding=None, routing=False):
    """ShapeDtypeStructs of an update-step batch [rows, length] (sao_jax/batch_schema.py)."""
    sizes = dict(B=rows, T=length, L=len(cfg.moe_layers), K=cfg.num_experts_per_tok)
    names = batch_schema.fields_for({"routing"} if routing else ())
    return batch_schema.abstract_batch(names, sizes, sharding)


# XLA's CPU backend at optimisation level 0 compiles about twice as fast; the buffer
# assignment (and so memory_analysis) is decided before it and comes out the same.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_update_step(learner, cfg: ModelConfig, rows: int, length: int, *, fast=False):
    """`learner.update_step` compiled for a [rows, length] batch, from shapes only
    (`fast`: for its memory figures only, with FAST_COMPILE; not for running)."""
    sharder: Sharder = learner.sharder
    state, batch_sh = learner.abstract_state, None
    if sharder.mesh is not None:
        state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            learner.abstract_state,
            learner.state_shardings,
        )
        batch_sh = NamedSharding(sharder.mesh, sharder.spec(("batch",)))
    batch = abstract_batch(rows, length, cfg, batch_sh, routing=learner.rl.routing_replay)
    key = jax.eval_shape(lambda: jax.random.key(0))
    lowered = learner.update_step.lower(state, batch, key)
    return lowered.compile(FAST_COMPILE) if fast else lowered.compile()


def buffer_shapes(compiled) -> set[tuple[str, tuple[int, ...]]]:
    """Every (dtype, shape) that appears in the compiled program's HLO text."""
    out = set()
    for dtype, dims in _SHAPE.findall(compiled.as_text()):
        out.add((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


# ----------------------------------------------------------------------------- analytic

# Multiplicities read off XLA's buffer assignment (the `larger` benchmark model at T = 1024
# and 2048, and a dense-MLP model at T = 1024, remat='full', blockwise attention, layers
# scanned); tests/test_step_memory.py checks them on other shapes.
ATTN_COPIES = 10  # q, k, v (and their normed / rotated forms, gradients) per token
BLOCK_COPIES = 4  # [rows, N, block, block] float32 score / probability blocks, fwd + bwd
RESID_COPIES = 8  # residual-stream vectors per token in one layer's backward
DENSE_MLP_COPIES = 6  # SwiGLU gate, up, hidden and their gradients, per token
DENSE_MOE_COPIES = 14  # [tokens, E_local, F] buffers of the dense-over-experts path
RAGGED_COPIES = 3  # routed-slot buffers, forward + backward (from shapes, not compiled)
HEAD_COPIES = 3  # logits, log-probs and their gradient for one chunk


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def mlp_bytes_per_token(cfg: ModelConfig, moe_impl: str, e_local: int, gather: int = 1) -> int:
    """Bytes per token of the largest MLP's recomputed forward + backward (c = compute bytes).

    Dense SwiGLU: DENSE_MLP_COPIES x F c. MoE: the router (2 E float32) plus either the
    dense-over-experts path (moe_impl='dense', what a CPU runs: DENSE_MOE_COPIES x G x
    E_local x F c) or the grouped-matmul dispatch ('ragged', what a GPU/TPU runs:
    RAGGED_COPIES x (G k E_local / E) x (2 D + 3 F) c for the gathered token, gate, up,
    hidden and output of each routed slot a device computes, plus the tokens all-gathered
    over the expert group, G x D x (c + 4)). G (`gather`) is the number of batch shards
    along the expert axis (moe/dispatch.py gathers their tokens).
    """
    c = _itemsize(cfg.compute_dtype)
    d = cfg.hidden_size
    dense = DENSE_MLP_COPIES * cfg.intermediate_size * c
    if not cfg.moe_layers:
        return dense
    e, fm, topk = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    if moe_impl == "dense":
        moe = DENSE_MOE_COPIES * gather * e_local * fm * c
    else:
        slots = gather * topk * e_local / e  # routed slots a device computes, per own token
        moe = RAGGED_COPIES * slots * (2 * d + 3 * fm) * c + gather * d * (c + 4)
    moe += 2 * e * 4
    has_dense = len(cfg.moe_layers) < cfg.num_hidden_layers
    return int(max(moe, dense if has_dense else 0))


def layer_working_bytes(
    cfg: ModelConfig, moe_impl: str, e_local: int, gather: int, rows: int, length: int
) -> int:
    """One decoder layer recomputed and differentiated, for `rows` rows of `length` tokens.

    The residual stream (RESID_COPIES x D c per token) is live throughout; the attention
    half and the MLP half are not live at once, so the layer needs the larger of
      attention: ATTN_COPIES x (N + 2K) H c per token + BLOCK_COPIES x rows x N x b^2 x 4
                 (b = min(attention_block, T): the kernel's score blocks)
      MLP:       mlp_bytes_per_token (above) per token.
    """
    c = _itemsize(cfg.compute_dtype)
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    tokens = rows * length
    blk = min(cfg.attention_block, length)
    attn = tokens * ATTN_COPIES * (n + 2 * k) * h * c + BLOCK_COPIES * rows * n * blk * blk * 4
    mlp = tokens * mlp_bytes_per_token(cfg, moe_impl, e_local, gather)
    return int(tokens * RESID_COPIES * cfg.hidden_size * c + max(attn, mlp))


@dataclasses.dataclass(frozen=True)
class AnalyticStep:
    """Predicted temporaries of the update step, per device, term by term (bytes)."""

    critic_carry: int  # critic params + moments looped over the K critic steps
    grads: int  # param-dtype gradients (x2 with microbatches: accumulator)
    saved_inputs: int  # remat='full': every layer's input, L x tokens x D x c
    layer_working: int  # one layer recomputed and differentiated
    lm_head: int  # one chunk of logits [rows, C, V] (a few copies) + hidden states

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


def _param_bytes(policy_def: ModelDef, sharder: Sharder) -> int:
    """Param bytes per device of a model (either layer layout: the stacked one's layer axis
    is unsharded, so both count the same)."""
    shapes = policy_def.shapes()
    shardings = policy_def.shardings(sharder)
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    sh_leaves = (
        jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        if shardings is not None
        else [None] * len(leaves)
    )
    total = 0
    for (_, s), sh in zip(leaves, sh_leaves):
        total += (
            math.prod(sh.shard_shape(s.shape) if sh is not None else s.shape) * s.dtype.itemsize
        )
    return total


def analytic_step_bytes(
    cfg: ModelConfig,
    policy_def: ModelDef,
    critic_def: ModelDef,
    sharder: Sharder,
    *,
    critic_opt_bytes: int,
    rows_per_device: int,
    length: int,
    microbatches: int = 1,
    moe_impl: str | None = None,
) -> AnalyticStep:
    """The analytic model of the module docstring (remat='full', flash attention).

    `critic_opt_bytes`: per-device bytes of the critic's optimizer state (from
    sao_jax.plan.memory.memory_plan); `rows_per_device`: rows each device holds in
    one microbatch.
    """
    c = _itemsize(cfg.compute_dtype)
    p_bytes = _param_bytes(policy_def, sharder)
    c_bytes = _param_bytes(critic_def, sharder)
    grads = max(p_bytes, c_bytes) * (2 if microbatches > 1 else 1)
    tokens = rows_per_device * length
    saved = cfg.num_hidden_layers * tokens * cfg.hidden_size * c
    e_local = cfg.num_experts // max(sharder.axis_size("expert"), 1) if cfg.num_experts else 0
    batch_axes = set(sharder.mesh_axes("batch"))
    gather = (
        math.prod(sharder.mesh.shape[a] for a in sharder.mesh_axes("expert") if a in batch_axes)
        if sharder.mesh is not None
        else 1
    )
    impl = resolve_impl(moe_impl or cfg.moe_impl)
    working = layer_working_bytes(cfg, impl, e_local, gather, rows_per_device, length)
    chunk = min(cfg.logits_chunk or length, length)
    vocab_local = cfg.vocab_size // max(sharder.axis_size("act_vocab"), 1)
    lm_head = HEAD_COPIES * rows_per_device * chunk * vocab_local * 4
    lm_head += 2 * tokens * cfg.hidden_size * 4
    return AnalyticStep(c_bytes + critic_opt_bytes, grads, saved, working, lm_head)


def _gib(n: float) -> str:
    return f"{n / 2**30:9.2f}"


def step_plan_lines(
    cfg: ModelConfig,
    plan,
    sharder: Sharder,
    *,
    length: int,
    rows_per_device: int,
    microbatches: int,
    slots_per_host: int,
    devices_per_host: int,
    frozen: bool = True,
    moe_impl: str = "ragged",
    pool=None,
) -> list[str]:
    """The update step's temporaries (analytic) and the sampler's share, per device, as
    table lines under `format_plan`'s; `plan` is sao_jax.plan.memory.Plan. The KV cache
    is `pool`'s (sao_jax.plan.kv_pool.PoolPlan: dense or paged), or else a dense cache
    of `slots_per_host` slots of `length` over the host's devices."""
    from sao_jax.models.factory import critic_def, policy_def

    opt = plan.critic_opt_frozen if frozen else plan.critic_opt_full
    a = analytic_step_bytes(
        cfg,
        policy_def(cfg, sharder),
        critic_def(cfg, sharder),
        sharder,
        critic_opt_bytes=opt.device_bytes,
        rows_per_device=rows_per_device,
        length=length,
        microbatches=microbatches,
        moe_impl=moe_impl,
    )
    c = _itemsize(cfg.compute_dtype)
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * c
    kv = slots_per_host * length * kv_token / devices_per_host
    kv_line = f"KV cache: {slots_per_host} slots/host x T x {kv_token / 1024:g} KiB/token"
    if pool is not None and pool.layout == "paged":
        kv = pool.device_bytes
        kv_line = (
            f"KV cache, paged: {pool.pages} pages x {pool.page_size} x {kv_token / 1024:g} KiB"
        )
    elif pool is not None:
        kv = pool.device_bytes
        kv_line = f"KV cache: {pool.slots} slots x {pool.max_len} x {kv_token / 1024:g} KiB/token"
    copy_devices = pool.devices if pool is not None else devices_per_host  # the engine's
    sampler = plan.policy_total.count * c / copy_devices
    state = plan.total(frozen).device_bytes
    lines = [
        "",
        f"update step temporaries, analytic (sao_jax/plan/step_memory.py): T = {length}, "
        f"{rows_per_device} row(s) per device per microbatch, {microbatches} microbatch(es), "
        f"remat={cfg.remat}, scan_layers={cfg.scan_layers}, MoE '{moe_impl}'",
        f"{'term':<60}{'per-device GiB':>16}",
    ]
    terms = [
        ("critic params + moments carried over the K critic steps", a.critic_carry),
        ("gradients (x2 with microbatches: accumulator)", a.grads),
        ("saved layer inputs (remat='full': L x tokens x D)", a.saved_inputs),
        ("one layer recomputed + differentiated", a.layer_working),
        ("LM-head chunk (logits [rows, C, V] f32) + final hidden", a.lm_head),
        ("total temporaries", a.total),
        ("params + AdamW (above) + temporaries: the update step", state + a.total),
        (f"sampler bf16 policy copy, split over {copy_devices} devices", sampler),
        (kv_line, kv),
        ("sum: update step + sampler (one copy) + KV cache", state + a.total + sampler + kv),
    ]
    for name, value in terms:
        lines.append(f"{name:<60}{_gib(value):>16}")
    lines.append(
        "not included: XLA's own scratch and fragmentation, the collectives' buffers, "
        "the 2 extra sampler copies while a publish is in flight"
    )
    if cfg.remat != "full" or cfg.attention_impl.startswith("naive"):
        lines.append(
            "warning: the model assumes remat='full' and a flash kernel; with "
            f"remat={cfg.remat!r}, attention_impl={cfg.attention_impl!r} it undercounts "
            "(compile with --compile to see XLA's figure)"
        )
    return lines
