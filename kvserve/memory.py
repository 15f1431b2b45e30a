"""Host memory for the bytes every decode step streams: the weights and the KV cache live in 2 MiB
("huge") pages where Linux grants them, because a stream over 4 KiB pages misses the TLB every 4 KiB.
On the 2-core development VM (nested paging, so each miss walks two page tables) a plain read of
1 GiB runs at ~19-20 GB/s over 4 KiB pages and ~27-28 GB/s over 2 MiB pages.

Pages come from an anonymous private ``mmap`` asked for transparent huge pages with
``madvise(MADV_HUGEPAGE)`` (Linux ``/sys/kernel/mm/transparent_hugepage/enabled`` = ``always`` or
``madvise``); elsewhere, or with ``KVSERVE_HUGE_PAGES=0`` (or false/no/off), plain torch memory is used.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from collections import Counter

import torch

HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # every tensor placed in an arena starts on a cache line
_OFF = ("0", "false", "no", "off")


def huge_pages_enabled() -> bool:
    """Whether kvserve asks for huge pages: on Linux (``mmap.MADV_HUGEPAGE`` exists) unless
    ``KVSERVE_HUGE_PAGES`` is ``0``, ``false``, ``no`` or ``off`` (any case)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("KVSERVE_HUGE_PAGES", "1").strip().lower() not in _OFF


def physical_memory_bytes() -> int:
    """This machine's physical memory in bytes (``SC_PAGE_SIZE`` × ``SC_PHYS_PAGES``): the host memory the
    weights and KV caches must fit in."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cgroup_memory_limit_bytes(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory limit of this process's control group in bytes, or None where it has none (or no cgroup
    file is readable). A group is held to the lowest limit of itself and its ancestors, so each level from
    the group up to ``root`` is read and the lowest limit wins. cgroup v2: ``memory.max`` ("max" = none) of
    the group ``proc_cgroup`` names (``0::/path``) and of each parent directory; cgroup v1:
    ``memory/<path>/memory.limit_in_bytes`` and its parents', where "none" is a value near 2**63. Inside a
    container the group's files are often at the root of ``root``, which is read too. A path with ``..``
    (the kernel's view of a group outside this cgroup namespace) is not followed: only the root's file
    is read. Malformed lines of ``proc_cgroup`` are skipped; values that are not text, not an integer,
    or not positive are ignored. Source: the Linux kernel's
    Documentation/admin-guide/cgroup-v2.rst ("memory.max", hierarchical limits) and cgroup-v1/memory.rst."""
    paths = {}
    try:
        with open(proc_cgroup) as f:
            for line in f:
                fields = line.rstrip("\n").split(":", 2)
                if len(fields) != 3:  # not "id:controllers:path": skip the line, keep reading
                    continue
                _, controllers, path = fields
                if controllers == "":
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass

    def levels(base: str, group: str | None, name: str) -> list[str]:
        parts = [p for p in (group or "").split("/") if p not in ("", ".")]
        if ".." in parts:  # a group outside this cgroup namespace ("/../x"): only the root's own file applies
            parts = []
        return [os.path.join(base, *parts[:n], name) for n in range(len(parts), -1, -1)]

    candidates = levels(root, paths.get("v2"), "memory.max")
    candidates += levels(os.path.join(root, "memory"), paths.get("v1"), "memory.limit_in_bytes")
    limits = []
    for path in dict.fromkeys(candidates):
        try:
            with open(path) as f:
                text = f.read().strip()
            limit = int(text)
        except (OSError, ValueError):  # unreadable, a directory, not text, or "max" (no limit)
            continue
        if 0 < limit < 2**62:  # v1 writes "no limit" as 2**63 rounded down to a page
            limits.append(limit)
    return min(limits, default=None)


def memory_limit() -> tuple[int, str]:
    """(bytes, what they are) of the host memory the weights and KV caches must fit in: physical memory
    ("this machine's memory"), or this process's cgroup limit where that is lower ("the cgroup memory
    limit": a container with a memory limit is killed at the limit, not at the machine's size)."""
    limit = cgroup_memory_limit_bytes()
    have = physical_memory_bytes()
    if limit is not None and limit < have:
        return limit, "the cgroup memory limit"
    return have, "this machine's memory"


def memory_limit_bytes() -> int:
    """The bytes of :func:`memory_limit`."""
    return memory_limit()[0]


