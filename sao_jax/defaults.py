"""The default run config: every section's defaults, one comment per field, in one place.

`default_config()` is what configs/base.py starts from (every experiment config starts from
configs/base.py) and what `sao_jax.config.validate` checks a config's field names and types
against (`reference`). The sections and who reads them:

  seed            the one seed the run's named RNG streams are split from, by one table
                  (sao_jax/run/streams.py)
  model           ModelConfig's fields (sao_jax/models/config.py, one comment per field);
                  configs/base.py puts the embedded model there (configs/models/tiny.py)
  mesh            device mesh and the one logical-axis rules table (sao_jax/parallel/mesh.py)
  optim           policy and critic AdamW (sao_jax/rl/optim.py)
  rl              the update step's algorithm: estimator, loss, TTUR, lambdas (sao_jax/rl/)
  sampling        rollout engine and async sampler (sao_jax/sampling/)
  env, data, init, sft, value_pretrain, train
                  the run's stages (sao_jax/train.py, sao_jax/run/)
  gateway         the OpenAI-compatible rollout gateway: serving, and training on agent
                  harnesses' episodes (sao_jax/serve/settings.py, docs/harness.md)

Ranges and cross-field rules are checked by the module that consumes a section (its
validator, registered with `sao_jax.schema.register_validator`); a new field is one line
here (with its comment) and its use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from sao_jax.models.config import ModelConfig
from sao_jax.parallel.mesh import DEFAULT_RULES, MESH_AXES
from sao_jax.rl import advantages, critic_targets, losses
from sao_jax.rl.optim import ATTENTION_PATTERNS
from sao_jax.sampling import vllm_config
from sao_jax.schema import ConfigDict

# Fields whose owner checks them itself (model: ModelConfig.from_config; sampling:
# sao_jax.sampling.sampler.configs_from_section, both reject unknown fields and fill
# missing ones from their dataclasses) or that hold free-form keyword arguments (a task's
# env and prompt parameters, chat-template variables): `reference` leaves them open.
OPEN_FIELDS = ("model", "sampling", "env.params", "env.prompts", "data.template_kwargs")


def default_config() -> ConfigDict:
    """A fresh ConfigDict of every section's defaults (the module docstring lists them)."""
    c = ConfigDict()
    c.seed = 0  # the one seed every named RNG stream is split from (sao_jax/run/streams.py)
    c.model = ConfigDict(dataclasses.asdict(ModelConfig()))  # sao_jax/models/config.py
    c.mesh = mesh_section()  # device mesh and the logical-axis rules table
    c.optim = ConfigDict()  # the RL optimizers, one per model
    c.optim.policy = optimizer_section(1e-6)  # paper: policy lr 1e-6
    c.optim.critic = optimizer_section(5e-6)  # paper: critic lr 5e-6
    c.optim.critic.freeze_attention = True  # SAO's frozen-attention critic
    c.optim.critic.trainable = "moe"  # what trains while attention is frozen: 'moe' (MoE /
    # MLP blocks + router + value head, the seed's) | 'all_but_attention' (+ embedding, norms)
    c.optim.critic.frozen_patterns = ATTENTION_PATTERNS  # regexes on parameter paths
    c.optim.critic.warmup_steps = 10  # the paper's 10-step critic warm-up, read as an LR
    # warm-up over the first RL steps; rl.critic_only_steps gives the other reading
    c.rl = rl_section()  # the update step's algorithm
    c.sampling = sampling_section()  # generation engine + async sampler
    c.env = env_section()  # task, prompt difficulty, held-out split, group size
    c.data = data_section()  # prompts: the task's generator or a dataset file (field mapping)
    c.init = init_section()  # warm start: SFT on demonstrations | HF checkpoint | random
    c.sft = sft_section()  # the SFT warm start
    c.value_pretrain = value_pretrain_section()  # the critic's pretraining before RL
    c.train = train_section()  # RL steps, rollout mode, logging, eval, checkpoints
    c.gateway = gateway_section()  # the rollout gateway (serve; harness / live training)
    return c


def mesh_section() -> ConfigDict:
    """The device mesh (sao_jax/parallel/mesh.py)."""
    c = ConfigDict()
    c.axes = MESH_AXES  # named mesh axes
    c.shape = (-1, 1, 1, 1)  # one size may be -1 (all remaining devices)
    c.rules = DEFAULT_RULES  # logical axis -> mesh axes (the one rules table)
    return c


