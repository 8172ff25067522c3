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

  temp = grads + scan copies + saved layer inputs + one layer's working set + LM head

  grads           policy gradients in param dtype (x2 with microbatches: accumulator +
                  the current microbatch's)
  scan copies     the compute-dtype stack of the layer parameters, and its gradient
  saved inputs    L x tokens x D x compute bytes (remat='full': each layer's input)
  layer working   one layer recomputed and differentiated: tokens x W bytes, W from the
                  layer's shapes (attention projections, MoE dispatch buffers)
  LM head         a chunk of logits [rows, C, V] float32, a few copies

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
import numpy as np
from jax.sharding import NamedSharding

from sao_jax.models.config import ModelConfig
from sao_jax.models.moe.dispatch import resolve_impl
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef
from sao_jax.rl.synthetic import synthetic_batch

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
    """ShapeDtypeStructs of an update-step batch [rows, length] (the synthetic layout)."""
    like = synthetic_batch(2, 16, cfg.vocab_size)
    out = {}
    for name, x in like.items():
        shape = (rows, length, *x.shape[2:]) if x.ndim >= 2 else (rows,)
        out[name] = jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
    if routing:
        shape = (rows, length, len(cfg.moe_layers), cfg.num_experts_per_tok)
        out["forced_experts"] = jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding)
    return out


def compile_update_step(learner, cfg: ModelConfig, rows: int, length: int):
    """`learner.update_step` compiled for a [rows, length] batch, from shapes only."""
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
    return learner.update_step.lower(state, batch, key).compile()


def buffer_shapes(compiled) -> set[tuple[str, tuple[int, ...]]]:
    """Every (dtype, shape) that appears in the compiled program's HLO text."""
    out = set()
    for dtype, dims in _SHAPE.findall(compiled.as_text()):
        out.add((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


# ----------------------------------------------------------------------------- analytic


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def layer_working_bytes_per_token(cfg: ModelConfig, moe_impl: str, e_local: int) -> int:
    """Bytes per token of one decoder layer's recomputed forward + backward buffers.

    Counted from the layer's shapes (c = compute bytes, f = 4): the normed input, q, k, v
    before and after norm/RoPE and their gradients (~3 copies of (N + 2K) H), the
    attention output and its log-sum-exp, the residual stream and its gradient (~6 D),
    RoPE tables, and the MLP: dense SwiGLU 4 F; MoE router logits and probabilities
    (2 E float32) plus the dispatch buffers, per routed slot (k of them) the gathered
    token, gate, up and hidden (D + 3 F) and their gradients, or for the dense-over-
    experts CPU path (moe_impl='dense') 4 x E_local x F per token.
    """
    c, f = _itemsize(cfg.compute_dtype), 4
    n, k, h, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    attn = 3 * (n + 2 * k) * h * c + n * h * c + n * f + h * f
    resid = 6 * d * c
    if cfg.num_experts == 0:
        mlp = 4 * cfg.intermediate_size * c
    else:
        e, fm, topk = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        router = 2 * e * f + 2 * topk * f
        if moe_impl == "dense":
            mlp = router + 4 * e_local * fm * c + e_local * f
        else:
            mlp = router + 2 * topk * (d + 3 * fm) * c + topk * d * f
    return attn + resid + mlp


@dataclasses.dataclass(frozen=True)
class AnalyticStep:
    """Predicted temporaries of the policy step, per device, term by term (bytes)."""

    grads: int
    scan_copies: int
    saved_inputs: int
    layer_working: int
    lm_head: int
    attention_blocks: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


def analytic_step_bytes(
    cfg: ModelConfig,
    policy_def: ModelDef,
    sharder: Sharder,
    *,
    rows_per_device: int,
    length: int,
    microbatches: int = 1,
    moe_impl: str | None = None,
) -> AnalyticStep:
    """The analytic model of the module docstring (remat='full', flash attention)."""
    shapes = policy_def.shapes()
    shardings = policy_def.shardings(sharder)
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    sh_leaves = (
        jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        if shardings is not None
        else [None] * len(leaves)
    )
    c = _itemsize(cfg.compute_dtype)
    param_bytes = layer_elems = 0
    for (path, s), sh in zip(leaves, sh_leaves):
        n = math.prod(sh.shard_shape(s.shape) if sh is not None else s.shape)
        param_bytes += n * s.dtype.itemsize
        if ".layers." in "." + ".".join(str(getattr(p, "key", p)) for p in path) + ".":
            layer_elems += n
    grads = param_bytes * (2 if microbatches > 1 else 1)
    scan_copies = 2 * layer_elems * c if cfg.scan_layers else 0
    tokens = rows_per_device * length
    saved = cfg.num_hidden_layers * tokens * cfg.hidden_size * c
    e_local = cfg.num_experts // max(sharder.axis_size("expert"), 1) if cfg.num_experts else 0
    impl = resolve_impl(moe_impl or cfg.moe_impl)
    working = tokens * layer_working_bytes_per_token(cfg, impl, e_local)
    chunk = min(cfg.logits_chunk or length, length)
    vocab_local = cfg.vocab_size // max(sharder.axis_size("act_vocab"), 1)
    lm_head = 3 * rows_per_device * chunk * vocab_local * 4 + tokens * cfg.hidden_size * 4
    blk = min(cfg.attention_block, length)
    attention_blocks = 4 * rows_per_device * cfg.num_attention_heads * blk * blk * 4
    return AnalyticStep(grads, scan_copies, saved, working, lm_head, attention_blocks)
