"""Hugging Face checkpoint I/O against transformers' own Qwen3-MoE (PyTorch CPU, fp32).

Tiny random models are built and saved with transformers inside each test (no downloads);
every weight, including RMSNorm scales and routers, is redrawn so nothing sits at a
trivial value. Logits are compared on random tokens with the default causal mask.
"""

import json
import os
import shutil
import weakref

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from sao_jax.models import hf
from sao_jax.models import safetensors_io as st
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.schema import ConfigError

# (a) GQA with head_dim != hidden / heads, every layer sparse, normalised top-k.
CONFIG_A = dict(
    vocab_size=100,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
# (b) dense and sparse layers mixed (sparse step 2 plus an mlp-only layer), tied
# embeddings, unnormalised top-k.
CONFIG_B = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    decoder_sparse_step=2,
    mlp_only_layers=[3],
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)
TOKENS = np.random.default_rng(0).integers(0, 96, (3, 12))


def _hf_model(kwargs, seed=0):
    """A transformers model with every parameter redrawn (norm scales around 1)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs, attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def _hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def _logits(mdef, params):
    return np.asarray(jax.jit(lambda p, t: mdef.bind(p)(t).out)(params, TOKENS))


@pytest.fixture(scope="module")
def ckpt_a(tmp_path_factory):
    model = _hf_model(CONFIG_A)
    path = str(tmp_path_factory.mktemp("a"))
    model.save_pretrained(path)
    return path, model, _hf_logits(model)


@pytest.fixture(scope="module")
def ckpt_b(tmp_path_factory):
    model = _hf_model(CONFIG_B, seed=3)
    path = str(tmp_path_factory.mktemp("b"))
    model.save_pretrained(path, max_shard_size="20KB")  # sharded, with an index file
    return path, model, _hf_logits(model)


@pytest.fixture(scope="module")
def loaded_a(ckpt_a):
    return hf.load_hf_policy(ckpt_a[0])


def _rewrite(src, dst, edit=None, config_edit=None):
    """Copies a checkpoint into one model.safetensors, editing tensors and config.json."""
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    os.makedirs(dst)
    save_file(edit(tensors) if edit else tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config_edit(config) if config_edit else config, f)
    return dst


def _assert_same_tree(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("which", ["a", "b"])
def test_logits_match_transformers(which, ckpt_a, ckpt_b, loaded_a):
    path, _, want = ckpt_a if which == "a" else ckpt_b
    cfg, mdef, params = loaded_a if which == "a" else hf.load_hf_policy(path)
    assert ("lm_head" in params) == (which == "a")
    if which == "b":
        assert cfg.moe_layers == (1,) and cfg.tie_word_embeddings and not cfg.norm_topk_prob
    np.testing.assert_allclose(_logits(mdef, params), want, atol=1e-4, rtol=0)


def _in_memory(model):
    """transformers' own in-memory tensors: fused experts (tied LM head left out)."""
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _split_layer(tensors, i):
    """Fused gate_up_proj [E, 2M, D] / down_proj [E, D, M] -> per-expert, renamed by hand."""
    x = f"model.layers.{i}.mlp.experts."
    gate_up, down = tensors.pop(f"{x}gate_up_proj"), tensors.pop(f"{x}down_proj")
    m = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"{x}{e}.gate_proj.weight"] = np.ascontiguousarray(gate_up[e, :m])
        tensors[f"{x}{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, m:])
        tensors[f"{x}{e}.down_proj.weight"] = np.ascontiguousarray(down[e])
    return tensors


def test_fused_per_expert_and_mixed_layouts_load_identically(ckpt_b, tmp_path):
    path, model, _ = ckpt_b
    want = hf.load_hf_policy(path)[2]  # what save_pretrained wrote (per-expert)
    fused = _rewrite(path, str(tmp_path / "fused"), lambda _: _in_memory(model))
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(f"{fused}/model.safetensors")
    _assert_same_tree(hf.load_hf_policy(fused)[2], want)
    by_hand = _rewrite(path, str(tmp_path / "split"), lambda _: _split_layer(_in_memory(model), 1))
    _assert_same_tree(hf.load_hf_policy(by_hand)[2], want)

    # Layers may use different layouts; one layer holding both is rejected by name.
    two = _hf_model({**CONFIG_B, "mlp_only_layers": [], "decoder_sparse_step": 1}, seed=5)
    src = _rewrite(
        path, str(tmp_path / "two"), lambda _: _in_memory(two), lambda c: two.config.to_dict()
    )
    mixed = _rewrite(src, str(tmp_path / "mixed"), lambda t: _split_layer(t, 2))
    _assert_same_tree(hf.load_hf_policy(mixed)[2], hf.load_hf_policy(src)[2])
    np.testing.assert_allclose(
        _logits(*hf.load_hf_policy(mixed)[1:]), _hf_logits(two), atol=1e-4, rtol=0
    )

    def both(t):
        t["model.layers.0.mlp.experts.0.gate_proj.weight"] = np.zeros((16, 32), np.float32)
        return t

    bad = _rewrite(src, str(tmp_path / "both"), both)
    with pytest.raises(ConfigError, match=r"layer 0 mixes fused .* and per-expert"):
        hf.load_hf_policy(bad)


@pytest.mark.parametrize("shape", [(1, 2, 2, 2), (2, 1, 4, 1)])
def test_mesh_load_gives_same_logits(shape, ckpt_a, loaded_a):
    sharder = Sharder(build_mesh(shape))
    _, mdef, params = hf.load_hf_policy(ckpt_a[0], sharder=sharder)
    shardings = mdef.shardings(sharder)
    jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim) or pytest.fail(), params, shardings
    )
    _assert_same_tree(params, loaded_a[2])
    np.testing.assert_allclose(_logits(mdef, params), ckpt_a[2], atol=1e-4, rtol=0)


