"""Maps each request to its block table; allocates, frees and — with prefix caching — reuses blocks.

Prefix caching (as in vLLM's automatic prefix caching): a full block is identified by a chained hash
of (parent block's hash, the block's token ids, extra keys such as a per-request ``cache_salt``), so
equal hashes mean equal prefixes. A new request starts from its longest cached prefix of full blocks.
``allocate_slots`` is all-or-nothing: it returns False, changing nothing, when the pool cannot give
the blocks a request needs; the scheduler then preempts or waits.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Sequence

from kvserve.kv_cache.block_pool import BlockHash, BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """128-bit chained block hash (SHA-256 over the pickled tuple, truncated)."""
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys))).digest()[:16]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's full blocks, in order
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ------------------------------------------------------------------ prefix lookup
    def block_hashes(self, request_id: str, token_ids: Sequence[int], extra_keys: tuple = ()) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids`` (extended incrementally; the salt goes into
        the first block, and the chain carries it to the rest)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra_keys if i == 0 else ()))
        return hashes

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            extra_keys: tuple = ()) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of ``token_ids`` and the tokens they cover.
        At least one token is always left to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return [], 0
        hits: list[KVCacheBlock] = []
        for h in self.block_hashes(request_id, token_ids, extra_keys)[:(len(token_ids) - 1) // self.block_size]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (tokens asked, tokens found)."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # ------------------------------------------------------------------ allocation
    def num_new_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self._blocks.get(request_id, ()))
        return max(0, cdiv(num_total_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Make the request's block table cover ``num_total_tokens`` token slots, starting with
        ``computed_blocks`` (cache hits, only when the request has no blocks yet). False if it can't."""
        held = self._blocks.get(request_id, [])
        assert not (computed_blocks and held), "cache hits apply only to a request without blocks"
        need = max(0, cdiv(num_total_tokens, self.block_size) - len(held) - len(computed_blocks))
        reclaimable = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # they leave the free list
        if need > self.pool.num_free_blocks - reclaimable:
            return False
        self.pool.touch(list(computed_blocks))
        blocks = self._blocks.setdefault(request_id, held)
        blocks.extend(computed_blocks)
        if need:
            blocks.extend(self.pool.get_new_blocks(need))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_keys: tuple = ()) -> None:
        """Register the request's blocks that are full of computed tokens for reuse."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request_id, [])
        n_full = min(num_computed_tokens // self.block_size, len(blocks))
        hashes = self.block_hashes(request_id, token_ids[:n_full * self.block_size], extra_keys)
        for block, h in zip(blocks[:n_full], hashes):
            if block.block_hash is None:
                self.pool.cache_block(block, h)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's tail blocks beyond those ``num_tokens`` slots need (rejected proposals)."""
        blocks = self._blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(list(reversed(tail)))

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks (tail first). Unknown ids are ignored."""
        self._hashes.pop(request_id, None)
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))