def optimizer_section(lr: float, **overrides: Any) -> ConfigDict:
    """One AdamW optimizer (policy, critic, SFT; sao_jax/rl/optim.py)."""
    c = ConfigDict()
    c.lr = lr  # peak learning rate (AdamW)
    c.b1 = 0.9  # AdamW first-moment decay
    c.b2 = 0.999  # AdamW second-moment decay
    c.eps = 1e-8  # AdamW denominator epsilon
    c.weight_decay = 0.0  # decoupled weight decay (AdamW)
    c.max_grad_norm = 1.0  # global-norm clip; 0 disables
    c.warmup_steps = 0  # linear LR warm-up steps of this optimizer
    c.decay = "constant"  # 'constant' | 'cosine' after warm-up
    c.decay_steps = 1000  # cosine length (when decay == 'cosine')
    c.final_lr_ratio = 0.1  # cosine floor as a fraction of lr
    c.update(overrides)
    return c


def rl_section() -> ConfigDict:
    """The algorithm of one update step (sao_jax/rl/update.py; checks: sao_jax/rl/settings.py).

    SAO's defaults (docs/method.md sections 2-4): observation-skipping GAE, DIS policy loss
    with keep band (0.7, 6.0), K=2 critic steps per policy step, lam_critic = 1,
    length-adaptive policy lambda with alpha = 1.5, gamma = 1, no whitening, no value
    clipping, one policy optimizer step per batch. PPO-style rows take `ppo_epochs` x
    `minibatches` policy steps per batch (docs/method.md section 5).
    """
    c = ConfigDict()
    c.batch_size = 128  # finished single trajectories per update (paper: 128 prompts x 1)
    c.advantage = "gae"  # estimator name (sao_jax.rl.advantages registry)
    c.policy_loss = "dis"  # loss name (sao_jax.rl.losses registry)
    c.k_critic = 2  # TTUR: critic optimizer steps per policy step (1 = ablation)
    c.order = "critic_first"  # 'critic_first': targets -> K critic steps -> recompute V ->
    # advantages -> policy step; 'policy_first': advantages from the current critic ->
    # policy step -> K critic steps
    c.gamma = 1.0  # discount [open]
    c.lam_critic = 1.0  # lambda of the critic's value targets (decoupled lambda)
    c.critic_target = "lambda"  # what the critic regresses (sao_jax.rl.critic_targets):
    # 'lambda' = the estimator's returns at lam_critic | 'brace' = anchored Bellman-residual
    # target for stale rollouts: k-capped importance-weighted correction + Monte-Carlo tail
    c.lam_mode = "adaptive"  # policy lambda: 'adaptive' = 1 - 1/(alpha * l) per row
    c.lam_alpha = 1.5  # alpha of the adaptive policy lambda (SAO 1.5; VAPO 0.05)
    c.lam_fixed = 0.95  # policy lambda when lam_mode == 'fixed'
    c.whiten_advantages = False  # masked whitening over action tokens [open]
    c.value_clip = 0.0  # value-loss clipping around the pre-update values; 0 = off [open]
    c.privileged_critic = False  # the critic reads the task's hint (info['critic_hint'],
    # e.g. the current target of a moving reward) in place of the prompt text it names:
    # a ceiling row for what a critic could do if it saw that, never a method to deploy
    c.critic_only_steps = 0  # critic warm-up read as N critic-only updates (policy frozen)
    c.ppo_epochs = 1  # passes of the policy over each batch (SAO/DIS: 1; PPO rows: more)
    c.minibatches = 1  # policy OPTIMIZER steps per epoch, each on batch_size / minibatches
    # rows reshuffled per epoch (veRL's ppo_mini_batch_size = batch_size / minibatches)
    c.microbatches = 1  # gradient ACCUMULATION inside one optimizer step (memory only: the
    # step is the same as on the whole (mini)batch); not to be confused with minibatches
    c.max_consecutive_skips = 10  # abort after this many non-finite steps in a row
    c.routing_replay = False  # force the policy's MoE routing recorded at rollout time
    c.moving_average_window = 128  # window of the moving-average baseline
    c.moving_average_keys = 0  # K >= 2: one window per key (keyed moving average: a row's
    # baseline is the mean of the last moving_average_window outcomes of its own key);
    # 0 or 1: one global window
    c.baseline_key = ""  # the prompt meta field whose int value in [0, K) is a row's key
    # (e.g. 'level' of the levels task: 1..4, so K = 5); '' = none (global window)
    c.group_eps = 1e-6  # epsilon of group std normalisation (GRPO)
    # Parameters of every policy loss, defaults from the loss registry (one source):
    # dis: keep r in (1 - eps_l, 1 + eps_h) = (0.7, 6.0); ppo_clip: eps_low/eps_high vs
    # pi_old = the behaviour (rollout) log-probs; icepop: + weight k = pi_train/pi_infer in
    # the band (icepop_mask: mask only); estr: keep |log r| <= sqrt(tau (H+eps)).
    c.losses = ConfigDict(
        {
            name: dict(losses.LOSSES.get(name).params)
            for name in losses.LOSSES.names()
            if losses.LOSSES.get(name).kind == "policy" and losses.LOSSES.get(name).params
        }
    )
    # Parameters of every advantage estimator, defaults from the estimator registry:
    # impl of the critic-based ones = the GAE implementation ('auto': per backend,
    # sao_jax/rl/gae.py; 'scan' | 'associative' | 'chunked').
    c.estimators = ConfigDict(
        {
            name: dict(advantages.ESTIMATORS.get(name).params)
            for name in advantages.ESTIMATORS.names()
            if advantages.ESTIMATORS.get(name).params
        }
    )
    # Parameters of every critic target, defaults from the critic-target registry:
    # brace: k (correction horizon, action tokens), c_bar / rho_bar (caps of the trace and
    # of the residual weight), tail ('one': Monte-Carlo tail weight 1 | 'trace': P_{t,k}).
    c.critic_targets = ConfigDict(
        {
            name: dict(critic_targets.CRITIC_TARGETS.get(name).params)
            for name in critic_targets.CRITIC_TARGETS.names()
            if critic_targets.CRITIC_TARGETS.get(name).params
        }
    )
    return c


