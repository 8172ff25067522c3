"""`sampling.backend` and `sampling.vllm.*`: which engine generates, and vLLM's knobs.

`sampling.backend = 'native'` (the default) keeps the in-process JAX engine
(sao_jax/sampling/engine.py); `'vllm'` generates with vLLM's CPU build running in its own
virtualenv (`make vllm-env`, docs/vllm.md: its pins cannot share .venv/), through
sao_jax/sampling/backend_vllm.py. These fields are checked here, once, up front;
`FIELDS` are the `sampling` names this module owns (the sampler's own check skips them).
"""

from __future__ import annotations

import dataclasses
import os

from ml_collections import ConfigDict

from sao_jax.schema import ConfigError

FIELDS = ("backend", "vllm")  # in the `sampling` section
BACKENDS = ("native", "vllm")
DTYPES = ("bfloat16", "float16", "float32")  # vLLM's CPU MoE refuses float32 (docs/vllm.md)
SETUP_HINT = "run `make vllm-env` (docs/vllm.md)"


@dataclasses.dataclass(frozen=True)
class VllmConfig:
    """vLLM's knobs; the defaults suit this project's 2-core CPU box."""

    python: str = ".vllm-venv/bin/python"  # the vLLM env's interpreter (make vllm-env)
    dtype: str = "bfloat16"  # weights and activations in the engine
    max_model_len: int = 0  # prompt + completion tokens per request; 0 = sampling.max_len
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the KV cache's reserved GiB (vLLM
    # takes whole GiB)
    port: int = 0  # VLLM_PORT, the base of the ports vLLM opens; 0 = a free one
    omp_threads: int = 1  # OpenMP threads of the engine (OMP_NUM_THREADS)
    max_num_seqs: int = 16  # requests decoded together
    startup_timeout_s: float = 300.0  # engine start (load + warm-up) before a clear error


def section() -> ConfigDict:
    """The `sampling.vllm` defaults (one comment per field: VllmConfig)."""
    return ConfigDict(dataclasses.asdict(VllmConfig()))


def _positive(name: str, value, kind=int, allow_zero=False) -> None:
    ok = isinstance(value, kind) and not isinstance(value, bool)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            f"config field sampling.vllm.{name}: must be a {kind.__name__} {bound}, got {value!r}"
        )


def vllm_config(section: ConfigDict | dict | None) -> VllmConfig:
    """VllmConfig from `sampling.vllm`; ConfigError names the bad field."""
    values = dict(section.to_dict() if isinstance(section, ConfigDict) else section or {})
    known = {f.name for f in dataclasses.fields(VllmConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config field sampling.vllm.{unknown[0]}: unknown vllm field")
    cfg = VllmConfig(**values)
    if not (isinstance(cfg.python, str) and cfg.python):
        raise ConfigError(f"config field sampling.vllm.python: must be a path, got {cfg.python!r}")
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"config field sampling.vllm.dtype: {cfg.dtype!r} is not one of {DTYPES}")
    _positive("max_model_len", cfg.max_model_len, allow_zero=True)
    _positive("port", cfg.port, allow_zero=True)
    if cfg.port > 65535:
        raise ConfigError(f"config field sampling.vllm.port: must be <= 65535, got {cfg.port}")
    _positive("omp_threads", cfg.omp_threads)
    _positive("max_num_seqs", cfg.max_num_seqs)
    _positive("kv_cache_gib", cfg.kv_cache_gib)
    for name in ("startup_timeout_s",):
        value = getattr(cfg, name)
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        _positive(name, value, kind=float)
    return cfg


def check_python(cfg: VllmConfig) -> str:
    """The vLLM env's interpreter as an absolute path; ConfigError when it is missing."""
    path = os.path.abspath(cfg.python)
    if not os.access(path, os.X_OK):
        raise ConfigError(
            f"config field sampling.vllm.python: {path} is not an executable; {SETUP_HINT}"
        )
    return path


def check_fields(section: ConfigDict | dict) -> None:
    """The checks of `sampling.backend` and `sampling.vllm` (the env's python is checked
    only when the run uses vLLM, so a native run never needs the vLLM env)."""
    backend = section.get("backend", "native")
    if backend not in BACKENDS:
        raise ConfigError(f"config field sampling.backend: {backend!r} is not one of {BACKENDS}")
    cfg = vllm_config(section.get("vllm"))
    if backend == "vllm":
        check_python(cfg)
