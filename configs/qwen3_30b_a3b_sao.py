r"""SAO on Qwen3-30B-A3B from a Hugging Face checkpoint: the paper-scale run.

Policy and critic both start from the checkpoint (the critic's trunk is a copy, its
value head starts at zero); the paper's sampling and batch sizes: 128 single
trajectories per update, K=2 critic steps per policy step, DIS keep band (0.7, 6.0),
policy lr 1e-6, critic lr 5e-6 with a 10-step warm-up, frozen-attention critic.
Master weights float32, matmuls bfloat16 (configs/models/qwen3_30b_a3b.py says why).

Meshes (docs/scaling.md has the memory plan of each; figures per device at 32k tokens
per trajectory, from `experiments.memory_plan`'s analytic update-step model):
  default  64 chips, e.g. a TPU v5p-128 slice (16 hosts x 4 chips): data=1 fsdp=8
           expert=8 tensor=1; 12.9 GiB/chip of params + AdamW states, 65.5 GiB/chip
           with the update step's temporaries, the sampler copy and the KV cache (of 95).
  gpus=16  16 x H200 (two hosts): fsdp=16; 41.9 GiB/GPU of params + AdamW states,
           108.9 GiB/GPU in all (of 131: raise XLA_PYTHON_CLIENT_MEM_FRACTION).
  gpus=8   8 x H200 (one host): fsdp=8; 83.7 GiB/GPU of params + AdamW states; the
           update step does NOT fit (the plan says ~189 GiB/GPU even at 8k tokens).

  python -m experiments.launch --target=tpu --tpu_name=<slice> --zone=<zone> \
      --config=configs/qwen3_30b_a3b_sao.py:hf_path=/mnt/models/Qwen3-30B-A3B \
      --workdir=/mnt/runs/sao30b
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python -m experiments.train \
      --config=configs/qwen3_30b_a3b_sao.py:gpus=16,replay --workdir=/mnt/runs/sao30b_gpu \
      --coordinator_address=h1:8476 --num_processes=2 --process_id=0   # 1 on host h2
  python -m experiments.memory_plan --config=configs/qwen3_30b_a3b_sao.py \
      --mesh=data=1,fsdp=8,expert=8,tensor=1 --devices=64
  python -m experiments.memory_plan --config=configs/qwen3_30b_a3b_sao.py:paged \
      --mesh=data=1,fsdp=8,expert=8,tensor=1 --devices=64

Variants (`:a,b=1`): gpus=N (an N-GPU fsdp mesh, N in 8..128; 0 = the TPU mesh),
replay (MoE routing replay: the sampler records each token's experts, the update
forces them), paged (a paged KV pool per host: 32 rollouts in flight per host, 512 on
the 64 chips, instead of 8 dense 32k-token slots; docs/scaling.md "The rollout pool"),
hf_path=DIR (config.json, *.safetensors, tokenizer.json), seed=N, data=FILE (a
GSM8K-format .jsonl / .parquet / save_to_disk folder: question, answer "... #### 72";
the policy answers through the chat template, may call Python, and is rewarded by
math-verify on its last \boxed{}), eval_data=FILE (held-out; default: a seeded 10%
split of data). Without data: the built-in multi-turn Python-tool task.
"""

from sao_jax.configs.models import qwen3_30b_a3b

from sao_jax.config import ConfigError, parse_arg
from sao_jax.configs import base

DEFAULT_HF_PATH = "/mnt/models/Qwen3-30B-A3B"  # a local or mounted copy of the Hub repo


