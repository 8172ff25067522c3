"""Per-device memory of policy, critic and their AdamW states, from shapes alone.

Nothing is allocated and no device is needed: parameters come from `ModelDef.of`
(nnx.eval_shape), optimizer states from `jax.eval_shape(tx.init, ...)`, and shardings
from the training rules (`ModelDef.shardings`) on a `jax.sharding.AbstractMesh`, so a
64-chip mesh can be planned on a laptop. A parameter whose sharded dimension does not
divide raises the ConfigError that training would raise, naming the parameter.

Per-device bytes of a leaf = prod(NamedSharding.shard_shape) x itemsize (every device of
a NamedSharding holds the same shard shape). Optimizer-state leaves take the sharding of
the parameter they mirror (matched by path suffix); anything else (step counts) is
counted as replicated. Activations, KV caches and gradients are not included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Critic, Policy
from sao_jax.parallel.mesh import DEFAULT_RULES, MESH_AXES, Rules, Sharder
from sao_jax.parallel.partition import ModelDef, path_str
from sao_jax.plan.shapes import category
from sao_jax.rl.optim import critic_frozen_labels, make_optimizer
from sao_jax.schema import ConfigDict, ConfigError


def parse_mesh(text: str, devices: int, axes: Sequence[str] = MESH_AXES) -> dict[str, int]:
    """'fsdp=8,expert=8' -> {data: 1, fsdp: 8, expert: 8, tensor: 1}; one size may be -1.

    Raises ConfigError naming the flag for an unknown axis, a bad size, or sizes whose
    product is not `devices`.
    """
    sizes = dict.fromkeys(axes, 1)
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, value = item.partition("=")
        if name not in sizes or not eq:
            raise ConfigError(f"flag --mesh: {item!r} is not <axis>=<size> with axis in {axes}")
        try:
            sizes[name] = int(value)
        except ValueError as e:
            raise ConfigError(f"flag --mesh: size {value!r} of axis {name} is not an int") from e
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
        raise ConfigError(f"flag --mesh: {sizes}: sizes must be >= 1, one may be -1")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill and devices % known == 0:
        sizes[fill[0]] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ConfigError(
            f"flag --mesh: {sizes} covers {math.prod(sizes.values())} devices, not {devices}"
        )
    return sizes


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    """A device-free mesh of these axis sizes (enough for shardings and shard shapes)."""
    return AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)
    )


def _nbytes(shape, dtype, sharding: NamedSharding | None) -> int:
    shard = sharding.shard_shape(tuple(shape)) if sharding is not None else shape
    return math.prod(shard) * jax.numpy.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Usage:
    """Element count, global bytes and bytes on each device of one group of leaves."""

    count: int = 0
    global_bytes: int = 0
    device_bytes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            *(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )


def tree_usage(tree, shardings: Mapping[str, NamedSharding], by=None) -> dict[str, Usage]:
    """Usage of a tree of ShapeDtypeStructs, grouped by `by(param path)` (one group "all").

    A leaf takes the sharding of the longest parameter path that ends its own path (an
    optimizer moment mirrors its parameter); unmatched leaves count as replicated.
    """
    out: dict[str, Usage] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        parts = path_str(path).split(".")
        param = next(
            (".".join(parts[i:]) for i in range(len(parts)) if ".".join(parts[i:]) in shardings),
            None,
        )
        sharding = shardings.get(param)
        n = math.prod(leaf.shape)
        group = by(param) if (by and param) else "all"
        u = Usage(n, n * leaf.dtype.itemsize, _nbytes(leaf.shape, leaf.dtype, sharding))
        out[group] = out.get(group, Usage()) + u
    return out


def _axis_names(*mdefs: ModelDef) -> set[str]:
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(e, (str, type(None))) for e in x)
    return {n for m in mdefs for axes in jax.tree.leaves(m.axes(), is_leaf=is_axes) for n in axes}


def flat_shardings(mdef: ModelDef, sharder: Sharder) -> dict[str, NamedSharding]:
    """{dotted param path: NamedSharding}; ConfigError names a parameter that cannot split."""
    tree = mdef.shardings(sharder)
    leaves = jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: isinstance(x, NamedSharding)
    )
    return {path_str(p): s for p, s in leaves}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Memory of one training setup; every `Usage` is per group of leaves."""

    cfg: ModelConfig
    mesh: dict[str, int]
    rules: Rules  # the rules of the logical axes that parameters use
    policy: dict[str, Usage]  # by parameter category
    critic: dict[str, Usage]
    policy_opt: Usage
    critic_opt_frozen: Usage  # exactly attention frozen: no moments for it
    critic_opt_full: Usage
    critic_opt_trainable: Usage  # the configured set (optim.critic.trainable) when frozen
    critic_trainable: str  # its name ('moe' by default)
    active_params: int  # parameters touched per token (top-k of the experts)

    @property
    def policy_total(self) -> Usage:
        return sum(self.policy.values(), Usage())

    @property
    def critic_total(self) -> Usage:
        return sum(self.critic.values(), Usage())

    def total(self, frozen: bool) -> Usage:
        """Everything; `frozen`: the critic trains its configured set (default 'moe')."""
        opt = self.critic_opt_trainable if frozen else self.critic_opt_full
        return self.policy_total + self.critic_total + self.policy_opt + opt


