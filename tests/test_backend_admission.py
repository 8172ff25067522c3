"""The native backend's admission window (sao_jax/sampling/backend_native.py, Admission):
a burst of concurrent requests takes its slots in one admission, its prompts prefilled
together (fewer prefill calls than requests); a lone request waits for the quiet gap only;
a stream with no pause starts after `admit_wait_s`; while slots decode, everything waiting
at a step's start joins at that step. The window runs on a fake clock that only the test
moves, so what is asserted never depends on timing."""

import threading

import pytest
from flax import nnx

from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling.backend import GenRequest
from sao_jax.sampling.backend_native import NativeBackend, check_admission
from sao_jax.sampling.engine import EngineConfig, row_groups
from tests.sampling_support import MODEL, FakeTokenizer

GAP, WAIT = 0.005, 0.02  # the window under test (seconds of the fake clock)
SLOTS = 16


class NoEos(FakeTokenizer):
    """No end-of-turn token: every request runs to its max_tokens (a held request cannot
    end early)."""

    eos_id = -1


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def backend(clock):
    mdef, params = init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())
    cfg = EngineConfig(num_slots=SLOTS, max_len=24, steps_per_sync=2)
    b = NativeBackend(mdef, params, NoEos(), cfg, seed=1, admit_gap_s=GAP,
                      admit_wait_s=WAIT, clock=clock)  # fmt: skip
    yield b
    b.close()


def _counts(backend) -> tuple[int, int]:
    stats = backend.stats()
    return stats.get("admissions", 0), stats["prefill_calls"]


def _requests(n: int, max_tokens: int = 3) -> list[GenRequest]:
    return [GenRequest((5, 6, 7 + i % 4), max_tokens=max_tokens) for i in range(n)]


def test_a_burst_is_admitted_whole(backend, clock):
    """12 requests from 12 threads, none admitted while the clock stands still (the
    burst has not gone quiet); once it moves past the gap, one admission whose 12 rows
    are prefilled in row_groups' calls (8 + 4): 2 prefill calls for 12 requests."""
    admissions, prefills = _counts(backend)
    handles, lock = [], threading.Lock()

    def call(request):
        h = backend.submit(request)
        with lock:
            handles.append(h)

    threads = [threading.Thread(target=call, args=(r,)) for r in _requests(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _counts(backend) == (admissions, prefills)  # the window is still open
    clock.t += GAP
    for h in handles:
        assert h.future.result(timeout=120).finish_reason == "length"
    assert _counts(backend) == (admissions + 1, prefills + len(row_groups(list(range(12)))))
    assert len(row_groups(list(range(12)))) == 2


def test_a_lone_request_waits_for_the_gap_only(backend, clock):
    admissions, _ = _counts(backend)
    h = backend.submit(_requests(1)[0])
    clock.t += GAP  # not WAIT: the gap closes the window
    h.future.result(timeout=60)
    assert _counts(backend)[0] == admissions + 1


def test_a_stream_without_pause_starts_after_admit_wait(backend, clock):
    """Arrivals every GAP / 2 never leave a quiet gap; the oldest's WAIT ends the window
    with every request that came so far in one admission."""
    admissions, _ = _counts(backend)
    handles = [backend.submit(_requests(1)[0])]
    start = clock.t
    while clock.t + GAP / 2 < start + WAIT:
        clock.t += GAP / 2
        handles.append(backend.submit(_requests(1)[0]))
        assert _counts(backend)[0] == admissions  # still open: never quiet, not WAIT yet
    clock.t = start + WAIT
    for h in handles:
        h.future.result(timeout=60)
    assert _counts(backend)[0] == admissions + 1


def test_requests_waiting_while_slots_decode_join_at_the_next_step(backend, clock):
    """A long request decodes; its token callback (on the backend thread) holds the thread
    between two steps while 6 requests arrive; they all take slots at the next step: one
    admission, 6 rows prefilled in row_groups' calls (4 + 2), though the clock never moves
    (a step is their window)."""
    gate, started = threading.Event(), threading.Event()

    def hold(chunk):
        started.set()
        assert gate.wait(60)

    long = backend.submit(GenRequest((5, 6), max_tokens=12), hold)
    clock.t += GAP
    assert started.wait(60)
    admissions, prefills = _counts(backend)
    burst = [backend.submit(r) for r in _requests(6)]
    gate.set()
    for h in burst:
        h.future.result(timeout=60)
    long.future.result(timeout=60)
    assert _counts(backend) == (admissions + 1, prefills + 2)


@pytest.mark.parametrize(
    "gap, wait, field", [(-0.001, 0.02, "admit_gap_s"), (0.01, 0.005, "admit_wait_s")]
)
def test_bad_windows_name_their_field(gap, wait, field):
    with pytest.raises(ValueError, match=field):
        check_admission(gap, wait)
