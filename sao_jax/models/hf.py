"""Hugging Face Qwen3-MoE checkpoints <-> sharded params, streamed tensor by tensor.

Loading validates everything before reading a single weight: `config.json` (through
`ModelConfig.from_hf`), then every tensor's name, shape and dtype from the safetensors
headers against the set this config expects. Each parameter is then built shard by
shard: a device's block is read from a memory map (only the bytes it needs), converted
to our layout, put on that device and dropped, so the host holds about one shard at a
time on top of what the devices hold.

Layouts (torch Linear stores [out, in]; ours is [in, ..., out] with heads split out):
  q_proj.weight [N*H, D] -> [D, N, H]        o_proj.weight [D, N*H] -> [N, H, D]
  mlp.gate.weight [E, D] -> kernel [D, E]    dense gate/up [F, D] -> [D, F], down [D, F] -> [F, D]
  experts, per-expert (published):  experts.{e}.gate_proj/up_proj.weight [M, D] -> [E, D, M]
                                    experts.{e}.down_proj.weight [D, M] -> [E, M, D]
  experts, fused (transformers' in-memory layout): experts.gate_up_proj [E, 2M, D] (gate
  rows first) -> gate, up [E, D, M];  experts.down_proj [E, D, M] -> [E, M, D]
With `model.scan_layers` (stacked decoder layers, `trunk.stacks.<r>.*` of shape [L_run, ...])
each stacked parameter is read as the per-layer tensors of its run, stacked shard by shard,
and written back one layer at a time: the Hugging Face side never changes.
Each MoE layer may use either expert layout (layers may differ); one layer mixing both
is rejected. transformers 5.x converts its fused experts back to per-expert tensors in
`save_pretrained`, and `save_hf_checkpoint` writes the per-expert layout by default.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

from sao_jax.models import safetensors_io as st
from sao_jax.models.config import ModelConfig
from sao_jax.models.layer_stack import layer_runs, stacked_key
from sao_jax.models.transformer import Critic, Policy
from sao_jax.parallel.mesh import Sharder
from sao_jax.parallel.partition import ModelDef, Params, check_params
from sao_jax.schema import ConfigError

LAYOUTS = ("per_expert", "fused")
INDEX_FILE = "model.safetensors.index.json"
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.|gate_up_proj$|down_proj$)")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # buffers some old exports carry
_NP_DTYPES = {"float32": np.float32, "bfloat16": st.DTYPES["BF16"], "float16": np.float16}


def _linear_t(name: str, out_dim: int, in_dim: int) -> st.Source:
    """torch Linear weight [out, in] -> our kernel [in, out]."""
    return st.Source((name,), ((out_dim,), (in_dim,)), (1, 0))


def _copy(name: str, *shape: int) -> st.Source:
    return st.Source((name,), tuple((s,) for s in shape), tuple(range(len(shape))))


def _attention_map(cfg: ModelConfig, p: str) -> dict[tuple, st.Source]:
    d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a = f"{p}self_attn."
    return {
        ("q_proj",): st.Source((f"{a}q_proj.weight",), ((n, h), (d,)), (2, 0, 1)),
        ("k_proj",): st.Source((f"{a}k_proj.weight",), ((k, h), (d,)), (2, 0, 1)),
        ("v_proj",): st.Source((f"{a}v_proj.weight",), ((k, h), (d,)), (2, 0, 1)),
        ("o_proj",): st.Source((f"{a}o_proj.weight",), ((d,), (n, h)), (1, 2, 0)),
        ("q_norm", "scale"): _copy(f"{a}q_norm.weight", h),
        ("k_norm", "scale"): _copy(f"{a}k_norm.weight", h),
    }


def _experts_map(cfg: ModelConfig, p: str, layout: str) -> dict[tuple, st.Source]:
    d, m, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    x = f"{p}mlp.experts."
    if layout == "fused":
        gate_up = ((e,), (2, m), (d,))  # view [E, 2, M, D]
        return {
            ("gate_proj",): st.Source((f"{x}gate_up_proj",), gate_up, (0, 2, 1), select=(1, 0)),
            ("up_proj",): st.Source((f"{x}gate_up_proj",), gate_up, (0, 2, 1), select=(1, 1)),
            ("down_proj",): st.Source((f"{x}down_proj",), ((e,), (d,), (m,)), (0, 2, 1)),
        }
    if layout != "per_expert":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    def per_expert(proj: str, out_dim: int, in_dim: int) -> st.Source:
        names = tuple(f"{x}{i}.{proj}.weight" for i in range(e))
        return st.Source(names, ((out_dim,), (in_dim,)), (1, 0), stacked=True)

    return {
        ("gate_proj",): per_expert("gate_proj", m, d),
        ("up_proj",): per_expert("up_proj", m, d),
        ("down_proj",): per_expert("down_proj", d, m),
    }


def tensor_map(cfg: ModelConfig, layouts: str | Mapping[int, str] = "per_expert") -> dict:
    """{policy param path (tuple of keys): st.Source}; `layouts` is one expert layout or
    one per MoE layer index."""
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    out: dict[tuple, st.Source] = {
        ("trunk", "embed", "embedding"): _copy("model.embed_tokens.weight", v, d)
    }
    for i in range(cfg.num_hidden_layers):
        p, key = f"model.layers.{i}.", ("trunk", "layers", i)
        out[(*key, "input_norm", "scale")] = _copy(f"{p}input_layernorm.weight", d)
        out[(*key, "post_attn_norm", "scale")] = _copy(f"{p}post_attention_layernorm.weight", d)
        for sub, src in _attention_map(cfg, p).items():
            out[(*key, "attn", *sub)] = src
        if cfg.is_moe_layer(i):
            layout = layouts if isinstance(layouts, str) else layouts[i]
            out[(*key, "mlp", "gate", "kernel")] = _linear_t(
                f"{p}mlp.gate.weight", cfg.num_experts, d
            )
            for sub, src in _experts_map(cfg, p, layout).items():
                out[(*key, "mlp", "experts", *sub)] = src
        else:
            out[(*key, "mlp", "gate_proj")] = _linear_t(f"{p}mlp.gate_proj.weight", f, d)
            out[(*key, "mlp", "up_proj")] = _linear_t(f"{p}mlp.up_proj.weight", f, d)
            out[(*key, "mlp", "down_proj")] = _linear_t(f"{p}mlp.down_proj.weight", d, f)
    out[("trunk", "final_norm", "scale")] = _copy("model.norm.weight", d)
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = _linear_t("lm_head.weight", v, d)
    return out


def expected_tensors(smap: Mapping[tuple, st.Source]) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} that a tensor map reads."""
    out = {}
    for src in smap.values():
        for name in src.names:
            out[name] = src.hf_shape
    return out


