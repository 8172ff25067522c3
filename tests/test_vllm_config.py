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