def get_config(arg=None):
    arg = parse_arg(
        arg,
        gpus=0,
        replay=False,
        paged=False,
        hf_path=DEFAULT_HF_PATH,
        seed=0,
        data="",
        eval_data="",
    )
    c = base.get_config()
    c.seed = arg.seed

    c.model = qwen3_30b_a3b.get_config()  # must match the checkpoint's config.json
    c.init.kind = "hf"
    c.init.hf_path = arg.hf_path
    c.init.tokenizer = arg.hf_path  # the checkpoint's tokenizer.json
    c.sft.steps = 0  # no SFT: the checkpoint is the warm start

    if arg.gpus:
        if arg.gpus not in (8, 16, 32, 64, 128):
            raise ConfigError(f"config variant gpus={arg.gpus}: one of 8, 16, 32, 64, 128")
        c.mesh.shape = (1, arg.gpus, 1, 1)  # fsdp over every GPU (lowest memory per GPU)
        c.rl.microbatches = 128 // arg.gpus  # 1 row per GPU per pass
        c.sampling.num_slots = 16  # per host: 16 x 32k-token KV caches = 48 GiB / 8 GPUs
    else:
        c.mesh.shape = (1, 8, 8, 1)  # 64 chips: fsdp=8 x expert=8 (128 experts -> 16/chip)
        c.rl.microbatches = 2  # 128 rows / (2 x 64 batch shards) = 1 row per chip per pass
        c.sampling.num_slots = 8  # per host: 8 x 32k-token KV caches = 24 GiB / 4 chips

    c.rl.batch_size = 128  # finished single trajectories per update (paper)
    c.rl.k_critic = 2  # TTUR: critic steps per policy step (paper)
    c.rl.policy_loss = "dis"
    c.rl.losses.dis.eps_l = 0.3  # keep ratios in (1 - 0.3, 1 + 5.0) = (0.7, 6.0) (paper)
    c.rl.losses.dis.eps_h = 5.0
    c.rl.routing_replay = arg.replay
    c.optim.policy.lr = 1e-6  # paper
    c.optim.critic.lr = 5e-6  # paper
    c.optim.critic.warmup_steps = 10  # paper: 10-step critic warm-up
    c.optim.critic.freeze_attention = True  # SAO's frozen-attention critic
    c.optim.critic.trainable = "moe"  # MoE projections + router + value head train

    # Longest trajectory (prompt + turns + observations): 32k tokens. The update step
    # rematerialises every decoder layer (only its input is kept), stores the 48 layers
    # stacked ([48, ...] params, trunk.stacks.0) and scans them (one compiled body, compile
    # time independent of depth; HF files unchanged, checkpoints in this layout), runs a
    # flash kernel (splash on TPU, cuDNN on GPU) and applies the LM head 1024 tokens at a
    # time; docs/scaling.md has the per-device memory plan.
    c.model.remat = "full"
    c.model.scan_layers = True
    c.model.attention_impl = "auto"
    c.model.logits_chunk = 1024
    c.sampling.max_len = 32768
    c.sampling.max_turn_tokens = 4096
    c.sampling.steps_per_sync = 8  # decode steps between host checks
    c.sampling.queue_size = 256
    c.sampling.record_routing = arg.replay
    if arg.paged:  # 512 rollouts in flight on 64 chips: a paged KV pool per host
        # docs/scaling.md "The rollout pool" (a plan from shapes): at log-normal episode
        # lengths (median 4k, p99 32k tokens) a host's 32 rollouts in flight hold <= 4,696
        # pages of 64 positions at 99.9% of moments; 4,736 pages = 27.75 GiB per host,
        # 6.94 GiB per chip with the host engine's KV heads over its 4 chips (one shared
        # pool; slots split 4 ways would be 4 pools of 8, short of pages 6% of the time),
        # against 6.0 GiB per chip for the dense cache's 8 slots.
        if arg.gpus:
            raise ConfigError("config variant paged: planned for the 64-chip TPU mesh only")
        c.sampling.kv_layout = "paged"
        c.sampling.num_slots = 32  # per host: 16 hosts x 32 = 512 rollouts in flight
        c.sampling.page_size = 64
        c.sampling.num_pages = 4736  # per host engine (>= 512: one 32k-token slot)
        c.sampling.per_token_keys = True  # admission waits never change a token

    c.env.name = "python_tool"  # multi-turn tool use: code runs in the sandbox
    c.env.params = {"max_turns": 4}
    c.env.prompts = {"n_ops": (2, 3), "operand_range": (10, 999)}
    if arg.data:  # a dataset with reference answers (README: "Train on your own data")
        c.env.name = "answer"  # answer turn(s), Python tool calls in between
        c.env.params = {"reward": "math", "tools": ("python",), "max_turns": 4}
        c.data.train = arg.data
        c.data.eval = arg.eval_data
        c.data.fields.prompt = "question"
        c.data.fields.answer = "answer"
        c.data.answer_regex = r"####\s*(.+)$"  # GSM8K: the number after '####'
        c.data.prompt_format = (
            "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
        )
        c.data.template_kwargs = {"enable_thinking": False}  # short turns fit max_len
        c.init.chat_template = "tokenizer"  # Qwen3's, from tokenizer_config.json
    c.value_pretrain.steps = 200  # most critic steps before RL; stops on the EV plateau [open]
    c.value_pretrain.batch_size = 128  # fresh rollouts per step (paper's RL batch) [open]
    c.value_pretrain.heldout_rollouts = 1024  # never trained on [open]

    c.train.total_steps = 500  # [open]
    c.train.length_bucket = 4096  # <= 8 distinct update-step shapes up to 32k
    c.train.eval_every = 50
    c.train.checkpoint_every = 25
    c.train.take_timeout_s = 3600.0
    return c
