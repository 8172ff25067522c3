"""The GPU weight sync's trainer side: JAX params to vLLM's workers over NCCL. A PLAN:
written against vLLM 0.32's documented weight-transfer API, run on CPU only through a
stand-in collective (tests/test_weight_payloads.py); never run on a GPU.

Why this shape (vLLM 0.32, `vllm/distributed/weight_transfer/`): vLLM's RL weight
transfer ("nccl" backend) puts the trainer at rank 0 of an NCCL group with the engine's
workers at ranks 1.. (`rank_offset=1`), and moves the weights as one broadcast per tensor
from rank 0 in the order of a per-round update info (names, torch dtype names, shapes),
loading each received tensor by its checkpoint name. A trainer without torch.distributed
(JAX) joins through a pre-shared `ncclUniqueId` instead of a TCPStore: the init info's
`nccl_unique_id_b64` (standard base64 of the 128 raw bytes); every rank enters the init at
once, and the worker then issues a one-element all_reduce that the trainer must match
before anything else (`PyNcclCommunicator.from_unique_id_bytes`). This module is that
trainer:

  sender = NcclSender(world_size=1 + n_workers, device=jax.local_devices()[0])
  sender.connect(lambda info: rpc("init", info))    # worker side: vllm_worker_nccl.py
  sender.send(cfg, params, "bfloat16", lambda upd: rpc("receive", upd))   # each update

`rpc(...)` returns a Future: the engine's workers must sit in their receive while the
trainer broadcasts (both meet inside the same NCCL calls), so the receive is started
first and awaited last. The control plane is the server's: with
`sampling.vllm.weight_sync='nccl'`, sao_jax/sampling/vllm_server.py starts the engine
with the worker extension `vllm_worker_nccl.NcclWeightSync` and runs its two calls
through collective_rpc on the commands `nccl_init` and `nccl_receive`, which
backend_vllm.py sends through `ServerSync` below (the unpacked wire format is also
vLLM's own `WeightTransferConfig(backend="nccl")`'s). Run on CPU through a stand-in
collective and a stand-in engine only (docs/vllm.md, "Weight sync on GPU and TPU").

Each tensor comes from models/hf.py's export (weight_payloads.py: the one mapping,
produced on the device), is gathered whole onto the sender's GPU (device to device) and
wrapped as a torch tensor through DLPack (dlpack_torch.py: no host copy) for NCCL.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import jax

from sao_jax.models.config import ModelConfig
from sao_jax.parallel.partition import Params
from sao_jax.sampling import dlpack_torch
from sao_jax.sampling.weight_payloads import checked, device_entries, payload_plan, update_info

NCCL_UNIQUE_ID_BYTES = 128


class Collective(Protocol):
    """The trainer's end of the NCCL group (rank 0)."""

    def all_reduce_one(self) -> None: ...  # the one-element warm-up all_reduce

    def broadcast(self, tensor) -> None: ...  # from rank 0, the tensor's numel elements


class TorchNccl:
    """Rank 0 through torch's raw NCCL bindings (`torch.cuda.nccl`: unique_id, init_rank,
    all_reduce, broadcast), so the trainer needs a CUDA torch but neither vLLM nor
    torch.distributed. A plan: not run (no GPU here)."""

    def __init__(self, unique_id: bytes, world_size: int):
        import torch.cuda.nccl as nccl  # CUDA torch on the GPU host only

        self._nccl = nccl
        self._comm = nccl.init_rank(world_size, unique_id, 0)

    @staticmethod
    def new_unique_id() -> bytes:
        import torch.cuda.nccl as nccl

        return nccl.unique_id()

    def all_reduce_one(self) -> None:
        import torch

        one = torch.zeros(1, device="cuda")
        self._nccl.all_reduce([one], comms=[self._comm])
        torch.cuda.current_stream().synchronize()

    def broadcast(self, tensor) -> None:
        self._nccl.broadcast([tensor], root=0, comms=[self._comm])