def test_export_roundtrip_through_transformers(ckpt_a, loaded_a, tmp_path):
    cfg, _, params = loaded_a
    files = hf.save_hf_checkpoint(tmp_path / "pe", cfg, params, max_shard_bytes=40_000)
    assert len(files) > 1 and os.path.isfile(tmp_path / "pe" / hf.INDEX_FILE)
    names = set()
    for f in files:
        names |= set(st.read_header(f)[0])
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names  # published layout
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "pe", attn_implementation="eager")
    np.testing.assert_allclose(_hf_logits(back.eval()), ckpt_a[2], atol=1e-5, rtol=0)
    _assert_same_tree(hf.load_hf_policy(tmp_path / "pe")[2], params)

    hf.save_hf_checkpoint(tmp_path / "fused", cfg, params, layout="fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(
        tmp_path / "fused" / "model.safetensors"
    )
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "fused", attn_implementation="eager")
    np.testing.assert_allclose(_hf_logits(back.eval()), ckpt_a[2], atol=1e-5, rtol=0)
    with pytest.raises(FileExistsError):
        hf.save_hf_checkpoint(tmp_path / "fused", cfg, params)


def test_export_keeps_the_source_config_fields(tmp_path):
    """Round trip of config.json: every field of the source checkpoint's is kept (token
    ids, max_position_embeddings, rope, tying), the dtype fields set by the export."""
    ids = dict(eos_token_id=5, pad_token_id=0, bos_token_id=1, max_position_embeddings=1024)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG_B, **ids)).save_pretrained(tmp_path / "src")
    source = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg, _, params = hf.load_hf_policy(tmp_path / "src")
    hf.save_hf_checkpoint(tmp_path / "out", cfg, params, base_config=source)
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    kept = {k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}
    assert {k: out[k] for k in kept} == kept
    assert out["dtype"] == out["torch_dtype"] == "float32"
    assert Qwen3MoeConfig.from_pretrained(tmp_path / "out").eos_token_id == 5
    bare = cfg.to_hf()  # no source: the defaults
    assert bare["max_position_embeddings"] == 32768 and "eos_token_id" not in bare