# --------------------------------------------------------------------------- reading


def _norm_index(index, shape) -> tuple[slice, ...]:
    out = []
    for sl, n in zip(index, shape):
        start, stop, step = sl.indices(n)
        assert step == 1, index
        out.append(slice(start, stop))
    return tuple(out)


def put_sharded(shape, dtype, sharding, read: Callable[[tuple[slice, ...]], np.ndarray]):
    """A sharded jax.Array built one distinct shard at a time from `read(index)`.

    Devices that hold the same block (replication) share one read; each host block is
    transferred and dropped before the next is read, so the loader holds one shard at a
    time (jax itself may keep a block or two until its transfer callbacks have run).
    """
    by_index: dict[tuple, list] = {}
    for device, idx in sharding.addressable_devices_indices_map(shape).items():
        norm = _norm_index(idx, shape)
        by_index.setdefault(tuple((s.start, s.stop) for s in norm), []).append((device, norm))
    arrays = []
    for group in by_index.values():
        host = read(group[0][1])
        # may_alias=False: a CPU device could otherwise adopt `host` as its buffer.
        placed = [jax.device_put(host, device, may_alias=False) for device, _ in group]
        jax.block_until_ready(placed)
        arrays += placed
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)


# ------------------------------------------------------------------------- validation


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory: every tensor's location and each MoE layer's layout."""

    path: str
    tensors: dict[str, st.TensorInfo]
    layouts: dict[int, str]


def read_hf_config(path: str, **overrides: Any) -> ModelConfig:
    """ModelConfig from `path/config.json` (ConfigError naming the field it cannot express)."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise ConfigError(f"checkpoint {path}: no config.json")
    with open(file) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from e
    return ModelConfig.from_hf(hf, **overrides)