def worker_init_info(unique_id: bytes, world_size: int) -> dict:
    """The workers' init info (vLLM's NCCLWeightTransferInitInfo fields): trainer at rank
    0, workers from rank 1, unpacked (one broadcast per tensor)."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(
            f"weight sync: an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}"
        )
    if world_size < 2:
        raise ValueError(
            f"weight sync: world_size counts the trainer and >= 1 worker, got {world_size}"
        )
    return dict(
        nccl_unique_id_b64=base64.b64encode(unique_id).decode("ascii"),
        rank_offset=1,
        world_size=world_size,
        packed=False,
    )


class NcclSender:
    """Rank 0 of the weight-sync group; see the module docstring.

    Args:
      world_size: the trainer plus every vLLM worker (tensor x pipeline x data parallel).
      device: the trainer's GPU that sends (each tensor is gathered whole onto it).
      collective: the NCCL binding; None: TorchNccl on a fresh unique id (GPU only).
    """

    def __init__(self, world_size: int, device: jax.Device, collective: Collective | None = None):
        self.world_size = world_size
        self.device = device
        self._collective = collective
        self._unique_id = None if collective is not None else TorchNccl.new_unique_id()
        self.sent: list[str] = []  # the last sync's tensor names, in send order

    def connect(self, start_worker_init: Callable[[dict], Future]) -> None:
        """Joins the group with the workers: their init runs (started by
        `start_worker_init` with the init info) while this rank's init and warm-up run."""
        uid = self._unique_id or bytes(NCCL_UNIQUE_ID_BYTES)
        future = start_worker_init(worker_init_info(uid, self.world_size))
        if self._collective is None:
            self._collective = TorchNccl(uid, self.world_size)
        self._collective.all_reduce_one()
        future.result()

    def send(
        self,
        cfg: ModelConfig,
        params: Params,
        dtype: str,
        start_receive: Callable[[dict], Future],
    ) -> dict:
        """One sync: the workers' receive is started with the update info, then every
        tensor is broadcast in plan order; returns {'tensors', 'bytes'} once the workers
        have loaded them. An error leaves the group unusable (a worker may wait in a
        broadcast): the caller tears the engine down."""
        if self._collective is None:
            raise RuntimeError("weight sync: NcclSender.send before connect")
        entries = device_entries(cfg, params, dtype)
        plan = payload_plan(entries)
        future = start_receive(update_info(plan))
        self.sent = []
        for name, x in checked(entries, plan):
            if future.done():  # the workers failed before this broadcast: say why
                future.result()
            x = dlpack_torch.single_device(x, self.device).block_until_ready()
            self._collective.broadcast(dlpack_torch.to_torch(x))
            self.sent.append(name)
        future.result()
        return dict(tensors=len(plan), bytes=sum(p.nbytes for p in plan))


def in_thread(fn: Callable[[], object]) -> Future:
    """`fn()` run on a daemon thread, as a Future (a control-plane call that blocks in
    NCCL while this thread broadcasts)."""
    future: Future = Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as e:  # handed to the caller through the future
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="weight-sync-rpc").start()
    return future


# rpc(op, answer, **fields): sends the server command `op` and returns a Future of the
# event `answer` that acknowledges it (backend_vllm.VllmBackend._rpc)
Rpc = Callable[..., Future]


class ServerSync:
    """weight_sync='nccl' through vllm_server.py: the rendezvous on the first publication
    (`nccl_init` -> `nccl_ready`), then one `nccl_receive` -> `synced` per publication,
    the trainer's broadcasts running while the server's workers receive.

    Args:
      rpc: the server's commands (Rpc above).
      world_size: the trainer plus the engine's workers (vllm_server.py starts one).
      device: the trainer's GPU that sends.
      collective: the NCCL binding; None: TorchNccl (GPU only).
    """

    def __init__(
        self, rpc: Rpc, world_size: int, device: jax.Device, collective: Collective | None = None
    ):
        self.rpc = rpc
        self.sender = NcclSender(world_size, device, collective)
        self.connected = False

    def publish(self, cfg: ModelConfig, params: Params, dtype: str, version: int) -> dict:
        """One sync of `params` as `version`; returns the sender's {'tensors', 'bytes'}."""
        if not self.connected:
            self.sender.connect(lambda info: self.rpc("nccl_init", "nccl_ready", init_info=info))
            self.connected = True
        return self.sender.send(
            cfg,
            params,
            dtype,
            lambda info: self.rpc("nccl_receive", "synced", version=version, update_info=info),
        )