def memory_plan(
    cfg: ModelConfig,
    optim: ConfigDict,
    mesh: Mapping[str, int],
    rules: Rules = DEFAULT_RULES,
) -> Plan:
    """Per-device bytes of policy, critic, and both AdamW states (critic with and without
    frozen attention) on an abstract mesh; shapes only (jax.eval_shape)."""
    sharder = Sharder(abstract_mesh(mesh), tuple(map(tuple, rules)))
    pdef = ModelDef.of(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(0)))
    cdef = ModelDef.of(lambda: Critic(cfg, sharder=sharder, rngs=nnx.Rngs(0)))
    p_shard, c_shard = flat_shardings(pdef, sharder), flat_shardings(cdef, sharder)
    p_shapes, c_shapes = pdef.shapes(), cdef.shapes()

    def opt_usage(tx, shapes, shardings) -> Usage:
        state = jax.eval_shape(tx.init, shapes)
        return tree_usage(state, shardings).get("all", Usage())

    def frozen_opt(trainable: str) -> Usage:
        c = optim.critic.copy_and_resolve_references()
        c.freeze_attention, c.trainable = True, trainable
        tx = make_optimizer(optim.critic, frozen=critic_frozen_labels(c_shapes, c))
        return opt_usage(tx, c_shapes, c_shard)

    trainable = optim.critic.get("trainable", "all_but_attention")
    policy = tree_usage(p_shapes, p_shard, by=category)
    experts = policy.get("experts", Usage()).count
    active = policy_total = sum(u.count for u in policy.values())
    if cfg.num_experts:
        active = policy_total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return Plan(
        cfg=cfg,
        mesh=dict(mesh),
        rules=tuple((n, a) for n, a in map(tuple, rules) if n in _axis_names(pdef, cdef)),
        policy=policy,
        critic=tree_usage(c_shapes, c_shard, by=category),
        policy_opt=opt_usage(make_optimizer(optim.policy), p_shapes, p_shard),
        critic_opt_frozen=frozen_opt("all_but_attention"),  # what freezing attention saves
        critic_opt_full=opt_usage(make_optimizer(optim.critic), c_shapes, c_shard),
        critic_opt_trainable=frozen_opt(trainable),
        critic_trainable=trainable,
        active_params=active,
    )


def _axes(a) -> str:
    return "-" if not a else a if isinstance(a, str) else "+".join(a)


def _gib(n: int) -> str:
    return f"{n / 2**30:10.2f}"


def format_plan(plan: Plan) -> str:
    """The plan as a fixed-width table (GiB = 2^30 bytes)."""
    cfg, n_dev = plan.cfg, math.prod(plan.mesh.values())
    attn_p = plan.policy.get("attention", Usage())
    attn_c = plan.critic.get("attention", Usage())
    lines = [
        f"model: {plan.policy_total.count / 1e9:.2f} B params, {plan.active_params / 1e9:.2f} B "
        f"active per token; param_dtype {cfg.param_dtype}, dtype {cfg.dtype}",
        "mesh: " + " ".join(f"{a}={s}" for a, s in plan.mesh.items()) + f" ({n_dev} devices)",
        "rules: " + ", ".join(f"{n}->{_axes(a)}" for n, a in plan.rules),
        "",
        f"{'group':<44}{'params (B)':>11}{'global GiB':>12}{'per-device GiB':>16}",
    ]

    def row(name: str, u: Usage, count=True):
        c = f"{u.count / 1e9:11.3f}" if count else " " * 11
        lines.append(f"{name:<44}{c}{_gib(u.global_bytes):>12}{_gib(u.device_bytes):>16}")

    row("policy params", plan.policy_total)
    for name, u in sorted(plan.policy.items(), key=lambda kv: -kv[1].global_bytes):
        row(f"  {name}", u)
    row("critic params", plan.critic_total)
    row("policy AdamW state (mu, nu)", plan.policy_opt, count=False)
    row("critic AdamW state, attention frozen", plan.critic_opt_frozen, count=False)
    row(f"critic AdamW state, trains '{plan.critic_trainable}'", plan.critic_opt_trainable, False)
    row("critic AdamW state, all trainable", plan.critic_opt_full, count=False)
    row(f"total, critic trains '{plan.critic_trainable}'", plan.total(True), count=False)
    row("total, all trainable", plan.total(False), count=False)
    full, frozen = plan.critic_opt_full, plan.critic_opt_frozen
    saved = Usage(
        0, full.global_bytes - frozen.global_bytes, full.device_bytes - frozen.device_bytes
    )
    row("saved by freezing critic attention", saved, count=False)
    share = attn_c.count / plan.critic_total.count
    dev_share = attn_p.device_bytes / plan.policy_total.device_bytes
    lines += [
        "",
        f"attention share: {share:.2%} of critic parameters, {dev_share:.2%} of per-device "
        "parameter bytes",
        "not included: activations, KV caches, gradients, sampler copies of the params",
    ]
    return "\n".join(lines)
