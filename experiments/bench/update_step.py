"""Benchmark of the SAO update step, before and after issue 16, side by side in one run.

    python -m experiments.bench.update_step                     # tiny 64 x 128, larger 4 x 512
    python -m experiments.bench.update_step --quick             # tiny 16 x 64, larger 4 x 128
    python -m experiments.bench.update_step --dtype bfloat16    # bf16 activations / matmuls
    python -m experiments.bench.update_step --models larger --attention naive blockwise:128
                                  # + one after form per attention impl[:block], same rounds
    python -m experiments.bench.update_step --models larger --two-token-dims
                                  # + the after form with two-token-dim einsums, same rounds

Two models: the embedded tiny MoE (configs/models/tiny.py) and a larger one (LARGER
below), each run with SAO's defaults (configs/base.py: critic_first, K = 2 critic steps,
DIS loss, frozen critic attention) on a synthetic multi-turn batch, in two forms:

  before  moe_impl 'dense' (every expert on every token), V0 by its own critic forward
          (`SeparateV0Learner` below), the naive attention in its input layout (which
          'auto' ran at these lengths) and the per-token products as two-token-dim einsums
          (`before_forms` below patches both in): the update step before issue 16;
  after   moe_impl 'auto' (on CPU: 'grouped', matmuls over tiles of each expert's group), V0
          from the first critic step's own forward, attention_impl 'auto', and the per-token
          products over one merged token dim (sao_jax/models/layers.py `token_einsum`).

`--two-token-dims` adds the after form with the per-token products as two-token-dim
einsums (`before_forms(two_token_dims=True)`): the after step before `token_einsum`.

`--attention IMPL[:BLOCK] ...` adds one more after form per entry, with that
`model.attention_impl` (and `model.attention_block`), timed in the same rounds; IMPL may
also be `naive_literal` (the naive attention in its input layout, `before_forms`): e.g.
`naive_literal naive` is the heads-major attention's before / after within one run.
Useful FLOPs count the attention scores of the causal lower triangle only (the work a
causal mask needs); executed FLOPs count the whole square for the naive forms and the
blocks on or below the diagonal for the blockwise kernel.

The machine may be shared, so everything is timed in INTERLEAVED rounds: each round
runs the fp32 (or --dtype) matmul peak (a chained n x n @ n x n `jnp.dot`), each matmul
shape of the model's forward jitted alone (the MFU ceiling at these widths:
update_parts.shape_programs), the before step, the after step and, unless --no-passes,
each pass of both forms jitted on its own. Every MFU is computed per round against that
round's peak, then the median and range over rounds are printed, with the load average
before and after.

FLOPs (sao_jax/plan/flops.py): USEFUL = the analytic matmul work of every pass (2 x active
params x tokens forward, 3x that forward + backward, attention scores over the causal
lower triangle) over every position of the padded batch, except that the routed experts
count for real (non-padding) tokens only; EXECUTED = the same with the attention the
kernel computes (naive: the whole T x T square; blockwise: its blocks on or below the
diagonal) and the expert rows an implementation multiplies (dense: E / k x every
position's; grouped: the rows of the tiles the real tokens' routing needs, measured per
MoE layer on the policy's routing of this batch; ragged on XLA:CPU: E x every
position's). Shares: of the useful FLOPs per pass, and of the time of the separately
jitted passes (their sum is printed against the whole step: XLA fuses across passes
inside the step, so the two need not agree).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from sao_jax.experiments.bench import update_parts as parts

from sao_jax import config as config_lib
from sao_jax.configs import base
from sao_jax.models import attention as attention_lib
from sao_jax.models import attention_backends, layers, transformer
from sao_jax.models.config import ATTENTION_IMPLS, ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.models.moe.dispatch import resolve_impl
from sao_jax.parallel.mesh import Sharder
from sao_jax.plan import flops
from sao_jax.rl.optim import critic_trainable
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner

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
FORMS = {
    "before": dict(
        moe_impl="dense",
        separate_v0=True,
        attention_impl="naive",
        literal_attention=True,
        flat_tokens=False,
    ),
    "after": dict(moe_impl="auto"),
}
# `--two-token-dims`: the after step with the per-token products as two-token-dim einsums
# (`before_forms(two_token_dims=True)`), i.e. the after step before they were merged.
TWO_TOKEN_DIMS = {"after, two-token-dim einsums": dict(moe_impl="auto", flat_tokens=False)}


def attention_forms(entries: list[str]) -> dict[str, dict]:
    """`--attention` entries 'impl' or 'impl:block' -> extra after forms by name."""
    forms, impls = {}, (*ATTENTION_IMPLS, "naive_literal")
    for entry in entries:
        impl, _, block = entry.partition(":")
        if impl not in impls or (block and not block.isdigit()):
            raise SystemExit(f"--attention: {entry!r} is not IMPL[:BLOCK], IMPL in {impls}")
        extra = {"attention_block": int(block)} if block else {}
        if impl == "naive_literal":
            impl, extra = "naive", {**extra, "literal_attention": True}
        forms[f"after, attention {entry}"] = dict(moe_impl="auto", attention_impl=impl, **extra)
    return forms


@contextlib.contextmanager
def before_forms(*, literal_attention: bool = False, two_token_dims: bool = False):
    """Functions traced inside run forms the library no longer has: the naive attention
    in its input layout (`grouped_attention_literal`) and per-token products as plain
    two-token-dim einsums (the same values; the layouts before issue 16)."""
    patches = []
    if literal_attention:
        patches.append(
            (attention_lib.NAIVE_IMPLS, "naive", attention_lib.grouped_attention_literal)
        )
    saved = [(table, key, table[key]) for table, key, _ in patches]
    modules = (layers, attention_lib, transformer) if two_token_dims else ()
    saved_einsums = [(m, m.token_einsum) for m in modules]
    try:
        for table, key, value in patches:
            table[key] = value
        for m in modules:
            m.token_einsum = jnp.einsum
        yield
    finally:
        for table, key, value in saved:
            table[key] = value
        for m, fn in saved_einsums:
            m.token_einsum = fn


class SeparateV0Learner(Learner):
    """The before form's V0: its own critic forward before the K critic steps."""

    def initial_values(self, critic, batch):
        return self.critic_values(critic, batch)


