"""`sampling.backend` -> the run's generation backend: the one place one is built.

* `build_backend(kind, ...)`: a GenerationBackend (sao_jax/sampling/backend.py) of that
  kind on the given weights: 'native' the in-process JAX engine (backend_native.py),
  'vllm' a vLLM server in its own environment (backend_vllm.py, docs/vllm.md).
* `backend_builder(config, ...)`: `(params, version) -> backend` of the run config's
  `sampling.backend`, with its engine settings (`sampling`), vLLM's knobs
  (`sampling.vllm`), the run's tokenizer (eos) and, for an `init.kind='hf'` run, the
  checkpoint's config.json (fields the export keeps). The gateway (serve/launch.py,
  serve/source.py) serves whichever it builds.
* `sampler_backend(config, ...)`: what the in-process rollouts (sampling/rollouts.py)
  generate with: None for 'native' (the sampler's own continuous-batching engine, as
  always: its compiled programs, keys and lockstep bits), else the builder, whose
  backend the BackendEngines share (sampling/backend_engine.py).

vLLM's exports and log go to `<workdir>/vllm/engine<i>/` (one directory per backend
built in this process: value pretraining's and the RL loop's never share one).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from typing import Any

import jax
from flax import nnx

from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.backend import GenerationBackend
from sao_jax.sampling.backend_engine import BackendBuilder
from sao_jax.sampling.sampler import configs_from_section
from sao_jax.sampling.slots import EngineConfig
from sao_jax.sampling.vllm_config import VllmConfig, vllm_config
from sao_jax.schema import ConfigDict, ConfigError

_ENGINES = itertools.count()  # vLLM backends built by this process (their directories)


def build_backend(
    kind: str,
    *,
    mdef: ModelDef,
    params: Params,
    tokenizer,
    engine_cfg: EngineConfig,
    version: int = 0,
    seed: int = 0,
    vllm: VllmConfig | None = None,
    workdir: str | os.PathLike | None = None,
    base_config: dict[str, Any] | None = None,
) -> GenerationBackend:
    """A `kind` backend ('native' | 'vllm') serving `params` as `version`, sampling with
    `engine_cfg`'s law and limits; vLLM's knobs `vllm`, its files under `workdir`."""
    if kind == "native":
        from sao_jax.sampling.backend_native import NativeBackend

        try:
            return NativeBackend(mdef, params, tokenizer, engine_cfg, version=version, seed=seed)
        except ValueError as e:  # the tokenizer's vocabulary does not fit the model's
            raise ConfigError(f"config field model.vocab_size: {e}") from None
    if kind == "vllm":
        from sao_jax.sampling.backend_vllm import VllmBackend

        if workdir is None:
            raise ValueError("build_backend: the vllm backend needs a workdir")
        return VllmBackend(
            vllm or VllmConfig(),
            nnx.merge(mdef.graphdef, mdef.abstract).cfg,
            params,
            workdir=os.path.join(workdir, "vllm", f"engine{next(_ENGINES)}"),
            max_len=engine_cfg.max_len,
            eos_id=getattr(tokenizer, "eos_id", None),
            version=version,
            temperature=engine_cfg.temperature,
            top_p=engine_cfg.top_p,
            seed=seed,
            base_config=base_config,
            decode=getattr(tokenizer, "decode", None),
        )
    raise ConfigError(f"config field sampling.backend: {kind!r} is not one of native, vllm")


def _base_config(config: ConfigDict) -> dict[str, Any] | None:
    """The config.json of an `init.kind='hf'` run's checkpoint (None otherwise)."""
    init = config.get("init")
    if init is None or init.get("kind") != "hf":
        return None
    path = os.path.join(init.hf_path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config field init.hf_path: cannot read {path}: {e}") from None


def backend_builder(
    config: ConfigDict, *, mdef: ModelDef, tokenizer, workdir, seed: int
) -> BackendBuilder:
    """`(params, version) -> backend` of the run config's `sampling.backend`."""
    sampling = config.sampling
    kind = sampling.get("backend", "native")
    if kind == "vllm" and jax.process_count() > 1:  # the export writes on process 0 only
        raise ConfigError(
            f"config field sampling.backend: 'vllm' runs in one process for now; this run "
            f"has {jax.process_count()}"
        )
    engine_cfg, _ = configs_from_section(sampling, seed)
    return functools.partial(
        _build_at,
        kind,
        mdef=mdef,
        tokenizer=tokenizer,
        engine_cfg=engine_cfg,
        seed=seed,
        vllm=vllm_config(sampling.get("vllm")),
        workdir=workdir,
        base_config=_base_config(config),
    )


def _build_at(kind: str, params: Params, version: int, **kw) -> GenerationBackend:
    return build_backend(kind, params=params, version=version, **kw)


def sampler_backend(
    config: ConfigDict, *, mdef: ModelDef, tokenizer, workdir, seed: int
) -> BackendBuilder | None:
    """The in-process rollouts' backend: None for 'native' (the sampler's own engine),
    else the run's builder (module docstring)."""
    if config.sampling.get("backend", "native") == "native":
        return None
    return backend_builder(config, mdef=mdef, tokenizer=tokenizer, workdir=workdir, seed=seed)
