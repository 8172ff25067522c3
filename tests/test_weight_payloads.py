"""The GPU and TPU weight syncs to vLLM, as far as they run without the device (default
suite, in process, no vLLM env).

On a tiny Qwen3-MoE (dense and sparse layers, tied embeddings) whose params are sharded
over the 8 fake CPU devices (fsdp): the payload plan is models/hf.py's export (every
param feeds it, every tensor once, save_hf_checkpoint's names, shapes and dtypes), its
tensors produced on the devices equal the checkpoint's bit for bit; DLPack hands jax
buffers to torch without a copy (bfloat16, float32); the NCCL sender (a stand-in
collective for NCCL) broadcasts the plan in order and the worker's receive loop hands the
checkpoint's tensors to the loader; the TPU reshard puts each tensor on the engine leaf's
sharding (another mesh) with the values the plan says. What is NOT run here: NCCL, a GPU,
vLLM's GPU worker, tpu-inference (docs/scaling.md, "What is verified how").
"""

import collections
from concurrent.futures import Future

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.torch import load_file

from sao_jax.models import hf
from sao_jax.parallel.mesh import Sharder, build_mesh
from sao_jax.sampling import dlpack_torch, weight_payloads, weight_sync_tpu
from sao_jax.sampling.vllm_worker_nccl import load_all, received_tensors
from sao_jax.sampling.weight_sync_nccl import NcclSender, worker_init_info
from tests.tiny_moe import save_tiny_moe


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = save_tiny_moe(str(tmp_path_factory.mktemp("tiny")))
    sharder = Sharder(build_mesh((1, 8, 1, 1), devices=jax.devices()[:8]))  # fsdp over 8
    cfg, _, params = hf.load_hf_policy(path, sharder=sharder)
    out = tmp_path_factory.mktemp("export")
    hf.save_hf_checkpoint(str(out / "ckpt"), cfg, params, dtype="bfloat16")
    return cfg, params, load_file(str(out / "ckpt" / "model.safetensors"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def test_the_plan_is_the_hf_export_and_covers_every_param_once(policy):
    cfg, params, ckpt = policy
    entries = weight_payloads.device_entries(cfg, params, "bfloat16")
    plan = weight_payloads.payload_plan(entries)
    assert sorted(p.name for p in plan) == sorted(ckpt)  # each name once (payload_plan checks)
    for p in plan:
        assert p.shape == tuple(ckpt[p.name].shape) and p.dtype == "bfloat16", p
    leaves = {
        tuple(str(k.key) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
    }
    mapped = {tuple(str(k) for k in key) for key in hf.tensor_map(cfg)}
    assert mapped == leaves  # every param feeds the export; nothing else does
    info = weight_payloads.update_info(plan)
    assert info["names"] == [p.name for p in plan]
    assert set(info["dtype_names"]) == {"bfloat16"}
    assert [tuple(s) for s in info["shapes"]] == [p.shape for p in plan]


def test_device_entries_stay_on_the_devices_and_equal_the_checkpoint(policy):
    cfg, params, ckpt = policy
    for e in weight_payloads.device_entries(cfg, params, "bfloat16"):
        x = e.produce()
        assert isinstance(x, jax.Array) and len(x.devices()) > 1, e.name  # sharded, on device
        t = torch.from_numpy(np.array(x).view(np.int16))
        assert torch.equal(t, _bits(ckpt[e.name])), e.name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dlpack_hands_the_buffer_to_torch_without_a_copy(dtype):
    x = jax.random.normal(jax.random.key(0), (8, 24)).astype(dtype)
    x = dlpack_torch.single_device(x, jax.devices()[3])
    t = dlpack_torch.to_torch(x)
    assert dlpack_torch.shares_memory(x, t)
    assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == x.shape
    want = np.asarray(x).view(np.int16 if dtype == "bfloat16" else np.int32)
    assert np.array_equal(_bits(t).numpy(), want)


class FakeCollective:
    """Rank 0's NCCL calls, recorded: what each broadcast would put on the wire."""

    def __init__(self):
        self.warmed = False
        self.wire = collections.deque()

    def all_reduce_one(self):
        self.warmed = True

    def broadcast(self, tensor):
        self.wire.append(tensor.clone())


def _done(value=None) -> Future:
    f = Future()
    f.set_result(value)
    return f


def test_the_sender_broadcasts_the_plan_and_the_worker_loads_the_checkpoint(policy):
    cfg, params, ckpt = policy
    net = FakeCollective()
    sender = NcclSender(world_size=3, device=jax.devices()[0], collective=net)
    inits = []
    sender.connect(lambda info: inits.append(info) or _done())
    assert net.warmed and inits[0]["rank_offset"] == 1 and inits[0]["world_size"] == 3
    infos = []
    sent = sender.send(cfg, params, "bfloat16", lambda info: infos.append(info) or _done())
    assert sent["tensors"] == len(ckpt) and sender.sent == infos[0]["names"]

    def receive(buf):  # a worker's end of the broadcast
        buf.copy_(net.wire.popleft())

    loaded = {}
    n = load_all(loaded.update, received_tensors(receive, infos[0], "cpu"))
    assert n == len(ckpt) and not net.wire and sorted(loaded) == sorted(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(_bits(loaded[name]), _bits(t)), name


def test_a_loader_that_stops_early_still_receives_every_tensor():
    info = dict(names=["a", "b", "c"], dtype_names=["float32"] * 3, shapes=[[2], [3], [1]])
    got = []
    with pytest.raises(RuntimeError, match="left 2 tensors, first b"):
        load_all(lambda it: next(it), received_tensors(lambda b: got.append(b), info, "cpu"))
    assert [tuple(b.shape) for b in got] == [(2,), (3,), (1,)]  # the wire was drained
    with pytest.raises(ValueError, match="tensor a has dtype 'int8'"):
        list(received_tensors(lambda b: None, dict(info, dtype_names=["int8"] * 3), "cpu"))
    with pytest.raises(ValueError, match="has 128 bytes, got 3"):
        worker_init_info(b"abc", 2)


def test_a_produced_tensor_unlike_its_payload_is_named(policy):
    cfg, params, _ = policy
    entries = weight_payloads.device_entries(cfg, params, "bfloat16")
    plan = weight_payloads.payload_plan(entries)
    plan[2] = weight_payloads.Payload(plan[2].name, (1, 2), "bfloat16")
    with pytest.raises(ValueError, match=f"payload 2 planned as .*{plan[2].name}"):
        list(weight_payloads.checked(entries, plan))


def _engine_leaves(cfg, mesh) -> dict:
    """An engine's leaves as tpu-inference's JAX Qwen3-MoE would hold them: named as the
    checkpoint's tensors, attention and dense MLP in models/hf.py's layout, the rest in
    Hugging Face shape; each sharded over 'model' on its first dim that 4 divides."""
    layouts = weight_sync_tpu.our_layout(cfg)
    leaves = {}
    for name, shape in hf.expected_tensors(hf.tensor_map(cfg)).items():
        if name in layouts:
            view, perm = layouts[name]
            shape = tuple(view[p] for p in perm)
        dims = [i for i, n in enumerate(shape) if n % 4 == 0]
        spec = P(*[("model" if i == dims[0] else None) for i in range(len(shape))]) if dims else P()
        sds = jax.ShapeDtypeStruct(shape, "bfloat16", sharding=NamedSharding(mesh, spec))
        leaves[name] = sds
    return leaves


def test_the_tpu_reshard_puts_every_array_where_the_plan_says(policy):
    cfg, params, ckpt = policy
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    leaves = _engine_leaves(cfg, mesh)
    entries = weight_payloads.device_entries(cfg, params, "bfloat16")
    layouts = weight_sync_tpu.our_layout(cfg)
    plan = weight_sync_tpu.sync_plan(entries, leaves, weight_sync_tpu.name_of_by_path(layouts))
    assert len(plan) == len(ckpt) and sum(t.perm is not None for t in plan) > 0
    arrays = weight_sync_tpu.reshard(entries, plan)
    for t in plan:
        x = arrays[t.path]
        assert x.sharding.is_equivalent_to(t.sharding, len(t.shape)), t.path
        want = ckpt[t.name].view(torch.int16).numpy()
        if t.view is not None:
            want = want.reshape(t.view).transpose(t.perm)
        assert x.shape == t.shape == want.shape, t.path
        placed = t.sharding.devices_indices_map(t.shape)
        for shard in x.addressable_shards:
            assert shard.index == placed[shard.device], t.path
            assert np.array_equal(np.asarray(shard.data).view(np.int16), want[shard.index]), t.path
    q = "model.layers.1.self_attn.q_proj.weight"  # in our layout: the trainer's own param
    assert np.array_equal(
        np.asarray(arrays[q]),
        np.asarray(params["trunk"]["layers"][1]["attn"]["q_proj"]).astype(arrays[q].dtype),
    )


def test_a_tpu_plan_that_does_not_fit_names_the_leaf(policy):
    cfg, params, _ = policy
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    leaves = _engine_leaves(cfg, mesh)
    entries = weight_payloads.device_entries(cfg, params, "bfloat16")
    name_of = weight_sync_tpu.name_of_by_path(weight_sync_tpu.our_layout(cfg))
    bad = dict(leaves)
    bad["model.norm.weight"] = jax.ShapeDtypeStruct(
        (31,), "bfloat16", sharding=leaves["model.norm.weight"].sharding
    )
    with pytest.raises(ValueError, match=r"leaf model.norm.weight has shape \(31,\)"):
        weight_sync_tpu.sync_plan(entries, bad, name_of)
    fewer = {k: v for k, v in leaves.items() if k != "model.norm.weight"}
    with pytest.raises(
        ValueError, match="1 exported tensors feed no leaf, first model.norm.weight"
    ):
        weight_sync_tpu.sync_plan(entries, fewer, name_of)


def test_apply_to_state_writes_the_leaves_in_place():
    class Tiny(nnx.Module):
        def __init__(self):
            self.norm = nnx.Param(jax.numpy.zeros((4,)))

    state = nnx.state(Tiny())
    new = jax.numpy.arange(4.0)
    assert weight_sync_tpu.apply_to_state(state, {"norm": new}) == 1
    assert np.array_equal(np.asarray(state["norm"][...]), np.arange(4.0))
    with pytest.raises(KeyError, match="no leaf lm_head"):
        weight_sync_tpu.apply_to_state(state, {"lm_head": new})


# ---- weight_sync='nccl' wired through the server (sampling/vllm_server.py) ------------


def test_the_knob_selects_the_servers_worker_extension(tmp_path):
    """sampling.vllm.weight_sync -> the server's command line -> its worker extension;
    'nccl' names the GPU extension, which exists with its two calls."""
    from sao_jax.sampling import backend_vllm, vllm_server, vllm_worker_ext, vllm_worker_nccl
    from sao_jax.sampling.vllm_config import WEIGHT_SYNCS, VllmConfig

    assert set(vllm_server.WORKER_EXTENSIONS) == set(WEIGHT_SYNCS)
    modules = {"vllm_worker_ext": vllm_worker_ext, "vllm_worker_nccl": vllm_worker_nccl}
    for sync, ext in vllm_server.WORKER_EXTENSIONS.items():
        cmd = backend_vllm.server_command("py", VllmConfig(weight_sync=sync), "/m", 64, 3, 9)
        assert cmd[:2] == ["py", backend_vllm.SERVER] and f"--weight_sync={sync}" in cmd
        module, cls = ext.split(".")
        assert hasattr(getattr(modules[module], cls), "sao_nccl_receive") == (sync == "nccl")
    nccl = vllm_worker_nccl.NcclWeightSync
    assert callable(nccl.sao_nccl_init) and callable(nccl.sao_nccl_receive)


class WireCollective(FakeCollective):
    """Rank 0's broadcasts put on a wire another thread (the worker) reads."""

    def __init__(self):
        super().__init__()
        import queue

        self.wire = queue.Queue()

    def broadcast(self, tensor):
        self.wire.put(tensor.clone())


class StandInEngine:
    """vLLM's engine as vllm_server.Server calls it, with one worker whose two NCCL calls
    are vllm_worker_nccl.NcclWeightSync's, its broadcast reading the stand-in wire."""

    def __init__(self, wire):
        self.wire, self.loaded, self.calls = wire, {}, []
        self.unfinished = {"r7"}  # a request in flight at the sync

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        if method == "sao_nccl_init":
            (info,) = args
            return [dict(rank=0 + info["rank_offset"])]
        assert method == "sao_nccl_receive"

        def broadcast(buf):
            buf.copy_(self.wire.get(timeout=30))

        n = load_all(self.loaded.update, received_tensors(broadcast, args[0], "cpu"))
        return [dict(seconds=0.0, tensors=n, moe_layers=0)]

    def abort_request(self, ids):
        self.unfinished -= set(ids)
        self.calls.append(("abort", tuple(ids)))

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return True

    def has_unfinished_requests(self):
        return bool(self.unfinished)


def test_an_nccl_sync_runs_through_the_servers_commands(policy):
    """weight_sync='nccl' as wired: the trainer's ServerSync sends the server's commands
    (JSON, as backend_vllm does) and broadcasts while the server's command loop runs the
    worker's receive; the rendezvous once, a request in flight aborted, the checkpoint's
    tensors loaded bit for bit, the version moved. NCCL itself is a stand-in."""
    import json
    import threading

    from sao_jax.sampling.vllm_server import Server
    from sao_jax.sampling.weight_sync_nccl import ServerSync

    cfg, params, ckpt = policy
    net = WireCollective()
    engine = StandInEngine(net.wire)
    answers, events, sent = {}, [], []

    def emit(**event):
        events.append(event)
        if event["op"] in answers:
            answers.pop(event["op"]).set_result(event)

    server = Server(engine, make_request=None, emit=emit, version=0)
    server.sent["r7"] = 3

    def rpc(op, answer, **fields):  # backend_vllm.VllmBackend._rpc over a pipe
        future = answers[answer] = Future()
        cmd = json.loads(json.dumps(dict(op=op, **fields)))
        sent.append(cmd)
        threading.Thread(target=server.handle, args=(cmd,), daemon=True).start()
        return future

    sync = ServerSync(rpc, world_size=2, device=jax.devices()[0], collective=net)
    out = sync.publish(cfg, params, "bfloat16", version=1)
    assert net.warmed and out["tensors"] == len(ckpt)
    assert [c["op"] for c in sent] == ["nccl_init", "nccl_receive"]
    assert sent[0]["init_info"]["world_size"] == 2 and sent[1]["version"] == 1
    assert sent[1]["update_info"]["names"] == sync.sender.sent
    assert engine.calls == [
        "sao_nccl_init",
        ("abort", ("r7",)),
        "sao_nccl_receive",
        "reset_prefix_cache",
    ]
    assert [e["op"] for e in events] == ["nccl_ready", "synced"]
    assert events[1]["interrupted"] == ["r7"] and server.version == 1 and net.wire.empty()
    for name, t in ckpt.items():
        assert torch.equal(_bits(engine.loaded[name]), _bits(t)), name
    sync.publish(cfg, params, "bfloat16", version=2)  # no second rendezvous
    assert [c["op"] for c in sent] == ["nccl_init", "nccl_receive", "nccl_receive"]
    assert server.version == 2 and events[-1]["op"] == "synced"


def test_a_failed_nccl_call_is_fatal_for_the_caller():
    """A worker's NCCL call that raises: an error event with no id (the caller's backend
    is then failed: the group and the weights are undefined)."""
    from sao_jax.sampling.vllm_server import Server

    class Broken(StandInEngine):
        def collective_rpc(self, method, args=()):
            raise RuntimeError("NCCL error: unhandled system error")

    events = []
    server = Server(Broken(None), None, lambda **e: events.append(e), version=0)
    server.handle({"op": "nccl_init", "init_info": {}})
    server.handle({"op": "nccl_receive", "version": 1, "update_info": {}})
    assert [(e["op"], e["id"]) for e in events] == [("error", None)] * 2
    assert "NCCL error" in events[0]["message"] and server.version == 0
