"""The experts vLLM routes every position to, per request: two vLLM worker functions.

Run inside the vLLM env only: vllm_server.py (`--record_routing`) passes them to the
engine's `collective_rpc`, which calls each with the worker as its argument, on every
worker (any weight-sync extension). They import numpy, never sao_jax. What they are for:
sampling.record_routing with sampling.backend='vllm', so that rl.routing_replay replays
the engine's own MoE choices (docs/vllm.md "Routing replay on vLLM rollouts": without it
~1% of positions are routed to other experts by the learner, and the tokens after them
carry 0.25-2 nats of |delta logp|).

vLLM 0.32's own per-request capture (`enable_return_routed_experts`) needs its Model
Runner V2, which needs Triton, absent from the CPU build. These use the hook that
capture is built on: every MoE layer's router (`mlp.experts.router`) hands the top-k ids
it routes a forward's rows with to a callback (`set_capture_fn`), the ids after the
kernel's own tie-breaking. A forward's rows belong to the requests of the model runner's
input batch in order (`query_start_loc` [R + 1] row offsets, `input_batch.req_ids`), and
row r computes position `positions[r]` of its request; both are set for the step before
the forward runs. `take_routing` returns, per request (its id as the caller gave it:
vLLM appends `-<8 hex>` to make its internal ids unique), the positions computed since
the last take and their experts [m, L_moe, k].
"""

from __future__ import annotations

import numpy as np


def internal_to_external(req_id: str) -> str:
    """The caller's request id of vLLM's internal `<id>-<8 hex>`."""
    head, _, tail = req_id.rpartition("-")
    return head if head and len(tail) == 8 else req_id


def split_rows(query_start_loc, req_ids, positions, ids_rk):
    """{request id: (positions [m], ids [m, k])} of one layer's rows: rows
    query_start_loc[i]:query_start_loc[i + 1] are request req_ids[i]'s (rows past the last
    request's are padding)."""
    out = {}
    for i, rid in enumerate(req_ids):
        a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if b > a:
            out[rid] = (np.asarray(positions[a:b]), np.asarray(ids_rk[a:b]))
    return out


def capture_routing(worker) -> int:
    """A capture callback on every MoE router of `worker`'s model; returns the number of
    MoE layers."""
    model = worker.model_runner.get_model()
    worker.sao_routing = {}  # request id -> [(MoE layer, positions, ids)]
    moe = 0
    for layer in model.model.layers:
        router = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "router", None)
        if router is None:
            continue
        router.set_capture_fn(lambda ids, moe=moe: _capture(worker, moe, ids))
        moe += 1
    if not moe:
        raise RuntimeError("record_routing: no MoE router (model.model.layers[i].mlp.experts)")
    worker.sao_moe_layers = moe
    return moe


def _capture(worker, moe: int, ids) -> None:
    """One MoE layer's rows of the forward running now, filed by request."""
    runner = worker.model_runner
    num_reqs = runner.input_batch.num_reqs
    rows = split_rows(
        runner.query_start_loc.np[: num_reqs + 1],
        runner.input_batch.req_ids[:num_reqs],
        runner.positions[: ids.shape[0]].cpu().numpy(),
        ids.detach().cpu().numpy(),
    )
    for rid, (pos, got) in rows.items():
        worker.sao_routing.setdefault(internal_to_external(rid), []).append((moe, pos, got))


def take_routing(worker) -> dict[str, tuple[list[int], list]]:
    """{request id: (positions, experts [m, L_moe, k] as lists)} computed since the last
    take; RuntimeError if a request's MoE layers saw different rows."""
    taken, worker.sao_routing = worker.sao_routing, {}
    return {rid: stack_layers(parts, worker.sao_moe_layers, rid) for rid, parts in taken.items()}


def stack_layers(parts, layers: int, rid: str) -> tuple[list[int], list]:
    """(positions [m], experts [m, L, k]) of one request's (layer, positions, ids) parts."""
    by_layer: dict[int, list] = {}
    for layer, pos, got in parts:
        by_layer.setdefault(layer, []).append((pos, got))
    if sorted(by_layer) != list(range(layers)):
        raise RuntimeError(f"record_routing: request {rid}: MoE layers {sorted(by_layer)}")
    pos0 = np.concatenate([p for p, _ in by_layer[0]])
    stacked = []
    for layer in range(layers):
        if not np.array_equal(np.concatenate([p for p, _ in by_layer[layer]]), pos0):
            raise RuntimeError(f"record_routing: request {rid}: MoE layers' rows differ")
        stacked.append(np.concatenate([g for _, g in by_layer[layer]]))
    return pos0.tolist(), np.stack(stacked, axis=1).astype(np.int32).tolist()
