"""Physical KV blocks: reference counts, an LRU free list, and the hash → block map of prefix caching.
Knows nothing about requests.

A block holds ``block_size`` consecutive tokens of K and V for every layer. Freed blocks go to the
tail of the free list; new blocks come from the head (least recently freed first). A freed block that
is full keeps its hash and stays reusable by a later request with the same prefix until it is
handed out again as a new block (evicted in LRU order).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockHash = bytes


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered for reuse


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
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including cached ones that may still be reused)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free list, evicting their cached contents."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0
            self._evict(block)
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

    # ------------------------------------------------------------------ prefix caching
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a new request reuses (removing free ones from the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (the first block with a given hash wins)."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