def test_bf16_checkpoint(ckpt_a, tmp_path):
    model = _hf_model(CONFIG_A).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    header = st.read_header(str(tmp_path / "model.safetensors"))[0]
    assert {i.dtype for i in header.values()} == {"BF16"}
    _, mdef, params = hf.load_hf_policy(tmp_path)  # param_dtype float32 by default
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    # Same (bf16-rounded) weights in fp32 on both sides: tight. Against the fp32
    # original: loose (bf16 rounding moves the logits and may flip a few routings).
    fp32 = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want = _hf_logits(fp32.eval())
    got = _logits(mdef, params)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.mean(np.abs(got - ckpt_a[2])) < 0.05 * np.mean(np.abs(ckpt_a[2]))
    _, _, p16 = hf.load_hf_policy(tmp_path, param_dtype="bfloat16")
    q = np.asarray(p16["trunk"]["layers"][1]["attn"]["q_proj"])
    assert q.dtype == st.DTYPES["BF16"]
    np.testing.assert_array_equal(
        q.astype(np.float32), np.asarray(params["trunk"]["layers"][1]["attn"]["q_proj"])
    )


def test_critic_copies_trunk_with_zero_value_head(ckpt_a, loaded_a):
    sharder = Sharder(build_mesh((2, 1, 4, 1)))
    _, cdef, critic = hf.load_hf_critic(ckpt_a[0], sharder=sharder)
    _assert_same_tree(critic["trunk"], loaded_a[2]["trunk"])
    assert not np.any(np.asarray(critic["value_head"])) and float(critic["value_bias"]) == 0.0
    assert not np.any(np.asarray(jax.jit(lambda p, t: cdef.bind(p)(t).out)(critic, TOKENS)))


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


BAD = [
    (
        "missing",
        _drop("model.layers.1.self_attn.k_norm.weight"),
        None,
        r"missing tensor model\.layers\.1\.self_attn\.k_norm\.weight",
    ),
    (
        "extra",
        lambda t: {
            **t,
            "model.layers.0.mlp.experts.8.up_proj.weight": np.zeros((24, 48), np.float32),
        },
        None,
        r"unexpected tensor model\.layers\.0\.mlp\.experts\.8\.up_proj\.weight in .*safetensors",
    ),
    (
        "shape",
        lambda t: {**t, "model.norm.weight": np.ones(47, np.float32)},
        None,
        r"tensor model\.norm\.weight in .*model\.safetensors has shape \[47\], expected \[48\]",
    ),
    (
        "dtype",
        lambda t: {**t, "model.norm.weight": np.ones(48, np.int64)},
        None,
        r"tensor model\.norm\.weight in .*model\.safetensors: unsupported dtype I64",
    ),
    (
        "arch",
        None,
        lambda c: {**c, "architectures": ["LlamaForCausalLM"]},
        r"unsupported architecture \['LlamaForCausalLM'\]",
    ),
    ("bias", None, lambda c: {**c, "attention_bias": True}, r"field attention_bias"),
    (
        "tied",
        None,
        lambda c: {**c, "tie_word_embeddings": True},
        r"unexpected tensor lm_head\.weight .*tie_word_embeddings",
    ),
]


