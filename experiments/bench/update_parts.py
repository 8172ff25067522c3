"""Pieces of the update-step benchmark (experiments/bench/update_step.py): the MoE routing
and executed-row factors, the per-pass programs and their table, the MoE kernel timings,
and the state bytes."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.moe import grouped
from sao_jax.models.moe.dispatch import IMPLS, moe_dispatch
from sao_jax.models.moe.router import route
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import tree_bytes
from sao_jax.plan.memory import memory_plan, parse_mesh
from sao_jax.rl import passes as P

# Analytic pass name (sao_jax.plan.flops.update_step_passes) -> row of the pass table.
_ROW_OF = {
    "critic forward (targets)": "critic V0 forward",
    "critic forward (recompute)": "critic V1 forward",
    "policy step (fwd+bwd)": "policy fwd+bwd",
    "policy forward (old logp)": "policy old-logp forward",
}


def _row(pass_name: str) -> str:
    return "critic K steps (fwd+bwd)" if pass_name.startswith("critic step") else _ROW_OF[pass_name]


def policy_routing(models, host_batch) -> tuple[np.ndarray, np.ndarray]:
    """([B, T, L_moe, k] experts the policy chooses on the batch, [B, T] real tokens)."""
    out = jax.jit(lambda p, tok, pos, seg: models.policy_def.bind(p)(tok, pos, seg))(
        models.policy, host_batch["tokens"], host_batch["positions"], host_batch["segment_ids"]
    )
    return np.asarray(out.experts_btlk), np.asarray(host_batch["segment_ids"] != 0)


def layer_overheads(cfg, routing) -> list[dict[str, float]]:
    """grouped.padding_overhead of each MoE layer's routing (real tokens only)."""
    experts, real = routing
    k = experts.shape[-1]
    return [
        grouped.padding_overhead(
            experts[:, :, i].reshape(-1, k), cfg.num_experts, token_mask_n=real.reshape(-1)
        )
        for i in range(experts.shape[2])
    ]


def expert_factors(impl: str, cfg, routing) -> tuple[float, float]:
    """(useful, executed) expert rows per position row (B T k), averaged over MoE layers.

    Useful: the rows of real tokens only (padding is routed but is no useful work).
    Executed: `dense` multiplies E / k rows per position row (padding included); `grouped`
    its tiles' rows (sum_e R ceil(group_e / R)) per real row; `ragged` E on XLA:CPU
    (every row against every group) and the real rows on accelerators (grouped GEMM).
    """
    real = float(np.mean(routing[1]))
    if not cfg.num_experts:
        return 1.0, 1.0
    if impl == "dense":
        return real, cfg.num_experts / cfg.num_experts_per_tok
    if impl == "ragged":
        return real, (float(cfg.num_experts) if jax.default_backend() == "cpu" else real)
    per_real = statistics.mean(o["executed_over_useful"] for o in layer_overheads(cfg, routing))
    return real, real * per_real


def routing_summary(cfg, routing) -> str:
    parts = [
        f"layer {layer}: largest group {o['largest_over_balanced']:.2f}x balanced, "
        f"{o['tiles']:.0f} tiles of {o['rows']:.0f}, rows {o['executed_over_useful']:.2f}x useful"
        for layer, o in zip(cfg.moe_layers, layer_overheads(cfg, routing))
    ]
    real = float(np.mean(routing[1]))
    return (
        f"real (non-padding) tokens {real:.0%}; grouped MoE on their routing (policy at "
        "init): " + "; ".join(parts)
    )


