"""Start-up checks of a run against its real inputs, before the workdir is touched.

`check_inputs(config, inputs)` runs once, in `sao_jax.train.run`, after the inputs are
read (sao_jax/run/inputs.py) and before anything compiles or is written. A failure is a
ConfigError naming the field and the numbers (one line, exit 2: sao_jax/cli.py):

* vocabulary: every id of the tokenizer has a row in the model's embedding
  (model.vocab_size; the checkpoint's with init.kind='hf').
* prompt lengths: each prompt is rendered as the sampler renders it (`env.reset`: the
  system prompt, the chat template and the tools' schemas applied), tokenized, BOS
  counted with sampling.add_bos. Measured: the rows of one training epoch of a dataset
  (the first MAX_MEASURED of them) and the held-out prompts; for a task's own generator,
  the held-out prompts and its first TASK_SAMPLE training prompts. The longest must leave
  sampling.max_turn_tokens to generate within sampling.max_len: the engine drops a prompt
  of max_len tokens or more (a stream of such prompts yields no rollout and the run
  waits until train.take_timeout_s), and cuts the first turn of one that leaves less
  than max_turn_tokens at max_len (truncated, reward 0), in every episode.
* tools: when the env describes tools to the chat template (its `tool_schemas`), the
  template renders them: the first held-out prompt with and without them differs (a
  template without tool support drops the schemas silently).
* Weights & Biases: train.wandb_project needs the optional `wandb` package.

`PromptLengths` is what the start-up summary shows (sao_jax/report/startup.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time

from sao_jax.data.pipeline import epoch_length
from sao_jax.envs.base import tool_names, tool_schemas
from sao_jax.run.inputs import Inputs, render_prompt
from sao_jax.schema import ConfigDict, ConfigError

MAX_MEASURED = 100_000  # training rows of a dataset measured at most (a shuffled sample)
TASK_SAMPLE = 256  # training prompts measured of a task's endless generator


@dataclasses.dataclass(frozen=True)
class PromptLengths:
    """Token counts of the prompts as the policy sees them (template, system prompt, BOS)."""

    longest: int  # tokens of the longest prompt measured
    longest_uid: str
    measured: int  # prompts measured (training + held-out)
    train_rows: int | None  # training prompts per epoch of a dataset; None: a generator
    too_long: int  # prompts of sampling.max_len tokens or more
    no_room: int  # prompts leaving less than sampling.max_turn_tokens to generate
    seconds: float  # time taken to measure them
    rendering: str  # how prompts are rendered, e.g. "chat template + system prompt + BOS"


def check_inputs(config: ConfigDict, inputs: Inputs) -> PromptLengths:
    """Every start-up check above; the prompt lengths measured."""
    check_wandb(config)
    check_vocab(config, inputs.tokenizer)
    check_tools_rendered(config, inputs)
    lengths = measure_prompts(config, inputs)
    check_prompt_lengths(lengths, config.sampling)
    return lengths


def check_wandb(config: ConfigDict) -> None:
    """Logging to W&B needs the wandb package (optional: not in requirements.txt)."""
    project = config.train.wandb_project
    if project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"config field train.wandb_project: {project!r} needs the wandb package, which "
            "is not installed: pip install wandb, or leave train.wandb_project empty"
        )


def check_vocab(config: ConfigDict, tokenizer) -> None:
    """The tokenizer's ids fit the model's embedding table."""
    vocab = config.model.vocab_size
    if tokenizer.vocab_size <= vocab:
        return
    if config.init.kind == "hf":
        raise ConfigError(
            f"config field init.tokenizer: {config.init.tokenizer!r} has "
            f"{tokenizer.vocab_size} tokens, more than the {vocab} rows of the embedding of "
            f"the checkpoint {config.init.hf_path!r} (its config.json vocab_size): use the "
            "checkpoint's own tokenizer"
        )
    raise ConfigError(
        f"config field model.vocab_size: {vocab} < the {tokenizer.vocab_size} tokens of "
        f"init.tokenizer={config.init.tokenizer!r}: raise model.vocab_size to at least "
        f"{tokenizer.vocab_size}"
    )


def check_tools_rendered(config: ConfigDict, inputs: Inputs) -> None:
    """With tools and a chat template, the template shows the tools to the policy."""
    env = inputs.env_factory()
    schemas = tool_schemas(env)
    if not schemas or inputs.chat is None:
        return
    prompt = inputs.eval_prompts[0]
    messages = inputs.chat.messages(prompt.text, prompt.meta.get("messages"))
    if inputs.chat.prompt(messages, tools=schemas) == inputs.chat.prompt(messages):
        raise ConfigError(
            f"config field init.chat_template: {inputs.chat.template.origin} ignores "
            f"`tools`: prompt {prompt.uid!r} renders the same with and without the schemas "
            f"of {tool_names(env)} (env.params.tools), so the policy would never see "
            "them; use a template that renders tools (Qwen3's does), set "
            "init.chat_template to a .jinja file that does, or drop env.params.tools"
        )


def _rendering(config: ConfigDict, inputs: Inputs, env, bos: bool) -> str:
    parts = ["chat template" if inputs.chat is not None else "raw text"]
    if inputs.chat is not None and config.data.system_prompt:
        parts.append("system prompt")
    if inputs.chat is not None and tool_schemas(env):
        parts.append("tool schemas")
    if bos:
        parts.append("BOS")
    return " + ".join(parts)


def measure_prompts(config: ConfigDict, inputs: Inputs) -> PromptLengths:
    """Tokens of the training and held-out prompts (see the module docstring)."""
    t0 = time.monotonic()
    env, tok, sampling = inputs.env_factory(), inputs.tokenizer, config.sampling
    bos = bool(sampling.add_bos and getattr(tok, "bos_id", None) is not None)
    dataset = bool(config.data.train)
    epoch = epoch_length(inputs.train_prompts)
    n_train = min(epoch, MAX_MEASURED if dataset else TASK_SAMPLE)
    prompts = [inputs.train_prompts[i] for i in range(n_train)] + list(inputs.eval_prompts)
    longest, longest_uid, too_long, no_room = 0, "", 0, 0
    room = sampling.max_len - sampling.max_turn_tokens  # the longest prompt with a full turn
    for prompt in prompts:
        n = len(tok.encode(render_prompt(env, prompt, config.env.name))) + bos
        if n > longest:
            longest, longest_uid = n, prompt.uid
        too_long += n >= sampling.max_len
        no_room += n > room
    return PromptLengths(
        longest=longest,
        longest_uid=longest_uid,
        measured=len(prompts),
        train_rows=epoch if dataset else None,
        too_long=too_long,
        no_room=no_room,
        seconds=time.monotonic() - t0,
        rendering=_rendering(config, inputs, env, bos),
    )


def check_prompt_lengths(lengths: PromptLengths, sampling: ConfigDict) -> None:
    """The longest prompt leaves sampling.max_turn_tokens to generate within max_len."""
    max_len, turn = sampling.max_len, sampling.max_turn_tokens
    n, uid, how = lengths.longest, lengths.longest_uid, lengths.rendering
    need = n + turn
    if n >= max_len:
        raise ConfigError(
            f"config field sampling.max_len: {max_len} tokens cannot hold the longest prompt "
            f"({n} tokens: {uid!r}, {how}); {lengths.too_long} of {lengths.measured} prompts "
            f"measured are that long and would be dropped: set sampling.max_len >= {need} "
            f"(the longest prompt + sampling.max_turn_tokens={turn})"
        )
    if need > max_len:
        raise ConfigError(
            f"config field sampling.max_len: the longest prompt ({n} tokens: {uid!r}, {how}) "
            f"leaves {max_len - n} of max_len={max_len} tokens to generate, fewer than "
            f"sampling.max_turn_tokens={turn}; {lengths.no_room} of {lengths.measured} "
            f"prompts measured would have their first turn cut at max_len: set "
            f"sampling.max_len >= {need} or sampling.max_turn_tokens <= {max_len - n}"
        )