@pytest.mark.parametrize("name,edit,config_edit,message", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoints_fail_before_reading(
    name, edit, config_edit, message, ckpt_a, tmp_path, monkeypatch
):
    path = _rewrite(ckpt_a[0], str(tmp_path / name), edit, config_edit)
    reads = []
    monkeypatch.setattr(st.Reader, "read", lambda self, *a: reads.append(a))
    with pytest.raises(ConfigError, match=message):
        hf.load_hf_policy(path)
    assert not reads  # validated before any weight was read


def test_broken_index_and_missing_file(ckpt_b, tmp_path):
    path = shutil.copytree(ckpt_b[0], tmp_path / "b")
    victim = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[2]
    os.remove(path / victim)
    with pytest.raises(ConfigError, match=f"lists file {victim}, which does not exist"):
        hf.load_hf_policy(path)


def test_loader_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """Each read is one device's block, each distinct block is read once, and the host
    blocks alive at once stay a small fraction of the model (not the whole model).

    Blocks are >= 16 KB here: jax may keep a few host blocks until their transfers'
    completion callbacks run, and with very small arrays it keeps more of them.
    """
    wide = {**CONFIG_A, "vocab_size": 512, "hidden_size": 128, "head_dim": 32}
    wide.update(num_hidden_layers=4, moe_intermediate_size=64)
    _hf_model(wide).save_pretrained(tmp_path)
    sharder = Sharder(build_mesh((1, 2, 4, 1)))
    reads, live = [], {"now": 0, "peak": 0}
    original = st.read_target

    def counted(*args):
        x = original(*args)
        reads.append(x.nbytes)
        live["now"] += x.nbytes
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(x, _release, live, x.nbytes)
        return x

    monkeypatch.setattr(st, "read_target", counted)
    params = hf.load_hf_policy(tmp_path, sharder=sharder)[2]
    shards = [
        {
            tuple((s.start, s.stop) for s in idx)
            for idx in x.sharding.devices_indices_map(x.shape).values()
        }
        for x in jax.tree.leaves(params)
    ]
    block = [x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params)]
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert len(reads) == sum(map(len, shards))
    # Distinct blocks tile each parameter: every element is read exactly once.
    assert sum(reads) == sum(b * len(s) for b, s in zip(block, shards)) == total
    assert max(reads) == max(block) < max(x.nbytes for x in jax.tree.leaves(params))
    # Loading whole tensors or the whole checkpoint would hold `total`. What stays alive
    # besides the block in hand are blocks whose transfer callbacks jax has not yet run, a
    # number that grows with the machine's load: ~2 largest blocks' worth on an idle
    # machine, 4.25 on a heavily loaded one, 9.1 (27% of `total`) in CI beside another
    # xdist worker. So the bound is half the model, not a count of blocks.
    assert live["peak"] <= total / 2, (live["peak"], max(block), total)


def test_read_block_matches_literal_transform():
    """Random sources and blocks, including sliced head_dim (read whole, cut after)."""
    rng = np.random.default_rng(0)
    cases = [
        st.Source(("t",), ((4, 6), (5,)), (2, 0, 1)),  # q_proj-like
        st.Source(("t",), ((5,), (4, 6)), (1, 2, 0)),  # o_proj-like
        st.Source(("t",), ((3,), (2, 4), (5,)), (0, 2, 1), select=(1, 1)),  # fused up half
        st.Source(("t",), ((7,), (5,)), (1, 0)),
    ]
    for src in cases:
        full = rng.normal(size=src.hf_shape).astype(np.float32)
        view = full.reshape([s for g in src.split for s in g])
        if src.select is not None:
            view = np.take(view, src.select[1], axis=src.select[0])
        target = np.transpose(view, src.perm)
        back = full.reshape([s for g in src.split for s in g])
        if src.select is not None:
            back = np.take(back, [src.select[1]], axis=src.select[0])
        np.testing.assert_array_equal(st.to_source_view(src, target), back)
        for _ in range(20):
            index = []
            for n in target.shape:
                a = int(rng.integers(0, n))
                index.append(slice(a, int(rng.integers(a + 1, n + 1))))
            reader = _ArrayReader(full)
            got = st.read_block(reader, None, src, tuple(index))
            np.testing.assert_array_equal(got, target[tuple(index)])


def _release(live, nbytes):
    live["now"] -= nbytes


class _ArrayReader:
    """Stands in for st.Reader over one in-memory tensor."""

    def __init__(self, full):
        self.full = full

    def read(self, info, index):
        del info
        return np.array(self.full[index])