def _collect_tensors(path: str) -> dict[str, st.TensorInfo]:
    """All tensors of the checkpoint's safetensors files, from their headers only."""
    index_file = os.path.join(path, INDEX_FILE)
    weight_map = None
    if os.path.isfile(index_file):
        with open(index_file) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ConfigError(f"{index_file}: not a JSON object ({e})") from e
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index_file}: no weight_map object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(path, name)):
                raise ConfigError(f"{index_file}: lists file {name}, which does not exist")
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ConfigError(f"checkpoint {path}: no *.safetensors files")
    tensors: dict[str, st.TensorInfo] = {}
    for name in files:
        for t, info in st.read_header(os.path.join(path, name))[0].items():
            if t in tensors:
                raise ConfigError(f"tensor {t} appears in both {tensors[t].file} and {info.file}")
            tensors[t] = info
    for t, info in tensors.items():
        if weight_map is not None and weight_map.get(t) != os.path.basename(info.file):
            raise ConfigError(
                f"{index_file}: tensor {t} is in {info.file}, index says {weight_map.get(t)}"
            )
    if weight_map is not None:
        for t, name in weight_map.items():
            if t not in tensors:
                raise ConfigError(
                    f"{index_file}: maps tensor {t} to {name}, which does not hold it"
                )
    return {t: info for t, info in tensors.items() if not _IGNORED.search(t)}


def _detect_layouts(cfg: ModelConfig, tensors: Mapping[str, Any], path: str) -> dict[int, str]:
    """Per MoE layer: 'fused' when it has fused expert tensors, else 'per_expert'."""
    found: dict[tuple[int, bool], list[str]] = {}  # (layer, fused) -> expert tensor names
    for t in tensors:
        m = _EXPERT.match(t)
        if m:
            found.setdefault((int(m[1]), m[2] is None), []).append(t)
    out = {}
    for i in cfg.moe_layers:
        fused, per = sorted(found.get((i, True), [])), sorted(found.get((i, False), []))
        if fused and per:
            raise ConfigError(
                f"checkpoint {path}: layer {i} mixes fused ({fused[0]}) and per-expert "
                f"({per[0]}) expert tensors"
            )
        out[i] = "fused" if fused else "per_expert"
    return out


def _problems(cfg, expected, tensors) -> list[str]:
    out = [f"missing tensor {t}" for t in expected if t not in tensors]
    for t, info in sorted(tensors.items()):
        if t not in expected:
            hint = ""
            if t == "lm_head.weight" and cfg.tie_word_embeddings:
                hint = " (config.json has tie_word_embeddings=true)"
            out.append(f"unexpected tensor {t} in {info.file}{hint}")
        elif info.shape != expected[t]:
            out.append(
                f"tensor {t} in {info.file} has shape {list(info.shape)}, "
                f"expected {list(expected[t])} from config.json"
            )
    return out


