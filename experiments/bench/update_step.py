"""Benchmark of the SAO update step: tokens/s, achieved FLOP/s and MFU, state bytes.

    python -m experiments.bench.update_step                     # tiny 64 x 128, larger 4 x 512
    python -m experiments.bench.update_step --quick             # tiny 16 x 64, larger 4 x 128
    python -m experiments.bench.update_step --dtype bfloat16    # bf16 activations / matmuls

Two models side by side in one run: the embedded tiny MoE (configs/models/tiny.py) and a
larger one (LARGER below). For each, the jitted `Learner.update_step` with SAO's defaults
(configs/base.py: critic_first, K = 2 critic steps, DIS loss, frozen critic attention)
runs on a synthetic multi-turn batch: one compile-and-warm-up call, then the median of
--repeats calls, each ended by `jax.block_until_ready`. tokens/s counts all B x T
positions (padding included: the model computes on them).

Achieved FLOP/s = sao_jax.flops.update_step_flops / median seconds: matmul FLOPs of every
model pass of the step (critic forward for the targets, K critic forward + backward,
critic forward recompute, policy forward + backward), 2 x active params x tokens forward
and 3x that forward + backward, attention scores INCLUDED over the full T x T square (the
masked square the code computes; not causal-halved). MFU = achieved / the FLOP/s of a
large square matmul (`jnp.dot`, --peak-size) of the model's dtype timed the same way in
the same run. The analytic count is "useful" work; XLA's own cost analysis of one policy
forward is printed next to it: a ratio far above 1 means the backend executes more than
the useful FLOPs (on CPU, `ragged_dot` runs dense over all E experts).

Bytes: parameters and AdamW states of policy and critic from sao_jax.parallel.memory
(shapes only, one device), critic optimizer state with and without frozen attention,
checked against the live TrainState of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import config as config_lib
from sao_jax import flops
from sao_jax.configs import base
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.memory import memory_plan, parse_mesh
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import tree_bytes
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner, reduce_metrics

# The larger configuration: Qwen3-MoE layout at toy width (layer 0 dense, 1-3 MoE).
LARGER = dict(
    vocab_size=1024,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=2,
    mlp_only_layers=(0,),
)
# (name, model overrides on tiny, (B, T) full, (B, T) --quick)
MODELS = (
    ("tiny", {}, (64, 128), (16, 64)),
    ("larger", LARGER, (4, 512), (4, 128)),
)


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    cfg: ModelConfig
    batch: int
    length: int
    compile_s: float
    seconds: float  # median of the timed update steps
    times: list[float]
    step_flops: int
    passes: dict[str, int]
    unfrozen_flops: int  # the same step with a trainable critic attention
    xla_ratio: float  # XLA cost-analysis FLOPs / analytic FLOPs of one policy forward
    ragged_ratio: float  # ragged_dot time / dense dot time at this model's expert shapes
    skipped: float
    bytes: dict[str, int]
    live_ok: bool  # the live TrainState's bytes equal the memory plan's


def run_config(overrides: dict, batch: int, dtype: str, param_dtype: str):
    c = base.get_config()
    c.model.update(overrides)
    c.model.dtype = dtype
    c.model.param_dtype = param_dtype
    c.rl.batch_size = batch
    return config_lib.validate(c)


def median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def matmul_peak(dtype: str, n: int, inner: int, repeats: int) -> float | None:
    """FLOP/s of `inner` chained [n, n] @ [n, n] products in one jitted call (None if the
    backend cannot run this dtype)."""
    dt = jnp.dtype(dtype)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), dt)
    w = (jax.random.normal(kw, (n, n), jnp.float32) / np.sqrt(n)).astype(dt)  # keeps |x| ~ 1
    chain = jax.jit(lambda x, w: jax.lax.fori_loop(0, inner, lambda _, y: jnp.dot(y, w), x))
    try:
        jax.block_until_ready(chain(x, w))
    except (RuntimeError, TypeError, ValueError) as e:  # the backend refuses this dtype
        print(f"# matmul peak {dtype}: not supported here ({type(e).__name__})")
        return None
    sec, _ = median_seconds(lambda: jax.block_until_ready(chain(x, w)), repeats)
    return 2 * n**3 * inner / sec


def ragged_dot_ratio(rows: int, dim: int, hidden: int, experts: int, dtype, repeats: int):
    """Seconds of `ragged_dot` of [rows, D] over E equal groups of [D, F] weights, over
    seconds of one dense [rows, D] @ [D, F] (the same useful FLOPs): about 1 where the
    backend has a grouped matmul, about E where it runs every group over every row."""
    kx, kw = jax.random.split(jax.random.key(1))
    x_md = jax.random.normal(kx, (rows, dim), dtype)
    w_edf = jax.random.normal(kw, (experts, dim, hidden), dtype)
    sizes_e = jnp.full((experts,), rows // experts, jnp.int32).at[0].add(rows % experts)
    ragged = jax.jit(jax.lax.ragged_dot)
    dense = jax.jit(jnp.dot)
    jax.block_until_ready((ragged(x_md, w_edf, sizes_e), dense(x_md, w_edf[0])))
    sec_r, _ = median_seconds(lambda: jax.block_until_ready(ragged(x_md, w_edf, sizes_e)), repeats)
    sec_d, _ = median_seconds(lambda: jax.block_until_ready(dense(x_md, w_edf[0])), repeats)
    return sec_r / sec_d


def xla_forward_ratio(models, batch: dict, length: int) -> float:
    """XLA's cost-analysis FLOPs of one compiled policy forward over the analytic count."""
    cfg, pdef = models.cfg, models.policy_def
    b = batch["tokens"].shape[0]
    fwd = jax.jit(lambda p, tok, pos, seg: pdef.bind(p)(tok, pos, seg).out)
    args = (models.policy, batch["tokens"], batch["positions"], batch["segment_ids"])
    cost = fwd.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla = float((cost or {}).get("flops", float("nan")))
    return xla / flops.model_pass_flops(cfg, b, length, backward=False)


