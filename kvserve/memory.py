"""Host memory for the bytes every decode step streams: the weights and the KV cache live in 2 MiB
("huge") pages where Linux grants them, because a stream over 4 KiB pages misses the TLB every 4 KiB.
On the 2-core development VM (nested paging, so each miss walks two page tables) a plain read of
1 GiB runs at ~19-20 GB/s over 4 KiB pages and ~27-28 GB/s over 2 MiB pages.

Pages come from an anonymous private ``mmap`` asked for transparent huge pages with
``madvise(MADV_HUGEPAGE)`` (Linux ``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or
``madvise``); elsewhere, or with ``KVSERVE_HUGE_PAGES=0``, plain ``torch.zeros`` memory is used.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections import Counter

import torch

HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # every tensor placed in an arena starts on a cache line


def huge_pages_enabled() -> bool:
    """Whether kvserve asks for huge pages: on Linux (``mmap.MADV_HUGEPAGE`` exists) unless
    ``KVSERVE_HUGE_PAGES=0``."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("KVSERVE_HUGE_PAGES", "1") != "0"


def huge_page_zeros(num_bytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of ``num_bytes`` bytes whose first byte is 2 MiB-aligned, in an
    anonymous private mapping advised MADV_HUGEPAGE (the kernel backs it with 2 MiB pages as it is
    touched, when it has them; otherwise with 4 KiB pages, silently). The tensor keeps the mapping
    alive. Falls back to ``torch.zeros`` when huge pages are off or the mapping fails (OSError).
    Raises ValueError for a negative size."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    if num_bytes == 0 or not huge_pages_enabled():
        return torch.zeros(num_bytes, dtype=torch.uint8)
    try:
        # private, not shared: shared anonymous memory is shmem, which follows shmem_enabled (often never)
        mm = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return torch.zeros(num_bytes, dtype=torch.uint8)
    probe = ctypes.c_char.from_buffer(mm)
    offset = -ctypes.addressof(probe) % HUGE_PAGE_BYTES
    del probe  # a live export would keep the mapping from ever closing
    return torch.frombuffer(mm, dtype=torch.uint8, count=num_bytes, offset=offset)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``, in :func:`huge_page_zeros` memory on the CPU,
    every page written once here, as ``torch.zeros`` does: a KV cache claims its memory at startup.
    Left to the first request, the faults cost it 0.5-2 s on the development VM (each first write to a
    2 MiB page clears the whole page; a prefill touches a page in each of the 60-120 cache tensors)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    t = huge_page_zeros(num_bytes)
    t.zero_()  # fault the pages in now
    return t.view(dtype).view(shape)


def _owns_storage(t: torch.Tensor) -> bool:
    """A dense CPU tensor that is its whole storage (moving a view would split it from its base)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def move_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (dense, contiguous, CPU) packed into one :func:`huge_page_zeros` arena,
    each 64-byte aligned, same shapes, dtypes and values."""
    sizes = [-(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES for t in tensors]
    arena = huge_page_zeros(sum(sizes))
    out, at = [], 0
    for t, size in zip(tensors, sizes):
        copy = arena[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)  # [*t.shape]
        copy.copy_(t)
        out.append(copy)
        at += size
    return out


def model_to_huge_pages(model: torch.nn.Module) -> int:
    """Move every parameter and buffer of ``model`` that owns its storage alone (dense CPU tensors no
    other one views; tied weights once) into one huge-page arena, in module order, so a decode step
    streams them in address order. Returns the bytes moved (0 when huge pages are off). Call before
    anything records the tensors' data pointers (kvserve's one-call decode plan checks them and
    rebuilds if they move)."""
    if not huge_pages_enabled():
        return 0
    slots: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = []
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            slots += [(module, kind, name, t) for name, t in getattr(module, kind).items() if t is not None]
    tensors = {id(t): t for *_, t in slots}
    dense = [t for t in tensors.values() if t.device.type == "cpu" and t.layout == torch.strided]  # not mkldnn
    sharers = Counter(t.untyped_storage().data_ptr() for t in dense)
    # a tensor whose storage another one views (or that views one) stays put: moving it would break the alias
    unique = [t for t in dense if _owns_storage(t) and sharers[t.untyped_storage().data_ptr()] == 1]
    keep = {id(t) for t in unique}
    slots = [s for s in slots if id(s[3]) in keep]
    moved = dict(zip(map(id, unique), move_to_huge_pages(unique)))
    for module, kind, name, t in slots:
        if kind == "_parameters":
            t.data = moved[id(t)]  # the Parameter object (and every module sharing it) stays
        else:
            module._buffers[name] = moved[id(t)]
    return sum(t.numel() * t.element_size() for t in unique)
