"""`sampling.backend` / `sampling.vllm.*` (sao_jax/sampling/vllm_config.py): the default
keeps the native engine, and every bad value fails validation naming its field."""

import pytest

from sao_jax import config as config_lib
from sao_jax import defaults
from sao_jax.schema import ConfigError
from tests import train_support as ts


def _validated(**overrides):
    return config_lib.validate(ts.with_fields(defaults.default_config(), overrides))


def test_default_backend_is_native_and_needs_no_vllm_env():
    c = _validated(sampling__vllm__python="/nonexistent/python")
    assert c.sampling.backend == "native"


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        ({"sampling__backend": "sglang"}, "sampling.backend", "not one of"),
        ({"sampling__vllm__dtype": "int8"}, "sampling.vllm.dtype", "not one of"),
        ({"sampling__vllm__max_model_len": -1}, "sampling.vllm.max_model_len", ">= 0"),
        ({"sampling__vllm__port": 70000}, "sampling.vllm.port", "<= 65535"),
        ({"sampling__vllm__omp_threads": 0}, "sampling.vllm.omp_threads", "> 0"),
        ({"sampling__vllm__kv_cache_gib": 0}, "sampling.vllm.kv_cache_gib", "> 0"),
        # no 'tpu': the TPU sync writes an in-process engine, not a server (docs/vllm.md)
        ({"sampling__vllm__weight_sync": "tpu"}, "sampling.vllm.weight_sync", "not one of"),
        (
            {"sampling__backend": "vllm", "sampling__vllm__python": "/nonexistent/python"},
            "sampling.vllm.python",
            "make vllm-env",
        ),
    ],
)
def test_bad_vllm_fields_fail_naming_the_field(overrides, field, words):
    with pytest.raises(ConfigError, match=rf"{field}\b.*{words}"):
        _validated(**overrides)


def test_unknown_vllm_field_is_named():
    from sao_jax.sampling import vllm_config

    with pytest.raises(ConfigError, match=r"sampling\.vllm\.gpu_util: unknown"):
        vllm_config.vllm_config({"gpu_util": 0.9})


def test_nccl_without_a_cuda_torch_exits_2_naming_the_field(capsys):
    """weight_sync='nccl' on a host whose vLLM env has a CPU torch (this interpreter's,
    standing in for it): exit 2 at start-up, one line naming the field and the cause."""
    import sys

    from sao_jax import cli

    c = ts.with_fields(
        defaults.default_config(),
        {
            "sampling__backend": "vllm",
            "sampling__vllm__python": sys.executable,
            "sampling__vllm__weight_sync": "nccl",
        },
    )
    with pytest.raises(SystemExit) as e:
        cli.guard(lambda _: config_lib.validate(c))([])
    lines = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    assert "config field sampling.vllm.weight_sync: 'nccl' needs a CUDA torch" in lines[0]
    assert f"the vLLM env ({sys.executable}): torch" in lines[0], lines[0]
    assert "not a CUDA build" in lines[0] or "sees no CUDA device" in lines[0], lines[0]
