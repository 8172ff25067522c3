"""Decoder layers of a pass: one subtree per layer, or stored stacked per run and scanned.

Two parameter layouts, chosen by `model.scan_layers`:
  per layer (False)  `trunk.layers.<i>.*`, the Hugging Face layout; a training pass
                     applies the layers one after another (XLA unrolls them all).
  stacked (True)     `trunk.stacks.<r>.*`: each maximal run r of consecutive layers of one
                     kind (dense MLP or MoE; Qwen3-30B-A3B is one run of 48, the tiny model
                     a dense layer 0 then a run of MoE layers) is one module whose
                     parameters have a leading layer axis [L_run, ...], logical name
                     `layers` (mapped to no mesh axis; the other axes keep their sharding).
                     A training pass `lax.scan`s the stored stack directly: XLA compiles
                     one layer body per run, the optimizer holds one leaf per parameter
                     kind per run, and compile cost no longer grows with depth.
The stacked model is built per layer and stacked at construction, so one seed gives the
same weights in both layouts (`stack_params` maps one layout's params to the other's).
Prefill/decode scan the stacks too: the KV cache is stacked per run as well ([L_run, ...]
per KVCache field, one cache per stack), carried whole by the scan, each layer writing
and reading its own index in place; the per-layer layout keeps one KVCache per layer.

`remat` wraps each layer in `jax.checkpoint` with a policy:
  none  keep every intermediate for the backward pass (fastest, O(L T) big activations)
  full  keep only each layer's input (the scan carry); recompute the layer in the backward
  dots  also keep the outputs of the weight matmuls without batch dimensions (the q/k/v/o
        and MLP projections), recompute the rest (norms, RoPE, attention, activations)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.attention import KVCache
from sao_jax.models.moe.router import load_balancing_loss
from sao_jax.parallel.mesh import Sharder

LAYER_AXIS = "layers"  # logical name of the stacked layout's leading axis (no mesh axis)
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def runs(kinds: Sequence) -> list[tuple[int, int]]:
    """[start, stop) of each maximal run of equal consecutive kinds."""
    out: list[tuple[int, int]] = []
    for i, kind in enumerate(kinds):
        if out and kinds[out[-1][0]] == kind:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def layer_runs(cfg) -> list[tuple[int, int]]:
    """[start, stop) of each stack of a model config (runs of dense / MoE layers)."""
    return runs([cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)])


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def stack_modules(layers: Sequence[nnx.Module]) -> nnx.Module:
    """Same-kind layers -> one module of their graph whose parameters are stacked [L, ...],
    the leading axis tagged with the logical name `layers`."""

    def stack(*variables):
        axes = variables[0].get_metadata().get("axes") or (None,) * variables[0][...].ndim
        return variables[0].replace(
            jnp.stack([v[...] for v in variables]), axes=(LAYER_AXIS, *axes)
        )

    graphdef, _ = nnx.split(layers[0])
    states = [nnx.state(layer) for layer in layers]
    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_var))


def stack_size(stack: nnx.Module) -> int:
    """L of a stacked module (the leading axis of its parameters)."""
    return jax.tree.leaves(nnx.state(stack))[0].shape[0]


def _slice(state: nnx.State, j: int) -> nnx.State:
    """Layer j of a stacked state (index j of every parameter's leading axis)."""
    return jax.tree.map(lambda v: v.replace(v[...][j]), state, is_leaf=_is_var)


def stack_params(cfg, params: dict, *, to_stacked: bool = True) -> dict:
    """Pure params dict of one layout -> the other's (per layer <-> stacked).

    Also maps any tree of the same structure (gradients). Everything outside the decoder
    layers is kept as is.
    """
    trunk = dict(params["trunk"])
    if to_stacked:
        layers = trunk.pop("layers")
        trunk["stacks"] = {
            r: jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(a, b)])
            for r, (a, b) in enumerate(layer_runs(cfg))
        }
    else:
        stacks = trunk.pop("stacks")
        trunk["layers"] = {
            a + j: jax.tree.map(lambda x, j=j: x[j], stacks[r])
            for r, (a, b) in enumerate(layer_runs(cfg))
            for j in range(b - a)
        }
    return {**params, "trunk": trunk}