@dataclasses.dataclass
class Form:
    """One form of the update step, compiled, with its FLOP counts and timings."""

    name: str
    moe_impl: str  # as resolved on this backend
    passes_useful: dict[str, int]
    expert_factor: float
    executed: int
    compile_s: float
    step: object  # zero-argument callable: one update step, blocked
    pass_fns: dict[str, object]
    times: list[float] = dataclasses.field(default_factory=list)
    pass_times: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    attention: str = ""  # the training attention as resolved at this length, with its block


def run_config(overrides: dict, batch: int, args, moe_impl: str, **model):
    c = base.get_config()
    c.model.update(overrides)
    c.model.update(dtype=args.dtype, param_dtype=args.param_dtype, moe_impl=moe_impl, **model)
    c.rl.batch_size = batch
    return config_lib.validate(c)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_peak_fn(dtype: str, n: int, inner: int):
    """(callable, flops) of `inner` chained [n, n] @ [n, n] products in one jitted call."""
    dt = jnp.dtype(dtype)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (n, n), dt)
    w = (jax.random.normal(kw, (n, n), jnp.float32) / np.sqrt(n)).astype(dt)  # keeps |x| ~ 1
    chain = jax.jit(lambda x, w: jax.lax.fori_loop(0, inner, lambda _, y: jnp.dot(y, w), x))
    jax.block_until_ready(chain(x, w))
    return (lambda: jax.block_until_ready(chain(x, w))), 2 * n**3 * inner


def build_form(name, spec, overrides, b, t, args, host_batch, routing) -> Form:
    # Everything of the form is traced (first called) here, so the patches hold for it.
    before = dict(
        literal_attention=spec.get("literal_attention", False),
        two_token_dims=not spec.get("flat_tokens", True),
    )
    with before_forms(**before):
        return _build_form(name, spec, overrides, b, t, args, host_batch, routing)


