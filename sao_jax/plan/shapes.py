"""The one shape source of capacity planning: a model's parameter shapes, read from the
model itself (`jax.eval_shape` of its init: nothing is allocated, any size plans on a
laptop), grouped by the categories of the plans.

plan/flops.py counts parameters and the parameters that multiply every token from these
shapes, plan/memory.py sizes them per device, so a model knob that adds, drops or
reshapes a parameter needs no edit here or there: only the model config, its use in the
model, the HF mapping and, where it changes the work per token, the one plan module that
counts that work (plan/flops.py for FLOPs, plan/step_memory.py for activations).
"""

from __future__ import annotations

import functools
import math
import re

import jax
from flax import nnx

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Critic, Policy
from sao_jax.parallel.partition import ModelDef, path_str
from sao_jax.schema import ConfigError

HEADS = ("policy", "critic")
# Parameter categories by dotted path (first match wins).
CATEGORIES = (
    ("attention", r"(^|\.)attn\."),
    ("router", r"\.mlp\.gate\.kernel$"),
    ("experts", r"\.mlp\.experts\."),
    ("dense mlp", r"\.mlp\.(gate|up|down)_proj$"),
    ("embedding + lm_head", r"(^|\.)(embed\.embedding|lm_head)$"),
    ("norms", r"norm\.scale$"),
    ("value head", r"^value_"),
)
EMBEDDING = "trunk.embed.embedding"  # the input table (the LM head too when tied)


def category(path: str) -> str:
    for name, pattern in CATEGORIES:
        if re.search(pattern, path):
            return name
    return "other"


def check_head(head: str) -> None:
    if head not in HEADS:
        raise ConfigError(f"argument head: must be one of {HEADS}, got {head!r}")


@functools.lru_cache(maxsize=64)
def param_shapes(cfg: ModelConfig, head: str = "policy") -> dict[str, tuple[int, ...]]:
    """{dotted parameter path: shape} of the policy (or critic), in the layout it runs
    (per layer, or stacked [L_run, ...] with `scan_layers`)."""
    check_head(head)
    model = Policy if head == "policy" else Critic
    shapes = ModelDef.of(lambda: model(cfg, rngs=nnx.Rngs(0))).shapes()
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    return {path_str(p): tuple(s.shape) for p, s in leaves}


def param_counts(cfg: ModelConfig, head: str = "policy") -> dict[str, int]:
    """Parameter counts by category (zero ones omitted)."""
    out: dict[str, int] = {}
    for path, shape in param_shapes(cfg, head).items():
        out[category(path)] = out.get(category(path), 0) + math.prod(shape)
    return {k: v for k, v in out.items() if v}


def matmul_params(cfg: ModelConfig, head: str = "policy") -> int:
    """Active parameters that multiply every token in a matmul: every matrix (ndim >= 2),
    the routed experts scaled by k / E, the value head's weight; the embedding table only
    where it doubles as the policy's LM head (a gather otherwise); not the norm scales nor
    the value bias (elementwise)."""
    n = 0
    for path, shape in param_shapes(cfg, head).items():
        size = math.prod(shape)
        if path == EMBEDDING:
            n += size if (head == "policy" and cfg.tie_word_embeddings) else 0
        elif category(path) == "experts":
            n += size * cfg.num_experts_per_tok // cfg.num_experts
        elif not _elementwise(path):
            n += size
    return n


def _elementwise(path: str) -> bool:
    """Norm scales and the value bias: applied elementwise, not in a matmul."""
    return path.endswith("norm.scale") or path == "value_bias"


def attention_proj_params(cfg: ModelConfig) -> int:
    """The q, k, v, o projections of one decoder layer (the q/k norms not included)."""
    total = sum(
        math.prod(shape)
        for path, shape in param_shapes(cfg).items()
        if category(path) == "attention" and not _elementwise(path)
    )
    return total // cfg.num_hidden_layers


def expert_params_per_token(cfg: ModelConfig) -> int:
    """The routed experts' parameters one token multiplies in one MoE layer (k of E)."""
    experts = param_counts(cfg).get("experts", 0)
    moe = len(cfg.moe_layers)
    return experts * cfg.num_experts_per_tok // cfg.num_experts // moe if moe else 0
