"""Generation: sampling laws, KV-cache decode == full forward, slot scheduling, no retrace.

The tiny model, character tokenizer and multi-turn env come from tests/sampling_support.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.generate import (
    GenerateFns,
    SamplingParams,
    inert_rows,
    sample_tokens,
    truncation_mask,
)
from sao_jax.sampling.trajectory import pad_batch
from tests.sampling_support import MODEL, FakeTokenizer, TurnEnv, prompts

L_MAX = 64


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


@pytest.fixture(scope="module")
def fns(model):
    return GenerateFns(model[0], num_slots=4, max_len=L_MAX, record_routing=True)


@pytest.fixture(scope="module")
def full_forward(model):
    mdef, params = model
    f = jax.jit(lambda b: mdef.bind(params)(b["tokens"], b["positions"], b["segment_ids"]))
    return f


def reference_logp(full_forward, trajs):
    """log pi(token t | tokens < t) from one uncached forward of the padded batch."""
    batch = pad_batch(trajs, length=L_MAX, num_rows=16)
    out = full_forward(batch)
    logp_btv = np.asarray(jax.nn.log_softmax(out.out, axis=-1))
    tokens = batch["tokens"]
    logp_bt = np.zeros(tokens.shape, np.float32)
    logp_bt[:, 1:] = np.take_along_axis(logp_btv[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    return batch, logp_bt, np.asarray(out.experts_btlk), np.asarray(out.out)


# ---- sampling -----------------------------------------------------------------------


def literal_mask(logits, k, p):
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[: (k if k > 0 else len(order))]
    z = sum(math.exp(logits[i]) for i in kept)
    out, mass = [], 0.0
    for i in kept:
        if mass < p or p >= 1:
            out.append(i)
        mass += math.exp(logits[i]) / z
    threshold = min(logits[i] for i in out)
    return np.array([x >= threshold for x in logits])


@pytest.mark.parametrize("k,p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.8), (1, 0.9), (0, 0.999)])
def test_truncation_mask_matches_literal(k, p):
    logits = np.array([0.3, 2.0, -1.0, 1.2, 0.9, 2.0, -3.0, 0.0], np.float32)
    got = np.asarray(truncation_mask(jnp.asarray(logits)[None], jnp.int32(k), jnp.float32(p)))
    np.testing.assert_array_equal(got[0], literal_mask(logits.tolist(), k, p))


@pytest.mark.parametrize("temperature,k,p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.7)])
def test_sample_law_and_logps(temperature, k, p):
    logits_v = np.array([0.3, 2.0, -1.0, 1.2, 0.9, 1.7, -3.0, 0.0], np.float32)
    n = 40_000
    s = sample_tokens(
        jax.random.key(0),
        jnp.broadcast_to(logits_v, (n, 8)),
        jnp.float32(temperature),
        jnp.int32(k),
        jnp.float32(p),
    )
    keep = literal_mask((logits_v / temperature).tolist(), k, p)
    q = np.where(keep, np.exp(logits_v / temperature), 0.0)
    q /= q.sum()
    freq = np.bincount(np.asarray(s.tokens_s), minlength=8) / n
    np.testing.assert_allclose(freq, q, atol=0.01)
    assert np.all(freq[~keep] == 0)
    tok = np.asarray(s.tokens_s)
    np.testing.assert_allclose(np.asarray(s.sampled_logp_s), np.log(q[tok]), rtol=1e-5)
    full = logits_v - np.log(np.exp(logits_v).sum())
    np.testing.assert_allclose(np.asarray(s.rollout_logp_s), full[tok], rtol=1e-5)


def test_greedy_and_traced_params_do_not_retrace():
    logits = jax.random.normal(jax.random.key(1), (5, 16))
    traces = []

    @jax.jit
    def f(key, logits, t, k, p):
        traces.append(1)
        return sample_tokens(key, logits, t, k, p)

    for t, k, p in [(0.0, 0, 1.0), (1.0, 3, 0.9), (0.5, 0, 0.5)]:
        s = f(jax.random.key(2), logits, *SamplingParams(t, k, p).arrays())
        if t == 0.0:
            np.testing.assert_array_equal(s.tokens_s, jnp.argmax(logits, -1))
            np.testing.assert_array_equal(s.sampled_logp_s, 0.0)
            np.testing.assert_allclose(
                s.rollout_logp_s, jnp.max(jax.nn.log_softmax(logits, -1), -1), rtol=1e-6
            )
    assert len(traces) == 1


def test_sampling_params_reject_bad_values():
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


# ---- the cache ----------------------------------------------------------------------


def test_slots_refill_isolation_and_observation_chunk(model):
    """Per-slot cached logits == uncached forward, while slots sit at different positions,
    after a slot is refilled, and after an observation chunk is appended mid-sequence."""
    mdef, params = model
    fns = GenerateFns(mdef, num_slots=3, max_len=32, return_logits=True)
    forward = jax.jit(lambda x: mdef.bind(params)(x[None]).out[0])
    greedy = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(4, 32, size=n)) for n in (5, 9)]  # slot 2 stays idle
    cache = fns.init_cache(params)

    def prefill(rows):  # {slot: (start, tokens)}
        nonlocal cache
        tokens, positions = inert_rows(3, 16, 32)
        for s, (start, toks) in rows.items():
            tokens[s, : len(toks)] = toks
            positions[s, : len(toks)] = np.arange(start, start + len(toks))
        cache, _ = fns.prefill(params, cache, tokens, positions)

    def decode_and_check(active):  # feeds each active slot's last token
        nonlocal cache
        tok = np.array([seqs[s][-1] if s in active else 0 for s in range(3)])
        pos = np.array([len(seqs[s]) - 1 if s in active else 32 for s in range(3)])
        cache, out = fns.decode(params, cache, tok, pos, jax.random.key(0), greedy)
        for s in active:
            full = np.zeros(32, np.int32)
            full[: len(seqs[s])] = seqs[s]
            ref = np.asarray(forward(full))[len(seqs[s]) - 1]
            np.testing.assert_allclose(np.asarray(out.logits_nsv[0, s]), ref, atol=1e-4)
            seqs[s].append(int(out.tokens_ns[0, s]))

    prefill({0: (0, seqs[0][:-1]), 1: (0, seqs[1][:-1])})
    for _ in range(3):
        decode_and_check([0, 1])
    seqs[0] = list(rng.integers(4, 32, size=4))  # slot 0 refilled with a new prompt
    obs = list(rng.integers(4, 32, size=6))  # slot 1 gets an observation chunk
    prefill({0: (0, seqs[0][:-1]), 1: (len(seqs[1]) - 1, [seqs[1][-1], *obs[:-1]])})
    seqs[1] += obs
    for _ in range(3):
        decode_and_check([0, 1])
    assert fns.traces == {"prefill": 1, "decode": 1}


# ---- the engine ---------------------------------------------------------------------


def check_turn_ends(tok, trajs, cfg):
    for tr in trajs:
        for turn in range(tr.num_turns):
            idx = np.flatnonzero(tr.turn_ids == turn)
            assert np.all(np.diff(idx) == 1), "a turn is one contiguous span"
            ids = tr.tokens[idx]
            text = [tok.decode([i]) for i in ids]
            first_stop = next((j for j, t in enumerate(text) if "a" in t), None)
            first_eos = next((j for j, i in enumerate(ids) if i == tok.eos_id), None)
            ends = [j for j in (first_stop, first_eos) if j is not None]
            at_end = idx[-1] == tr.length - 1
            if ends:
                assert min(ends) == len(ids) - 1, "the turn ends at its first stop/EOS"
            else:
                assert len(ids) == cfg.max_turn_tokens or (tr.truncated and at_end)


@pytest.mark.parametrize("steps", [1, 3])
def test_engine_rollout_logp_equals_full_forward(model, fns, full_forward, steps):
    mdef, params = model
    cfg = EngineConfig(
        num_slots=4, max_len=L_MAX, max_turn_tokens=10, steps_per_sync=steps, record_routing=True
    )
    if steps == 1:
        eng = Engine(fns, FakeTokenizer(), TurnEnv, cfg)
    else:
        eng = Engine.create(mdef, FakeTokenizer(), TurnEnv, cfg)
    trajs, drops = eng.run(params, prompts(11, turns=3), version=7)
    assert not drops and len(trajs) == 11
    assert sorted(t.prompt_uid for t in trajs) == sorted(f"p{i}" for i in range(11))
    batch, ref_logp, ref_experts, _ = reference_logp(full_forward, trajs)
    am = batch["action_mask"]
    np.testing.assert_allclose(batch["rollout_logp"][am], ref_logp[am], atol=1e-4)
    for b, tr in enumerate(trajs):
        assert np.all(tr.versions == 7)
        recorded = tr.experts[:, 0, 0] >= 0
        assert recorded[:-1].all() and not recorded[-1], "all but the final token are fed"
        np.testing.assert_array_equal(tr.experts[:-1], ref_experts[b, : tr.length - 1])
        obs = ~tr.action_mask
        obs[: np.argmax(tr.action_mask)] = False  # after the prompt
        if tr.terminated:
            assert tr.num_turns == 3 and tr.outcome == 3.0
            np.testing.assert_array_equal(tr.turn_rewards, [1.0, 2.0, 3.0])
            text = FakeTokenizer().decode(tr.tokens[obs])
            assert text == "<1><2>"
    check_turn_ends(FakeTokenizer(), trajs, cfg)
    assert eng.fns.traces["decode"] == 1
    assert eng.fns.traces["prefill"] <= len(cfg.buckets)


def test_engine_greedy_is_argmax_and_seeded_runs_repeat(model, fns, full_forward):
    params = model[1]
    base = dict(num_slots=4, max_len=L_MAX, max_turn_tokens=10, record_routing=True)
    greedy = Engine(fns, FakeTokenizer(), TurnEnv, EngineConfig(temperature=0.0, **base))
    trajs, _ = greedy.run(params, prompts(5, seed=1))
    batch, _, _, logits = reference_logp(full_forward, trajs)
    am_bt = batch["action_mask"][:, 1:]
    argmax_bt = logits[:, :-1].argmax(-1)  # greedy choice after each prefix
    np.testing.assert_array_equal(batch["tokens"][:, 1:][am_bt], argmax_bt[am_bt])

    def run(seed):
        eng = Engine(fns, FakeTokenizer(), TurnEnv, EngineConfig(top_p=0.9, **base), seed=seed)
        return [t.tokens for t in eng.run(params, prompts(6, seed=2))[0]]

    a, b, c = run(3), run(3), run(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
