"""A peer in the same run: google-tunix 0.1.7's PPO train steps vs sao_jax's update step.

    python -m experiments.bench.peers                  # B x T = 4 x 512, 5 rounds
    python -m experiments.bench.peers --quick          # 4 x 128, 3 rounds

tunix is a bench-only extra, never a library dependency and not installed by CI:
install it into a separate virtualenv (docs/benchmarks.md, "Peer: tunix PPO"):

    python3 -m venv /tmp/tunix_venv
    /tmp/tunix_venv/bin/pip install google-tunix==0.1.7 -r requirements.txt  # = .[bench]
    PYTHONPATH=$PWD /tmp/tunix_venv/bin/python -m experiments.bench.peers

Both sides get the same model shapes (the update-step bench's larger model,
experiments/bench/update_step.py LARGER: D=256, 4 layers, 8/4 heads of 32, layer 0
dense with width 1024, layers 1-3 MoE with 16 experts of width 256, top-2, vocab 1024,
untied head, fp32), the same batch (sao_jax.rl.synthetic: rows of random length in
[T/2, T], right-padded, a 4-token prompt then action/observation turns) and AdamW with
a global-norm clip of 1.0. A dense row repeats everything with every layer a dense MLP
of width 1024.

tunix, as its `PPOLearner` wires its two `rl.trainer.Trainer`s (tunix/rl/ppo/
ppo_learner.py): a random-init tunix `Qwen3` actor, the critic made from it by
`tunix.rl.utils.create_critic_model` (a copy with the LM head replaced by a Linear(D, 1)
value head), the actor trainer's loss the registry's `policy_loss_fn` 'ppo', the
critic's `value_loss_fn` 'ppo', their `gen_model_input_fn`s as PPOLearner sets them,
and each trainer's own jitted train step (`jit_train_and_eval_step`, `nnx.jit` with the
optimizer donated and the nnx graph cached, as `Trainer.train` runs it) called on a
`TrainExample` whose prompt is the batch's first 4 tokens and whose completion is the
rest. Timed per call: the actor step (policy forward + backward + AdamW), the critic
step (critic forward + backward + AdamW) and, apart, the values forward PPOLearner runs
before them (`common.compute_score`, its rollout phase). On CPU tunix's MoE computes
every expert on every token (its megablox kernel is TPU-only) and its dense MLP starts
at zero weights (the FLOPs are the same).

sao_jax: `Learner.update_step` (sao_jax/rl/update.py), the whole step in one program:
  SAO      its defaults (configs/base.py): V0 from the first critic step's forward, GAE,
           K = 2 critic steps of the frozen-attention critic, V recomputed, DIS loss,
           one policy step;
  PPO-like k_critic = 1, the whole critic trained, PPO clip loss, order policy_first:
           the same optimizer steps as tunix's two train steps plus the values forward.

Every program is compiled (and its compile + first call timed) before the rounds; then
each round runs every step once, interleaved, and ratios are taken per round.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from sao_jax.experiments.bench.update_step import LARGER

from sao_jax import config as config_lib
from sao_jax.configs import base
from sao_jax.models.config import ModelConfig
from sao_jax.models.factory import init_models
from sao_jax.parallel.mesh import Sharder
from sao_jax.rl.synthetic import synthetic_batch
from sao_jax.rl.update import Learner

PROMPT = 4  # synthetic_batch's prompt length: tunix's prompt_ids
PAD = 0  # synthetic_batch pads with token 0 (real tokens are >= 1)
LR, CLIP = 1e-6, 1.0  # both sides: AdamW(b1 0.9, b2 0.999, eps 1e-8), global-norm clip
# sao_jax's two forms: overrides of the config's rl / optim.critic sections.
SAO_FORMS = {
    "SAO": {},
    "PPO-like": {
        "rl.k_critic": 1,
        "rl.policy_loss": "ppo_clip",
        "rl.order": "policy_first",
        "optim.critic.freeze_attention": False,
    },
}
DENSE = dict(num_experts=0, mlp_only_layers=())


def import_tunix():
    try:
        import optax
        from flax import nnx
        from tunix.models.qwen3 import model as qwen3
        from tunix.rl import common, function_registry
        from tunix.rl import trainer as rl_trainer
        from tunix.rl import utils as rl_utils
        from tunix.rl.ppo import ppo_learner
        from tunix.sft import peft_trainer
    except ImportError as e:
        raise SystemExit(
            f"experiments.bench.peers needs google-tunix ({e}); install the bench extra in a "
            "separate virtualenv: pip install -e '.[bench]' (docs/benchmarks.md)"
        ) from None
    return dict(
        optax=optax,
        nnx=nnx,
        qwen3=qwen3,
        common=common,
        registry=function_registry.default_registry,
        rl_trainer=rl_trainer,
        rl_utils=rl_utils,
        ppo=ppo_learner,
        peft=peft_trainer,
    )


def sao_config(overrides: dict, batch: int, form: dict):
    c = base.get_config()
    c.model.update(overrides)
    c.rl.batch_size = batch
    for path, value in form.items():
        section, field = path.rsplit(".", 1)
        node = c
        for part in section.split("."):
            node = node[part]
        node[field] = value
    for opt in (c.optim.policy, c.optim.critic):
        opt.update(lr=LR, max_grad_norm=CLIP, warmup_steps=0, weight_decay=0.0)
    return config_lib.validate(c)


def sao_step(overrides: dict, form: dict, host_batch, seed: int):
    """A zero-argument callable: one sao_jax update step, blocked."""
    b = host_batch["tokens"].shape[0]
    config = sao_config(overrides, b, form)
    cfg = ModelConfig.from_config(config.model)
    sharder = Sharder()
    models = init_models(cfg, sharder, seed=seed)
    learner = Learner(config.rl, config.optim, models.policy_def, models.critic_def, sharder)
    holder = {"state": learner.new_state(models.policy, models.critic, seed=seed)}
    batch = jax.device_put(host_batch)
    key = jax.random.key(seed)

    def step():
        holder["state"], metrics = learner.update_step(holder["state"], batch, key)
        jax.block_until_ready((holder["state"], metrics))

    return step


def tunix_model_config(t, overrides: dict):
    """tunix's Qwen3 config of the same shapes; `moe_width` for every MoE layer."""
    c = {**base.get_config().model.to_dict(), **overrides}
    moe = c["num_experts"] > 0
    return (
        t["qwen3"].ModelConfig(
            num_layers=c["num_hidden_layers"],
            vocab_size=c["vocab_size"],
            embed_dim=c["hidden_size"],
            hidden_dim=c["moe_intermediate_size"] if moe else c["intermediate_size"],
            num_heads=c["num_attention_heads"],
            head_dim=c["head_dim"],
            num_kv_heads=c["num_key_value_heads"],
            rope_theta=int(c["rope_theta"]),
            norm_eps=c["rms_norm_eps"],
            use_tied_embedding=c["tie_word_embeddings"],
            num_experts=c["num_experts"] if moe else None,
            num_experts_per_tok=c["num_experts_per_tok"] if moe else None,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
        ),
        [i for i in c["mlp_only_layers"] if moe],
        c["intermediate_size"],
    )