def sampling_section() -> ConfigDict:
    """The rollout engine and the async sampler, flat: the fields of
    sao_jax.sampling.engine.EngineConfig and sao_jax.sampling.sampler.SamplerConfig
    (`configs_from_section` builds both and rejects other names)."""
    placeholder = ml_collections.config_dict.placeholder
    c = ConfigDict()
    c.num_workers = 1  # sampler threads, each with its own engine and environments
    c.num_slots = 4  # trajectories decoded together per worker
    c.max_len = 128  # cache length = longest trajectory in tokens
    c.max_turn_tokens = 64  # a model turn ends after this many tokens
    c.prefill_buckets = ()  # prefill chunk widths; () = powers of two 8..max_len
    c.span_buckets = ()  # cache read spans; () = powers of two 128..max_len; (max_len,) = off
    c.lane_slots = 0  # the longest slots read their own longer span; 0 = off
    c.steps_per_sync = 1  # decode steps between host checks (overshoot discarded)
    c.temperature = 1.0  # 0 = greedy
    c.top_k = 0  # 0 = off
    c.top_p = 1.0  # 1 = off
    c.record_routing = False  # record each token's experts (for rl.routing_replay)
    c.add_bos = True  # prepend the tokenizer's BOS to every prompt
    c.env_timeout_s = ml_collections.FieldReference(120.0, field_type=float)  # per env
    # call (a tool run, a judge call), then the trajectory is dropped; None = no timeout
    c.env_workers = 8  # env calls running at once per worker (off the decoding thread)
    # KV cache layout (docs/sampling.md, "Paged KV pool"): 'dense' preallocates
    # num_slots x max_len per layer; 'paged' shares a pool of pages among the slots, sized
    # to the live tokens, with admission control when it is full.
    c.kv_layout = "dense"
    c.page_size = 16  # paged: token positions per page
    c.num_pages = 0  # paged: pages per layer in each engine's pool; 0 = num_slots x max_len
    c.paged_kernel = "auto"  # paged decode read: auto (Pallas on TPU/GPU, else gather) |
    # gather | pallas_tpu | pallas_gpu (off their backend: Pallas interpret mode, tests only)
    c.per_token_keys = False  # key each draw by (trajectory, position): the same tokens
    # whatever the schedule (slots, batching, admission waits); False: a key per decode call
    c.queue_size = 64  # finished trajectories buffered ahead of the learner
    c.max_staleness = placeholder(int)  # drop if current - oldest version > this; None = off
    c.max_env_errors = 8  # environment failures in a row before the sampler fails
    c.max_dropped_in_a_row = 64  # dropped episodes in a row (any reason, e.g. every prompt
    # longer than max_len) before the run stops naming the drops by reason
    c.lockstep = placeholder(int)  # deterministic mode: trajectories per version
    # Where the pool decodes (sao_jax/parallel/placement.py): 'colocated' on the trainer's
    # devices | 'disaggregated' on devices of its own (the trainer mesh takes the rest)
    c.placement = "colocated"
    c.pool_devices = 0  # disaggregated: each process's last N local devices form its pool
    c.pool_mesh = ()  # the pool's mesh shape over mesh.axes (product = pool_devices);
    # () = (pool_devices, 1, 1, 1): the engine's slots over the first (data) axis
    c.backend = "native"  # the engine: 'native' (JAX, in process) | 'vllm' (vLLM's CPU
    # build in its own env, `make vllm-env`; docs/vllm.md)
    c.vllm = vllm_config.section()  # vLLM's knobs (sao_jax/sampling/vllm_config.py)
    return c


