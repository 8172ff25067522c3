"""Config sections of a training run (env, data, init, sft, value_pretrain, train), with checks.

The algorithm lives in `rl` (sao_jax/rl/settings.py), the rollout engine in `sampling`
(sao_jax/sampling/sampler.py); these sections say what to train on and how the run is
staged: warm start -> value pretraining -> asynchronous RL with periodic evaluation.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sao_jax.rl.optim import TRAINABLE_SETS, optimizer_section
from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

# The built-in procedural tasks (any registered task or import path is accepted:
# sao_jax/envs/tasks.py).
ENV_NAMES = ("arithmetic", "arithmetic_levels", "python_tool", "style")
DATA_FORMATS = ("auto", "jsonl", "parquet", "hf_disk")
INIT_KINDS = ("sft", "hf", "params", "random")
ROLLOUT_MODES = ("async", "sync")
WARM_START_CRITIC_SUBDIR = "warm_start_critic"  # <workdir>/...: a run's pretrained critic
# Config fields value pretraining reads besides the warm-start policy (prefixes end in
# '.'), minus those it does not; two runs that agree on them pretrain the same critic
# (`pretraining_fields`). Not read: rl.k_critic, rl.lam_critic, rl.policy_loss, every
# other RL-time field, optim.critic.{freeze_attention,trainable,warmup_steps,decay,...}.
PRETRAIN_READS = (
    "value_pretrain.",
    "rl.gamma",
    "rl.microbatches",
    "optim.critic.b1",
    "optim.critic.b2",
    "optim.critic.eps",
    "optim.critic.weight_decay",
    "optim.critic.max_grad_norm",
    "optim.critic.frozen_patterns",
    "sampling.",
    "env.",
    "model.",
    "seed",
)
PRETRAIN_IGNORES = (
    "sampling.max_staleness",  # no version ever lags: the policy is never republished
    "sampling.lockstep",
    "sampling.queue_size",
    "sampling.env_timeout_s",
    "sampling.max_env_errors",
    "env.eval_size",
    "env.group_size",  # value pretraining samples one rollout per prompt
    "sampling.placement",  # where the pool runs, like mesh.* (float rounding only)
    "sampling.pool_devices",
    "sampling.pool_mesh",
)


def env_section() -> ConfigDict:
    c = ConfigDict()
    c.name = "arithmetic"  # a registered task (sao_jax/envs/tasks.py) or 'pkg.module:Task'
    c.params = ConfigDict(dict(max_turns=4))  # env constructor arguments
    c.prompts = ConfigDict(dict(n_ops=(2, 2), operand_range=(2, 99)))  # difficulty
    c.eval_fraction = 0.1  # share of the problem space held out (by uid hash)
    c.eval_size = 128  # held-out prompts per evaluation
    c.group_size = 1  # rollouts per prompt (1 = SAO; > 1 for GRPO-style baselines)
    return c


def data_section() -> ConfigDict:
    """Where prompts come from (sao_jax/data/pipeline.py): the task's own generator, or a
    dataset with reference answers mapped field by field."""
    c = ConfigDict()
    c.train = ""  # .jsonl / .parquet file, or a save_to_disk folder; "" = the task's prompts
    c.eval = ""  # held-out prompts; "" = a seeded split of data.train (env.eval_fraction)
    c.format = "auto"  # auto (from the path) | jsonl | parquet | hf_disk
    c.fields = ConfigDict()
    c.fields.prompt = "prompt"  # text field of the question
    c.fields.messages = ""  # or a field of chat messages [{role, content}] (then prompt = "")
    c.fields.answer = "answer"  # reference answer field (for the reward)
    c.fields.id = ""  # stable row id field; "" = file name + row number
    c.fields.meta = ()  # fields copied into the prompt's metadata
    c.answer_regex = ""  # keep group 1 of its last match in the answer (GSM8K: r"####\s*(.+)")
    c.prompt_format = "{prompt}"  # str.format of the prompt text; other fields by {name}
    c.system_prompt = ""  # a system message first in every chat ("" = none)
    c.template_kwargs = ConfigDict()  # extra chat-template variables, e.g. enable_thinking
    c.shuffle = True  # shuffle training rows with the run seed (reshuffled every epoch)
    c.split_seed = 0  # which rows the seeded train/eval split holds out
    return c


def init_section() -> ConfigDict:
    c = ConfigDict()
    c.kind = "sft"  # 'sft' on demonstrations | 'hf' checkpoint | 'params' | 'random'
    c.hf_path = ""  # Hugging Face checkpoint directory when kind == 'hf'
    c.params_path = ""  # a run's <workdir>/warm_start when kind == 'params' (shared SFT)
    c.critic_path = ""  # a run's <workdir>/warm_start_critic: start from that value-
    # pretrained critic and skip value pretraining ('' = pretrain here; sweeps share one)
    c.tokenizer = "char"  # 'char' (built-in) or a directory with tokenizer.json
    # 'auto': the tokenizer's chat template when it has one (else raw text) | 'tokenizer':
    # required from the tokenizer | 'none': raw text | a path to a .jinja file
    c.chat_template = "auto"
    return c


def sft_section() -> ConfigDict:
    c = ConfigDict()
    c.steps = 300  # supervised steps on demonstrations
    c.batch_size = 32
    c.length = 96  # tokens per demonstration row (longer demos are skipped)
    c.error_rate = 0.3  # share of deliberately imperfect demonstrations (RL headroom)
    c.optim = optimizer_section(3e-3, warmup_steps=20, max_grad_norm=1.0)
    return c


def value_pretrain_section() -> ConfigDict:
    """Value pretraining (sao_jax/run/value_pretrain.py): the critic regresses Monte-Carlo
    returns of fresh rollouts of the warm-start policy, streamed, until its explained
    variance on held-out rollouts stops improving. Independent of RL-time settings."""
    c = ConfigDict()
    c.steps = 200  # most critic optimizer steps (0 = no value pretraining) [open]
    c.batch_size = 64  # fresh rollouts per optimizer step (the corpus: steps x batch / reuse)
    c.reuse = 1  # optimizer steps each batch of fresh rollouts is used for (1 = never)
    c.heldout_rollouts = 512  # sampled first, never trained on: EV / loss measured here
    c.eval_every = 10  # optimizer steps between held-out evaluations (also at 0 and last)
    c.patience = 5  # stop after this many evaluations without a held-out EV gain of at
    c.min_delta = 0.005  # least min_delta over the best so far (patience 0 = never stop)
    c.trainable = "all"  # trained leaves: 'all' | 'all_but_attention' | 'moe' (rl/optim.py)
    c.lr = 0.0  # peak AdamW lr; 0 = optim.critic.lr (b1, b2, eps, weight decay and
    # clipping always come from optim.critic; warm-up and schedule are its own)
    c.warmup_steps = 10  # linear lr warm-up over the first pretraining steps
    c.sampler = "async"  # 'async': the async sampler runs ahead of the critic steps |
    # 'sync': the engine generates each batch in turn (deterministic with any worker count)
    return c


def pretraining_fields(config: ConfigDict) -> dict[str, Any]:
    """The flattened config fields value pretraining reads (PRETRAIN_READS); equal for two
    configs iff they pretrain the same critic from the same warm start. optim.critic.lr
    is read only when value_pretrain.lr is 0."""
    flat = _flatten(config.to_dict() if isinstance(config, ConfigDict) else config)
    reads = PRETRAIN_READS + (("optim.critic.lr",) if not flat["value_pretrain.lr"] else ())
    keep = lambda k: any(k == r or (r.endswith(".") and k.startswith(r)) for r in reads)
    out = {k: v for k, v in sorted(flat.items()) if keep(k) and k not in PRETRAIN_IGNORES}
    return json.loads(json.dumps(out))  # tuples as lists: as a checkpoint's meta has them


def train_section() -> ConfigDict:
    c = ConfigDict()
    c.total_steps = 100  # policy updates of the RL stage
    c.rollouts = "async"  # 'async' (SAO) | 'sync' (deterministic, resumable bit-exactly)
    c.length_bucket = 32  # pad batches to a multiple of this (few update-step shapes)
    c.pack = False  # model passes on packed rows, several trajectories each (rl/packing.py)
    c.pack_length = 0  # packed row length; 0 = the padded length T of the batch
    c.pack_rows_multiple = 4  # packed rows per (microbatch, shard) rounded up to this
    c.log_every = 5  # steps between metric writes (device -> host only then)
    c.eval_every = 25  # steps between held-out evaluations (0 = only before/after)
    c.eval_sampled = True  # also report sampled pass@1 (greedy always)
    c.checkpoint_every = 25  # steps between checkpoints (0 = only at the end)
    c.keep_checkpoints = 3
    c.async_checkpoints = True
    c.take_timeout_s = 600.0  # learner waits at most this long for a batch
    c.report = True  # write report.md + plots at the end
    c.progress = True  # terminal progress bar
    return c


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@register_validator("env")
def _check_env(config: ConfigDict) -> None:
    e = config.env
    from sao_jax.envs.tasks import RegistryError, get_task

    try:
        task = get_task(e.name)
    except RegistryError as err:
        raise ConfigError(f"config field env.name: {err}") from None
    if "data" in config and not config.data.train:
        require(
            task.prompts is not None,
            "data.train",
            f"task {e.name!r} has no built-in prompts: give a dataset file",
        )
    if "init" in config and "sft" in config and config.init.kind == "sft":
        require(
            task.demonstrations is not None or config.sft.steps == 0,
            "init.kind",
            f"task {e.name!r} has no SFT demonstrations: start from a checkpoint "
            "(init.kind='hf' or 'params') or set sft.steps=0",
        )
    require(
        0 < e.eval_fraction < 1, "env.eval_fraction", f"must be in (0, 1), got {e.eval_fraction}"
    )
    require(e.eval_size >= 1, "env.eval_size", f"must be >= 1, got {e.eval_size}")
    require(e.group_size >= 1, "env.group_size", f"must be >= 1, got {e.group_size}")
    if "rl" in config:
        require(
            config.rl.batch_size % e.group_size == 0,
            "env.group_size",
            f"{e.group_size} does not divide rl.batch_size={config.rl.batch_size}",
        )
        from sao_jax.rl import advantages

        if advantages.estimator(config.rl.advantage).needs_groups:
            require(
                e.group_size > 1,
                "env.group_size",
                f"rl.advantage={config.rl.advantage!r} needs groups: set env.group_size > 1",
            )


@register_validator("data")
def _check_data(config: ConfigDict) -> None:
    d = config.data
    require(d.format in DATA_FORMATS, "data.format", f"one of {DATA_FORMATS}, got {d.format!r}")
    f = d.fields
    require(
        bool(f.prompt) != bool(f.messages),
        "data.fields",
        f"set exactly one of prompt ({f.prompt!r}) and messages ({f.messages!r})",
    )
    require(bool(f.answer), "data.fields.answer", "the reference answer field is needed")
    require(d.split_seed >= 0, "data.split_seed", f"must be >= 0, got {d.split_seed}")
    require(bool(d.train) or not d.eval, "data.eval", "set only with data.train (a dataset)")


@register_validator("init")
def _check_init(config: ConfigDict) -> None:
    i = config.init
    require(i.kind in INIT_KINDS, "init.kind", f"must be one of {INIT_KINDS}, got {i.kind!r}")
    if i.kind == "hf":
        require(bool(i.hf_path), "init.hf_path", "a checkpoint directory is needed for kind 'hf'")
    if i.kind == "params":
        require(bool(i.params_path), "init.params_path", "a directory is needed for kind 'params'")


@register_validator("sft")
def _check_sft(config: ConfigDict) -> None:
    s = config.sft
    require(s.steps >= 0, "sft.steps", f"must be >= 0, got {s.steps}")
    require(s.batch_size >= 1, "sft.batch_size", f"must be >= 1, got {s.batch_size}")
    require(s.length >= 2, "sft.length", f"must be >= 2, got {s.length}")
    require(0 <= s.error_rate <= 1, "sft.error_rate", f"must be in [0, 1], got {s.error_rate}")
    require(s.optim.lr > 0, "sft.optim.lr", f"must be > 0, got {s.optim.lr}")


@register_validator("value_pretrain")
def _check_value_pretrain(config: ConfigDict) -> None:
    v = config.value_pretrain
    require(v.steps >= 0, "value_pretrain.steps", f"must be >= 0, got {v.steps}")
    for name in ("batch_size", "reuse", "heldout_rollouts", "eval_every"):
        require(v[name] >= 1, f"value_pretrain.{name}", f"must be >= 1, got {v[name]}")
    require(
        v.heldout_rollouts % v.batch_size == 0,
        "value_pretrain.heldout_rollouts",
        f"{v.heldout_rollouts} is not a multiple of value_pretrain.batch_size={v.batch_size}",
    )
    require(v.patience >= 0, "value_pretrain.patience", f"must be >= 0, got {v.patience}")
    require(v.min_delta >= 0, "value_pretrain.min_delta", f"must be >= 0, got {v.min_delta}")
    require(
        v.trainable in TRAINABLE_SETS,
        "value_pretrain.trainable",
        f"must be one of {TRAINABLE_SETS}, got {v.trainable!r}",
    )
    require(v.lr >= 0, "value_pretrain.lr", f"must be >= 0 (0 = optim.critic.lr), got {v.lr}")
    require(v.warmup_steps >= 0, "value_pretrain.warmup_steps", "must be >= 0")
    require(
        v.sampler in ROLLOUT_MODES,
        "value_pretrain.sampler",
        f"must be one of {ROLLOUT_MODES}, got {v.sampler!r}",
    )
    if "rl" in config:
        require(
            v.batch_size % config.rl.microbatches == 0,
            "value_pretrain.batch_size",
            f"{v.batch_size} is not divisible by rl.microbatches={config.rl.microbatches}",
        )


@register_validator("train")
def _check_train(config: ConfigDict) -> None:
    t = config.train
    require(t.total_steps >= 0, "train.total_steps", f"must be >= 0, got {t.total_steps}")
    require(
        t.rollouts in ROLLOUT_MODES,
        "train.rollouts",
        f"must be one of {ROLLOUT_MODES}, got {t.rollouts!r}",
    )
    for name in ("length_bucket", "log_every", "keep_checkpoints", "pack_rows_multiple"):
        require(t[name] >= 1, f"train.{name}", f"must be >= 1, got {t[name]}")
    require(isinstance(t.pack, bool), "train.pack", f"must be True or False, got {t.pack!r}")
    if t.pack_length and "sampling" in config:
        require(
            t.pack_length >= config.sampling.max_len,
            "train.pack_length",
            f"{t.pack_length} < sampling.max_len={config.sampling.max_len} (a trajectory "
            "must fit in a row); 0 = the batch's padded length",
        )
    require(t.pack_length >= 0, "train.pack_length", f"must be >= 0, got {t.pack_length}")
    if t.pack and "rl" in config:  # packed rows hold several trajectories: no row shuffling
        require(
            config.rl.ppo_epochs * config.rl.minibatches == 1,
            "train.pack",
            "packed batches take one policy step per batch; set rl.ppo_epochs = "
            f"rl.minibatches = 1 (got {config.rl.ppo_epochs} x {config.rl.minibatches})",
        )
    for name in ("eval_every", "checkpoint_every"):
        require(t[name] >= 0, f"train.{name}", f"must be >= 0, got {t[name]}")
    require(t.take_timeout_s > 0, "train.take_timeout_s", "must be > 0")


def check_run(config: ConfigDict, sharder) -> None:
    """Checks that need the file system or the mesh (ConfigError naming the field)."""
    init = config.init
    if init.kind == "hf" and not os.path.isdir(init.hf_path):
        raise ConfigError(
            f"config field init.hf_path: {init.hf_path!r} is not a directory (a Hugging "
            "Face checkpoint: config.json + *.safetensors)"
        )
    data = config.get("data")
    for field in ("train", "eval"):
        path = data[field] if data is not None else ""
        if path and not os.path.exists(path):
            raise ConfigError(f"config field data.{field}: {path!r} does not exist")
    if init.tokenizer != "char" and not os.path.isdir(init.tokenizer):
        raise ConfigError(
            f"config field init.tokenizer: {init.tokenizer!r} is neither 'char' nor a "
            "directory holding tokenizer.json"
        )
    shards, micro = sharder.axis_size("batch"), config.rl.microbatches
    mini = config.rl.minibatches
    if config.rl.batch_size % (shards * micro * mini):
        raise ConfigError(
            f"config field rl.batch_size: {config.rl.batch_size} is not divisible by "
            f"rl.minibatches ({mini}) x rl.microbatches ({micro}) x the data-parallel "
            f"shards ({shards})"
        )
    vp = config.value_pretrain
    if vp.steps > 0 and vp.batch_size % (shards * micro):
        raise ConfigError(
            f"config field value_pretrain.batch_size: {vp.batch_size} is not divisible by "
            f"rl.microbatches ({micro}) x the data-parallel shards ({shards})"
        )
    if init.critic_path and not os.path.isdir(init.critic_path):
        raise ConfigError(
            f"config field init.critic_path: {init.critic_path!r} is not a directory (a "
            "run's <workdir>/warm_start_critic)"
        )
    if init.kind == "sft" and config.sft.steps > 0 and config.sft.batch_size % shards:
        raise ConfigError(
            f"config field sft.batch_size: {config.sft.batch_size} is not divisible by the "
            f"data-parallel shards ({shards})"
        )