def tunix_models(t, overrides: dict, seed: int):
    """(actor, critic): a random-init tunix Qwen3 and `create_critic_model` of it. Layers
    sao_jax keeps dense (mlp_only_layers) get tunix's dense MLP of the dense width, since
    tunix's Qwen3 makes every layer MoE once num_experts is set."""
    nnx, qwen3 = t["nnx"], t["qwen3"]
    cfg, dense_layers, dense_width = tunix_model_config(t, overrides)
    actor = qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    dense_cfg = dataclasses.replace(
        cfg, hidden_dim=dense_width, num_experts=None, num_experts_per_tok=None
    )
    for i in dense_layers:
        actor.layers[i].mlp = qwen3.MLP(config=dense_cfg, rngs=nnx.Rngs(seed + 1 + i))
    return actor, t["rl_utils"].create_critic_model(actor, seed=seed)


def tunix_example(t, host_batch, seed: int):
    """The sao batch as tunix's PPO TrainExample: prompt = the first PROMPT tokens."""
    rng = np.random.default_rng(seed)
    tokens = host_batch["tokens"]
    completion = tokens[:, PROMPT:]
    mask = host_batch["action_mask"][:, PROMPT:].astype(bool)
    shape = completion.shape
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return t["ppo"].TrainExample(
        prompt_ids=jnp.asarray(tokens[:, :PROMPT]),
        prompt_mask=jnp.asarray(tokens[:, :PROMPT] != PAD, jnp.int32),
        completion_ids=jnp.asarray(completion),
        completion_mask=jnp.asarray(mask),
        advantages=f32(rng.normal(size=shape) * mask),
        ref_per_token_logps=None,
        old_per_token_logps=f32(np.where(mask, host_batch["rollout_logp"][:, PROMPT:], 0)),
        returns=f32(rng.normal(size=shape) * mask),
        old_values=f32(rng.normal(size=shape) * 0.1 * mask),
    )