def inspect_hf_checkpoint(path: str, **overrides: Any) -> tuple[ModelConfig, Checkpoint]:
    """Validates a checkpoint directory without reading any weight.

    Raises one ConfigError listing every missing, unexpected or misshapen tensor (with
    its file), an unsupported dtype, a broken index, or a config it cannot express.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint {path}: not a directory")
    cfg = read_hf_config(path, **overrides)
    tensors = _collect_tensors(path)
    layouts = _detect_layouts(cfg, tensors, path)
    problems = _problems(cfg, expected_tensors(tensor_map(cfg, layouts)), tensors)
    if problems:
        more = f"; ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ConfigError(f"checkpoint {path}: " + "; ".join(problems[:8]) + more)
    return cfg, Checkpoint(path, tensors, layouts)


# ---------------------------------------------------------------------------- loading


def _key(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def load_hf_checkpoint(
    path: str, *, sharder: Sharder | None = None, critic: bool = False, **overrides: Any
) -> tuple[ModelConfig, ModelDef, Params]:
    """Loads a Qwen3-MoE checkpoint as (cfg, mdef, params) sharded by `sharder`.

    Args:
      path: directory with config.json and model.safetensors or sharded files + index.
      sharder: mesh + rules; default unsharded (first device).
      critic: build a Critic whose trunk is the checkpoint's and whose value head is zero.
      **overrides: ModelConfig fields to override (e.g. param_dtype="bfloat16").
    """
    sharder = sharder or Sharder()
    cfg, ckpt = inspect_hf_checkpoint(path, **overrides)
    model_cls = Critic if critic else Policy
    mdef = ModelDef.of(lambda: model_cls(cfg, sharder=sharder, rngs=nnx.Rngs(0)))
    shapes = mdef.shapes()
    shardings = mdef.shardings(sharder)  # ConfigError naming a parameter that cannot split
    if shardings is None:
        one = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    smap = tensor_map(cfg, ckpt.layouts)
    with st.Reader() as reader:

        def load(path, sds, sharding):
            key = _key(path)
            if critic and key[0] != "trunk":  # value head and bias start at zero
                return jax.device_put(jnp.zeros(sds.shape, sds.dtype), sharding)
            dtype = np.dtype(sds.dtype)
            if key[:2] == ("trunk", "stacks"):  # [L_run, ...]: the run's layers, stacked
                start = layer_runs(cfg)[key[2]][0]
                srcs = [_source(smap, ("trunk", "layers", start + j, *key[3:])) for j in
                        range(sds.shape[0])]  # fmt: skip

                def read(idx):
                    return np.stack(
                        [
                            st.read_target(reader, ckpt.tensors, srcs[j], idx[1:], dtype)
                            for j in range(idx[0].start, idx[0].stop)
                        ]
                    )
            else:
                src = _source(smap, key)

                def read(idx):
                    return st.read_target(reader, ckpt.tensors, src, idx, dtype)

            return put_sharded(sds.shape, sds.dtype, sharding, read)

        params = jax.tree_util.tree_map_with_path(load, shapes, shardings)
    return cfg, mdef, params


def _source(smap: Mapping[tuple, st.Source], key: tuple) -> st.Source:
    if key not in smap:
        raise ValueError(f"no Hugging Face tensor maps to parameter {'.'.join(map(str, key))}")
    return smap[key]


def load_hf_policy(path: str, *, sharder: Sharder | None = None, **overrides: Any):
    """(cfg, mdef, params) of the Policy in a Hugging Face checkpoint."""
    return load_hf_checkpoint(path, sharder=sharder, critic=False, **overrides)


def load_hf_critic(path: str, *, sharder: Sharder | None = None, **overrides: Any):
    """(cfg, mdef, params) of a Critic: trunk from a policy checkpoint, value head zero."""
    return load_hf_checkpoint(path, sharder=sharder, critic=True, **overrides)


# ---------------------------------------------------------------------------- saving


_take = jax.jit(lambda x, e: jax.lax.dynamic_index_in_dim(x, e, 0, keepdims=False))


def _host(x, expert: int | None) -> np.ndarray:
    """One parameter (or one expert's slice of it) gathered to the host."""
    if expert is not None:
        x = _take(x, expert)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _param(cfg: ModelConfig, params: Params, key: tuple) -> jax.Array:
    """The parameter at a per-layer `key`; in the stacked layout, its layer's slice."""
    if key[:2] == ("trunk", "layers") and "stacks" in params["trunk"]:
        r, j = stacked_key(cfg, key[2])
        leaf = params["trunk"]["stacks"][r]
        for k in key[3:]:
            leaf = leaf[k]
        return _take(leaf, j)
    leaf = params
    for k in key:
        leaf = leaf[k]
    return leaf


def _device(x, expert: int | None) -> jax.Array:
    """One parameter (or one expert's slice of it), left on its devices."""
    return x if expert is None else _take(x, expert)


def _entries(
    cfg: ModelConfig, params: Params, layout: str, dtype, on_device: bool = False
) -> list[st.Entry]:
    parts: dict[str, list] = {}
    for key, src in tensor_map(cfg, layout).items():
        for e, name in enumerate(src.names):
            parts.setdefault(name, []).append((key, src, e if src.stacked else None))
    fetch, concatenate = (_device, jnp.concatenate) if on_device else (_host, np.concatenate)

    def produce(contributors):
        views = []
        for key, src, e in sorted(contributors, key=lambda c: (c[1].select or (0, 0))[1]):
            views.append(st.to_source_view(src, fetch(_param(cfg, params, key), e)))
        src = contributors[0][1]
        x = views[0] if len(views) == 1 else concatenate(views, axis=src.select[0])
        return x.reshape(src.hf_shape).astype(dtype)

    return [
        st.Entry(name, c[0][1].hf_shape, np.dtype(dtype), lambda c=c: produce(c))
        for name, c in parts.items()
    ]


def hf_entries(
    cfg: ModelConfig,
    params: Params,
    *,
    layout: str = "per_expert",
    dtype: str | None = None,
    on_device: bool = False,
) -> list[st.Entry]:
    """The tensors `save_hf_checkpoint` writes (Hugging Face names, shapes, `dtype`), each
    produced on the host only when asked: the one export mapping, for a file or for a
    live engine's weight sync (sao_jax/sampling/backend_vllm.py). With `on_device`,
    `produce()` returns a jax.Array on the params' devices instead (no host copy: the
    GPU and TPU syncs, sao_jax/sampling/weight_payloads.py)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    mdef = ModelDef.of(lambda: Policy(cfg, rngs=nnx.Rngs(0)))
    check_params(params, mdef, what="hf_entries params")
    dtype_name = dtype or cfg.param_dtype
    if dtype_name not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_NP_DTYPES)}, got {dtype_name!r}")
    return _entries(cfg, params, layout, _NP_DTYPES[dtype_name], on_device)


def save_hf_checkpoint(
    path: str,
    cfg: ModelConfig,
    params: Params,
    *,
    layout: str = "per_expert",
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    base_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Writes policy params as a Hugging Face Qwen3-MoE checkpoint; returns the files.

    config.json comes from `cfg.to_hf(base_config)` (`base_config`: the config.json of
    the checkpoint the params came from, whose other fields are kept); tensors go to
    model.safetensors, or to model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json when they exceed
    `max_shard_bytes`. Tensors are gathered to the host one at a time (per expert in the
    per-expert layout). `dtype` ('float32' | 'bfloat16' | 'float16') defaults to the
    params' dtype. In a multi-process run every process must call this (gathers are
    collective); only process 0 writes. Refuses a directory that already holds weights.
    """
    dtype_name = dtype or cfg.param_dtype
    entries = hf_entries(cfg, params, layout=layout, dtype=dtype)
    path = os.fspath(path)
    if glob.glob(os.path.join(path, "*.safetensors")) or os.path.exists(
        os.path.join(path, INDEX_FILE)
    ):
        raise FileExistsError(f"save_hf_checkpoint: {path} already holds safetensors files")
    shards = st.plan_shards(entries, max_shard_bytes)
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
        hf = cfg.to_hf(base_config)
        hf["torch_dtype"] = hf["dtype"] = dtype_name
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
    for name, shard in zip(names, shards):
        if writer:
            st.write_file(os.path.join(path, name), shard, {"format": "pt"})
        else:
            for e in shard:
                e.produce()  # take part in the collective gathers
    if writer and n > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard},
        }
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    return [os.path.join(path, name) for name in names]
