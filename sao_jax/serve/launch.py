"""`python -m experiments.serve`: a run config's initial policy behind the gateway.

`build_gateway(config, workdir, cfg)` reads the config's model, tokenizer and chat
template (`init`), builds the policy without any training (`init.kind` 'hf': the
checkpoint; 'random' and 'sft': the random initialisation from the run's seed, SFT is NOT
run; 'params': the warm-start policy at `init.params_path`), and puts the run's generation backend
(`sampling.backend`: the native engine or vLLM, sao_jax/sampling/backend_factory.py)
with the run's sampling section behind a `Gateway` writing `workdir/episodes.jsonl`.
`init.tokenizer='harness'` builds the project's local BPE tokenizer with the Qwen3-style
template
(sao_jax/text/harness_tokenizer.py) into `workdir/tokenizer`.

`serve(...)` starts it with the config's `gateway` section (sao_jax/serve/settings.py),
writes `workdir/gateway.json` atomically once it accepts connections (`base_url`,
`api_key` = the admin key, `port`, `model`, `pid`), and serves until SIGTERM or SIGINT;
then the live sessions' episodes are written as dropped
('shutdown'), and it stops and returns (exit status 0).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import threading

from flax import nnx

from sao_jax.models import hf
from sao_jax.models.config import ModelConfig, run_overrides
from sao_jax.models.factory import policy_def
from sao_jax.models.transformer import Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import init_params
from sao_jax.run.inputs import load_policy
from sao_jax.run.streams import stream_seed
from sao_jax.sampling.backend_factory import backend_builder
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.serve.app import Server, start_server
from sao_jax.serve.episodes import EpisodeLog
from sao_jax.serve.gateway import Gateway, GatewayConfig
from sao_jax.serve.render import ChatRenderer
from sao_jax.serve.settings import gateway_config
from sao_jax.text.chat_template import run_chat_format
from sao_jax.text.harness_tokenizer import write_harness_tokenizer
from sao_jax.text.tokenizer import load_tokenizer

log = logging.getLogger("sao_jax")
HARNESS_TOKENIZER = "harness"  # init.tokenizer value: build the local BPE into the workdir


def _tokenizer(config: ConfigDict, workdir: pathlib.Path):
    spec = config.init.tokenizer
    if spec == HARNESS_TOKENIZER:
        path = workdir / "tokenizer"
        if not (path / "tokenizer.json").is_file():
            write_harness_tokenizer(path)
        spec = str(path)
    try:
        return load_tokenizer(spec)
    except ValueError as e:
        raise ConfigError(f"config field init.tokenizer: {e}") from None


def _policy(config: ConfigDict, sharder: Sharder):
    kind = config.init.kind
    if kind == "hf":
        _, mdef, params = hf.load_hf_policy(
            config.init.hf_path, sharder=sharder, **run_overrides(config.model)
        )
        return mdef, params
    cfg = ModelConfig.from_config(config.model)
    if kind == "params":  # a warm start's policy (init.params_path), as a run starts from
        pdef = policy_def(cfg, sharder)
        return pdef, load_policy(config.init.params_path, pdef, sharder)
    seed = stream_seed(config.seed, "model_init")
    return init_params(lambda: Policy(cfg, sharder=sharder, rngs=nnx.Rngs(seed)), sharder)


def build_gateway(config: ConfigDict, workdir: str | pathlib.Path, cfg: GatewayConfig) -> Gateway:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(config, workdir)
    chat = run_chat_format(config, tok)
    if chat is None:
        raise ConfigError(
            f"config field init.chat_template: the gateway needs a chat template and "
            f"{config.init.tokenizer!r} has none"
        )
    sharder = Sharder()
    mdef, params = _policy(config, sharder)
    build = backend_builder(config, mdef=mdef, tokenizer=tok, workdir=workdir, seed=config.seed)
    backend = build(params, 0)
    renderer = ChatRenderer(chat.template, tok)
    return Gateway(backend, renderer, cfg, EpisodeLog(workdir / "episodes.jsonl"))


def write_gateway_json(workdir: str | pathlib.Path, server: Server) -> pathlib.Path:
    """`workdir/gateway.json`, atomically (a reader sees the whole file or none)."""
    path = pathlib.Path(workdir) / "gateway.json"
    info = {
        "base_url": f"{server.url}/v1",
        "api_key": server.gateway.admin_key,
        "port": server.port,
        "model": server.gateway.cfg.model_name,
        "pid": os.getpid(),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def serve(
    config: ConfigDict,
    workdir: str | pathlib.Path,
    cfg: GatewayConfig | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serves until SIGTERM / SIGINT (or `stop` is set); see the module docstring. The
    settings are the config's `gateway` section (serve-only: a request's sampling values
    apply); `cfg`, `host`, `port` override it."""
    section = config.get("gateway")
    if cfg is None:
        cfg = gateway_config(section, training=False) if section else GatewayConfig()
    host = host if host is not None else (section.host if section else "127.0.0.1")
    port = port if port is not None else (section.port if section else 0)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("gateway: listening on %s: reachable beyond this machine", host)
    gateway = build_gateway(config, workdir, cfg)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    server = start_server(gateway, host, port)
    try:
        path = write_gateway_json(workdir, server)
        log.info("gateway: serving %s at %s/v1 (%s)", cfg.model_name, server.url, path)
        while not stop.wait(1.0):
            pass
    finally:
        dropping = asyncio.run_coroutine_threadsafe(gateway.drop_all("shutdown"), server.loop)
        dropped = dropping.result(timeout=60)
        server.stop()
        gateway.backend.close()
        log.info("gateway: %d live sessions dropped at shutdown", dropped)
        log.info("gateway: stopped; %s", json.dumps(gateway.stats()))