def tunix_steps(t, overrides: dict, host_batch, seed: int) -> dict:
    """{'actor step', 'critic step', 'values forward'}: zero-argument callables, blocked."""
    optax = t["optax"]
    actor, critic = tunix_models(t, overrides, seed)
    example = tunix_example(t, host_batch, seed)
    ppo_config = t["ppo"].PPOConfig()
    eos = int(host_batch["tokens"].max()) + 1  # no token is eos: every row runs to its pad
    tx = lambda: optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=0.0))
    training = lambda: t["peft"].TrainingConfig(eval_every_n_steps=10**9)
    # As PPOLearner.__init__ configures rl_cluster.actor_trainer / critic_trainer:
    actor_trainer = t["rl_trainer"].Trainer(actor, tx(), training(), lambda: {})
    actor_trainer.with_loss_fn(t["registry"].get("policy_loss_fn", "ppo"), has_aux=True)
    actor_trainer.with_gen_model_input_fn(
        lambda x: {"train_example": x, "algo_config": ppo_config, "pad_id": PAD, "eos_id": eos}
    )
    critic_trainer = t["rl_trainer"].Trainer(critic, tx(), training(), lambda: {})
    critic_trainer.with_loss_fn(t["registry"].get("value_loss_fn", "ppo"), has_aux=True)
    critic_trainer.with_gen_model_input_fn(
        lambda x: {
            "train_example": x,
            "clip_range_value": ppo_config.clip_range_value,
            "pad_id": PAD,
            "eos_id": eos,
        }
    )
    actor_fn, _ = actor_trainer.jit_train_and_eval_step(cache_nnx_graph=True)
    critic_fn, _ = critic_trainer.jit_train_and_eval_step(cache_nnx_graph=True)
    prompt, completion = example.prompt_ids, example.completion_ids
    return {
        "actor step": lambda: jax.block_until_ready(actor_fn(example)),
        "critic step": lambda: jax.block_until_ready(critic_fn(example)),
        "values forward": lambda: jax.block_until_ready(
            t["common"].compute_score(critic_trainer.model, prompt, completion, PAD, eos)
        ),
    }


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def med_range(xs, fmt="{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def bench_row(t, name: str, overrides: dict, b: int, length: int, rounds: int, seed: int):
    host_batch = synthetic_batch(b, length, overrides.get("vocab_size", 1024), seed=seed)
    steps = {
        f"sao_jax {k}": sao_step(overrides, form, host_batch, seed) for k, form in SAO_FORMS.items()
    }
    steps.update(
        {f"tunix {k}": fn for k, fn in tunix_steps(t, overrides, host_batch, seed).items()}
    )
    compile_s = {k: seconds(fn) for k, fn in steps.items()}  # compile + first call
    times = {k: [] for k in steps}
    load0 = os.getloadavg()[0]
    for _ in range(rounds):
        for k, fn in steps.items():
            times[k].append(seconds(fn))
    load1 = os.getloadavg()[0]
    tok = int((host_batch["tokens"] != PAD).sum())
    print(
        f"\n## {name}: B x T = {b} x {length} ({tok} real tokens), "
        f"load average {load0:.1f} -> {load1:.1f}"
    )
    print("| step | s per step, median (range) | compile + first call (s) |")
    print("|---|---|---|")
    for k in steps:
        print(f"| {k} | {med_range(times[k])} | {compile_s[k]:.1f} |")
    tunix2 = [a + c for a, c in zip(times["tunix actor step"], times["tunix critic step"])]
    tunix3 = [x + v for x, v in zip(tunix2, times["tunix values forward"])]
    print("per-round ratios, tunix time / sao_jax time (median, range):")
    for form in SAO_FORMS:
        sao = times[f"sao_jax {form}"]
        r2 = [x / s for x, s in zip(tunix2, sao)]
        r3 = [x / s for x, s in zip(tunix3, sao)]
        print(
            f"  (actor + critic step) / sao_jax {form}: {med_range(r2, '{:.2f}')}x; "
            f"+ values forward: {med_range(r3, '{:.2f}')}x"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="T = 128, 3 rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--length", type=int, default=None, help="T (default 512; --quick 128)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rows", nargs="+", default=["moe", "dense"], choices=["moe", "dense"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    length = args.length or (128 if args.quick else 512)
    t = import_tunix()
    from importlib import metadata

    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  {platform.node()}  {platform.processor()}")
    print(
        f"# jax {jax.__version__} backend={jax.default_backend()} devices={jax.device_count()}, "
        f"google-tunix {metadata.version('google-tunix')}, {rounds} interleaved rounds"
    )
    rows = {
        "moe": ("MoE (update-step bench's larger model)", LARGER),
        "dense": ("dense", {**LARGER, **DENSE}),
    }
    for r in args.rows:
        name, overrides = rows[r]
        bench_row(t, name, overrides, args.batch, length, rounds, args.seed)


if __name__ == "__main__":
    main()
