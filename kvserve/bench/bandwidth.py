"""The machine's plain large-tensor read bandwidth: the roofline a memory-bound decode step is
compared with in the same run."""
from __future__ import annotations

import time

import torch

from kvserve import memory


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-``repeats`` bytes/s for ``torch.sum`` over a float32 tensor of ``num_bytes`` bytes, held in
    2 MiB pages as the engine holds its weights and KV cache (kvserve/memory.py). The default 1 GiB is
    much larger than the last-level cache, so it streams from DRAM; a buffer that fits the share of the
    cache this process gets stays there between reads (on the 2-core development VM about 80-100 MiB of
    a 480 MiB L3 shared with other tenants: ~45-50 GB/s, against ~27 GB/s from DRAM over 2 MiB pages
    and ~20 GB/s over 4 KiB ones)."""
    x = memory.huge_page_zeros(num_bytes // 4 * 4).view(torch.float32)
    x.fill_(1.0)  # touch the pages
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best
