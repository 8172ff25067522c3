"""Decoder layers of a training pass: `lax.scan` over runs of same-kind layers, remat per layer.

Parameters stay one subtree per layer (`trunk.layers.<i>`, the Hugging Face layout that
checkpoints, optimizer path patterns and routing replay address). Inside the traced pass
each maximal run of consecutive layers of one kind (dense MLP or MoE; Qwen3-30B-A3B is
one run of 48, the tiny model a dense layer 0 then a run of 2) has its parameters cast
to the compute dtype (every layer casts them at use anyway, so results are unchanged)
and stacked along a new leading axis, and one `lax.scan` applies the run: XLA compiles
one layer body per run instead of unrolling every layer. The stacked copy costs one
compute-dtype copy of the run's parameters on top of the master weights (per device:
it keeps the parameters' sharding, with the layer axis unsharded).

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

from sao_jax.models.moe.router import load_balancing_loss
from sao_jax.parallel.mesh import Sharder

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


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def stack_states(states: Sequence[nnx.State], dtype, sharder: Sharder) -> nnx.State:
    """Layer states -> one state whose arrays have a leading layer axis, floating leaves
    cast to `dtype`, each constrained to its parameter's sharding plus an unsharded axis."""

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def stack(*variables):
        arr = jnp.stack([cast(v[...]) for v in variables])
        axes = variables[0].get_metadata().get("axes") or (None,) * (arr.ndim - 1)
        return variables[0].replace(sharder.constrain(arr, (None, *axes)))

    return jax.tree.map(stack, *states, is_leaf=_is_var)


def apply_layers(
    layers: Sequence[nnx.Module],
    x_btd: jax.Array,
    positions_bt: jax.Array,
    segment_ids_bt: jax.Array,
    forced_experts_btlk: jax.Array | None,
    *,
    num_experts: int,
    remat: str,
    scan: bool,
    sharder: Sharder,
):
    """Applies decoder layers (no KV cache). Returns (x [B, T, D], experts: one [B, T, k]
    per MoE layer, aux: one load-balancing loss per MoE layer), as the layer loop would."""
    if remat not in REMAT:
        raise ValueError(f"config field model.remat: {remat!r} is not one of {tuple(REMAT)}")
    b, t = x_btd.shape[:2]
    token_mask_n = (segment_ids_bt != 0).reshape(-1)

    def layer_fn(graphdef):
        def fn(state, x, forced_btk):
            layer = nnx.merge(graphdef, state)
            x, _, routing = layer(x, positions_bt, segment_ids_bt, None, forced_btk)
            x = sharder.constrain(x, ("batch", "length", "act_embed"))
            if routing is None:
                return x, None, None
            experts_btk = routing.experts_nk.reshape(b, t, -1)
            return x, experts_btk, load_balancing_loss(routing, num_experts, token_mask_n)

        if remat == "none":
            return fn
        return jax.checkpoint(fn, policy=REMAT[remat], prevent_cse=not scan)

    experts, aux = [], []
    moe_index = 0
    kinds = [bool(layer.is_moe) for layer in layers]
    for start, stop in runs(kinds) if scan else [(i, i + 1) for i in range(len(layers))]:
        graphdef, _ = nnx.split(layers[start])
        fn = layer_fn(graphdef)
        is_moe, n = kinds[start], stop - start
        forced = None
        if is_moe and forced_experts_btlk is not None:
            forced = forced_experts_btlk[:, :, moe_index : moe_index + n]  # [B, T, n, k]
        if n == 1:
            state = nnx.state(layers[start])
            x_btd, e, a = fn(state, x_btd, None if forced is None else forced[:, :, 0])
            e_list, a_list = ([e], [a]) if is_moe else ([], [])
        else:
            dtype = x_btd.dtype
            stacked = stack_states(
                [nnx.state(layers[i]) for i in range(start, stop)], dtype, sharder
            )
            forced_l = None if forced is None else jnp.moveaxis(forced, 2, 0)  # [n, B, T, k]

            def body(x, xs, fn=fn):
                state_l, forced_btk = xs
                x, e, a = fn(state_l, x, forced_btk)
                return x, (e, a)

            x_btd, (e_stack, a_stack) = jax.lax.scan(body, x_btd, (stacked, forced_l))
            e_list = [e_stack[j] for j in range(n)] if is_moe else []
            a_list = [a_stack[j] for j in range(n)] if is_moe else []
        experts += e_list
        aux += a_list
        moe_index += n if is_moe else 0
    return x_btd, experts, aux
