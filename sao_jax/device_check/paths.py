"""Each accelerator path against the path the test suite verified on CPU, same inputs.

  moe_paths       `ragged_dot` grouped GEMMs (dispatch.local_moe, what 'auto' runs on
                  GPU/TPU) against the tiled grouped matmuls (moe/grouped.py: checked
                  against the dense reference in tests/test_moe_grouped.py), forward and
                  the gradients of x and the three expert weights, float32 and bf16; and
                  the time of ragged / grouped / dense forward + backward in bf16.
  attention_paths the fused kernel of the backend (cuDNN flash on GPU, Pallas splash
                  compiled on TPU; on CPU the cuDNN call through XLA and splash in Pallas
                  interpret mode) against the blockwise kernel (checked against the naive
                  one in tests/test_attention.py), values and q/k/v gradients, on padded
                  rows (the layout the fused kernels take), and their times.
  update_dtype    one SAO update step (the run config's RL and optimizer settings: K
                  critic steps, frozen-attention critic, DIS) computed in bf16 (as it runs,
                  the program update_mfu times) against the same step in float32 at
                  'highest' matmul precision, from the same params and batch: the metrics
                  that are O(1) by construction (losses, gradient norms, entropy, values).

Errors are max |path - reference| / max |reference| (`rel_error`; per leaf for
gradients, the worst one counted). Tolerances (`TOLERANCE`), per dtype: float32 at
'highest' matmul precision 1e-4 (the paths sum in different orders: <= 1e-6 measured on
CPU); bf16 5e-2 (an 8-bit mantissa: 3.9e-3 per rounding, and the paths round operands and
probabilities at different points; 1.2e-2 measured on CPU for the MoE gradients; a wrong
mask, scale or routing gives errors of order 1); the bf16 update step against float32 5e-2
of each metric (bf16 activations through every layer). Splash runs in bf16 only on TPU
(the recipe's dtype; inside a Mosaic kernel float32 matmuls need not honour 'highest').
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.device_check.record import Phase, timed
from sao_jax.device_check.shapes import Shapes
from sao_jax.metrics import pair_means
from sao_jax.models import attention_backends as backends
from sao_jax.models.attention_kernels import blockwise_attention
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import critic_def, init_models, policy_def
from sao_jax.models.moe.dispatch import dense_local_moe, local_moe
from sao_jax.models.moe.grouped import grouped_local_moe
from sao_jax.models.moe.router import route
from sao_jax.parallel import platform
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner
from sao_jax.schema import ConfigDict

TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "update_bf16_vs_fp32": 5e-2}
# Update-step metrics compared in bf16 against float32 (each O(1), never ~0 by design).
UPDATE_METRICS = (
    "critic_first/loss",
    "critic/loss",
    "critic/grad_norm",
    "policy/grad_norm",
    "policy/entropy",
    "policy/logp_gap",  # the policy's log-probs, the quantity DIS ratios are built on
)


def rel_error(got, want) -> float:
    """max over leaves of max |got - want| / max |want| (float32 arithmetic)."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        worst = max(worst, float(np.max(np.abs(g - w))) / scale)
    return worst


def _normal(key, shape, scale=1.0):
    return jax.random.normal(key, shape, jnp.float32) * scale


def _fwd_bwd(fn, ct):
    """jit(args -> (fn(*args), d sum(fn(*args) * ct) / d args))."""

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) * ct)

    return jax.jit(
        lambda *args: (fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args))
    )


def moe_paths(p: Phase, s: Shapes) -> None:
    n, d, f, e, k = s.moe
    kx, kr, kg, ku, kd, kc = jax.random.split(jax.random.key(0), 6)
    x = _normal(kx, (n, d))
    routing = route(_normal(kr, (n, e)), k, norm_topk=True)
    w = [_normal(kg, (e, d, f), d**-0.5), _normal(ku, (e, d, f), d**-0.5)]
    w.append(_normal(kd, (e, f, d), f**-0.5))
    ct = _normal(kc, (n, d))
    impls = {
        "ragged": local_moe,
        "grouped": functools.partial(grouped_local_moe, num_experts=e),
        "dense": dense_local_moe,
    }
    programs = {
        name: _fwd_bwd(
            lambda x, wg, wu, wd, fn=fn: fn(
                x, routing.experts_nk, routing.weights_nk, wg, wu, wd, 0
            ),
            ct,
        )
        for name, fn in impls.items()
    }
    for dtype in ("float32", "bfloat16"):
        args = [a.astype(dtype) for a in (x, *w)]
        with jax.default_matmul_precision("highest"):
            want = programs["grouped"](*args)
            got = programs["ragged"](*args)
        p.check(f"ragged vs grouped {dtype} out", rel_error(got[0], want[0]), TOLERANCE[dtype])
        p.check(f"ragged vs grouped {dtype} grads", rel_error(got[1], want[1]), TOLERANCE[dtype])
    args = [a.astype(jnp.bfloat16) for a in (x, *w)]
    for name, program in programs.items():
        if p.time_left() <= 0:
            p.skip(f"timing {name}")
            continue
        r = timed(lambda program=program: program(*args), s.timed_repeats, p)
        p.results[f"{name}_bf16_fwd_bwd_ms"] = 1e3 * r["median_s"]