def _build_form(name, spec, overrides, b, t, args, host_batch, routing) -> Form:
    attn = {k: spec[k] for k in ("attention_impl", "attention_block") if k in spec}
    config = run_config(overrides, b, args, spec["moe_impl"], **attn)
    cfg = ModelConfig.from_config(config.model)
    sharder = Sharder()
    separate = spec.get("separate_v0", False)
    models = init_models(cfg, sharder, seed=args.seed)  # same params in both forms
    learner = (SeparateV0Learner if separate else Learner)(
        config.rl, config.optim, models.policy_def, models.critic_def, sharder
    )
    holder = {"state": learner.new_state(models.policy, models.critic, seed=args.seed)}
    batch = jax.device_put(host_batch)
    key = jax.random.key(args.seed)

    def step():
        holder["state"], metrics = learner.update_step(holder["state"], batch, key)
        jax.block_until_ready((holder["state"], metrics))

    compile_s = seconds(step)
    if name == "after":
        print(parts.state_summary(cfg, config.optim, holder["state"]))
    rl = config.rl
    useful_factor, factor = parts.expert_factors(resolve_impl(cfg.moe_impl), cfg, routing)
    kw = dict(
        order=rl.order,
        critic_trainable=critic_trainable(config.optim.critic),
        old_logp=learner.loss_entry.needs_old_logp,
        separate_v0=separate,
    )
    attn_impl, block = attention_backends.resolve(
        cfg.attention_impl, cfg.dtype, length=t, block=cfg.attention_block
    )
    naive = attn_impl.startswith("naive")
    # Useful attention: the causal lower triangle. Executed: the naive forms' whole masked
    # square, the blockwise kernel's blocks on or below the diagonal.
    useful = flops.update_step_passes(
        cfg, b, t, rl.k_critic, expert_factor=useful_factor, causal=True, **kw
    )
    executed = flops.update_step_flops(
        cfg, b, t, rl.k_critic, expert_factor=factor, attention_block=None if naive else block, **kw
    )
    factor /= useful_factor  # MoE rows computed per useful row
    pass_fns = {} if args.no_passes else parts.pass_programs(learner, holder, batch)
    attention = attn_impl if naive else f"{attn_impl}:{block}"
    attention = "naive_literal" if spec.get("literal_attention") else attention
    return Form(
        name,
        resolve_impl(cfg.moe_impl),
        useful,
        factor,
        executed,
        compile_s,
        step,
        pass_fns,
        attention=attention,
    )


def bench_model(name, overrides, b, t, args, peak_fn):
    config = run_config(overrides, b, args, "auto")
    cfg = ModelConfig.from_config(config.model)
    models = init_models(cfg, Sharder(), seed=args.seed)
    host_batch = synthetic_batch(b, t, cfg.vocab_size, seed=args.seed)
    routing = parts.policy_routing(models, host_batch)
    specs = {**FORMS, **(TWO_TOKEN_DIMS if args.two_token_dims else {})}
    specs.update(attention_forms(args.attention))
    forms = [
        build_form(k, spec, overrides, b, t, args, host_batch, routing) for k, spec in specs.items()
    ]
    moe = parts.moe_kernel_times(cfg, b * t, args.rounds) if cfg.num_experts else {}
    shapes = parts.shape_programs(cfg, b, t)
    shape_times = {name: [] for name in shapes}
    load0 = os.getloadavg()[0]
    peaks = []
    for _ in range(args.rounds):
        peaks.append(peak_fn[1] / seconds(peak_fn[0]))
        for name, (fn, _, _) in shapes.items():
            shape_times[name].append(seconds(fn))
        for f in forms:
            f.times.append(seconds(f.step))
            for k, fn in f.pass_fns.items():
                f.pass_times.setdefault(k, []).append(seconds(fn))
    load1 = os.getloadavg()[0]
    return cfg, forms, peaks, (load0, load1), routing, moe, (shapes, shape_times)


