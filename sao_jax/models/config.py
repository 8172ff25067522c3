"""The model's hyperparameters: one frozen dataclass, from a config section or a HF config.json.

Field names follow Hugging Face's `Qwen3MoeConfig` so that checkpoints map one to one.
Anything the model cannot express (attention bias, another activation, sliding windows,
an unknown architecture) is rejected here with the field named, before any weight is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from sao_jax.schema import ConfigDict, ConfigError, register_validator, require

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
ATTENTION_IMPLS = ("auto", "naive", "blockwise", "cudnn", "splash")  # attention_backends.py
REMAT_POLICIES = ("none", "full", "dots")  # transformer.py REMAT
# config.model fields a Hugging Face config.json does not set: how the model runs, not what
# it is. An init.kind='hf' run takes them from config.model too (`run_overrides`).
RUN_FIELDS = (
    "moe_impl", "dtype", "param_dtype", "attention_impl", "attention_block", "remat",
    "scan_layers", "logits_chunk",
)  # fmt: skip
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only MoE transformer, architecture-compatible with Qwen3-MoE."""

    vocab_size: int = 64  # tokens in the embedding table and LM head
    hidden_size: int = 64  # D, residual stream width
    num_hidden_layers: int = 2  # L
    num_attention_heads: int = 4  # N, query heads
    num_key_value_heads: int = 2  # K, key/value heads (GQA: N % K == 0)
    head_dim: int = 16  # H, per-head width (need not equal D / N)
    intermediate_size: int = 128  # F of dense (non-MoE) MLP layers
    moe_intermediate_size: int = 32  # F of each expert
    num_experts: int = 8  # E; 0 means every layer is dense
    num_experts_per_tok: int = 2  # k, top-k routing
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to one
    decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss (0 disables)
    initializer_range: float = 0.02
    moe_impl: str = "auto"  # expert compute: 'ragged' (grouped GEMM), 'grouped', 'dense', 'auto'
    dtype: str = "float32"  # activation / matmul dtype
    param_dtype: str = "float32"  # parameter storage dtype
    # Long-context training (docs/scaling.md). None of these changes a result.
    attention_impl: str = "auto"  # training attention: ATTENTION_IMPLS above
    attention_block: int = 512  # query/key block of the blockwise and splash kernels
    remat: str = "none"  # per decoder layer: none|full|dots (jax.checkpoint policies)
    scan_layers: bool = False  # params stacked [L_run, ...] per run of same-kind layers and
    # lax.scan-ned (trunk.stacks.<r>: compile cost independent of depth); False: one subtree
    # per layer (trunk.layers.<i>, the HF layout). Checkpoints are saved in the layout used.
    logits_chunk: int = 1024  # training log-probs: tokens per LM-head chunk (0 = all)

    def __post_init__(self):
        _check(self)

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return _DTYPES[self.param_dtype]

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule for which decoder layers hold a sparse MoE block."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @classmethod
    def from_config(cls, section: ConfigDict | Mapping[str, Any]) -> ModelConfig:
        """Builds from a `config.model` section; an unknown field is an error naming it."""
        values = dict(section.to_dict() if isinstance(section, ConfigDict) else section)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"config field model.{unknown[0]}: unknown model field")
        if "mlp_only_layers" in values:
            values["mlp_only_layers"] = tuple(values["mlp_only_layers"])
        return cls(**values)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
        """Builds from a Hugging Face `config.json` dict of a Qwen3-MoE model.

        Raises ConfigError naming the HF field when the checkpoint uses something this
        model cannot express.
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type != "qwen3_moe" or any(a not in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"config.json: unsupported architecture {archs or model_type!r}; "
                f"supported: {SUPPORTED_ARCHITECTURES} (model_type 'qwen3_moe')"
            )
        if hf.get("attention_bias", False):
            raise ConfigError("config.json field attention_bias: biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json field hidden_act: {hf['hidden_act']!r} != 'silu'")
        if hf.get("use_sliding_window", False):
            raise ConfigError("config.json field use_sliding_window: not supported")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"config.json field rope_parameters: unsupported {rope!r}")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_heads = hf["num_attention_heads"]
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads", num_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            num_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
            num_experts_per_tok=hf["num_experts_per_tok"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The `config.json` dict a Hugging Face Qwen3-MoE model of these dims expects.

        `base`: the config.json of the checkpoint the model came from; every field this
        config does not define (eos/pad/bos token ids, max_position_embeddings, ...) is
        kept from it (max_position_embeddings is 32768 without one)."""
        out = dict(base or {})
        out.setdefault("max_position_embeddings", 32768)
        out |= dict(
            architectures=list(SUPPORTED_ARCHITECTURES),
            model_type="qwen3_moe",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=list(self.mlp_only_layers),
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            router_aux_loss_coef=self.router_aux_loss_coef,
            initializer_range=self.initializer_range,
            hidden_act="silu",
            attention_bias=False,
            use_sliding_window=False,
            torch_dtype="float32",
        )
        return out