def state_bytes(cfg: ModelConfig, optim, state) -> tuple[dict[str, int], bool]:
    """Global bytes from the memory plan (one device) and whether the live state agrees."""
    plan = memory_plan(cfg, optim, parse_mesh("", 1))
    out = {
        "policy params": plan.policy_total.global_bytes,
        "critic params": plan.critic_total.global_bytes,
        "policy AdamW": plan.policy_opt.global_bytes,
        "critic AdamW, attention frozen": plan.critic_opt_frozen.global_bytes,
        "critic AdamW, all trainable": plan.critic_opt_full.global_bytes,
    }
    frozen = optim.critic.freeze_attention
    live_ok = (
        tree_bytes(state.policy) == out["policy params"]
        and tree_bytes(state.critic) == out["critic params"]
        and tree_bytes(state.policy_opt) == out["policy AdamW"]
        and tree_bytes(state.critic_opt)
        == out["critic AdamW, attention frozen" if frozen else "critic AdamW, all trainable"]
    )
    return out, live_ok


def bench_model(name, overrides, b, t, args) -> Result:
    config = run_config(overrides, b, args.dtype, args.param_dtype)
    cfg = ModelConfig.from_config(config.model)
    sharder = Sharder()
    models = init_models(cfg, sharder, seed=args.seed)
    learner = Learner(config, models.policy_def, models.critic_def, sharder)
    state = learner.new_state(models.policy, models.critic, seed=args.seed)
    host_batch = synthetic_batch(b, t, cfg.vocab_size, seed=args.seed)
    learner.check_batch(host_batch)
    batch = jax.device_put(host_batch)
    key = jax.random.key(args.seed)
    bytes_, live_ok = state_bytes(cfg, config.optim, state)

    holder = {"state": state, "metrics": None}

    def step():
        holder["state"], holder["metrics"] = learner.update_step(holder["state"], batch, key)
        jax.block_until_ready((holder["state"], holder["metrics"]))

    start = time.perf_counter()
    step()  # compile and warm up
    compile_s = time.perf_counter() - start
    seconds, times = median_seconds(step, args.repeats)
    skipped = reduce_metrics(holder["metrics"])["skipped"]
    rl = config.rl
    options = dict(
        order=rl.order,
        frozen_attention=learner.critic_frozen is not None,
        old_logp=learner.loss_entry.needs_old_logp,
    )
    passes = flops.update_step_passes(cfg, b, t, rl.k_critic, **options)
    unfrozen = flops.update_step_flops(
        cfg, b, t, rl.k_critic, **dict(options, frozen_attention=False)
    )
    ragged = float("nan")
    if cfg.num_experts:
        rows = b * t * cfg.num_experts_per_tok
        dims = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.compute_dtype)
        ragged = ragged_dot_ratio(rows, *dims, args.repeats)
    return Result(
        name=name,
        cfg=cfg,
        batch=b,
        length=t,
        compile_s=compile_s,
        seconds=seconds,
        times=times,
        step_flops=sum(passes.values()),
        passes=passes,
        unfrozen_flops=unfrozen,
        xla_ratio=xla_forward_ratio(models, batch, t),
        ragged_ratio=ragged,
        skipped=skipped,
        bytes=bytes_,
        live_ok=live_ok,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def print_result(r: Result, peak: float | None, peak_dtype: str) -> None:
    cfg = r.cfg
    tokens = r.batch * r.length
    achieved = r.step_flops / r.seconds
    print(
        f"\n## {r.name}: D={cfg.hidden_size} L={cfg.num_hidden_layers} "
        f"N/K/H={cfg.num_attention_heads}/{cfg.num_key_value_heads}/{cfg.head_dim} "
        f"E={cfg.num_experts} top-{cfg.num_experts_per_tok} V={cfg.vocab_size} "
        f"(moe layers {list(cfg.moe_layers)}), dtype {cfg.dtype}, B x T = {r.batch} x {r.length}"
    )
    print(
        f"params: policy {flops.total_params(cfg) / 1e6:.3f} M total, "
        f"{flops.active_params(cfg) / 1e6:.3f} M active, "
        f"{flops.matmul_params(cfg) / 1e6:.3f} M in matmuls per token; critic "
        f"{flops.total_params(cfg, 'critic') / 1e6:.3f} M total, "
        f"{flops.matmul_params(cfg, 'critic') / 1e6:.3f} M in matmuls"
    )
    scores = sum(
        flops.attention_score_flops(cfg, r.batch, r.length) * (3 if "bwd" in k else 1)
        for k in r.passes
    )
    print(f"analytic FLOPs per update step: {r.step_flops / 1e9:.2f} G, of which")
    for k, v in r.passes.items():
        print(f"  {k:<30} {v / 1e9:9.3f} G")
    print(f"  (attention scores, all passes  {scores / 1e9:9.3f} G = {scores / r.step_flops:.1%})")
    saved = r.unfrozen_flops - r.step_flops
    print(
        f"  (frozen critic attention skips {saved / 1e9:.3f} G of weight gradients = "
        f"{saved / r.unfrozen_flops:.1%} of the step with it trainable)"
    )
    spread = f"{min(r.times) * 1e3:.0f}-{max(r.times) * 1e3:.0f}"
    print(
        f"compile + first call {r.compile_s:.1f} s; update step median {r.seconds * 1e3:.1f} ms "
        f"(range {spread} ms over {len(r.times)}); skipped {r.skipped:.0f}"
    )
    if peak:
        print(
            f"tokens/s: {tokens / r.seconds:,.0f}; achieved {achieved / 1e9:.2f} GFLOP/s; "
            f"MFU {achieved / peak:.2%} of the {peak_dtype} matmul peak"
        )
    else:
        print(f"tokens/s: {tokens / r.seconds:,.0f}; achieved {achieved / 1e9:.2f} GFLOP/s")
    xla = f"XLA cost analysis / analytic FLOPs of one policy forward: {r.xla_ratio:.2f}"
    if peak:
        xla += f" (MFU on XLA-counted FLOPs ~ {achieved * r.xla_ratio / peak:.2%})"
    print(xla)
    if cfg.num_experts:
        print(
            f"ragged_dot [{r.batch * r.length * cfg.num_experts_per_tok}, {cfg.hidden_size}] over "
            f"{cfg.num_experts} experts of [{cfg.hidden_size}, {cfg.moe_intermediate_size}] "
            f"takes {r.ragged_ratio:.1f}x a dense dot of the same useful FLOPs"
        )
    b = r.bytes
    saved = b["critic AdamW, all trainable"] - b["critic AdamW, attention frozen"]
    print("| state (MiB) | critic attention frozen | all trainable |")
    print("|---|---|---|")
    print(f"| policy params | {_mib(b['policy params'])} | {_mib(b['policy params'])} |")
    print(f"| critic params | {_mib(b['critic params'])} | {_mib(b['critic params'])} |")
    print(f"| policy AdamW | {_mib(b['policy AdamW'])} | {_mib(b['policy AdamW'])} |")
    frozen, full = b["critic AdamW, attention frozen"], b["critic AdamW, all trainable"]
    print(f"| critic AdamW | {_mib(frozen)} | {_mib(full)} |")
    base_total = b["policy params"] + b["critic params"] + b["policy AdamW"]
    print(f"| total | {_mib(base_total + frozen)} | {_mib(base_total + full)} |")
    print(
        f"frozen attention saves {_mib(saved)} MiB ({saved / full:.1%} of the critic AdamW state, "
        f"{saved / (base_total + full):.1%} of the total); live TrainState matches the plan: "
        f"{'yes' if r.live_ok else 'NO'}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small batches, a minute or so")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=None, help="timed update steps (3)")
    p.add_argument("--models", nargs="*", default=[m[0] for m in MODELS], help="subset")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n x n matmul peak")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.repeats = args.repeats or 3
    unknown = set(args.models) - {m[0] for m in MODELS}
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)}; known {[m[0] for m in MODELS]}")

    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    n = args.peak_size or (2048 if on_cpu else 8192)
    inner = 1 if on_cpu else 10
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(
        f"# jax {jax.__version__} on {dev.platform} ({dev.device_kind}), "
        f"{jax.device_count()} device(s); matmul precision "
        f"{jax.config.jax_default_matmul_precision or 'default'}"
    )
    peaks = {dt: matmul_peak(dt, n, inner, args.repeats) for dt in ("float32", "bfloat16")}
    for dt, v in peaks.items():
        if v:
            print(f"# matmul peak {dt}: {v / 1e9:.1f} GFLOP/s ({n} x {n} @ {n} x {n}, x{inner})")
    for name, overrides, full, quick in MODELS:
        if name not in args.models:
            continue
        b, t = quick if args.quick else full
        result = bench_model(name, overrides, b, t, args)
        print_result(result, peaks[args.dtype], args.dtype)


if __name__ == "__main__":
    main()