def _med_range(xs, fmt="{:.1%}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def print_model(name, b, t, cfg, forms, peaks, load, routing, moe, shapes, args) -> None:
    print(
        f"\n## {name}: D={cfg.hidden_size} L={cfg.num_hidden_layers} "
        f"N/K/H={cfg.num_attention_heads}/{cfg.num_key_value_heads}/{cfg.head_dim} "
        f"E={cfg.num_experts} top-{cfg.num_experts_per_tok} V={cfg.vocab_size} "
        f"(moe layers {list(cfg.moe_layers)}), dtype {cfg.dtype}, B x T = {b} x {t}; "
        f"load average {load[0]:.1f} -> {load[1]:.1f}"
    )
    print(
        f"params: policy {flops.total_params(cfg) / 1e6:.3f} M total, "
        f"{flops.active_params(cfg) / 1e6:.3f} M active; critic "
        f"{flops.total_params(cfg, 'critic') / 1e6:.3f} M"
    )
    if cfg.num_experts:
        print(parts.routing_summary(cfg, routing))
        print(parts.moe_kernel_summary(moe))
    peak_s = _med_range([p / 1e9 for p in peaks], "{:.1f}")
    print(f"{args.dtype} matmul peak per round: {peak_s} GFLOP/s over {len(peaks)} rounds")
    print("this model's shapes, each jitted alone, timed in the same rounds:")
    print(parts.shape_table(*shapes, peaks))
    scores = flops.attention_score_flops(cfg, b, t)
    for f in forms:
        useful = sum(f.passes_useful.values())
        mfu_u = [useful / s / p for s, p in zip(f.times, peaks)]
        mfu_x = [f.executed / s / p for s, p in zip(f.times, peaks)]
        n_scores = sum(3 if "fwd+bwd" in k else 1 for k in f.passes_useful)
        v0 = "its own forward" if "critic forward (targets)" in f.passes_useful else "fused"
        print(f"\n### {f.name}: moe_impl {f.moe_impl}, V0 {v0}, attention {f.attention}")
        print(
            f"  compile + first call {f.compile_s:.1f} s; step {_med_range(f.times, '{:.3f}')} s; "
            f"tokens/s {b * t / statistics.median(f.times):,.0f}"
        )
        print(
            f"  FLOPs per step: useful {useful / 1e9:.2f} G, executed {f.executed / 1e9:.2f} G "
            f"(MoE rows computed per useful row: {f.expert_factor:.2f}); attention scores "
            f"{n_scores * scores / useful:.0%} of useful"
        )
        print(f"  useful-FLOP MFU   {_med_range(mfu_u)}")
        print(f"  executed-FLOP MFU {_med_range(mfu_x)}")
        print(parts.pass_table(f.passes_useful, f.pass_times, statistics.median(f.times)))
    before, after = forms[:2]
    speed = [a / c for a, c in zip(before.times, after.times)]
    print(f"\nspeedup after / before (per round): {_med_range(speed, '{:.2f}x')}")
    for f in forms[2:]:
        vs_before = [a / c for a, c in zip(before.times, f.times)]
        vs_after = [a / c for a, c in zip(after.times, f.times)]
        print(
            f"speedup {f.name}: / before {_med_range(vs_before, '{:.2f}x')}, "
            f"/ after {_med_range(vs_after, '{:.2f}x')}"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small batches, a few minutes")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--models", nargs="*", default=[m[0] for m in MODELS], help="subset")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n x n matmul peak")
    p.add_argument("--no-passes", action="store_true", help="skip the per-pass programs")
    p.add_argument(
        "--attention",
        nargs="*",
        default=[],
        metavar="IMPL[:BLOCK]",
        help="extra after forms with this model.attention_impl (and attention_block)",
    )
    p.add_argument(
        "--two-token-dims",
        action="store_true",
        help="also the after step with two-token-dim einsums (before models.layers.token_einsum)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = set(args.models) - {m[0] for m in MODELS}
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)}; known {[m[0] for m in MODELS]}")
    dev = jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    n = args.peak_size or (2048 if on_cpu else 8192)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(
        f"# jax {jax.__version__} on {dev.platform} ({dev.device_kind}), "
        f"{jax.device_count()} device(s), {os.cpu_count()} CPUs; matmul precision "
        f"{jax.config.jax_default_matmul_precision or 'default'}; peak: {n} x {n} @ {n} x {n}"
    )
    peak_fn = matmul_peak_fn(args.dtype, n, 1 if on_cpu else 10)
    for name, overrides, full, quick in MODELS:
        if name in args.models:
            b, t = quick if args.quick else full
            print_model(name, b, t, *bench_model(name, overrides, b, t, args, peak_fn), args)


if __name__ == "__main__":
    main()
