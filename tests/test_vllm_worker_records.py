"""What the vLLM server's workers record beside the tokens, without vLLM:
sampling.record_routing (sao_jax/sampling/vllm_worker_routing.py: a forward's rows filed
by request, the layers stacked, the server's events carrying each request's positions and
experts) and `sampled_logp` under the drawn law (vllm_worker_sampled.py's computation
against a literal one; the server's events carrying it). On vLLM's real routers and
sampler: tests/test_vllm_backend.py (the parity test replays the routing; the sampled
log-probs against the learner's tempered, truncated law)."""

import math
import types

import numpy as np
import pytest
import torch

from sao_jax.sampling.vllm_server import Server
from sao_jax.sampling.vllm_worker_routing import internal_to_external, split_rows, stack_layers
from sao_jax.sampling.vllm_worker_sampled import processed_logp


def test_a_forwards_rows_are_filed_by_request_and_position():
    # two requests: r0 decodes one row (position 9), r1 prefills three (0, 1, 2); a padded
    # row past the last request's is nobody's
    qsl, positions = np.array([0, 1, 4]), np.array([9, 0, 1, 2, 0])
    ids = np.array([[1, 2], [0, 3], [2, 3], [1, 0], [0, 1]])
    rows = split_rows(qsl, ["r0-1a2b3c4d", "r1-00ff00ff"], positions, ids)
    assert list(rows) == ["r0-1a2b3c4d", "r1-00ff00ff"]
    assert rows["r0-1a2b3c4d"][0].tolist() == [9] and rows["r0-1a2b3c4d"][1].tolist() == [[1, 2]]
    assert rows["r1-00ff00ff"][0].tolist() == [0, 1, 2]
    assert rows["r1-00ff00ff"][1].tolist() == [[0, 3], [2, 3], [1, 0]]
    assert internal_to_external("r1-00ff00ff") == "r1"
    assert internal_to_external("r-1") == "r-1"  # no 8-hex suffix: the id as it is


def test_layers_stack_into_positions_by_layer_by_k():
    parts = [
        (0, np.array([0, 1]), np.array([[0, 1], [2, 3]])),
        (1, np.array([0, 1]), np.array([[3, 2], [1, 0]])),
        (0, np.array([2]), np.array([[1, 2]])),
        (1, np.array([2]), np.array([[0, 3]])),
    ]
    pos, experts = stack_layers(parts, 2, "r0")
    assert pos == [0, 1, 2]
    assert experts == [[[0, 1], [3, 2]], [[2, 3], [1, 0]], [[1, 2], [0, 3]]]
    with pytest.raises(RuntimeError, match="r0: MoE layers' rows differ"):
        stack_layers([*parts[:3], (1, np.array([5]), np.array([[0, 3]]))], 2, "r0")
    with pytest.raises(RuntimeError, match=r"r0: MoE layers \[0\]"):
        stack_layers(parts[:1], 2, "r0")


class _Engine:
    """add_request / step / abort / collective_rpc of a stand-in engine: each step emits
    one token for every live request and files its routing."""

    def __init__(self):
        self.live, self.routing = {}, {}

    def add_request(self, rid, prompt, params):
        self.live[rid] = 0

    def abort_request(self, ids):
        for rid in ids:
            self.live.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid in list(self.live):
            n = self.live[rid] = self.live[rid] + 1
            self.routing[rid] = ([n], [[[n % 4, (n + 1) % 4]]])
            done = types.SimpleNamespace(
                token_ids=list(range(n)),
                logprobs=[{t: types.SimpleNamespace(logprob=-1.0)} for t in range(n)],
                finish_reason="length",
            )
            outs.append(types.SimpleNamespace(request_id=rid, outputs=[done], finished=n == 2,
                                              prompt_token_ids=[7]))  # fmt: skip
            if n == 2:
                del self.live[rid]
        return outs

    def collective_rpc(self, fn, args=()):
        return [fn(self)]


def test_the_sampled_tokens_log_prob_is_under_the_tempered_cut_law():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0]])
    sampled, temp = torch.tensor([1, 2]), torch.tensor([0.5, 2.0])

    def keep_top2(x, k, p):  # a cut standing in for vLLM's apply_top_k_top_p
        assert k is None and p.shape == (2,)
        low = x.topk(2, dim=-1).values[:, -1:]
        return x.masked_fill(x < low, -float("inf"))

    got = processed_logp(logits, sampled, temp, None, torch.tensor([0.9, 0.9]), keep_top2)
    # row 0: logits / 0.5 = [4, 2, 0, -2], kept {0, 1}: log e^2 / (e^4 + e^2)
    # row 1: logits / 2 = [.25, .25, 1.5, 0], kept {2} and a tie at .25 (both kept)
    want = [2 - math.log(math.exp(4) + math.exp(2)),
            1.5 - math.log(math.exp(1.5) + 2 * math.exp(0.25))]  # fmt: skip
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_the_servers_events_carry_each_requests_routing_and_sampled_logp():
    events = []
    server = Server(_Engine(), lambda cmd: (None, None), lambda **e: events.append(e), 0,
                    take_routing=lambda engine: engine.routing,
                    take_sampled=lambda engine: {"r0": -0.5})  # fmt: skip
    server.handle({"op": "generate", "id": "r0"})
    server.step()
    server.step()
    tokens = [e for e in events if e["op"] == "tokens"]
    assert [e["routing"] for e in tokens] == [
        {"positions": [1], "experts": [[[1, 2]]]},
        {"positions": [2], "experts": [[[2, 3]]]},
    ]
    assert tokens[-1]["finish"] == "length" and not server.routing
    assert [e["sampled_logp"] for e in tokens] == [[-0.5], [-0.5]]  # one token a step