def stacked_key(cfg, layer: int) -> tuple[int, int]:
    """(stack r, index j in it) of decoder layer `layer` in the stacked layout."""
    for r, (a, b) in enumerate(layer_runs(cfg)):
        if a <= layer < b:
            return r, layer - a
    raise ValueError(f"layer {layer}: outside [0, {cfg.num_hidden_layers})")


def apply_layers(
    modules: Sequence[nnx.Module],
    x_btd: jax.Array,
    positions_bt: jax.Array,
    segment_ids_bt: jax.Array,
    forced_experts_btlk: jax.Array | None,
    *,
    num_experts: int,
    remat: str,
    stacked: bool,
    sharder: Sharder,
    cache: Sequence[KVCache] | None = None,
):
    """Applies decoder layers: one module per layer, or (`stacked`) one per run with
    stacked parameters, scanned. Returns (x [B, T, D], experts_btlk [B, T, L_moe, k] or
    None, aux_l [L_moe] load-balancing losses or None, the updated cache or None), as the
    layer loop would.

    `cache` (prefill/decode) has one KVCache per module: per layer [B, S, K, H], or
    stacked [L_run, B, S, K, H], which the scan carries whole while each layer writes and
    reads its own index in place (attention.KVCache.layer). No remat with a cache."""
    if remat not in REMAT:
        raise ValueError(f"config field model.remat: {remat!r} is not one of {tuple(REMAT)}")
    b, t = x_btd.shape[:2]
    token_mask_n = (segment_ids_bt != 0).reshape(-1)

    def layer_fn(graphdef, in_scan: bool):
        def fn(state, x, c, forced_btk):
            layer = nnx.merge(graphdef, state)
            x, c, routing = layer(x, positions_bt, segment_ids_bt, c, forced_btk)
            x = sharder.constrain(x, ("batch", "length", "act_embed"))
            if routing is None:
                return x, c, None, None
            experts_btk = routing.experts_nk.reshape(b, t, -1)
            return x, c, experts_btk, load_balancing_loss(routing, num_experts, token_mask_n)

        if remat == "none" or cache is not None:
            return fn
        return jax.checkpoint(fn, policy=REMAT[remat], prevent_cse=not in_scan)

    def at(c: KVCache | None, j) -> KVCache | None:  # a stacked cache set to layer j, or back
        return None if c is None else c.replace(layer=j)

    experts, aux, new_cache = [], [], []
    moe_index = 0
    for m, module in enumerate(modules):
        is_moe = bool(module.is_moe)
        n = stack_size(module) if stacked else 1
        graphdef, state = nnx.split(module)
        c = None if cache is None else cache[m]
        forced = None
        if is_moe and forced_experts_btlk is not None:
            forced = forced_experts_btlk[:, :, moe_index : moe_index + n]  # [B, T, n, k]
        if n == 1:
            if stacked:
                state, c = _slice(state, 0), at(c, 0)
            fn = layer_fn(graphdef, in_scan=False)
            forced_btk = None if forced is None else forced[:, :, 0]
            x_btd, c, e_btk, a = fn(state, x_btd, c, forced_btk)
            c = at(c, None)
            if is_moe:
                experts.append(e_btk[:, :, None])
                aux.append(a[None])
        else:
            fn = layer_fn(graphdef, in_scan=True)
            forced_l = None if forced is None else jnp.moveaxis(forced, 2, 0)  # [n, B, T, k]

            def body(carry, xs, fn=fn):
                x, c = carry
                state_l, forced_btk, j = xs
                x, c, e, a = fn(state_l, x, at(c, j), forced_btk)
                return (x, at(c, None)), (e, a)

            xs = (state, forced_l, jnp.arange(n, dtype=jnp.int32))
            (x_btd, c), (e_nbtk, a_n) = jax.lax.scan(body, (x_btd, c), xs)
            if is_moe:
                experts.append(jnp.moveaxis(e_nbtk, 0, 2))  # [B, T, n, k]
                aux.append(a_n)
        new_cache.append(c)
        moe_index += n if is_moe else 0
    new_cache = None if cache is None else tuple(new_cache)
    if not experts:
        return x_btd, None, None, new_cache
    return x_btd, jnp.concatenate(experts, axis=2), jnp.concatenate(aux), new_cache
