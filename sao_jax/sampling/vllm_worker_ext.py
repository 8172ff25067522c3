"""In-place weight sync for sampling.backend='vllm': a vLLM worker extension.

Run inside the vLLM env only (vllm_server.py passes `worker_extension_cls=
"vllm_worker_ext.WeightSync"`; the server's own folder is on its sys.path): it imports
torch and vLLM, never sao_jax.

The trainer (sao_jax/sampling/backend_vllm.py) writes the new weights, in Hugging Face
names and layout (models/hf.py's `hf_entries`, the one export mapping), into one flat
buffer: a file in /dev/shm (shared memory) when it has room, else in the run's workdir.
The manifest lists each tensor's name, dtype, shape and byte offset. `sao_load_weights`
maps that buffer (no copy: torch tensors view it), hands the tensors to vLLM's own
in-place reload (`model_runner.reload_weights`: every layer is re-materialized, loaded
through its weight loaders and re-processed, then copied into the kernel tensors the
engine holds), and then redoes the one step that reload skips on this CPU build.

Why that step (vLLM 0.32, vllm/model_executor/layers/fused_moe/): on the first load,
UnquantizedFusedMoEMethod._setup_kernel (unquantized_fused_moe_method.py) ends with
`fused_experts.process_weights_after_loading(layer)`, which for the CPU experts
(experts/cpu_moe.py, CPUUnquantizedExperts) pads the intermediate width and PREPACKS
w13/w2 into the grouped-gemm layout of `cpu_fused_moe`. On a weight update
(`is_weight_update = self.moe_kernel is not None`) _setup_kernel copies the checkpoint's
layout into the parameters and skips that call, so the CPU kernel reads unpacked weights
as packed: reloading the very same weights moved log-probs by up to 2.4 nats
(docs/vllm.md). `redo_cpu_moe_prepack` prepacks them again, in place (the kernel tensors
keep their storage), with the experts' own ISA.
"""

from __future__ import annotations

import contextlib
import mmap
import time

import torch

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def shared_tensors(buffer, manifest: list[dict]):
    """(name, tensor) for each manifest entry, each tensor a view of `buffer` (no copy)."""
    for t in manifest:
        dtype = TORCH_DTYPES[t["dtype"]]
        count = 1
        for n in t["shape"]:
            count *= n
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=t["offset"])
        yield t["name"], flat.view(t["shape"])


def cpu_experts(model: torch.nn.Module):
    """(layer, experts) for each MoE layer whose kernel is vLLM's CPU unquantized one;
    RuntimeError naming any other experts kernel (its post-load processing is not
    known here: `sampling.vllm.weight_sync='restart'`)."""
    try:  # vLLM's own environment (.vllm-venv, make vllm-env), never the run's
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError as e:
        raise RuntimeError(f"vllm_worker_ext runs inside vLLM's worker: {e}") from e

    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None:
            continue
        if not isinstance(experts, CPUUnquantizedExperts):
            raise RuntimeError(
                f"in-place weight sync: MoE experts kernel {type(experts).__name__} is not "
                "CPUUnquantizedExperts; set sampling.vllm.weight_sync='restart'"
            )
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise RuntimeError(
                f"in-place weight sync: MoE intermediate {cfg.intermediate_size_per_partition} "
                "is padded by the CPU kernel (not a multiple of 32); "
                "set sampling.vllm.weight_sync='restart'"
            )
        yield layer, experts


@torch.no_grad()
def redo_cpu_moe_prepack(layers) -> int:
    """Prepacks each CPU MoE layer's w13/w2 (as loaded: the checkpoint's layout) into the
    CPU kernel's layout, in place; returns how many layers. ZenTorch layers read the
    plain layout and are left alone."""
    try:  # vLLM's own environment, as above
        from vllm._custom_ops import cpu_prepack_moe_weight
    except ImportError as e:
        raise RuntimeError(f"vllm_worker_ext runs inside vLLM's worker: {e}") from e

    n = 0
    for layer, experts in layers:
        if experts._use_zentorch:
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        n += 1
    return n


class WeightSync:
    """Mixed into vLLM's worker (`worker_extension_cls`); called through collective_rpc."""

    def sao_load_weights(self, path: str, manifest: list[dict]) -> dict:
        """Loads the tensors of the buffer at `path` (manifest: name, dtype, shape, offset)
        into the running model; returns {'seconds', 'tensors', 'moe_layers'}."""
        start = time.perf_counter()
        model = self.model_runner.get_model()
        layers = list(cpu_experts(model))  # refused kernels are named before any load
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            self.model_runner.reload_weights(
                weights_iterator=shared_tensors(buffer, manifest), is_checkpoint_format=True
            )
            moe = redo_cpu_moe_prepack(layers)
        finally:
            with contextlib.suppress(BufferError):  # a view still held: the GC closes it
                buffer.close()
        return dict(seconds=time.perf_counter() - start, tensors=len(manifest), moe_layers=moe)
