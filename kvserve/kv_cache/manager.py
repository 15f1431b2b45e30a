"""Maps each request to its block table and allocates or frees blocks for it.

``allocate_slots`` is all-or-nothing: it returns False, changing nothing, when the pool cannot give
the blocks a request needs; the scheduler then preempts or waits.
"""
from __future__ import annotations

from kvserve.kv_cache.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self._blocks.get(request_id, ()))
        return max(0, cdiv(num_total_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_total_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Make the request's block table cover ``num_total_tokens`` token slots. False if it can't."""
        need = self.num_new_blocks_needed(request_id, num_total_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            self._blocks.setdefault(request_id, []).extend(self.pool.get_new_blocks(need))
        else:
            self._blocks.setdefault(request_id, [])
        return True

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks (tail first). Unknown ids are ignored."""
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))