def fused_attention_paths(backend: str, block: int) -> dict[str, tuple]:
    """name -> (kernel(q, k, v, pos, seg), dtypes) of the backend's fused attention."""
    cudnn = functools.partial(backends.cudnn_attention, block=block)
    splash = functools.partial(backends.splash_attention, block=block)
    if backend == "gpu":
        return {"cudnn": (cudnn, ("bfloat16",))}
    if backend == "tpu":
        return {"splash": (functools.partial(splash, interpret=False), ("bfloat16",))}
    return {
        "cudnn_through_xla": (functools.partial(cudnn, implementation="xla"), ("float32",)),
        "splash_interpret": (functools.partial(splash, interpret=True), ("float32",)),
    }


def attention_paths(p: Phase, s: Shapes) -> None:
    b, t, n, kh, h, block = s.attention
    kq, kk, kv, kc = jax.random.split(jax.random.key(1), 4)
    q, k, v = _normal(kq, (b, t, n, h)), _normal(kk, (b, t, kh, h)), _normal(kv, (b, t, kh, h))
    lengths = np.array([t - (i * t) // (2 * b) for i in range(b)])  # padded prefix rows
    seg = jnp.asarray(np.arange(t)[None, :] < lengths[:, None], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ct = _normal(kc, (b, t, n, h)) * seg[:, :, None, None]  # no cotangent on padding
    real = np.asarray(seg, bool)[:, :, None, None]

    def ref_kernel(q, k, v):
        return blockwise_attention(q, k, v, pos, pos, seg, seg, block=block)

    reference = _fwd_bwd(ref_kernel, ct)
    timed_dtype = None
    for name, (kernel, dtypes) in fused_attention_paths(platform.backend(), block).items():
        program = _fwd_bwd(lambda q, k, v, kernel=kernel: kernel(q, k, v, pos, seg), ct)
        for dtype in dtypes:
            args = [a.astype(dtype) for a in (q, k, v)]
            with jax.default_matmul_precision("highest"):
                want, got = reference(*args), program(*args)
            out_err = rel_error(np.where(real, got[0], 0), np.where(real, want[0], 0))
            p.check(f"{name} vs blockwise {dtype} out", out_err, TOLERANCE[dtype])
            p.check(
                f"{name} vs blockwise {dtype} grads", rel_error(got[1], want[1]), TOLERANCE[dtype]
            )
        timed_dtype = dtypes[0]
        args = [a.astype(timed_dtype) for a in (q, k, v)]
        if p.time_left() <= 0:
            p.skip(f"timing {name}")
            continue
        r = timed(lambda program=program, args=args: program(*args), s.timed_repeats, p)
        p.results[f"{name}_{timed_dtype}_fwd_bwd_ms"] = 1e3 * r["median_s"]
    if timed_dtype is not None and p.time_left() > 0:
        args = [a.astype(timed_dtype) for a in (q, k, v)]
        r = timed(lambda: reference(*args), s.timed_repeats, p)
        p.results[f"blockwise_{timed_dtype}_fwd_bwd_ms"] = 1e3 * r["median_s"]


def run_config(config: ConfigDict, cfg: ModelConfig, rows: int) -> ConfigDict:
    """`config` (a run config: its rl and optim sections are used) with model `cfg` on one
    device, `rows` trajectories per update in one microbatch."""
    c = config.copy_and_resolve_references()
    c.model = ConfigDict(dataclasses.asdict(cfg))
    c.rl.batch_size = rows
    c.rl.microbatches = 1
    c.rl.minibatches = 1
    c.mesh.shape = (1, 1, 1, 1)
    return c


class Learners:
    """One `Learner` per (model config, rows) for the run config's settings, so that a
    phase reuses the update step another phase compiled (in smoke mode update_mfu runs
    update_dtype's bf16 program)."""

    def __init__(self, config: ConfigDict):
        self.config = config
        self._made: dict[tuple[ModelConfig, int], Learner] = {}

    def get(self, cfg: ModelConfig, rows: int) -> Learner:
        if (cfg, rows) not in self._made:
            run = run_config(self.config, cfg, rows)
            pdef, cdef = policy_def(cfg, Sharder()), critic_def(cfg, Sharder())
            self._made[cfg, rows] = Learner(run.rl, run.optim, pdef, cdef, Sharder())
        return self._made[cfg, rows]


def update_dtype(p: Phase, s: Shapes, learners: Learners) -> None:
    rows, length = s.dtype_batch
    base = s.dtype_model
    models = init_models(dataclasses.replace(base, dtype="float32"), Sharder(), seed=0)
    batch = jax.device_put(synthetic_batch(rows, length, base.vocab_size, seed=0))
    key = jax.random.key(0)
    out = {}
    for dtype in ("float32", "bfloat16"):
        learner = learners.get(dataclasses.replace(base, dtype=dtype), rows)
        state = learner.new_state(models.policy, models.critic, seed=0)
        # float32 at 'highest' (the reference); bf16 as it runs (update_mfu's program).
        highest = dtype == "float32"
        with jax.default_matmul_precision("highest") if highest else contextlib.nullcontext():
            _, metrics = learner.update_step(state, batch, key)
        out[dtype] = pair_means(metrics)
    for name in UPDATE_METRICS:
        want, got = out["float32"].get(name), out["bfloat16"].get(name)
        if want is None:
            p.note(f"metric {name} not reported")
            continue
        p.results[f"{name} float32"] = want
        err = abs(got - want) / max(abs(want), 1e-30)
        p.check(f"bf16 vs fp32 {name}", err, TOLERANCE["update_bf16_vs_fp32"])
