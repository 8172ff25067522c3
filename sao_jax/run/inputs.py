"""What a run reads before its workdir is touched: tokenizer, chat template, envs,
prompts (`read_inputs`), and the policy and critic models (`build_models`). A bad input
raises ConfigError naming the config field."""

from __future__ import annotations

import dataclasses
from typing import Any

from sao_jax.data.pipeline import run_prompts
from sao_jax.envs.registry import env_factory
from sao_jax.models import hf
from sao_jax.models.config import ModelConfig, run_overrides
from sao_jax.models.factory import Models, init_models
from sao_jax.run.streams import stream_seed
from sao_jax.schema import ConfigDict, ConfigError
from sao_jax.text.chat_template import run_chat_format
from sao_jax.text.tokenizer import load_tokenizer


def build_models(config: ConfigDict, sharder, tokenizer) -> Models:
    if config.init.kind == "hf":
        run = run_overrides(config.model)  # remat, scan_layers, dtypes, ...: not in config.json
        cfg, pdef, policy = hf.load_hf_policy(config.init.hf_path, sharder=sharder, **run)
        _, cdef, critic = hf.load_hf_critic(config.init.hf_path, sharder=sharder, **run)
        models = Models(cfg, pdef, policy, cdef, critic)
    else:
        seed = stream_seed(config.seed, "model_init")
        models = init_models(ModelConfig.from_config(config.model), sharder, seed)
    if tokenizer.vocab_size > models.cfg.vocab_size:
        raise ConfigError(
            f"config field model.vocab_size: {models.cfg.vocab_size} < the tokenizer's "
            f"{tokenizer.vocab_size} tokens"
        )
    return models


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
    try:  # the chat template renders, the env takes the prompts
        factory().reset(eval_prompts[0])
    except ValueError as e:
        raise ConfigError(
            f"config field env.name: task {env.name!r} refuses the first held-out prompt "
            f"{eval_prompts[0].uid!r}: {e}"
        ) from None
    return Inputs(tokenizer, chat, factory, hook, train_prompts, eval_prompts)
