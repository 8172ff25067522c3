"""Checks of a training run's sections (env, data, init, sft, value_pretrain, train).

Their defaults are sao_jax/defaults.py; the algorithm's checks are sao_jax/rl/settings.py,
the rollout engine's sao_jax/sampling/sampler.py. These sections say what to train on and
how the run is staged: warm start -> value pretraining -> asynchronous RL with periodic
evaluation. `check_run` adds the checks that need the file system or the mesh.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from sao_jax.rl.batch import check_divisible
from sao_jax.rl.optim import TRAINABLE_SETS
from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

DATA_FORMATS = ("auto", "jsonl", "parquet", "hf_disk")
INIT_KINDS = ("sft", "hf", "params", "random")
ROLLOUT_MODES = ("async", "sync")
WANDB_MODES = ("online", "offline", "disabled")  # wandb.init(mode=...)
WARM_START_CRITIC_SUBDIR = "warm_start_critic"  # <workdir>/...: a run's pretrained critic
# Config fields value pretraining reads besides the warm-start policy (prefixes end in
# '.'), minus those it does not; two runs that agree on them pretrain the same critic
# (`pretraining_fields`). Not read: rl.k_critic, rl.lam_critic, rl.policy_loss, every
# other RL-time field, optim.critic.{freeze_attention,trainable,warmup_steps,decay,...}.
PRETRAIN_READS = (
    "value_pretrain.",
    "rl.gamma",
    "rl.privileged_critic",
    "rl.microbatches",
    "optim.critic.b1",
    "optim.critic.b2",
    "optim.critic.eps",
    "optim.critic.weight_decay",
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
    "sampling.max_dropped_in_a_row",
    "env.eval_size",
    "env.group_size",  # value pretraining samples one rollout per prompt
    "sampling.placement",  # where the pool runs, like mesh.* (float rounding only)
    "sampling.pool_devices",
    "sampling.pool_mesh",
)


def pretraining_fields(config: ConfigDict) -> dict[str, Any]:
    """The flattened config fields value pretraining reads (PRETRAIN_READS); equal for two
    configs iff they pretrain the same critic from the same warm start. optim.critic.lr
    is read only when value_pretrain.lr is 0, optim.critic.max_grad_norm only when
    value_pretrain.max_grad_norm is -1."""
    flat = _flatten(config.to_dict() if isinstance(config, ConfigDict) else config)
    reads = PRETRAIN_READS + (("optim.critic.lr",) if not flat["value_pretrain.lr"] else ())
    if flat.get("value_pretrain.max_grad_norm", -1.0) < 0:  # absent: a run from before it
        reads += ("optim.critic.max_grad_norm",)
    keep = lambda k: any(k == r or (r.endswith(".") and k.startswith(r)) for r in reads)
    out = {k: v for k, v in sorted(flat.items()) if keep(k) and k not in PRETRAIN_IGNORES}
    return json.loads(json.dumps(out))  # tuples as lists: as a checkpoint's meta has them


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
    from sao_jax.envs.registry import RegistryError, get_task

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
    require(
        v.max_grad_norm == -1 or v.max_grad_norm >= 0,
        "value_pretrain.max_grad_norm",
        f"must be -1 (optim.critic.max_grad_norm) or >= 0 (0 = no clip), got {v.max_grad_norm}",
    )
    require(v.warmup_steps >= 0, "value_pretrain.warmup_steps", "must be >= 0")
    require(
        v.sampler in ROLLOUT_MODES,
        "value_pretrain.sampler",
        f"must be one of {ROLLOUT_MODES}, got {v.sampler!r}",
    )
    if "rl" in config:  # the mesh's shards too: check_run
        check_divisible(
            v.batch_size,
            "config field value_pretrain.batch_size",
            microbatches=config.rl.microbatches,
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
    require(
        t.eval_sampled_repeats >= 1,
        "train.eval_sampled_repeats",
        f"must be >= 1, got {t.eval_sampled_repeats}",
    )
    require(t.take_timeout_s > 0, "train.take_timeout_s", "must be > 0")
    dump = t.token_dump_steps
    require(
        isinstance(dump, (tuple, list))
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in dump),
        "train.token_dump_steps",
        f"must be a tuple of RL steps >= 1, got {dump!r}",
    )
    require(
        t.samples_per_log >= 0, "train.samples_per_log", f"must be >= 0, got {t.samples_per_log}"
    )
    require(
        t.wandb_mode in WANDB_MODES,
        "train.wandb_mode",
        f"must be one of {WANDB_MODES}, got {t.wandb_mode!r}",
    )


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
    if init.tokenizer not in ("char", "harness") and not os.path.isdir(init.tokenizer):
        raise ConfigError(
            f"config field init.tokenizer: {init.tokenizer!r} is neither 'char', 'harness' "
            "nor a directory holding tokenizer.json"
        )
    if config.train.token_dump_steps and jax.process_count() > 1:
        raise ConfigError(
            "config field train.token_dump_steps: one process only (the dump reads the "
            f"whole batch on the host), got {jax.process_count()} processes"
        )
    shards, micro = sharder.axis_size("batch"), config.rl.microbatches
    check_divisible(
        config.rl.batch_size,
        "config field rl.batch_size",
        minibatches=config.rl.minibatches,
        microbatches=micro,
        shards=shards,
    )
    vp = config.value_pretrain
    if vp.steps > 0:
        check_divisible(
            vp.batch_size,
            "config field value_pretrain.batch_size",
            microbatches=micro,
            shards=shards,
        )
    if init.critic_path and not os.path.isdir(init.critic_path):
        raise ConfigError(
            f"config field init.critic_path: {init.critic_path!r} is not a directory (a "
            "run's <workdir>/warm_start_critic)"
        )
    if init.kind == "sft" and config.sft.steps > 0:
        check_divisible(config.sft.batch_size, "config field sft.batch_size", shards=shards)
    check_sandbox(config)


def sandbox_uses(config: ConfigDict) -> list[tuple[str, str, bool]]:
    """(config field, isolation, allow_weak) of each part of the run that executes
    model-written code: a task that does (`runs_code`, e.g. python_tool: env.name), the
    answer env's python tool (env.params.tools), a reward that does (code_tests:
    env.params.reward; its reward_params may override the env's sandbox settings)."""
    from sao_jax.envs.registry import RegistryError, get_task, reward_runs_code

    params = config.env.params.to_dict() if "params" in config.env else {}
    isolation = params.get("isolation", "auto")
    allow = bool(params.get("allow_weak_isolation", False))
    uses = []
    if get_task(config.env.name).runs_code:
        uses.append(("env.name", isolation, allow))
    if "python" in tuple(params.get("tools", ())):
        uses.append(("env.params.tools", isolation, allow))
    reward = params.get("reward")
    try:
        runs = isinstance(reward, str) and reward_runs_code(reward)
    except RegistryError:
        runs = False  # an unknown reward is named by the env check (read_inputs)
    if runs:
        rp = dict(params.get("reward_params") or {})
        rp_allow = bool(rp.get("allow_weak_isolation", allow))
        uses.append(("env.params.reward", rp.get("isolation", isolation), rp_allow))
    return uses


def check_sandbox(config: ConfigDict) -> None:
    """A run that executes model-written code needs the sandbox's kernel isolation
    (bubblewrap) unless the weak mode is allowed for it (env.params.allow_weak_isolation):
    checked at start-up, before the workdir is touched, as one ConfigError line naming
    the field and what to install; an allowed weak mode is said in one warning line."""
    from sao_jax.envs import sandbox

    for field, isolation, allow in sandbox_uses(config):
        try:  # an allowed weak mode: one warning line (once per process)
            sandbox.resolve_isolation(isolation, allow)
        except (ValueError, sandbox.SandboxUnavailable) as e:
            bad_name = not isinstance(e, sandbox.SandboxUnavailable)
            why = " ".join(str(e).split()).removeprefix("sandbox: ")
            raise ConfigError(
                f"config field {'env.params.isolation' if bad_name else field}: "
                f"{field}={_value_of(config, field)!r} runs model code in the sandbox, and {why}"
            ) from None


def _value_of(config: ConfigDict, field: str) -> Any:
    node = config
    for part in field.split("."):
        node = node[part]
    return node.to_dict() if isinstance(node, ConfigDict) else node
