"""The GPU weight sync's worker side: a vLLM worker extension that receives the trainer's
tensors over NCCL and loads them in place. A PLAN: written against vLLM 0.32's API,
its receive loop run on CPU with a stand-in broadcast (tests/test_weight_payloads.py);
never run inside a GPU worker.

Run inside the vLLM env only (like vllm_worker_ext.py, whose in-place load it shares:
`model_runner.reload_weights` over an iterator of checkpoint-named tensors). The trainer
side is weight_sync_nccl.py; the two meet in an NCCL group made from the trainer's
`ncclUniqueId` (`sao_nccl_init`, vLLM's `PyNcclCommunicator.from_unique_id_bytes`, which
issues the one-element warm-up all_reduce the trainer matches), trainer at rank 0 and
this worker at `rank_offset` + its rank among the engine's workers.

`sao_nccl_receive(update_info)` allocates each tensor of the update info (names, torch
dtype names, shapes: weight_payloads.update_info) on the worker's GPU, receives it by
broadcast from rank 0 and hands it to the in-place reload as it arrives. Every planned
tensor is received even when the loader stops early (else the trainer would wait in its
broadcast forever); a tensor the loader did not consume is then an error naming it.

MoE post-processing: vLLM's reload skips the experts kernel's
`process_weights_after_loading` on an update (vllm_worker_ext.py says why). On CUDA the
unquantized Triton experts inherit the base class's no-op, so nothing is skipped; any
experts kernel that overrides it (a prepacking or shuffling kernel) is refused by name
before anything is received (`sampling.vllm.weight_sync='restart'`), as the CPU path
does for kernels other than its own.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator

import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def received_tensors(
    broadcast: Callable[[torch.Tensor], None], update_info: dict, device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of each planned tensor, received in plan order by `broadcast`
    (filling a fresh tensor of the planned shape and dtype on `device`)."""
    names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"weight sync: update info of {len(names)} names, {len(dtypes)} dtypes, "
            f"{len(shapes)} shapes"
        )
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"weight sync: tensor {name} has dtype {dtype!r}")
        buf = torch.empty(shape, dtype=TORCH_DTYPES[dtype], device=device)
        broadcast(buf)
        yield name, buf


def load_all(load: Callable[[Iterator], None], tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    """`load(tensors)`, then receives whatever it left; returns how many it took.
    RuntimeError naming the first tensor left unloaded."""
    taken = 0

    def counted():
        nonlocal taken
        for item in tensors:
            taken += 1
            yield item

    try:
        load(counted())
    finally:  # received (the trainer is sending them) and dropped, also when load failed
        left = [name for name, _ in tensors]
    if left:
        raise RuntimeError(f"weight sync: the loader left {len(left)} tensors, first {left[0]}")
    return taken


def worker_rank(parallel_config) -> int:
    """This worker's rank among all the engine's workers (data-parallel groups included)."""
    per_dp = parallel_config.world_size  # tensor x pipeline parallel
    return parallel_config.data_parallel_index * per_dp + parallel_config.rank


def check_experts(model: torch.nn.Module) -> int:
    """How many MoE layers there are; RuntimeError naming an experts kernel whose
    post-load processing an in-place update would skip."""
    try:  # vLLM's own environment, never the run's
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError as e:
        raise RuntimeError(f"vllm_worker_nccl runs inside vLLM's worker: {e}") from e

    n = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None:
            continue
        if type(experts).process_weights_after_loading is not (
            FusedMoEExperts.process_weights_after_loading
        ):
            raise RuntimeError(
                f"NCCL weight sync: MoE experts kernel {type(experts).__name__} processes "
                "weights after loading, which an in-place update skips; set "
                "sampling.vllm.weight_sync='restart'"
            )
        n += 1
    return n


class NcclWeightSync:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`); called through
    collective_rpc on every worker."""

    def sao_nccl_init(self, init_info: dict) -> dict:
        """Joins the trainer's NCCL group (init info: weight_sync_nccl.worker_init_info)."""
        try:  # vLLM's own environment, as above
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        except ImportError as e:
            raise RuntimeError(f"vllm_worker_nccl runs inside vLLM's worker: {e}") from e

        uid = base64.b64decode(init_info["nccl_unique_id_b64"], validate=True)
        rank = worker_rank(self.vllm_config.parallel_config) + init_info["rank_offset"]
        self._sao_nccl = PyNcclCommunicator.from_unique_id_bytes(
            uid, rank=rank, world_size=init_info["world_size"], device=self.device
        )
        return dict(rank=rank)

    def sao_nccl_receive(self, update_info: dict) -> dict:
        """Receives and loads one sync; returns {'seconds', 'tensors', 'moe_layers'}."""
        start = time.perf_counter()
        comm = self._sao_nccl
        moe = check_experts(self.model_runner.get_model())  # refused before any receive

        def broadcast(buf: torch.Tensor) -> None:
            comm.broadcast(buf, src=0, stream=torch.cuda.current_stream())

        def load(weights):
            self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

        n = load_all(load, received_tensors(broadcast, update_info, self.device))
        torch.cuda.current_stream().synchronize()
        return dict(seconds=time.perf_counter() - start, tensors=n, moe_layers=moe)
