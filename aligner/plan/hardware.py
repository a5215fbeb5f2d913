"""The accelerators the planner knows, with the figures the memory and time models use.

Every figure is per GPU, from NVIDIA's datasheets (dense, i.e. without 2:4 sparsity; the datasheets
print the sparse figure with an asterisk, twice the dense one):
* H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), SXM column:
  BF16 1,979 TFLOPS* -> 989 dense, FP8 3,958* -> 1,979 dense, HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s
  (both directions together: 450 GB/s each way), PCIe Gen5 128 GB/s (64 each way).
* H200 SXM 141GB: NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), SXM column:
  the H100's compute (BF16 989 dense, FP8 1,979 dense), HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s,
  PCIe Gen5 128 GB/s.
* A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), 80GB SXM
  column: BF16 312 TFLOPS dense (624*), no FP8, HBM2e 80 GB at 2,039 GB/s, NVLink 600 GB/s (300 each
  way), PCIe Gen4 64 GB/s (32 each way).
* Inter-node: one 400 Gb/s ConnectX-7 InfiniBand port per GPU in a DGX H100 / H200 (DGX H100 user
  guide: 8 x single-port ConnectX-7 for the compute fabric) = 50 GB/s each way; one 200 Gb/s ConnectX-6
  per GPU in a DGX A100 (DGX A100 user guide) = 25 GB/s.
* Memory is what `nvidia-smi` reports as the total (MiB): 81,559 (H100 80GB), 143,771 (H200), 81,920
  (A100 80GB); the planner keeps `RUNTIME_RESERVE_GIB` of it for the CUDA context, NCCL and cuBLAS
  workspaces and allocator fragmentation.

`cpu` is the test vehicle: no datasheet, its memory is the one the user states (cluster.memory_gib)
and its FLOP/s and bandwidth are rough orders of magnitude for one core (its step time is only a
scale, not a prediction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = 1024 ** 3
TERA = 1e12
GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float  # total device memory
    bf16_flops: float  # peak dense FLOP/s in bf16 (fp32 for `cpu`)
    fp8_flops: Optional[float]  # peak dense FLOP/s in fp8; None: no fp8
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # one direction, to another GPU of the node
    ib_bytes_per_s: float  # one direction, to another node (this GPU's NIC)
    pcie_bytes_per_s: float  # one direction, host <-> device
    reserve_gib: float  # kept for the runtime (context, communication buffers, fragmentation)


RUNTIME_RESERVE_GIB = 3.0

ACCELERATORS = {
    "h100-80gb": Accelerator("h100-80gb", 81559 / 1024, 989 * TERA, 1979 * TERA, 3350 * GB, 450 * GB, 50 * GB,
                             64 * GB, RUNTIME_RESERVE_GIB),
    "h200": Accelerator("h200", 143771 / 1024, 989 * TERA, 1979 * TERA, 4800 * GB, 450 * GB, 50 * GB, 64 * GB,
                        RUNTIME_RESERVE_GIB),
    "a100-80gb": Accelerator("a100-80gb", 81920 / 1024, 312 * TERA, None, 2039 * GB, 300 * GB, 25 * GB, 32 * GB,
                             RUNTIME_RESERVE_GIB),
}


def cpu(memory_gib: float) -> Accelerator:
    """One CPU rank (one core: aligner runs one thread per rank) with the stated memory; nothing reserved
    (the validation subtracts the process's own start-up memory)."""
    return Accelerator("cpu", float(memory_gib), 50e9, None, 10 * GB, 5 * GB, 1 * GB, 10 * GB, 0.0)


def detect(device_name: str, memory_gib: float) -> Accelerator:
    """The table's entry for a CUDA device name (torch.cuda.get_device_name), else one with the device's
    own memory and the H100's speeds (only its memory is used by the pre-launch check)."""
    name = device_name.upper()
    for key, marker in (("h200", "H200"), ("h100-80gb", "H100"), ("a100-80gb", "A100")):
        if marker in name and abs(ACCELERATORS[key].memory_gib - memory_gib) < 8:
            return ACCELERATORS[key]
    h100 = ACCELERATORS["h100-80gb"]
    return Accelerator(device_name, memory_gib, h100.bf16_flops, h100.fp8_flops, h100.hbm_bytes_per_s,
                       h100.nvlink_bytes_per_s, h100.ib_bytes_per_s, h100.pcie_bytes_per_s, RUNTIME_RESERVE_GIB)
