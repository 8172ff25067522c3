"""`sampling.backend` -> the run's generation backend: the one place one is built.

* `build_backend(kind, ...)`: a GenerationBackend (sao_jax/sampling/backend.py) of that
  kind on the given weights: 'native' the in-process JAX engine (backend_native.py),
  'vllm' a vLLM server in its own environment (backend_vllm.py, docs/vllm.md).
* `backend_builder(config, ...)`: `(params, version) -> backend` of the run config's
  `sampling.backend`, with its engine settings (`sampling`), vLLM's knobs
  (`sampling.vllm`), the run's tokenizer (eos) and, for an `init.kind='hf'` run, the
  checkpoint's config.json (fields the export keeps). The gateway (serve/launch.py)
  serves whichever it builds.
* `RunBackend` (`run_backend(config, ...)`): a training run's one backend, lent to each
  rollouts source in turn (value pretraining's, then the RL loop's: in-process or the
  gateway's, serve/source.py): built on the first weights a source serves, published to
  when a source serves a newer version, closed by the run (sao_jax/train.py), never by a
  source: a source's `close()` cancels its own requests and leaves the server up. One
  vLLM server per run, not one per source (a start costs 8-26 s on 2 cores, docs/vllm.md).
  `sampler()` is what the in-process rollouts (sampling/rollouts.py) generate with:
  None for 'native' (the sampler's own continuous-batching engine, as always: its
  compiled programs, keys and lockstep bits), else the run's backend, whose server the
  BackendEngines share (sampling/backend_engine.py).

vLLM's exports and log go to `<workdir>/vllm/engine<i>/` (one directory per backend
built in this process: a run builds one, engine0 in a fresh process).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from sao_jax.parallel.partition import ModelDef, Params
from sao_jax.sampling.backend import (
    GenChunk,
    GenerationBackend,
    GenerationError,
    GenHandle,
    GenRequest,
)
from sao_jax.sampling.backend_engine import BackendBuilder, SharedBackend
from sao_jax.sampling.generate import GenerateFns
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
    admission: dict[str, float] | None = None,
    fns: GenerateFns | None = None,
) -> GenerationBackend:
    """A `kind` backend ('native' | 'vllm') serving `params` as `version`, sampling with
    `engine_cfg`'s law and limits; the native one's admission windows `admission`
    (`admit_gap_s`, `admit_wait_s`; None: its defaults) and compiled programs `fns` (the
    run's, shared with its evaluator; None: its own); vLLM's knobs `vllm`, its files under
    `workdir`."""
    if kind == "native":
        from sao_jax.sampling.backend_native import NativeBackend

        try:
            return NativeBackend(
                mdef,
                params,
                tokenizer,
                engine_cfg,
                version=version,
                seed=seed,
                fns=fns,
                **(admission or {}),
            )
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
            record_routing=engine_cfg.record_routing,
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
    config: ConfigDict,
    *,
    mdef: ModelDef,
    tokenizer,
    workdir,
    seed: int,
    fns: GenerateFns | None = None,
) -> BackendBuilder:
    """`(params, version) -> backend` of the run config's `sampling.backend`; a native one
    runs `fns` (GenerateFns of the same engine settings: a training run's, which its
    evaluator and samplers share; None: its own)."""
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
        admission=_admission(config),
        fns=fns,
    )


def _admission(config: ConfigDict) -> dict[str, float] | None:
    """`gateway.admit_gap_s` / `admit_wait_s` (checked at start-up, serve/settings.py)."""
    g = config.get("gateway")
    if g is None:
        return None
    return dict(admit_gap_s=float(g.admit_gap_s), admit_wait_s=float(g.admit_wait_s))


def _build_at(kind: str, params: Params, version: int, **kw) -> GenerationBackend:
    return build_backend(kind, params=params, version=version, **kw)


def run_backend(
    config: ConfigDict,
    *,
    mdef: ModelDef,
    tokenizer,
    workdir,
    seed: int,
    fns: GenerateFns | None = None,
) -> RunBackend:
    """The run's one backend of `sampling.backend` (`RunBackend`, module docstring)."""
    build = backend_builder(
        config, mdef=mdef, tokenizer=tokenizer, workdir=workdir, seed=seed, fns=fns
    )
    return RunBackend(build, native=config.sampling.get("backend", "native") == "native")


class RunBackend(SharedBackend):
    """A run's one generation backend, lent to its rollouts sources in turn: a
    SharedBackend (sao_jax/sampling/backend_engine.py: built with `build` on the first
    weights it is given, published to when a newer version comes, closed once) that,
    called as a BackendBuilder `(params, version)`, serves that version (a source starting
    on weights it already serves, the RL loop's version 0 after value pretraining's,
    publishes nothing) and returns a `LentBackend`, the caller's view. `close()` (the
    run's, once no source uses it) closes the backend."""

    def __init__(self, build: BackendBuilder, *, native: bool = False):
        super().__init__(build)
        self.native = native  # sampling.backend='native': see sampler()

    def sampler(self) -> BackendBuilder | None:
        """What the in-process rollouts generate with: None for 'native' (the sampler's
        own engine), else this backend."""
        return None if self.native else self

    def __call__(self, params: Params, version: int) -> LentBackend:
        self.serve(params, version)
        backend = self.backend
        if backend is None:  # closed meanwhile
            raise GenerationError("the backend is closed")
        return LentBackend(backend)


class LentBackend:
    """A rollouts source's view of the run's backend: every call and attribute is the
    backend's, except `close()`, which cancels the requests submitted through this view
    (still in flight) and leaves the backend serving; later submissions are refused."""

    def __init__(self, backend: GenerationBackend):
        self._backend = backend
        self._lock = threading.Lock()
        self._handles: set[GenHandle] = set()
        self._closed = False

    def submit(
        self, request: GenRequest, on_tokens: Callable[[GenChunk], None] | None = None
    ) -> GenHandle:
        with self._lock:
            if self._closed:
                raise GenerationError("the backend is closed")
        handle = self._backend.submit(request, on_tokens)
        with self._lock:
            closed = self._closed  # closed while it was submitted: cancelled at once
            if not closed:
                self._handles.add(handle)
        if closed:
            handle.cancel()
        else:
            handle.future.add_done_callback(lambda _: self._forget(handle))
        return handle

    def _forget(self, handle: GenHandle) -> None:
        with self._lock:
            self._handles.discard(handle)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            handles, self._handles = list(self._handles), set()
        for handle in handles:
            handle.cancel()

    def __getattr__(self, name: str) -> Any:  # submit and close aside: the backend's own
        if name == "_backend":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self._backend, name)
