"""The native generation backend (sao_jax/sampling/backend_native.py): many callers share
the engine's slots; per-request limits, stop ids, streaming, cancel, weight publication;
the recorded log-probs are the model's (a teacher-forced forward pass recomputes them)."""

import concurrent.futures
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.backend import BackendBusy, GenerationError, GenRequest
from sao_jax.sampling.backend_native import NativeBackend
from sao_jax.sampling.engine import EngineConfig
from tests.sampling_support import MODEL, FakeTokenizer


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


class NoEos(FakeTokenizer):
    """The fake tokenizer without an end-of-turn token: requests end at their limits."""

    eos_id = -1


@pytest.fixture(scope="module")
def backend(model):
    mdef, params = model
    cfg = EngineConfig(num_slots=4, max_len=48, steps_per_sync=2, top_k=0, top_p=1.0)
    b = NativeBackend(mdef, params, FakeTokenizer(), cfg, seed=1, max_pending=64)
    yield b
    b.close()


def _recomputed_logp(mdef, params, ids, width=48, full=False):
    """log_softmax(logits[t - 1])[ids[t]] of a teacher-forced pass, per token (slow ref;
    one compiled program: the ids padded to `width`, causal so the padding is unseen)."""

    def logp_tv(p, tok_1t):
        logits = mdef.bind(p)(tok_1t, jnp.arange(width)[None], jnp.ones_like(tok_1t)).out[0]
        return jax.nn.log_softmax(logits, axis=-1)

    fn = _forward.setdefault(id(mdef), jax.jit(logp_tv))
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(ids)] = ids
    logp = np.asarray(fn(params, tokens))
    if full:  # [T, V]: row t predicts token t + 1
        return logp
    return np.asarray([logp[i - 1, ids[i]] for i in range(1, len(ids))])


_forward = {}


def test_concurrent_requests_share_slots(model, backend):
    mdef, params = model
    prompts = [tuple(int(x) for x in np.arange(4, 4 + 3 + i % 5)) for i in range(16)]
    pool = concurrent.futures.ThreadPoolExecutor(16)
    handles = list(pool.map(lambda p: backend.submit(GenRequest(p, max_tokens=6)), prompts))
    results = [h.future.result(timeout=120) for h in handles]
    pool.shutdown()
    stats = backend.stats()
    assert stats["max_active_slots"] > 1, stats
    assert stats["mean_active_slots"] > 1, stats
    for prompt, res in zip(prompts, results, strict=True):
        n = len(res.token_ids)
        assert 1 <= n <= 6
        assert len(res.rollout_logp) == len(res.sampled_logp) == len(res.versions) == n
        assert res.finish_reason == ("stop" if res.token_ids[-1] == 2 else "length")
        assert 2 not in res.token_ids[:-1]  # eos ends the request
        assert res.versions == [0] * n
        ref = _recomputed_logp(mdef, params, list(prompt) + res.token_ids)[len(prompt) - 1 :]
        np.testing.assert_allclose(res.rollout_logp, ref, atol=2e-5)
        assert all(s <= 0 for s in res.sampled_logp)


def test_stop_ids_streaming_and_limits(backend):
    chunks, lock = [], threading.Lock()

    def on_tokens(c):
        with lock:
            chunks.append(c)

    req = GenRequest((5, 6, 7), max_tokens=9, stop_ids=frozenset(range(4, 32)))
    res = backend.submit(req, on_tokens).future.result(timeout=60)
    # every id but pad/bos/eos/unk is a stop id: one token unless 0..3 came first
    assert res.finish_reason == "stop" or len(res.token_ids) == 9
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == res.token_ids
    assert [x for c in chunks for x in c.rollout_logp] == res.rollout_logp
    with pytest.raises(GenerationError, match="max_len=48"):
        backend.submit(GenRequest(tuple([5] * 48), max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        GenRequest((5,), max_tokens=0)


def test_cancel_frees_the_slot(model):
    """Cancelled in its slot (or still queued): 'cancelled' with the tokens so far; the
    slot is free and the backend goes on serving."""
    mdef, params = model
    cfg = EngineConfig(num_slots=4, max_len=48, steps_per_sync=2)
    b = NativeBackend(mdef, params, NoEos(), cfg, seed=1)
    try:
        started = threading.Event()
        h = b.submit(GenRequest((5, 6), max_tokens=40), lambda c: started.set())
        queued = b.submit(GenRequest((5, 6), max_tokens=40))
        queued.cancel()  # may still wait for a slot
        assert started.wait(60)
        h.cancel()
        res = h.future.result(timeout=60)
        assert res.finish_reason == "cancelled" and 1 <= len(res.token_ids) < 40
        assert len(res.rollout_logp) == len(res.token_ids)
        assert queued.future.result(timeout=60).finish_reason == "cancelled"
        assert b.submit(GenRequest((5,), max_tokens=3)).future.result(timeout=60).finish_reason \
            == "length"  # fmt: skip
        stats = b.stats()
        assert stats["active_slots"] == 0 and stats["cancelled"] == 2
    finally:
        b.close()


def test_publish_tags_versions(model, backend):
    params = model[1]
    backend.publish(jax.tree.map(lambda x: x * 1.01, params), 3)
    assert backend.version == 3
    res = backend.submit(GenRequest((5, 6), max_tokens=3)).future.result(timeout=60)
    assert set(res.versions) == {3}


def test_busy_queue(model):
    mdef, params = model
    cfg = EngineConfig(num_slots=1, max_len=16)
    b = NativeBackend(mdef, params, FakeTokenizer(), cfg, max_pending=1)
    try:
        with b._cond:  # hold the thread off so the queue stays full
            b.submit(GenRequest((5,), max_tokens=2))
            with pytest.raises(BackendBusy):
                b.submit(GenRequest((5,), max_tokens=2))
    finally:
        b.close()


def test_per_request_sampling(model, backend):
    """A greedy request and a temperature-1 one decode together, each with its own law:
    the greedy one takes the argmax (sampled_logp 0), the other samples the full
    temperature-1 distribution (sampled_logp == rollout_logp)."""
    mdef, params = model
    greedy = GenRequest((5, 6, 7), max_tokens=6, temperature=0.0)
    free = GenRequest((8, 9), max_tokens=6, temperature=1.0, top_p=1.0)
    hg, hf = backend.submit(greedy), backend.submit(free)
    rg, rf = hg.future.result(timeout=60), hf.future.result(timeout=60)
    assert rg.sampling["temperature"] == 0.0 and rf.sampling["temperature"] == 1.0
    assert rg.sampled_logp == [0.0] * len(rg.token_ids)
    np.testing.assert_allclose(rf.sampled_logp, rf.rollout_logp, atol=1e-5)
    ids = [5, 6, 7, *rg.token_ids]
    logp = _recomputed_logp(mdef, params, ids, full=True)
    assert [int(np.argmax(logp[i])) for i in range(2, len(ids) - 1)] == rg.token_ids[: len(ids) - 3]
    with pytest.raises(ValueError, match="top_p"):
        GenRequest((5,), max_tokens=1, top_p=0.0)
