"""`sampling.backend` and `sampling.vllm.*`: which engine generates, and vLLM's knobs.

`sampling.backend = 'native'` (the default) keeps the in-process JAX engine
(sao_jax/sampling/engine.py); `'vllm'` generates with vLLM's CPU build running in its own
virtualenv (`make vllm-env`, docs/vllm.md: its pins cannot share .venv/), through
sao_jax/sampling/backend_vllm.py. These fields are checked here, once, up front;
`FIELDS` are the `sampling` names this module owns (the sampler's own check skips them).
A run with `'vllm'` is also refused, naming the field, when the env's python is missing
or has no vllm package, when vLLM's CPU kernels refuse the policy's shapes (`check_model`)
and when it sets a sampling field vLLM cannot honour (`check_sampling`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from ml_collections import ConfigDict

from sao_jax.schema import ConfigError

FIELDS = ("backend", "vllm")  # in the `sampling` section
BACKENDS = ("native", "vllm")
# how a publication reaches the engine (docs/vllm.md): 'inplace' (CPU: shared memory),
# 'restart' (a new server), 'nccl' (GPU: NCCL broadcasts, checked for CUDA torch below). No
# 'tpu': the TPU sync (weight_sync_tpu.py) writes an engine in the trainer's process, and
# this backend's engine is a server in another process and environment (docs/vllm.md)
WEIGHT_SYNCS = ("inplace", "restart", "nccl")
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
    weight_sync: str = "inplace"  # a publication: 'inplace' (shared memory, worker
    # extension: sampling/vllm_worker_ext.py), 'restart' (a new server on the export) or
    # 'nccl' (GPU: sampling/weight_sync_nccl.py and vllm_worker_nccl.py; never run on one)


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
    if cfg.weight_sync not in WEIGHT_SYNCS:
        raise ConfigError(
            f"config field sampling.vllm.weight_sync: {cfg.weight_sync!r} is not one of "
            f"{WEIGHT_SYNCS}"
        )
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


_FIND_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def check_vllm_package(python: str) -> None:
    """ConfigError naming sampling.vllm.python unless `python` can import vllm (found,
    not imported: a few tens of milliseconds)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        found = subprocess.run([python, "-c", _FIND_VLLM], env=env, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"config field sampling.vllm.python: {python} failed: {e}") from None
    if not found:
        raise ConfigError(
            f"config field sampling.vllm.python: {python} has no vllm package; {SETUP_HINT}"
        )


# Exit 0 when the interpreter's torch is a CUDA build that sees a GPU; else one line why.
_CUDA_TORCH = (
    "import sys\n"
    "try:\n    import torch\n"
    "except ImportError as e:\n    print(f'no torch ({e})'); sys.exit(1)\n"
    "if torch.version.cuda is None:\n"
    "    print(f'torch {torch.__version__} is not a CUDA build'); sys.exit(1)\n"
    "if not torch.cuda.is_available():\n"
    "    print(f'torch {torch.__version__} sees no CUDA device'); sys.exit(1)\n"
)


