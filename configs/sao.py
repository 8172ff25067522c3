r"""SAO on the graded calculator task (sao_jax/envs/levels.py): the README's main job.

A small Qwen3-MoE-style model (configs/models/tiny.py) is warm-started by SFT on
deliberately imperfect tool-use demonstrations, its critic is value-pretrained on
Monte-Carlo returns, then it trains with single rollouts, asynchronously: DIS policy
loss, K=2 critic steps per policy step, frozen-attention critic, observation-skipping
GAE with the length-adaptive lambda. Learning rates are scaled for a model trained from
scratch on CPU (the paper's 1e-6 / 5e-6 are for a pretrained 30B model). The task mixes
four levels of difficulty in one prompt stream, checks every calculator call (`e:step`
for a call that is no step of the problem) and gives each episode a turn budget, so
the expected reward differs per prompt and changes mid-episode (docs/experiments.md).

  python -m experiments.train --config=configs/sao.py --workdir=workdirs/sao
  python -m experiments.train --config=configs/sao.py:smoke --workdir=/tmp/sao_smoke

Variants (`:a,b=1`): smoke (a run of seconds for tests), sync (deterministic rollouts, in
RL and in value pretraining), seed=N, calculator (the previous task: one problem format,
sao_jax/envs/arithmetic.py), vllm (rollouts by vLLM's CPU build, `make vllm-env` first:
sampling.backend='vllm' on a model of the shapes its CPU kernels take, docs/vllm.md):

  python -m experiments.train --config=configs/sao.py:vllm --workdir=workdirs/sao_vllm
"""

from sao_jax.config import ConfigDict, parse_arg
from sao_jax.configs import base
from sao_jax.sampling.vllm_config import use_vllm


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, sync=False, seed=0, calculator=False, vllm=False)
    c = base.get_config()
    c.seed = arg.seed

    if not arg.calculator:  # the graded task (sao_jax/envs/levels.py)
        c.env.name = "arithmetic_levels"
        # The task's defaults, so that another env.name needs no other edits: one retry
        # beyond one call per operation (spare_turns=1), the four levels drawn uniformly.
        c.env.params = ConfigDict()
        c.env.prompts = ConfigDict()
        c.env.eval_size = 256  # held-out prompts: binomial SE of a score ~3 points

    if arg.calculator:
        c.sft.steps = 500  # converged for every seed tried (at 300, seeds 1 and 2 were not)
        c.sft.error_rate = 0.3
    else:
        c.sft.steps = 1000  # at 500, seed 0 had not learned two-operation problems (3%)
        c.sft.error_rate = 0.8  # demo imperfection at level 4, x each level's weight
    c.value_pretrain.steps = 150  # at most; stops on the held-out EV plateau [open]

    c.rl.batch_size = 64
    c.optim.policy.lr = 1e-4
    c.optim.critic.lr = 1e-3
    c.optim.critic.warmup_steps = 10

    c.sampling.num_slots = 32
    c.sampling.max_len = 96
    c.sampling.max_turn_tokens = 24
    c.sampling.queue_size = 128

    c.train.total_steps = 60
    c.train.eval_every = 20
    c.train.checkpoint_every = 20
    c.train.rollouts = "sync" if arg.sync else "async"
    c.value_pretrain.sampler = "sync" if arg.sync else "async"  # both stages deterministic

    if arg.smoke:
        c.model.update(hidden_size=32, num_hidden_layers=2, mlp_only_layers=(0,), num_experts=4)
        c.sft.steps = 4
        c.sft.batch_size = 8
        c.value_pretrain.update(steps=2, batch_size=8, heldout_rollouts=8, eval_every=1)
        c.rl.batch_size = 8
        c.sampling.num_slots = 8
        c.env.eval_size = 8
        c.train.total_steps = 4
        c.train.log_every = 2
        c.train.eval_every = 2
        c.train.checkpoint_every = 2
        c.train.progress = False
        # One update-step shape: a smoke batch pads to max_len, not to the next multiple of
        # 32 its longest rollout reaches, so a run compiles its update once (of a smoke run's
        # ~100 s, the second bucket's trace and compile took ~40).
        c.train.length_bucket = c.sampling.max_len
    if arg.vllm:  # after smoke: the shapes vLLM's CPU kernels take (use_vllm); evaluation
        # stays on the native engine
        use_vllm(c)
        if not arg.smoke:  # vLLM on 2 CPU cores is ~10x slower than the native engine here
            c.value_pretrain.steps = 40
    return c
