"""The in-process rollouts on a generation backend (sao_jax/sampling/backend_engine.py):
the engine's episodes with a backend's tokens, checked with the native backend in
process (the logic is the backend's interface, whichever backend answers) and with a
scripted backend for what only vLLM does (a publication that interrupts requests).

* greedy episodes on the native backend equal the native engine's, token for token
  (multi-turn, stop strings, observations appended as ids, versions, rewards), with the
  same rollout log-probs;
* the async sampler on a backend: trajectories as from its engines, tokens' versions
  follow the publications, rollout log-probs are the policy's (a teacher-forced pass);
* the synchronous rollouts on a backend: each take on the published version;
* an interrupted request is asked again from the context it reached: no token lost or
  repeated, the streamed tokens keep their version; another failure ends the step, and
  in the async sampler the learner's take (SamplerError naming it).
"""

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.backend import (
    GenChunk,
    GenerationError,
    GenHandle,
    GenRequest,
    GenResult,
    RequestInterrupted,
)
from sao_jax.sampling.backend_engine import BackendEngine, SharedBackend
from sao_jax.sampling.backend_native import NativeBackend
from sao_jax.sampling.engine import Engine, EngineConfig
from sao_jax.sampling.rollouts import SyncRollouts
from sao_jax.sampling.sampler import AsyncSampler, SamplerConfig, SamplerError
from tests.sampling_support import MODEL, FakeTokenizer, TurnEnv, prompts

