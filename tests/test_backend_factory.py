"""`sampling.backend` -> the run's backend (sao_jax/sampling/backend_factory.py), and the
start-up refusals of a vLLM run (sao_jax/sampling/vllm_config.py): one line naming the
field, before anything starts (no vLLM env needed: the checks that need none come first).
"""

import json
import sys

import pytest
from flax import nnx

from sao_jax import config as config_lib
from sao_jax import defaults
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.sampling import backend_factory, backend_vllm
from sao_jax.sampling.backend import GenerationError, GenHandle, GenRequest
from sao_jax.sampling.backend_native import NativeBackend
from sao_jax.sampling.engine import generate_fns
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.schema import ConfigError
from tests import train_support as ts
from tests.sampling_support import MODEL, FakeTokenizer

VLLM_SHAPES = dict(hidden_size=64, head_dim=64, moe_intermediate_size=32)


def _config(**overrides):
    return ts.with_fields(defaults.default_config(), overrides)


def _vllm(**overrides):
    """A vLLM run's config with shapes vLLM takes and this interpreter (no vllm in it)."""
    model = {f"model__{k}": v for k, v in VLLM_SHAPES.items()}
    return _config(sampling__backend="vllm", sampling__vllm__python=sys.executable,
                   **{**model, **overrides})  # fmt: skip


@pytest.fixture(scope="module")
def policy():
    return init_params(lambda: Policy(MODEL, rngs=nnx.Rngs(0)), Sharder())


def test_native_runs_keep_the_samplers_engine_and_serve_the_native_backend(policy, tmp_path):
    mdef, params = policy
    c = _config()
    kw = dict(mdef=mdef, tokenizer=FakeTokenizer(), workdir=tmp_path, seed=0)
    assert backend_factory.run_backend(c, **kw).sampler() is None
    c.gateway.admit_gap_s, c.gateway.admit_wait_s = 0.05, 0.5  # the gateway's admission
    backend = backend_factory.backend_builder(c, **kw)(params, 3)
    try:
        assert isinstance(backend, NativeBackend) and backend.version == 3
        assert backend.max_len == c.sampling.max_len
        assert (backend.admit_gap_s, backend.admit_wait_s) == (0.05, 0.5)
    finally:
        backend.close()
    # a training run's backend runs the run's programs (train.py: the evaluator's too)
    fns = generate_fns(mdef, configs_from_section(c.sampling, 0)[0])
    run = backend_factory.run_backend(c, **kw, fns=fns)
    try:
        lent = run(params, 0)
        assert lent._engine.fns is fns
        done = lent.submit(GenRequest((1, 2, 3), 4)).future.result(timeout=60)
        assert 1 <= len(done.token_ids) <= 4
    finally:
        run.close()


@pytest.mark.parametrize(
    "gap, wait, field",
    [(-0.01, 0.2, "gateway.admit_gap_s"), (0.3, 0.2, "gateway.admit_wait_s")],
)
def test_bad_admission_windows_are_refused_naming_the_field(gap, wait, field):
    with pytest.raises(ConfigError, match=f"config field {field}: must be >="):
        config_lib.validate(_config(gateway__admit_gap_s=gap, gateway__admit_wait_s=wait))


def test_vllm_runs_build_the_vllm_backend_with_the_runs_settings(policy, tmp_path, monkeypatch):
    mdef, params = policy
    built = []

    class Recorder:
        def __init__(self, cfg, model_cfg, params, **kw):
            built.append((cfg, model_cfg, kw))

    monkeypatch.setattr(backend_vllm, "VllmBackend", Recorder)
    hf_dir = tmp_path / "ckpt"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    c = _vllm(sampling__temperature=0.7, sampling__top_p=0.9, sampling__vllm__max_num_seqs=3,
              sampling__record_routing=True, rl__routing_replay=True,
              init__kind="hf", init__hf_path=str(hf_dir))  # fmt: skip
    replay = _vllm(sampling__record_routing=True, rl__routing_replay=True)
    with pytest.raises(ConfigError, match=r"sampling\.vllm\.python: .* has no vllm"):
        config_lib.validate(replay)  # routing replay on vLLM rollouts passes every other check
    kw = dict(mdef=mdef, tokenizer=FakeTokenizer(), workdir=tmp_path, seed=5)
    assert isinstance(backend_factory.run_backend(c, **kw).sampler(), backend_factory.RunBackend)
    build = backend_factory.backend_builder(c, **kw)
    build(params, 4)
    build(params, 7)
    (cfg, model_cfg, a), (_, _, b) = built
    assert cfg.max_num_seqs == 3 and cfg.python == sys.executable
    assert model_cfg.vocab_size == MODEL.vocab_size
    assert (a["max_len"], a["eos_id"], a["version"], a["seed"]) == (c.sampling.max_len, 2, 4, 5)
    assert (a["temperature"], a["top_p"]) == (0.7, 0.9)
    assert a["base_config"] == {"eos_token_id": 2, "bos_token_id": 1}
    assert a["workdir"] != b["workdir"] and a["workdir"].startswith(str(tmp_path / "vllm"))
    assert a["decode"]([5, 6]) == FakeTokenizer().decode([5, 6])  # the run's stop strings
    assert a["record_routing"] and not _vllm().sampling.record_routing


