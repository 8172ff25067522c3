"""What a run reads before its workdir is touched: the config as run (`resolved_config`:
an init.kind='hf' run's model and tokenizer are the checkpoint's), tokenizer, chat
template, envs, prompts (`read_inputs`), and the policy and critic models
(`build_models`). A bad input raises ConfigError naming the config field."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

from sao_jax import checkpointing
from sao_jax import config as config_lib
from sao_jax.data.pipeline import run_prompts
from sao_jax.envs.registry import env_factory
from sao_jax.models import hf
from sao_jax.models.config import ModelConfig, run_overrides
from sao_jax.models.factory import Models, critic_def, init_models, policy_def
from sao_jax.run.streams import stream_seed
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.text.chat_template import run_chat_format
from sao_jax.text.tokenizer import load_tokenizer

log = logging.getLogger("sao_jax")


def build_models(config: ConfigDict, sharder, tokenizer) -> Models:
    if config.init.kind == "hf":
        run = run_overrides(config.model)  # remat, scan_layers, dtypes, ...: not in config.json
        cfg, pdef, policy = hf.load_hf_policy(config.init.hf_path, sharder=sharder, **run)
        _, cdef, critic = hf.load_hf_critic(config.init.hf_path, sharder=sharder, **run)
        models = Models(cfg, pdef, policy, cdef, critic)
    elif config.init.kind == "params" and config.init.critic_path:
        # both loaded by the warm start (sao_jax/train.py): no random init to build
        cfg = ModelConfig.from_config(config.model)
        models = Models(cfg, policy_def(cfg, sharder), None, critic_def(cfg, sharder), None)
    else:
        seed = stream_seed(config.seed, "model_init")
        models = init_models(ModelConfig.from_config(config.model), sharder, seed)
    return models


def load_policy(path: str, pdef, sharder):
    """The policy params a warm start saved at `path` (init.kind='params': sao_jax/train.py
    writes them, the gateway serves them), placed as `pdef` is sharded."""
    if not pathlib.Path(path).is_dir():
        raise ConfigError(f"config field init.params_path: {path!r} is not a directory")
    with checkpointing.Checkpointer(path, keep=1, async_save=False) as c:
        policy, _ = c.restore(checkpointing.abstract_like(pdef.shapes(), pdef.shardings(sharder)))
    log.info("warm start: policy params from %s", path)
    return policy


def resolved_config(config: ConfigDict) -> ConfigDict:
    """The config as the run uses it (what <workdir>/config.json records), validated.

    With init.kind='hf' the model section is the checkpoint's (its config.json's shapes
    with the run fields of config.model: dtypes, remat, ...), and init.tokenizer left at
    'char' means the checkpoint's own tokenizer: its folder when it holds tokenizer.json,
    else ConfigError. Other kinds: `config` unchanged."""
    init = config.init
    if init.kind != "hf":
        return config
    cfg = hf.read_hf_config(init.hf_path, **run_overrides(config.model))
    out = config.copy_and_resolve_references()
    with out.unlocked():
        out.model = ConfigDict(dataclasses.asdict(cfg))
        if init.tokenizer == "char":
            if not (pathlib.Path(init.hf_path) / "tokenizer.json").is_file():
                raise ConfigError(
                    f"config field init.tokenizer: 'char' (the built-in character tokenizer) "
                    f"cannot drive the checkpoint {init.hf_path!r}, which holds no "
                    "tokenizer.json; set init.tokenizer to the checkpoint's tokenizer folder"
                )
            out.init.tokenizer = init.hf_path
            log.info("init.tokenizer: the checkpoint's (%s)", init.hf_path)
    return config_lib.validate(out)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What a run reads besides the model: tokenizer, chat template, envs, prompts."""

    tokenizer: Any
    chat: Any  # a ChatFormat, or None for raw text
    env_factory: Any
    set_env_step: Any  # the task's step hook, or None
    train_prompts: Any  # grain.MapDataset, endless
    eval_prompts: list


def read_inputs(config: ConfigDict) -> Inputs:
    """Every input file read and checked (tokenizer, chat template, dataset rows, env
    parameters and reward), before the workdir is touched; ConfigError naming the field."""
    try:
        tokenizer = load_tokenizer(config.init.tokenizer)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config field init.tokenizer: {e}") from None
    chat = run_chat_format(config, tokenizer)
    env = config.env
    try:
        factory, hook = env_factory(env.name, env.params.to_dict(), chat)
    except ConfigError:
        raise
    except ValueError as e:  # unknown reward, bad env parameter, bad chat rendering
        raise ConfigError(f"config field env.params: {e}") from None
    # the task's generator or a dataset
    train_prompts, eval_prompts = run_prompts(config, seed=stream_seed(config.seed, "prompts"))
    render_prompt(factory(), eval_prompts[0], env.name)  # the template renders, the env takes it
    return Inputs(tokenizer, chat, factory, hook, train_prompts, eval_prompts)


def render_prompt(env, prompt, task: str) -> str:
    """The context text `env` starts an episode of `prompt` with (what the sampler
    tokenizes); ConfigError naming env.name when the env refuses the prompt."""
    try:
        return env.reset(prompt)
    except ValueError as e:
        raise ConfigError(
            f"config field env.name: task {task!r} refuses prompt {prompt.uid!r}: {e}"
        ) from None
