"""Accelerator table (peak figures from vendor datasheets) and the named efficiency factors that turn
peaks into achievable rates, one set per hardware class, fitted by :mod:`kvserve.planner.calibrate`.

``local`` is this machine as measured by ``kvserve probe`` (:mod:`kvserve.planner.probe`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

from kvserve.config import ConfigError

CALIBRATION_PATH = os.path.join(os.path.dirname(__file__), "calibration.json")


@dataclass(frozen=True)
class Hardware:
    """One accelerator. memory_bytes: capacity; memory_bandwidth_bytes_per_s: peak DRAM/HBM read;
    bf16/fp8_flops: dense (no 2:4 sparsity) tensor FLOP/s (fp8 0 = unsupported: bf16 is used);
    interconnect_bytes_per_s: one direction, per GPU, to its TP peers (NVLink/xGMI, else PCIe)."""

    name: str
    hardware_class: str
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    interconnect_bytes_per_s: float
    source: str = ""

    def peak_flops(self, weight_dtype: str) -> float:
        """Tensor FLOP/s for matmuls with ``weight_dtype`` weights: fp8 weights use the fp8 rate where the
        chip has one; int8/int4 weight-only kernels dequantize to bf16 and run at the bf16 rate."""
        return self.fp8_flops if weight_dtype == "fp8" and self.fp8_flops else self.bf16_flops


@dataclass(frozen=True)
class Efficiency:
    """Named factors that turn a Hardware's peaks into achievable rates (calibrated per class).

    bandwidth_efficiency: achieved / peak memory bandwidth of a decode step's weight and KV reads.
    kv_bandwidth_efficiency: the same for the KV reads alone where measured apart (0 = same as above).
    flops_efficiency: achieved / peak matmul FLOP/s in prefill (model FLOPs utilisation).
    step_overhead_s: fixed time per step not explained by bytes or FLOPs (launches, sampling, scheduling).
    overhead_per_layer_s: the same per transformer layer (eager PyTorch dispatch; 0 on GPUs with graphs).
    allreduce_hop_latency_s: latency of one step of a ring all-reduce (2(n−1) steps per all-reduce).
    """

    bandwidth_efficiency: float = 0.7
    kv_bandwidth_efficiency: float = 0.0
    flops_efficiency: float = 0.5
    step_overhead_s: float = 0.0
    overhead_per_layer_s: float = 0.0
    allreduce_hop_latency_s: float = 0.0
    calibrated_on: str = "uncalibrated"

    @property
    def kv_efficiency(self) -> float:
        return self.kv_bandwidth_efficiency or self.bandwidth_efficiency


_G, _T = 1e9, 1e12
# Sources (dense figures; vendor "with sparsity" numbers are halved):
#   A100-80GB SXM: NVIDIA A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
#     nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS,
#     no FP8, NVLink 600 GB/s bidirectional → 300 GB/s per direction.
#   H100 SXM / H100 PCIe: NVIDIA H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-
#     gpu-datasheet): SXM 80 GB HBM3 3.35 TB/s, BF16 989 / FP8 1,979 TFLOPS, NVLink 900 GB/s; PCIe 80 GB
#     HBM2e 2.0 TB/s, BF16 756 / FP8 1,513 TFLOPS, NVLink bridge 600 GB/s.
#   H200: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 141 GB HBM3e, 4.8 TB/s, compute as H100 SXM.
#   B200: NVIDIA HGX B200 spec (nvidia.com/en-us/data-center/hgx): 180 GB HBM3e, 8 TB/s per GPU, FP8 9 PFLOPS
#     and BF16 4.5 PFLOPS with sparsity (4.5 / 2.25 dense), NVLink 5 1.8 TB/s.
#   MI300X: AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html):
#     192 GB HBM3, 5.3 TB/s, BF16 1,307.4 / FP8 2,614.9 TFLOPS dense, Infinity Fabric 7 × 64 GB/s per direction.
#   L40S: NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): 48 GB GDDR6, 864 GB/s, BF16 362 / FP8 733
#     TFLOPS dense, no NVLink: PCIe Gen4 x16 32 GB/s per direction.
HARDWARE: dict[str, Hardware] = {
    "a100-80gb-sxm": Hardware("a100-80gb-sxm", "ampere", 80 * _G, 2039 * _G, 312 * _T, 0.0, 300 * _G, "NVIDIA A100 datasheet"),
    "h100-sxm": Hardware("h100-sxm", "hopper", 80 * _G, 3350 * _G, 989 * _T, 1979 * _T, 450 * _G, "NVIDIA H100 datasheet"),
    "h100-pcie": Hardware("h100-pcie", "hopper", 80 * _G, 2000 * _G, 756 * _T, 1513 * _T, 300 * _G, "NVIDIA H100 datasheet"),
    "h200": Hardware("h200", "hopper", 141 * _G, 4800 * _G, 989 * _T, 1979 * _T, 450 * _G, "NVIDIA H200 datasheet"),
    "b200": Hardware("b200", "blackwell", 180 * _G, 8000 * _G, 2250 * _T, 4500 * _T, 900 * _G, "NVIDIA HGX B200 spec"),
    "mi300x": Hardware("mi300x", "cdna3", 192 * _G, 5300 * _G, 1307.4 * _T, 2614.9 * _T, 448 * _G, "AMD MI300X datasheet"),
    "l40s": Hardware("l40s", "ada", 48 * _G, 864 * _G, 362 * _T, 733 * _T, 32 * _G, "NVIDIA L40S datasheet"),
}
ALIASES = {"a100": "a100-80gb-sxm", "a100-80gb": "a100-80gb-sxm", "h100": "h100-sxm"}
# Classes with no public measurement in the calibration set borrow the nearest calibrated class.
BORROWED_CLASS = {"blackwell": "hopper", "cdna3": "hopper", "ada": "hopper"}


def known_hardware() -> list[str]:
    return sorted(set(HARDWARE) | set(ALIASES) | {"local"})


def get_hardware(name: str) -> Hardware:
    """A table entry, an alias, or ``local`` (needs a saved ``kvserve probe``). ConfigError otherwise."""
    key = name.lower()
    if key == "local":
        from kvserve.planner.probe import load_probe

        return load_probe().hardware()
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; known: {known_hardware()}")
    return HARDWARE[key]


def load_calibration(path: str = CALIBRATION_PATH) -> dict[str, Efficiency]:
    """Efficiency per hardware class from the JSON written by ``python -m kvserve.planner.calibrate``."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {cls: Efficiency(**fields) for cls, fields in data.get("classes", {}).items()}


def efficiency_for(hw: Hardware, calibration: dict[str, Efficiency] | None = None) -> Efficiency:
    """The calibrated factors of ``hw``'s class (``local``: from the probe; borrowed classes say so)."""
    if hw.hardware_class == "local":
        from kvserve.planner.probe import load_probe

        return load_probe().efficiency()
    cal = load_calibration() if calibration is None else calibration
    cls = hw.hardware_class
    if cls in cal:
        return cal[cls]
    borrowed = BORROWED_CLASS.get(cls)
    if borrowed in cal:
        return replace(cal[borrowed], calibrated_on=f"borrowed from {borrowed} (no public measurement of {cls})")
    return Efficiency()


def efficiency_dict(eff: Efficiency) -> dict:
    return asdict(eff)