def test_a_gateway_run_with_routing_records_is_refused_naming_the_field():
    """The gateway's episodes carry no routing records: replay would force pad experts."""
    with pytest.raises(ConfigError, match=r"config field sampling\.record_routing: gateway"):
        config_lib.validate(
            _config(gateway__mode="live", sampling__record_routing=True, rl__routing_replay=True)
        )


class _Recorded:
    """A backend that records its publications and close; cancel() cancels the future."""

    max_len = 64

    def __init__(self, version):
        self.version, self.published, self.closed = version, [], False

    def submit(self, request, on_tokens=None):
        return GenHandle(request, lambda handle: handle.future.cancel())

    def publish(self, params, version):
        self.published.append(version)
        self.version = version

    def stats(self):
        return {"submitted": 2}

    def close(self):
        self.closed = True


def test_a_runs_backend_is_built_once_lent_to_each_source_and_closed_by_the_run():
    """Value pretraining's source, then the RL loop's, on one backend (one vLLM server):
    a source's close() cancels its own requests in flight and leaves the backend up; a
    source on the version served publishes nothing, a newer one publishes; the run's
    close() closes it (tests/test_vllm_backend.py: the same on a real server)."""
    built = []
    run = backend_factory.RunBackend(
        lambda params, version: built.append(version) or _Recorded(version)
    )
    first = run("weights", 0)
    ended = first.submit(GenRequest((1, 2), max_tokens=4))
    ended.future.set_result(None)
    live = first.submit(GenRequest((1, 2), max_tokens=4))
    first.close()
    assert live.future.cancelled() and not ended.future.cancelled()
    assert not run.backend.closed
    with pytest.raises(GenerationError, match="closed"):
        first.submit(GenRequest((1, 2), max_tokens=4))
    second = run("weights", 0)
    assert built == [0] and run.backend.published == []
    run("newer", 3)
    run("older", 2)
    assert run.backend.published == [3] and second.version == 3
    assert second.stats() == {"submitted": 2} and second.max_len == 64  # the backend's own
    backend = run.backend
    run.close()
    run.close()
    assert backend.closed and built == [0]
    with pytest.raises(GenerationError, match="the backend is closed"):
        run("weights", 4)
    assert backend_factory.RunBackend(run, native=True).sampler() is None


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"model__hidden_size": 48}, r"model\.hidden_size: 48 is not a multiple of 32"),
        ({"model__moe_intermediate_size": 48}, r"model\.moe_intermediate_size: 48 is not"),
        ({"model__head_dim": 16}, r"model\.head_dim: 16 is not 64"),
        ({"sampling__vllm__dtype": "float32"}, r"sampling\.vllm\.dtype: float32 MoE"),
        ({"sampling__top_k": 20}, r"sampling\.top_k: .*set top_k=0"),
        ({"sampling__vllm__max_model_len": 64}, r"sampling\.vllm\.max_model_len: 64 < "),
        ({}, r"sampling\.vllm\.python: .* has no vllm package; run `make vllm-env`"),
    ],
)
def test_a_vllm_run_is_refused_at_start_up_naming_the_field(overrides, words):
    with pytest.raises(ConfigError, match=rf"config field {words}"):
        config_lib.validate(_vllm(**overrides))


def test_an_hf_checkpoints_shapes_are_named_by_its_config_json(tmp_path):
    dims = dict(hidden_size=64, num_attention_heads=4, moe_intermediate_size=32, num_experts=4)
    (tmp_path / "config.json").write_text(json.dumps(dims))  # head_dim: 64 / 4 = 16
    c = _vllm(init__kind="hf", init__hf_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"init\.hf_path \(.*config\.json\) field head_dim: 16"):
        config_lib.validate(c)


@pytest.mark.parametrize(
    "before, new, stops, want",
    [
        ([], [5, 6, 7], ("c",), 2),  # 'b', 'bc': the token completing it is kept
        ([5], [6, 7], ("bc",), 1),  # completed across the chunks
        ([5], [6, 7], ("x", "d"), 2),
        ([5], [6, 7], ("x",), None),
    ],
)
def test_stop_string_end_is_the_first_token_whose_completion_holds_one(before, new, stops, want):
    decode = FakeTokenizer().decode  # 4 + i -> chars[i]: 5 'b', 6 'c', 7 'd'
    assert backend_vllm.stop_string_end(decode, before, new, stops) == want