def env_section() -> ConfigDict:
    """The task (sao_jax/envs/), its prompts' difficulty, the held-out split."""
    c = ConfigDict()
    c.name = "arithmetic"  # a registered task (sao_jax/envs/registry.py) or 'pkg.module:Task'
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
    c.fields = ConfigDict()  # dataset field -> prompt part
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
    """The warm start (sao_jax/train.py, `Run.warm_start`)."""
    c = ConfigDict()
    c.kind = "sft"  # 'sft' on demonstrations | 'hf' checkpoint | 'params' | 'random'
    c.hf_path = ""  # Hugging Face checkpoint directory when kind == 'hf'
    c.params_path = ""  # a run's <workdir>/warm_start when kind == 'params' (shared SFT)
    c.critic_path = ""  # a run's <workdir>/warm_start_critic: start from that value-
    # pretrained critic and skip value pretraining ('' = pretrain here; sweeps share one)
    c.tokenizer = "char"  # 'char' (built-in; with kind 'hf': the checkpoint's own, from
    # hf_path's tokenizer.json) or a directory with tokenizer.json
    # 'auto': the tokenizer's chat template when it has one (else raw text) | 'tokenizer':
    # required from the tokenizer | 'none': raw text | a path to a .jinja file
    c.chat_template = "auto"
    return c


def sft_section() -> ConfigDict:
    """SFT on the task's demonstrations (sao_jax/run/sft.py)."""
    c = ConfigDict()
    c.steps = 300  # supervised steps on demonstrations
    c.batch_size = 32  # demonstration rows per SFT step
    c.length = 96  # tokens per demonstration row (longer demos are skipped)
    c.error_rate = 0.3  # share of deliberately imperfect demonstrations (RL headroom)
    c.optim = optimizer_section(3e-3, warmup_steps=20, max_grad_norm=1.0)  # SFT's AdamW
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
    c.lr = 0.0  # peak AdamW lr; 0 = optim.critic.lr (b1, b2, eps and weight decay always
    # come from optim.critic; warm-up and schedule are its own)
    c.max_grad_norm = -1.0  # global-norm clip; -1 = optim.critic.max_grad_norm, 0 = none
    # (its own value lets the RL critic's clip vary while the pretrained critic is shared)
    c.warmup_steps = 10  # linear lr warm-up over the first pretraining steps
    c.sampler = "async"  # 'async': the async sampler runs ahead of the critic steps |
    # 'sync': the engine generates each batch in turn (deterministic with any worker count)
    return c