def format_size(num_bytes: int) -> str:
    """Bytes for a message: GiB (2 decimals) from 1 GiB up, else MiB (1 decimal)."""
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages of ``module``'s parameters and buffers: what it holds in memory as
    built (a packed int4/int8 matrix counts its packed bytes, a tied weight once)."""
    storages = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == "cpu" and t.layout == torch.strided:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` (an int or a sequence) and ``dtype``."""
    numel = torch.Size((shape,) if isinstance(shape, int) else tuple(shape)).numel()
    return numel * torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class Arena:
    """Tensors carved one after another (64-byte aligned, the first 2 MiB-aligned) from one anonymous
    private mapping of ``num_bytes`` advised MADV_HUGEPAGE: the kernel backs it with 2 MiB pages as
    it is written, when it has them (otherwise with 4 KiB pages, silently). One mapping for many
    tensors, so the 2 MiB rounding is paid once, not per tensor. Each tensor has a storage of its own
    over its own bytes (``torch.save`` writes just those) and keeps the mapping alive. When huge pages
    are off, or the mapping fails, each tensor is a plain ``torch.empty``. Raises ValueError for a
    negative size or when a tensor does not fit in what is left."""

    def __init__(self, num_bytes: int):
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        self.num_bytes, self._at, self._mm, self._base = num_bytes, 0, None, 0
        if num_bytes == 0 or not huge_pages_enabled():
            return
        try:
            # private, not shared: shared anonymous memory is shmem, which follows shmem_enabled (often never)
            mm = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, OverflowError, ValueError):
            return
        probe = ctypes.c_char.from_buffer(mm)
        self._base = -ctypes.addressof(probe) % HUGE_PAGE_BYTES
        del probe  # a live export would keep the mapping from ever closing
        self._mm = mm

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The next ``shape`` × ``dtype`` tensor of the arena (zeros unless written before)."""
        n = nbytes(shape, dtype)
        if self._at + n > self.num_bytes:
            raise ValueError(f"a {n}-byte tensor does not fit: {self.num_bytes - self._at} of {self.num_bytes} "
                             "bytes left")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if self._mm is None or n == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(self._mm, dtype=torch.uint8, count=n, offset=self._base + self._at)
            t = t.view(dtype).view(shape)
        self._at += _aligned(n)
        return t


def huge_page_zeros(num_bytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of ``num_bytes`` bytes, 2 MiB-aligned, alone in an :class:`Arena`
    (its pages backed as they are first written). Raises ValueError for a negative size."""
    arena = Arena(num_bytes)
    t = arena.empty(num_bytes, torch.uint8)
    return t if arena._mm is not None else t.zero_()


def zeros_many(specs: list[tuple], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``[torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]``, on the CPU in one
    :class:`Arena`, every page written once here, as ``torch.zeros`` does: a KV cache claims its memory
    at startup. Left to the first request, the faults cost it 0.5-2 s on the development VM (each first
    write to a 2 MiB page clears the whole page; a prefill touches a page in each of the 60-120 cache
    tensors). One arena, so a cache of many small tensors does not round each up to 2 MiB."""
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    arena = Arena(sum(_aligned(nbytes(shape, dtype)) for shape, dtype in specs))
    out = [arena.empty(shape, dtype) for shape, dtype in specs]
    for t in out:
        t.zero_()  # fault the pages in now
    return out


def zeros(shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor of :func:`zeros_many`."""
    return zeros_many([(shape, dtype)], device)[0]


def _whole_storage(t: torch.Tensor) -> bool:
    """A dense tensor that is its whole storage (moving a view would split it from its base)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def move_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (dense, contiguous, CPU) in one :class:`Arena`, same shapes, dtypes and
    values."""
    arena = Arena(sum(_aligned(t.numel() * t.element_size()) for t in tensors))
    return [arena.empty(t.shape, t.dtype).copy_(t) for t in tensors]


def model_to_huge_pages(model: torch.nn.Module) -> int:
    """Move every parameter and buffer of ``model`` that owns its storage alone (dense CPU tensors no
    other one views; tied weights once) into one :class:`Arena`, in module order, so a decode step
    streams them in address order. Each original is released as soon as its copy is in place, so the
    peak is the weights plus one tensor, not twice the weights (as long as nothing else holds them),
    and the heap's free pages are handed back at the end (:func:`release_freed_heap`).
    Returns the bytes moved (0 when huge pages are off). Call before anything records the tensors'
    data pointers (kvserve's one-call decode plan checks them and rebuilds if they move)."""
    if not huge_pages_enabled():
        return 0
    slots: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    tensors[id(t)] = t
                    slots.setdefault(id(t), []).append((module, kind, name))
    dense = [k for k, t in tensors.items() if t.device.type == "cpu" and t.layout == torch.strided
             and not t.is_quantized and not t.is_nested]  # mkldnn, quantized, nested: no storage to move
    sharers = Counter(tensors[k].untyped_storage().data_ptr() for k in dense)
    # a tensor whose storage another one views (or that views one) stays put: moving it would break the alias
    keys = [k for k in dense if _whole_storage(tensors[k]) and sharers[tensors[k].untyped_storage().data_ptr()] == 1]
    del dense, sharers
    arena = Arena(sum(_aligned(tensors[k].numel() * tensors[k].element_size()) for k in keys))
    moved = 0
    for k in keys:
        t = tensors.pop(k)
        copy = arena.empty(t.shape, t.dtype).copy_(t)
        moved += t.numel() * t.element_size()
        for module, kind, name in slots[k]:
            if kind == "_parameters":
                t.data = copy  # the Parameter object (and every module sharing it) stays
            else:
                module._buffers[name] = copy
        del t, copy  # the old storage goes now, not after every copy
    release_freed_heap()
    return moved


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim(0)``; nothing elsewhere). glibc
    keeps freed chunks resident: after the move the originals' pages stayed in the process, SmolLM2 as a
    speculative draft +0.5 GiB of RSS and the target's own weights ~80 MiB."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: musl, macOS
        pass