CFG = EngineConfig(num_slots=4, max_len=64, max_turn_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


@pytest.fixture(scope="module")
def native(model):
    """One native backend for the module (compiled once); tests publish increasing
    versions to it, and `builder` hands it to a SharedBackend that cannot close it."""
    mdef, params = model
    backend = NativeBackend(mdef, params, FakeTokenizer(), CFG, version=0, seed=1)
    yield backend
    backend.close()


class _Kept:
    """A backend whose close() leaves the module's backend running."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def close(self):
        pass


def builder(native):
    def build(params, version):
        if version > native.version:
            native.publish(params, version)
        return _Kept(native)

    return build


def _teacher_forced_logp(mdef, params, ids, width=CFG.max_len):
    """log_softmax(logits[t - 1])[ids[t]] for t >= 1, 0 at t = 0 (a slow reference, fp32;
    one compiled program: the ids padded to `width`, causal so the padding is unseen)."""
    if mdef not in _FORWARD:
        _FORWARD[mdef] = jax.jit(
            lambda p, t: jax.nn.log_softmax(mdef.bind(p)(t).out[0].astype(jnp.float32), -1)
        )
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(ids)] = ids
    logp = np.asarray(_FORWARD[mdef](params, tokens))
    return np.asarray([0.0] + [logp[t - 1, ids[t]] for t in range(1, len(ids))])


_FORWARD = {}


def test_greedy_episodes_equal_the_native_engines(model, native):
    mdef, params = model
    ps = prompts(6, seed=1, turns=3)
    ref, drops = Engine.create(mdef, FakeTokenizer(), TurnEnv, CFG, seed=3).run(params, ps, 1)
    assert not drops
    shared = SharedBackend(builder(native))
    eng = BackendEngine(shared, FakeTokenizer(), TurnEnv, CFG, vocab_size=MODEL.vocab_size)
    got, drops = eng.run(params, ps, version=1)
    assert not drops and native.version == 1
    ref = sorted(ref, key=lambda t: t.prompt_uid)
    got = sorted(got, key=lambda t: t.prompt_uid)
    assert [t.prompt_uid for t in got] == [p.uid for p in ps]
    assert max(t.num_turns for t in got) >= 2  # observations were appended as ids
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(b.tokens, a.tokens)
        np.testing.assert_array_equal(b.action_mask, a.action_mask)
        np.testing.assert_array_equal(b.turn_ids, a.turn_ids)
        np.testing.assert_array_equal(b.versions, a.versions)
        np.testing.assert_array_equal(b.turn_rewards, a.turn_rewards)
        np.testing.assert_allclose(b.rollout_logp, a.rollout_logp, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(b.sampled_logp, a.sampled_logp)  # greedy: 0
        assert (b.terminated, b.outcome, b.info["truncation"]) == (
            a.terminated,
            a.outcome,
            a.info["truncation"],
        )


def test_async_sampler_on_a_backend_records_the_policys_logps_and_versions(model, native):
    mdef, params = model
    cfg = EngineConfig(num_slots=4, max_len=64, max_turn_tokens=10)  # the backend's law
    sampler = AsyncSampler(
        mdef,
        FakeTokenizer(),
        TurnEnv,
        iter(prompts(400, seed=2, turns=2)),
        engine=cfg,
        config=SamplerConfig(queue_size=4, max_staleness=1),
        backend=builder(native),
    )
    v0 = native.version + 1
    new = jax.tree.map(lambda x: x * 1.3, params)
    with sampler:
        sampler.publish(params, v0)
        first = sampler.take(4, timeout=60)
        sampler.publish(new, v0 + 1)
        later = sampler.take(8, timeout=60)
    assert native.version == v0 + 1
    for t in first + later:
        acts = t.versions[t.action_mask]
        assert np.all(np.diff(acts) >= 0) and set(acts) <= {v0, v0 + 1}
        assert np.all(t.rollout_logp[~t.action_mask] == 0)
    assert any(t.min_version == v0 + 1 for t in later)
    for t in first + later:  # the recorded log-probs are the sampling policy's
        if len(set(t.versions[t.action_mask])) == 1:
            p = params if t.versions[t.action_mask][0] == v0 else new
            want = _teacher_forced_logp(mdef, p, list(t.tokens))
            np.testing.assert_allclose(
                t.rollout_logp[t.action_mask], want[t.action_mask], atol=1e-4, rtol=0
            )
    assert sampler.stats()["generated"] >= 12


class _Listed:
    """A prompt list with the get_state / set_state the synchronous rollouts read."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def __next__(self):
        self.i += 1
        return self.items[self.i - 1]

    def get_state(self):
        return self.i

    def set_state(self, i):
        self.i = i


def test_sync_rollouts_on_a_backend_take_on_the_published_version(model, native):
    mdef, params = model
    source = SyncRollouts(mdef, FakeTokenizer(), TurnEnv, _Listed(prompts(8, seed=3, turns=2)),
                          CFG, backend=builder(native))  # fmt: skip
    v = native.version + 1
    source.publish(params, v)
    trajs = source.take(4)
    assert sorted(t.prompt_uid for t in trajs) == ["p0", "p1", "p2", "p3"]  # the next four
    assert all(set(t.versions) == {v} for t in trajs) and native.version == v
    assert source.stats()["taken"] == 4
    source.stop()


class _Scripted:
    """A backend that streams `burst` tokens per request at once, then resolves the
    request if that was all it asked for, else leaves it open; `publish` fails the open
    ones with `failure` (RequestInterrupted: vLLM's restart). Token t of a context of n
    ids is 5 + n % 4 ('b'..'e': no stop string, no eos)."""

    max_len, eos_id = 64, 2

    def __init__(self, burst: int, failure=RequestInterrupted, layers: int = 0):
        self.burst, self.failure = burst, failure
        self.layers = layers  # > 0: report routing as the vLLM backend does (record_routing)
        self.version = 0
        self.requests: list[GenRequest] = []
        self.computed: list[range] = []  # the positions each request computed (layers > 0)
        self._open: list[GenHandle] = []

    @staticmethod
    def experts(position: int, request: int, layers: int) -> list[list[int]]:
        """The script's experts [L, 2] of `position` computed by request number `request`."""
        return [[(position + request) % 4, (position + request + 1) % 4]] * layers

    def submit(self, request, on_tokens=None):
        self.requests.append(request)
        handle = GenHandle(request, lambda h: None)
        ctx = list(request.prompt_ids)
        ids = []
        for _ in range(min(self.burst, request.max_tokens)):
            ids.append(5 + len(ctx) % 4)
            ctx.append(ids[-1])
        n = len(ids)
        routing = None
        if self.layers:  # the prompt's positions and the sampled tokens fed back
            r, computed = len(self.requests) - 1, range(len(request.prompt_ids) + n - 1)
            routing = (list(computed), [self.experts(p, r, self.layers) for p in computed])
            self.computed.append(computed)
        on_tokens(GenChunk(ids, [-1.0] * n, [-1.0] * n, [self.version] * n, routing))
        if n == request.max_tokens:
            handle.future.set_result(
                GenResult(ids, [-1.0] * n, [-1.0] * n, [self.version] * n, "length", {})
            )
        else:
            self._open.append(handle)
        return handle

    def publish(self, params, version):
        self.version = version
        for h in self._open:
            if not h.future.done():
                h.future.set_exception(self.failure("weights published: engine restarted"))
        self._open = []

    def stats(self):
        return {}

    def close(self):
        pass


def _one_prompt():
    return iter(prompts(1, seed=5, turns=2))


def _interrupted_episode(scripted, eng):
    """One 2-turn episode whose first request streams 3 tokens of version 0 and is then
    interrupted by publishing version 1 (asked again from its 3 tokens); its trajectory."""
    it = _one_prompt()
    eng.step(None, 0, lambda: next(it, None))  # 3 tokens of version 0, request open
    eng.step(None, 1, lambda: None)  # publication: interrupted
    scripted.burst = 100
    finished = []
    for _ in range(10):
        finished += eng.step(None, 1, lambda: None).finished
        if finished:
            break
    (traj,) = finished
    return traj


def test_an_interrupted_turn_continues_from_its_streamed_tokens():
    scripted = _Scripted(burst=3)
    eng = BackendEngine(SharedBackend(lambda p, v: scripted), FakeTokenizer(), TurnEnv, CFG,
                        vocab_size=32, poll_s=0.01)  # fmt: skip
    traj = _interrupted_episode(scripted, eng)
    first, second = scripted.requests[:2]
    n = len(first.prompt_ids)
    assert second.prompt_ids == first.prompt_ids + tuple(int(t) for t in traj.tokens[n : n + 3])
    assert second.max_tokens == first.max_tokens - 3
    turn0 = traj.turn_ids == 0
    assert turn0.sum() == CFG.max_turn_tokens  # nothing lost, nothing repeated
    assert list(traj.versions[turn0]) == [0] * 3 + [1] * 7
    want = [5 + i % 4 for i in range(len(traj.tokens))]  # the script, position by position
    np.testing.assert_array_equal(traj.tokens[traj.action_mask], np.asarray(want)[traj.action_mask])
    assert traj.num_turns == 2 and traj.terminated
    assert eng.stats()["resubmitted"] == 1


def test_routing_records_keep_each_positions_first_computation():
    """record_routing on a backend that reports experts (the vLLM backend's
    `record_routing`): every position but the last holds the experts of the first request
    that computed it, through a publication's resubmission and the next turn's request
    (which compute the earlier positions again, routed otherwise here)."""
    scripted = _Scripted(burst=3, layers=2)
    cfg = dataclasses.replace(CFG, record_routing=True)
    eng = BackendEngine(SharedBackend(lambda p, v: scripted), FakeTokenizer(), TurnEnv, cfg,
                        vocab_size=32, routing_lk=(2, 2), poll_s=0.01)  # fmt: skip
    traj = _interrupted_episode(scripted, eng)
    assert len(scripted.requests) == 3 and traj.experts.shape == (len(traj.tokens), 2, 2)
    first = {}  # position -> the first request that computed it
    for r, computed in enumerate(scripted.computed):
        for p in computed:
            first.setdefault(p, r)
    n = len(traj.tokens)
    want = np.asarray([_Scripted.experts(p, first[p], 2) for p in range(n - 1)])
    np.testing.assert_array_equal(traj.experts[: n - 1], want)
    assert (traj.experts[n - 1] == -1).all()  # never fed: no record (batch padding)
    with pytest.raises(ValueError, match="no MoE layers"):
        BackendEngine(SharedBackend(lambda p, v: scripted), FakeTokenizer(), TurnEnv, cfg,
                      vocab_size=32)  # fmt: skip


def test_a_failed_backend_ends_the_step_naming_it():
    scripted = _Scripted(burst=3, failure=GenerationError)
    eng = BackendEngine(SharedBackend(lambda p, v: scripted), FakeTokenizer(), TurnEnv, CFG,
                        vocab_size=32, poll_s=0.01)  # fmt: skip
    it = _one_prompt()
    eng.step(None, 0, lambda: next(it, None))
    with pytest.raises(GenerationError, match="generation backend failed.*restarted"):
        eng.step(None, 1, lambda: None)


def test_shared_backend_is_built_once_and_published_to_in_order():
    built, published = [], []

    class Recorder:
        version = 0

        def publish(self, params, version):
            published.append(version)
            self.version = version

        def close(self):
            built.append("closed")

    def build(params, version):
        built.append(version)
        return Recorder()

    shared = SharedBackend(build)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda v: shared.serve(None, 0), range(8)))
    shared.serve(None, 2)
    shared.serve(None, 1)  # older than what it serves: nothing
    shared.close()
    assert built == [0, "closed"] and published == [2]
    with pytest.raises(GenerationError, match="closed"):
        shared.serve(None, 3)


def test_a_backend_that_fails_surfaces_in_the_learners_take(model):
    mdef, _ = model
    scripted = _Scripted(burst=2, failure=GenerationError)
    sampler = AsyncSampler(mdef, FakeTokenizer(), TurnEnv, iter(prompts(8, seed=4)),
                           engine=CFG, backend=lambda p, v: scripted)  # fmt: skip
    with sampler:
        sampler.publish({}, 0)
        sampler.publish({}, 1)  # fails the open requests: the server "died"
        with pytest.raises(SamplerError, match="GenerationError: .*backend failed"):
            sampler.take(1, timeout=30)
