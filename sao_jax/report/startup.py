"""The start-up summary: what a run is about to train on, logged before anything compiles.

`startup_lines(config, inputs, lengths, sharder, placement)`, one line each:

  model      the checkpoint (init.hf_path) or how the model starts; its shapes
  tokenizer  init.tokenizer (or the built-in character tokenizer): size, eos, bos
  template   the chat template's file, system prompt, template kwargs, tools; or raw text
  prompts    rows loaded: the training epoch and the held-out prompts, and from where
  lengths    the longest prompt in tokens (as the policy sees it) vs sampling.max_len and
             sampling.max_turn_tokens
  devices    count and kind, processes, the trainer mesh, where the sampler pool runs
             (sampling.placement: sao_jax/parallel/placement.py)

`inputs` is a sao_jax.run.inputs.Inputs, `lengths` a sao_jax.run.preflight.PromptLengths.
"""

from __future__ import annotations

import jax

from sao_jax.envs.base import tool_names


def _model(config) -> str:
    m, init = config.model, config.init
    where = {
        "hf": f"checkpoint {init.hf_path}",
        "sft": f"random init + {config.sft.steps} SFT steps",
        "params": f"params of {init.params_path}",
        "random": "random init",
    }[init.kind]
    experts = f"{m.num_experts} experts top-{m.num_experts_per_tok}" if m.num_experts else "dense"
    return (
        f"model: {where}: {m.num_hidden_layers} layers, hidden {m.hidden_size}, {experts}, "
        f"vocab {m.vocab_size}, params {m.param_dtype}, compute {m.dtype}"
    )


def _tokenizer(config, tok) -> str:
    name = "built-in characters" if config.init.tokenizer == "char" else config.init.tokenizer
    specials = getattr(tok, "specials", {}) or {}
    eos = specials.get("eos_token", tok.eos_id)
    bos = specials.get("bos_token", tok.bos_id)
    return f"tokenizer: {name}: {tok.vocab_size} tokens, eos {eos!r}, bos {bos!r}"


def _template(config, inputs, env) -> str:
    chat = inputs.chat
    if chat is None:
        return (
            f"template: none (raw text prompts; init.chat_template={config.init.chat_template!r})"
        )
    system = f"{len(chat.system_prompt)} chars" if chat.system_prompt else "none"
    tools = tool_names(env)
    return (
        f"template: {chat.template.origin}: system prompt {system}, template kwargs "
        f"{chat.kwargs or {}}, tools {tools or 'none'}"
    )


def _prompts(config, inputs, lengths) -> str:
    data, held = config.data, len(inputs.eval_prompts)
    if not data.train:
        return f"prompts: task {config.env.name!r}'s generator, {held} held-out prompts"
    heldout = data.eval or f"a {config.env.eval_fraction:g} split of data.train"
    return (
        f"prompts: {lengths.train_rows} training rows of {data.train}, {held} held-out "
        f"prompts from {heldout} (env.eval_size={config.env.eval_size})"
    )


def _lengths(config, lengths) -> str:
    s = config.sampling
    spare = s.max_len - lengths.longest - s.max_turn_tokens
    return (
        f"lengths: longest prompt {lengths.longest} tokens ({lengths.longest_uid!r}; "
        f"{lengths.rendering}; {lengths.measured} prompts measured in "
        f"{lengths.seconds:.1f} s) vs sampling.max_len={s.max_len}, "
        f"sampling.max_turn_tokens={s.max_turn_tokens}: {spare} tokens to spare"
    )


def _devices(config, sharder, placement) -> str:
    devices = jax.devices()
    kind = devices[0].device_kind if devices else "?"
    mesh = dict(sharder.mesh.shape) if sharder.mesh is not None else "none (one device)"
    s = config.sampling
    return (
        f"devices: {len(devices)} x {kind} ({jax.default_backend()}), "
        f"{jax.process_count()} process(es); mesh {mesh}; placement "
        f"{placement.describe()} ({s.num_workers} worker(s) x {s.num_slots} slots, "
        f"{config.train.rollouts})"
    )


def startup_lines(config, inputs, lengths, sharder, placement) -> list[str]:
    """The summary lines (see the module docstring)."""
    env = inputs.env_factory()
    return [
        _model(config),
        _tokenizer(config, inputs.tokenizer),
        _template(config, inputs, env),
        _prompts(config, inputs, lengths),
        _lengths(config, lengths),
        _devices(config, sharder, placement),
    ]