def cuda_torch_problem(python: str) -> str | None:
    """Why `python` cannot run NCCL through torch (None: it can): no torch, a CPU build,
    or no CUDA device. Imports torch in that interpreter (a second or two)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        proc = subprocess.run(
            [python, "-c", _CUDA_TORCH], env=env, timeout=120, capture_output=True, text=True
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} failed: {e}"
    if proc.returncode == 0:
        return None
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def check_weight_sync(cfg: VllmConfig, python: str, trainer_python: str) -> None:
    """weight_sync='nccl' needs a CUDA torch that sees a GPU on both ends: the vLLM env
    (its workers receive) and the trainer's env (rank 0 sends through torch.cuda.nccl,
    weight_sync_nccl.TorchNccl). ConfigError naming the field and the cause otherwise."""
    if cfg.weight_sync != "nccl":
        return
    for who, exe in (("the vLLM env", python), ("the trainer's env", trainer_python)):
        problem = cuda_torch_problem(exe)
        if problem is not None:
            raise ConfigError(
                f"config field sampling.vllm.weight_sync: 'nccl' needs a CUDA torch on a GPU "
                f"host; {who} ({exe}): {problem} (on CPU use 'inplace')"
            )


# What vLLM 0.32's CPU kernels refuse (docs/vllm.md): "Unsupported CPU attention
# configuration" for head_dim 12 or 16, "No Unquantized MoE backend supports the
# deployment configuration" for hidden 48 and for float32 MoE weights.
CPU_MULTIPLE = 32  # hidden_size and moe_intermediate_size
CPU_HEAD_DIM = 64


def _model_dims(config: ConfigDict) -> tuple[dict, str]:
    """The policy's dims and how to name them: an `init.kind='hf'` run's checkpoint
    config.json ('init.hf_path's config.json field'), else `config.model`."""
    init = config.get("init")
    if init is not None and init.get("kind") == "hf" and init.get("hf_path"):
        path = os.path.join(init.hf_path, "config.json")
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, ValueError):
            return {}, ""  # init's own checks and the loader name the checkpoint
        heads = hf.get("num_attention_heads") or 1
        hf.setdefault("head_dim", hf.get("hidden_size", 0) // heads)
        return hf, f"init.hf_path ({path}) field "
    return config.model.to_dict(), "model."


def use_vllm(c: ConfigDict) -> None:
    """A run config's `vllm` variant (configs/sao.py, configs/harness.py): rollouts by
    vLLM's CPU build, on a small MoE of the shapes its CPU kernels take (`check_model`:
    hidden 64, expert width 32, head_dim 64; 2 / 1 heads, 4 experts, every layer MoE, as
    tests/test_vllm_backend.py's model), every episode decoding at once."""
    c.model.update(hidden_size=2 * CPU_MULTIPLE, num_attention_heads=2, num_key_value_heads=1)
    c.model.update(head_dim=CPU_HEAD_DIM, moe_intermediate_size=CPU_MULTIPLE, num_experts=4)
    c.model.mlp_only_layers = ()
    c.sampling.backend = "vllm"
    c.sampling.vllm.max_num_seqs = c.sampling.num_slots


def check_model(config: ConfigDict, cfg: VllmConfig) -> None:
    """ConfigError naming the field when vLLM's CPU kernels refuse the policy's shapes."""
    dims, where = _model_dims(config)
    if not dims:
        return
    why = "vLLM's CPU kernels refuse it (sampling.backend='vllm', docs/vllm.md)"
    moe = dims.get("num_experts", 0) > 0
    fields = ("hidden_size", "moe_intermediate_size") if moe else ("hidden_size",)
    for name in fields:
        value = dims.get(name, 0)
        if value % CPU_MULTIPLE:
            raise ConfigError(
                f"config field {where}{name}: {value} is not a multiple of {CPU_MULTIPLE}; {why}"
            )
    if dims.get("head_dim") != CPU_HEAD_DIM:
        raise ConfigError(
            f"config field {where}head_dim: {dims.get('head_dim')} is not {CPU_HEAD_DIM}; {why}"
        )
    if moe and cfg.dtype == "float32":
        raise ConfigError(f"config field sampling.vllm.dtype: float32 MoE weights; {why}")


def check_sampling(section: ConfigDict | dict, cfg: VllmConfig) -> None:
    """The `sampling` fields the vLLM backend cannot honour, named."""
    if section.get("top_k", 0):
        raise ConfigError(
            "config field sampling.top_k: the vllm backend samples with temperature and "
            "top_p only; set top_k=0"
        )
    max_len = section.get("max_len", 0)
    if cfg.max_model_len and cfg.max_model_len < max_len:
        raise ConfigError(
            f"config field sampling.vllm.max_model_len: {cfg.max_model_len} < "
            f"sampling.max_len={max_len} (0 = sampling.max_len)"
        )


def check_fields(section: ConfigDict | dict, config: ConfigDict | None = None) -> None:
    """The checks of `sampling.backend` and `sampling.vllm` (the vLLM env is checked only
    when the run uses vLLM, so a native run never needs it); with the run's `config`,
    the policy's shapes too."""
    backend = section.get("backend", "native")
    if backend not in BACKENDS:
        raise ConfigError(f"config field sampling.backend: {backend!r} is not one of {BACKENDS}")
    cfg = vllm_config(section.get("vllm"))
    if backend == "vllm":
        python = check_python(cfg)
        check_sampling(section, cfg)
        if config is not None and cfg.weight_sync != "nccl":  # GPU kernels: not these
            check_model(config, cfg)
        check_weight_sync(cfg, python, sys.executable)
        check_vllm_package(python)
