"""Each sampled token's log-prob under the law vLLM drew it from: two vLLM worker functions.

Run inside the vLLM env only: vllm_server.py passes them to the engine's `collective_rpc`
(each is called with the worker as its argument). They import torch and vLLM's sampling
ops, never sao_jax.

Why: the vLLM backend records two log-probs per token, as the native engine does
(docs/sampling.md): `rollout_logp`, log_softmax of the raw logits (vLLM's `logprobs=0`
value; what DIS reads), and `sampled_logp`, log q(token) with q the law it was sampled
from, softmax(top_k_top_p(logits / temperature)). vLLM reports one log-prob mode per
engine, so the second is computed here, beside its sampler: `install_sampled_logp` wraps
the model runner's `Sampler.forward`, and for the rows whose law is not the raw one
(temperature != 1, or a top-k / top-p cut; greedy rows are 0 and raw rows equal
`rollout_logp`, both filled by the caller) recomputes the law from a copy of the logits
it got, with vLLM's own `apply_top_k_top_p` (the function its CPU and native samplers
cut with), and gathers the sampled token's log-prob. Rows are the input batch's requests
in order (`input_batch.req_ids`; one sampled row per request, no speculative decoding).
`take_sampled_logp` returns {vLLM's request id: that step's value} since the last take
(the server maps the ids back: vllm_worker_routing.internal_to_external).
"""

from __future__ import annotations

import torch

EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy


def processed_logp(logits, sampled, temperature, top_k, top_p, cut) -> torch.Tensor:
    """[n] log q(sampled) with q = softmax(cut(logits / temperature, top_k, top_p)) of
    each row (float32; logits [n, V], the rest [n] or None)."""
    x = logits.float() / temperature.float().clamp(min=EPS).unsqueeze(1)
    x = cut(x, top_k, top_p)
    return torch.log_softmax(x, dim=-1).gather(1, sampled.long().view(-1, 1)).view(-1)


def install_sampled_logp(worker) -> bool:
    """Wraps the worker's sampler (once); True."""
    try:  # vLLM's own environment (.vllm-venv, make vllm-env), never the run's
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except ImportError as e:
        raise RuntimeError(f"vllm_worker_sampled runs inside vLLM's worker: {e}") from e

    runner = worker.model_runner
    sampler = runner.sampler
    worker.sao_sampled = {}
    if getattr(sampler, "sao_wrapped", False):
        return True
    inner = sampler.forward

    def forward(logits, sampling_metadata, *args, **kwargs):
        meta = sampling_metadata
        temp = meta.temperature
        rows = None
        if temp is not None and not meta.all_greedy:
            cut = (temp - 1).abs() > EPS
            if meta.top_k is not None:
                cut |= meta.top_k < logits.shape[-1]
            if meta.top_p is not None:
                cut |= meta.top_p < 1
            rows = torch.nonzero(cut & (temp >= EPS)).view(-1)
            kept = logits[rows].clone() if rows.numel() else None
        out = inner(logits, sampling_metadata, *args, **kwargs)
        if rows is not None and rows.numel():
            sampled = out.sampled_token_ids[rows, 0]
            top_k = None if meta.top_k is None else meta.top_k[rows]
            top_p = None if meta.top_p is None else meta.top_p[rows]
            values = processed_logp(kept, sampled, temp[rows], top_k, top_p, apply_top_k_top_p)
            ids = runner.input_batch.req_ids
            for row, value in zip(rows.tolist(), values.tolist(), strict=True):
                worker.sao_sampled[ids[row]] = value
        return out

    sampler.forward = forward
    sampler.sao_wrapped = True
    return True


def take_sampled_logp(worker) -> dict[str, float]:
    """{vLLM's request id: the sampled token's log-prob under its law} since the last
    take."""
    taken, worker.sao_sampled = worker.sao_sampled, {}
    return taken