def run_overrides(section: ConfigDict | Mapping[str, Any]) -> dict[str, Any]:
    """The RUN_FIELDS of a `config.model` section, as ModelConfig.from_hf overrides."""
    values = section.to_dict() if isinstance(section, ConfigDict) else dict(section)
    return {k: values[k] for k in RUN_FIELDS if k in values}


def _check(c: ModelConfig) -> None:
    positive = (
        "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim intermediate_size moe_intermediate_size decoder_sparse_step"
    )
    for name in positive.split():
        v = getattr(c, name)
        require(isinstance(v, int) and v > 0, f"model.{name}", f"must be a positive int, got {v!r}")
    require(
        c.num_attention_heads % c.num_key_value_heads == 0,
        "model.num_key_value_heads",
        f"must divide num_attention_heads ({c.num_attention_heads}), got {c.num_key_value_heads}",
    )
    require(c.head_dim % 2 == 0, "model.head_dim", f"must be even for RoPE, got {c.head_dim}")
    require(c.num_experts >= 0, "model.num_experts", f"must be >= 0, got {c.num_experts}")
    if c.num_experts:
        require(
            1 <= c.num_experts_per_tok <= c.num_experts,
            "model.num_experts_per_tok",
            f"must be in [1, num_experts={c.num_experts}], got {c.num_experts_per_tok}",
        )
    for i in c.mlp_only_layers:
        require(
            0 <= i < c.num_hidden_layers,
            "model.mlp_only_layers",
            f"layer {i} outside [0, {c.num_hidden_layers})",
        )
    require(c.rope_theta > 0, "model.rope_theta", f"must be > 0, got {c.rope_theta}")
    require(c.rms_norm_eps > 0, "model.rms_norm_eps", f"must be > 0, got {c.rms_norm_eps}")
    require(
        c.router_aux_loss_coef >= 0,
        "model.router_aux_loss_coef",
        f"must be >= 0, got {c.router_aux_loss_coef}",
    )
    impls = ("auto", "ragged", "grouped", "dense")
    require(c.moe_impl in impls, "model.moe_impl", f"must be one of {impls}, got {c.moe_impl!r}")
    require(
        c.attention_impl in ATTENTION_IMPLS,
        "model.attention_impl",
        f"must be one of {ATTENTION_IMPLS}, got {c.attention_impl!r}",
    )
    require(
        c.remat in REMAT_POLICIES,
        "model.remat",
        f"must be one of {REMAT_POLICIES}, got {c.remat!r}",
    )
    for name in ("attention_block", "logits_chunk"):
        v = getattr(c, name)
        require(isinstance(v, int) and v >= 0, f"model.{name}", f"must be an int >= 0, got {v!r}")
    require(c.attention_block >= 8, "model.attention_block", "must be >= 8")
    require(isinstance(c.scan_layers, bool), "model.scan_layers", "must be a bool")
    for name in ("dtype", "param_dtype"):
        v = getattr(c, name)
        require(v in _DTYPES, f"model.{name}", f"must be one of {sorted(_DTYPES)}, got {v!r}")


@register_validator("model")
def _validate_section(config: ConfigDict) -> None:
    ModelConfig.from_config(config.model)
