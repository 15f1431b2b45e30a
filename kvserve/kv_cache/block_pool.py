"""Physical KV blocks: reference counts and an LRU free list. Knows nothing about requests.

A block holds ``block_size`` consecutive tokens of K and V for every layer. Freed blocks go to the
tail of the free list; new blocks come from the head (least recently freed first), which is the
eviction order prefix caching will rely on.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """``num_blocks`` blocks with ids ``0 .. num_blocks-1``.

    ``get_new_blocks`` raises ``RuntimeError`` when asked for more than are free: callers check
    ``num_free_blocks`` first (running out is a scheduling outcome, decided by the scheduler).
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list's tail in
        the given order (pass a request's blocks tail-first so its prefix is evicted last)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
