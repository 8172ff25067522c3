"""Published peak figures of accelerators, by `jax.Device.device_kind`.

MFU and roofline figures divide by these (sao_jax/device_check/). Dense bf16 matmul
throughput (no structured sparsity) and HBM bandwidth per chip, as the vendors publish
them; a measurement is never compared against a figure that is not in this table (an
unknown device kind gets no MFU, it does not get a guess).

Sources (the vendors' own spec pages and datasheets):
  NVIDIA A100:  nvidia.com/en-us/data-center/a100/ (datasheet: BF16 Tensor Core 312
                TFLOPS dense, 624 with sparsity; HBM2e 2,039 GB/s for the 80GB SXM,
                HBM2 1,555 GB/s for the 40GB)
  NVIDIA H100:  nvidia.com/en-us/data-center/h100/ (datasheet: BF16 Tensor Core 1,979
                TFLOPS with sparsity = 989 dense for SXM, 3.35 TB/s HBM3; PCIe 1,513 =
                756 dense, 2 TB/s HBM2e)
  NVIDIA H200:  nvidia.com/en-us/data-center/h200/ (datasheet: BF16 Tensor Core 1,979
                TFLOPS with sparsity = 989 dense, 141 GB HBM3e at 4.8 TB/s)
  TPU v4:       cloud.google.com/tpu/docs/v4 (275 TFLOPS bf16, 32 GiB HBM2 at 1,200 GB/s)
  TPU v5e:      cloud.google.com/tpu/docs/v5e (197 TFLOPS bf16, 16 GB HBM2 at 819 GB/s)
  TPU v5p:      cloud.google.com/tpu/docs/v5p (459 TFLOPS bf16, 95 GB HBM2e at 2,765 GB/s)
  TPU v6e:      cloud.google.com/tpu/docs/v6e (918 TFLOPS bf16, 32 GB HBM at 1,640 GB/s)
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Peak:
    """One chip's published figures."""

    name: str  # the product, as the vendor names it
    bf16_flops: float  # dense bf16 matmul FLOP/s
    hbm_bytes_per_s: float  # HBM bandwidth, bytes/s
    hbm_bytes: float  # HBM capacity, bytes
    source: str  # where the figures are published


_T, _G = 1e12, 1e9
_NV, _GC = "nvidia.com/en-us/data-center/", "cloud.google.com/tpu/docs/"
# (device_kind pattern, figures): the first pattern that matches wins, so the more
# specific kinds come first ("TPU v5 lite" is a v5e, plain "TPU v5" a v5p).
PEAKS: tuple[tuple[str, Peak], ...] = (
    ("H200", Peak("NVIDIA H200", 989 * _T, 4.8e12, 141 * _G, _NV + "h200/")),
    (r"H100.*PCIe", Peak("NVIDIA H100 PCIe", 756 * _T, 2.0e12, 80 * _G, _NV + "h100/")),
    ("H100", Peak("NVIDIA H100 SXM", 989 * _T, 3.35e12, 80 * _G, _NV + "h100/")),
    (r"A100.*40GB", Peak("NVIDIA A100 40GB", 312 * _T, 1.555e12, 40 * _G, _NV + "a100/")),
    ("A100", Peak("NVIDIA A100 80GB", 312 * _T, 2.039e12, 80 * _G, _NV + "a100/")),
    (r"TPU v6( lite|e)", Peak("TPU v6e", 918 * _T, 1.64e12, 32 * _G, _GC + "v6e")),
    (r"TPU v5( lite|e)", Peak("TPU v5e", 197 * _T, 0.819e12, 16 * _G, _GC + "v5e")),
    (r"TPU v5", Peak("TPU v5p", 459 * _T, 2.765e12, 95 * _G, _GC + "v5p")),
    (r"TPU v4", Peak("TPU v4", 275 * _T, 1.2e12, 32 * 2**30, _GC + "v4")),
)  # fmt: skip


def peak_for(device_kind: str) -> Peak | None:
    """The published figures of a `jax.Device.device_kind`, or None when not listed."""
    for pattern, peak in PEAKS:
        if re.search(pattern, device_kind):
            return peak
    return None
