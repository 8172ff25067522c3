"""vLLM's side of experiments/vllm_parity: run by the vLLM env's python (`make vllm-env`).

Imports vLLM, never sao_jax (the two stacks live in separate environments, docs/vllm.md).
Generates each prompt of --prompts (a JSON list of id lists) ONE REQUEST AT A TIME, so
that every forward holds one request's rows in position order (its prefill, then one row
per decode step), and records the experts vLLM routed every row to: each MoE layer's
router (`mlp.experts.router`, vLLM 0.32's CPURouter) hands its top-k ids to a capture
callback (`set_capture_fn`, the hook vLLM's own routed-experts capture uses), so these
are the ids the engine computed with, its own tie-breaking included. Writes --out, JSON:
per request the sampled ids, their log-probs (vLLM's `logprobs=0` value, the raw logits'
log_softmax: what sampling.backend='vllm' records) and `experts` [P + N - 1, L_moe, k]
(every position the engine computed: the prompt's P and the N - 1 sampled tokens fed
back).
"""

from __future__ import annotations

import argparse
import json
import os

CAPTURE: list[tuple[int, object]] = []  # per forward and layer: (layer, topk ids [rows, k])


def _capture_routing(model) -> int:
    """A capture callback on every MoE layer's router; returns their count."""
    hooked = 0
    for index, layer in enumerate(model.model.layers):
        router = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "router", None)
        if router is None:
            continue
        router.set_capture_fn(
            lambda ids, index=index: CAPTURE.append((index, ids.detach().cpu().numpy().copy()))
        )
        hooked += 1
    if not hooked:
        raise SystemExit("engine_side: no MoE router found (model.model.layers[i].mlp.experts)")
    return hooked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max_tokens", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine (and its hooks) here
    import numpy as np

    try:  # vLLM lives in its own environment (`make vllm-env`; docs/vllm.md), not .venv
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise SystemExit(f"engine_side: {e}; run it with `make vllm-env`'s python") from e

    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=max(len(p) for p in prompts) + args.max_tokens,
        max_num_seqs=1,
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every position computed by its own request
        seed=0,
    )
    hooked = llm.apply_model(_capture_routing)[0]
    records = []
    for i, prompt in enumerate(prompts):
        CAPTURE.clear()
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=args.seed + i,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        done = out[0].outputs[0]
        ids = list(done.token_ids)
        by_layer: dict[int, list] = {}
        for index, ids_rk in CAPTURE:
            by_layer.setdefault(index, []).append(ids_rk)
        rows = {index: np.concatenate(parts) for index, parts in by_layer.items()}
        want = len(prompt) + len(ids) - 1
        if len(rows) != hooked or any(r.shape[0] != want for r in rows.values()):
            got = {index: r.shape[0] for index, r in rows.items()}
            raise SystemExit(f"request {i}: routed rows {got}, want {want} in {hooked} layers")
        experts = np.stack([rows[index] for index in sorted(rows)], axis=1)  # [T, L, k]
        records.append(
            dict(
                prompt=prompt,
                token_ids=ids,
                logp=[done.logprobs[t][tok].logprob for t, tok in enumerate(ids)],
                experts=experts.tolist(),
            )
        )
    with open(args.out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main()