def moe_kernel_times(cfg, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of one MoE dispatch forward + backward (x, router, expert weights) at this
    model's shapes for every implementation, interleaved; routing from random logits."""
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    k = cfg.num_experts_per_tok
    keys = jax.random.split(jax.random.key(1), 5)
    dt = cfg.compute_dtype
    x = jax.random.normal(keys[0], (tokens, d), dt)
    logits = jax.random.normal(keys[1], (tokens, e)) * 0.1
    w = [
        (jax.random.normal(kk, s) / np.sqrt(s[1])).astype(dt)
        for kk, s in ((keys[2], (e, d, f)), (keys[3], (e, d, f)), (keys[4], (e, f, d)))
    ]

    def program(impl):
        def loss(x, logits, *w):
            r = route(logits, k, norm_topk=True)
            y = moe_dispatch(x, r.experts_nk, r.weights_nk.astype(dt), *w, Sharder(), impl)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        jax.block_until_ready(fn(x, logits, *w))
        return lambda: jax.block_until_ready(fn(x, logits, *w))

    fns = {impl: program(impl) for impl in IMPLS}
    times = {impl: [] for impl in IMPLS}
    for _ in range(rounds):
        for impl, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[impl].append(time.perf_counter() - start)
    return times


def moe_kernel_summary(times: dict[str, list[float]]) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(med, key=med.get)
    cells = ", ".join(f"{k} {v * 1e3:.1f} ms ({v / med[best]:.1f}x)" for k, v in med.items())
    return f"one MoE block fwd+bwd, median: {cells}; fastest here: {best}"


def pass_programs(learner, holder, batch) -> dict[str, object]:
    """Zero-argument callables timing each pass of `learner`'s update step on its own,
    on the current state (holder['state']): critic forward (V0 and V1 alike), the K
    critic steps (with V0 fused into the first when the learner fuses it), the policy
    forward, and the policy step (forward + backward + AdamW)."""
    n_tok = jnp.maximum(jnp.sum(batch["action_mask"]), 1).astype(jnp.float32)
    critic_fwd = jax.jit(learner.critic_values)
    v0 = learner.initial_values(holder["state"].critic, batch)  # None: fused, as run
    steps = jax.jit(lambda c, o, b, v: learner.critic_steps(c, o, b, v, n_tok)[:2])
    policy_fwd = jax.jit(
        lambda p, b: P.policy_pass(learner.policy_def.bind(p), b, replay=False)["logp"]
    )
    key = jax.random.key(0)  # the PPO minibatch shuffle (unused by SAO's single step)
    policy_step = jax.jit(lambda s, b: learner.policy_step(s, b, b["rewards"], n_tok, key)[:2])
    run = lambda fn, args: lambda: jax.block_until_ready(fn(*args()))
    st = lambda: holder["state"]
    fns = {
        "critic forward": run(critic_fwd, lambda: (st().critic, batch)),
        "critic K steps (fwd+bwd)": run(steps, lambda: (st().critic, st().critic_opt, batch, v0)),
        "policy forward": run(policy_fwd, lambda: (st().policy, batch)),
        "policy fwd+bwd": run(policy_step, lambda: (st(), batch)),
    }
    for fn in fns.values():
        fn()  # compile
    return fns


def pass_table(passes_useful: dict[str, int], pass_times, step_s: float) -> str:
    """Rows: FLOP share of the useful total, time of the separately jitted pass, its share
    of the sum of pass times."""
    total = sum(passes_useful.values())
    rows: dict[str, int] = {}
    for name, v in passes_useful.items():
        rows[_row(name)] = rows.get(_row(name), 0) + v
    lines = [
        "  | pass | useful GFLOP | FLOP share | time (median) | time share |",
        "  |---|---|---|---|---|",
    ]
    med = {k: statistics.median(v) for k, v in pass_times.items()}
    secs = {row: med.get("critic forward" if row.startswith("critic V") else row) for row in rows}
    known = [s for s in secs.values() if s is not None]
    time_sum = sum(known) if known else None
    for row, v in rows.items():
        s = secs.get(row)
        t = f"{s * 1e3:.0f} ms" if s is not None else "-"
        share = f"{s / time_sum:.0%}" if s is not None and time_sum else "-"
        lines.append(f"  | {row} | {v / 1e9:.2f} | {v / total:.0%} | {t} | {share} |")
    if "policy forward" in med and "policy fwd+bwd" in med:
        fwd, both = med["policy forward"], med["policy fwd+bwd"]
        lines.append(
            f"  policy forward alone {fwd * 1e3:.0f} ms, so its backward + AdamW "
            f"{(both - fwd) * 1e3:.0f} ms"
        )
    if time_sum:
        lines.append(
            f"  sum of the separately jitted passes {time_sum * 1e3:.0f} ms vs the whole step "
            f"{step_s * 1e3:.0f} ms"
        )
    return "\n".join(lines)


def state_bytes(cfg, optim, state) -> tuple[dict[str, int], bool]:
    """Global bytes from the memory plan (one device), the live critic AdamW bytes, and
    whether the live state agrees with the plan where the plan models the configured
    set (`optim.critic.trainable`, or everything when attention is not frozen)."""
    plan = memory_plan(cfg, optim, parse_mesh("", 1))
    out = {
        "policy params": plan.policy_total.global_bytes,
        "critic params": plan.critic_total.global_bytes,
        "policy AdamW": plan.policy_opt.global_bytes,
        "critic AdamW, attention frozen": plan.critic_opt_frozen.global_bytes,
        "critic AdamW, all trainable": plan.critic_opt_full.global_bytes,
        "critic AdamW, configured set": plan.critic_opt_trainable.global_bytes,
        "critic AdamW, live": tree_bytes(state.critic_opt),
    }
    frozen = optim.critic.freeze_attention
    row = "critic AdamW, configured set" if frozen else "critic AdamW, all trainable"
    live_ok = (
        tree_bytes(state.policy) == out["policy params"]
        and tree_bytes(state.critic) == out["critic params"]
        and tree_bytes(state.policy_opt) == out["policy AdamW"]
        and out["critic AdamW, live"] == out[row]
    )
    return out, live_ok


def state_summary(cfg, optim, state) -> str:
    b, live_ok = state_bytes(cfg, optim, state)
    mib = lambda n: f"{n / 2**20:.3f}"
    saved = b["critic AdamW, all trainable"] - b["critic AdamW, attention frozen"]
    total = b["policy params"] + b["critic params"] + b["policy AdamW"]
    return (
        f"state MiB: policy params {mib(b['policy params'])}, critic params "
        f"{mib(b['critic params'])}, policy AdamW {mib(b['policy AdamW'])}, critic AdamW "
        f"{mib(b['critic AdamW, attention frozen'])} (attention frozen) / "
        f"{mib(b['critic AdamW, all trainable'])} (all trainable) / "
        f"{mib(b['critic AdamW, live'])} (live: optim.critic.trainable = "
        f"{optim.critic.get('trainable', '-')!r}); total "
        f"{mib(total + b['critic AdamW, live'])}; frozen attention saves "
        f"{mib(saved)} MiB; live TrainState matches the plan: {'yes' if live_ok else 'NO'}"
    )


def shape_programs(cfg, b: int, t: int) -> dict[str, tuple[object, int, int]]:
    """The matmul shapes of one policy forward of this model: name -> (callable running
    every call of that shape in a forward, as ONE jitted `fori_loop` (no per-call dispatch;
    each call's input shifted by the loop index so nothing is hoisted), FLOPs of those
    calls, calls). Plus the attention's masked softmax over [B, N, T, T] (no matmul FLOPs:
    its time only). Timed beside the n x n peak, they bound the MFU this CPU reaches at
    these widths: a forward of these shapes takes at least the sum of their times."""
    dt = cfg.compute_dtype
    d, n, kv, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    bt, keys = b * t, iter(jax.random.split(jax.random.key(2), 16))
    normal = lambda *shape: jax.random.normal(next(keys), shape, dt)
    moe = len(cfg.moe_layers)
    dense, layers = cfg.num_hidden_layers - moe, cfg.num_hidden_layers
    progs: dict[str, tuple[object, int, int]] = {}

    def add(name, op, args, flops_per_call, calls):
        out = jax.eval_shape(op, *args)

        def run(x, *rest):
            shifted = lambda i: x + i.astype(x.dtype)
            body = lambda i, _: op(shifted(i), *rest)
            return jax.lax.fori_loop(0, calls, body, jnp.zeros(out.shape, out.dtype))

        jitted = jax.jit(run)
        jax.block_until_ready(jitted(*args))
        progs[name] = (lambda: jax.block_until_ready(jitted(*args)), flops_per_call * calls, calls)

    mm = lambda x, w: x @ w
    add("q, o projections [BT, D] x [D, N H]", mm, (normal(bt, d), normal(d, n * h)),
        2 * bt * d * n * h, 2 * layers)  # fmt: skip
    add("k, v projections [BT, D] x [D, K H]", mm, (normal(bt, d), normal(d, kv * h)),
        2 * bt * d * kv * h, 2 * layers)  # fmt: skip
    if dense:
        f = cfg.intermediate_size
        add("dense MLP [BT, D] x [D, F]", mm, (normal(bt, d), normal(d, f)),
            2 * bt * d * f, 3 * dense)  # fmt: skip
    if moe:
        f, k, e = cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
        rows = grouped.tile_rows(bt, k, e)
        add(f"expert tile [R={rows}, D] x [D, F_e]", mm, (normal(rows, d), normal(d, f)),
            2 * rows * d * f, 3 * moe * -(-bt * k // rows))  # fmt: skip
    add("LM head [BT, D] x [D, V]", mm, (normal(bt, d), normal(d, cfg.vocab_size)),
        2 * bt * d * cfg.vocab_size, 1)  # fmt: skip
    g = n // kv
    q, kk = normal(b, t, kv, g, h), normal(b, t, kv, h)
    scores = lambda q, k: jnp.einsum("btkgh,bskh->bkgts", q, k)
    add("attention q k^T (contraction H)", scores, (q, kk), 2 * b * n * t * t * h, layers)
    probs = normal(b, kv, g, t, t)
    add("attention probs v", lambda p, v: jnp.einsum("bkgts,bskh->btkgh", p, v), (probs, kk),
        2 * b * n * t * t * h, layers)  # fmt: skip
    mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
    soft = lambda s, m: jax.nn.softmax(jnp.where(m[:, None, None], s, -1e30), axis=-1)
    add("attention masked softmax [B, N, T, T]", soft, (probs, mask), 0, layers)
    return progs


def shape_table(progs, times: dict[str, list[float]], peaks: list[float]) -> str:
    """Rate of each shape over the same round's peak, and the forward's ceiling."""
    lines = [
        "  | program | calls per forward | GFLOP/s (median) | of peak (per-round median) "
        "| share of the forward's time at these rates |",
        "  |---|---|---|---|---|",
    ]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    total_s = sum(med.values())
    flops = sum(fl for _, fl, _ in progs.values())
    for name, (_, fl, calls) in progs.items():
        rate = [fl / s / p for s, p in zip(times[name], peaks)]
        lines.append(
            f"  | {name} | {calls} | {fl / med[name] / 1e9:.1f} | "
            f"{statistics.median(rate):.0%} | {med[name] / total_s:.0%} |"
        )
    ceiling = [flops / sum(ts[i] for ts in times.values()) / p for i, p in enumerate(peaks)]
    lines.append(
        f"  one forward at these rates: {flops / total_s / 1e9:.1f} GFLOP/s, "
        f"{statistics.median(ceiling):.0%} of the peak (per-round range "
        f"{min(ceiling):.0%}-{max(ceiling):.0%}): the useful-FLOP MFU ceiling of this model's "
        "shapes on this machine (norms, RoPE, routing, gathers, optimizer excluded)"
    )
    return "\n".join(lines)