def train_section() -> ConfigDict:
    """The RL stage and the run's outputs (sao_jax/train.py)."""
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
    c.eval_sampled_repeats = 1  # samples per held-out prompt in the sampled evaluation
    # (its success is their mean: k samples a prompt divide its sampling variance by k)
    c.checkpoint_every = 25  # steps between checkpoints (0 = only at the end)
    c.keep_checkpoints = 3  # newest checkpoints kept (older ones deleted)
    c.async_checkpoints = True  # save in the background while training goes on
    c.take_timeout_s = 600.0  # no trajectory for this long: the run stops naming the drops
    # (NoProgress, exit 2); bounds every rollouts wait and an evaluation's silence too
    c.report = True  # write report.md + plots at the end
    c.progress = True  # terminal progress bar
    c.token_dump_steps = ()  # steps whose batch's per-token log-ratio, entropy and
    # staleness go to <workdir>/token_dump/step=<n>.npz (sao_jax/run/token_dump.py)
    c.samples_per_log = 4  # decoded rollouts per log step in <workdir>/samples.jsonl and
    # TensorBoard's TEXT tab (sao_jax/report/samples.py); 0 = none
    c.wandb_project = ""  # Weights & Biases project to log metrics to ("" = off; needs
    # `pip install wandb`)
    c.wandb_entity = ""  # W&B entity (team or user; "" = your default)
    c.wandb_name = ""  # W&B run name ("" = the workdir's name)
    c.wandb_mode = "online"  # 'online' | 'offline' (files in <workdir>/wandb, `wandb sync`
    # later) | 'disabled'
    return c


def gateway_section() -> ConfigDict:
    """The rollout gateway (sao_jax/serve/; checks: sao_jax/serve/settings.py). Read by
    `experiments.serve` (whose flags override these fields) and by a training run whose
    `mode` is not 'off'."""
    c = ConfigDict()
    c.mode = "off"  # a training run's rollouts: 'off' = the in-process env sampler |
    # 'harness' = harness processes (gateway.harness) through the gateway | 'live' = the
    # episodes of any client's sessions (serve with training on)
    c.host = "127.0.0.1"  # address to listen on (anything else: a warning)
    c.port = 0  # 0 = a free port (<workdir>/gateway.json says which)
    c.model_name = "sao-policy"  # the served model's name
    c.max_tokens = 0  # per request at most; 0 = whatever the context leaves
    c.max_body_bytes = 4 << 20  # larger request bodies: 413
    c.reward_timeout_s = 600.0  # an episode with no reward this long after its last call
    # is ended as by /end (scored by its task's reward, else dropped)
    c.strict_sampling = False  # sampling knobs that differ from the run's: a 400, not
    # ignored and counted
    # The native backend's admission of requests arriving over HTTP
    # (sao_jax/sampling/backend_native.py, Admission): while no slot decodes, waiting
    # requests start together once none arrived for admit_gap_s (a burst is over), or the
    # oldest waited admit_wait_s, or they fill the free slots; 0 <= gap <= wait. A vLLM
    # backend schedules its own requests and ignores both.
    c.admit_gap_s = 0.02
    c.admit_wait_s = 0.2
    c.max_staleness = ml_collections.FieldReference(16, field_type=int)  # drop an episode
    # whose oldest action token is more than this many versions behind the learner when
    # taken (None = off); on by default, unlike sampling.max_staleness, because nothing
    # else bounds a session's lag (docs/harness.md, "Training on harness episodes")
    c.harness = ConfigDict()  # the training driver's harness processes (mode 'harness')
    c.harness.command = ""  # template, split like a shell line; placeholders {base_url}
    # {api_key} (the session's), {task_json}, {python} (this interpreter), {workdir}
    c.harness.processes = 2  # harness processes running at once
    c.harness.timeout_s = 600.0  # a process running longer is killed, its episode dropped
    c.harness.sandbox = False  # run each inside bubblewrap; the gateway is reached
    # through a Unix socket only (docs/harness.md, "Sandboxed harnesses")
    c.harness.sandbox_paths = ()  # read-only paths the sandboxed harness needs (its code)
    return c


def reference() -> dict[str, Any]:
    """`default_config()` as a dict, OPEN_FIELDS set to None: the names and types
    `sao_jax.config.check_fields` checks a config against."""
    ref = default_config().to_dict()
    for dotted in OPEN_FIELDS:
        *parents, leaf = dotted.split(".")
        node = ref
        for p in parents:
            node = node[p]
        node[leaf] = None
    return ref
