"""Maps each request to its block table; allocates, frees and — with prefix caching — reuses blocks.

Prefix caching (as in vLLM's automatic prefix caching): a full block is identified by a chained hash
of (parent block's hash, the block's token ids, extra keys such as a per-request ``cache_salt``), so
equal hashes mean equal prefixes. A new request starts from its longest cached prefix of full blocks.
``allocate_slots`` is all-or-nothing: it returns False, allocating nothing, when the pool cannot give
the blocks a request needs; the scheduler then preempts or waits.

KV cache groups (models with sliding-window layers, see kvserve/kv_cache/spec.py): a request holds one
block table per group, all drawn from the one pool. A sliding group (window W) frees the blocks that
fall wholly before its window, ``position < num_computed_tokens - W + 1``: no later query of the
request reads them, so the group holds about W / block_size blocks however long the context grows.
Their table entries become ``FREED_BLOCK_ID`` (-1): attention never reads them. Prefix caching needs a
single full-attention group.
"""
from __future__ import annotations

import hashlib
import pickle
from typing import Sequence

from kvserve.kv_cache.block_pool import BlockHash, BlockPool, KVCacheBlock


FREED_BLOCK_ID = -1  # block-table entry of a block a sliding group freed (out of its window)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """128-bit chained block hash (SHA-256 over the pickled tuple, truncated)."""
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra_keys))).digest()[:16]


class KVCacheManager:
    """``group_windows``: the sliding window of each KV cache group (0 = full attention); the default
    is one full-attention group. ValueError for prefix caching with sliding or several groups."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 group_windows: Sequence[int] = (0,)):
        if enable_prefix_caching and tuple(group_windows) != (0,):
            raise ValueError("prefix caching needs one full-attention KV cache group")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[list[KVCacheBlock | None]]] = {}  # per request, per group
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of the request's full blocks, in order
        # full blocks of the request offered to the prefix cache so far: a decode step offers only a block
        # it filled, instead of walking the whole table (a held block keeps its hash until it is freed)
        self._num_offered: dict[str, int] = {}
        # offered blocks the cache refused (another block held the hash, e.g. the same prompt admitted in
        # the same step): offered again on every step, so they take the hash once the holder is evicted
        self._refused: dict[str, list[int]] = {}
        self.num_queried_tokens = 0  # prefix-cache lookups, in tokens
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ------------------------------------------------------------------ prefix lookup
    def block_hashes(self, request_id: str, token_ids: Sequence[int], extra_keys: tuple = (),
                     num_blocks: int | None = None) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``, or of its first ``num_blocks`` (extended
        incrementally, so the list may hold more; the salt goes into the first block, and the chain
        carries it to the rest)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs if num_blocks is None else num_blocks):
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
        tables = self._blocks.get(request_id) or [[] for _ in self.group_windows]
        return sum(max(0, cdiv(num_total_tokens, self.block_size) - len(t)) for t in tables)

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       computed_blocks: list[KVCacheBlock] = (), num_computed_tokens: int = 0) -> bool:
        """Make every block table of the request cover ``num_total_tokens`` token slots, starting with
        ``computed_blocks`` (cache hits, only when the request has no blocks yet). False if it can't.
        ``num_computed_tokens`` (tokens already in the cache) lets sliding groups first free the blocks
        out of their window; that happens even when the call returns False (no query reads them again)."""
        tables = self._blocks.get(request_id)
        assert not (computed_blocks and tables), "cache hits apply only to a request without blocks"
        if tables is not None:
            self._free_out_of_window(tables, num_computed_tokens)
        have = [len(t) for t in tables] if tables is not None else [0] * len(self.group_windows)
        have[0] += len(computed_blocks)
        needs = [max(0, cdiv(num_total_tokens, self.block_size) - h) for h in have]
        reclaimable = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # they leave the free list
        if sum(needs) > self.pool.num_free_blocks - reclaimable:
            return False
        self.pool.touch(list(computed_blocks))
        tables = self._blocks.setdefault(request_id, [[] for _ in self.group_windows])
        tables[0].extend(computed_blocks)
        for table, need in zip(tables, needs):
            if need:
                table.extend(self.pool.get_new_blocks(need))
        return True

    def _free_out_of_window(self, tables: list[list[KVCacheBlock | None]], num_computed_tokens: int) -> None:
        """Free, in each sliding group, the blocks wholly before position ``num_computed_tokens - W + 1``
        (the first key the next query sees). Freed entries form a prefix of the table."""
        for table, window in zip(tables, self.group_windows):
            if not window:
                continue
            i = min(len(table), max(0, num_computed_tokens - window + 1) // self.block_size) - 1
            freed = []
            while i >= 0 and table[i] is not None:
                freed.append(table[i])
                table[i] = None
                i -= 1
            if freed:
                self.pool.free_blocks(freed)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          extra_keys: tuple = ()) -> None:
        """Register the request's blocks that are full of computed tokens for reuse."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request_id, [[]])[0]
        n_full = min(num_computed_tokens // self.block_size, len(blocks))
        done, refused = self._num_offered.get(request_id, 0), self._refused.get(request_id, ())
        if n_full <= done and not refused:  # a decode step that filled no block: O(1), not O(context)
            return
        hashes = self.block_hashes(request_id, token_ids, extra_keys, n_full)
        still = []
        for i in [*refused, *range(done, n_full)]:
            if blocks[i].block_hash is None:
                self.pool.cache_block(blocks[i], hashes[i])
                if blocks[i].block_hash is None:  # another block holds the hash: offer again next step
                    still.append(i)
        self._num_offered[request_id] = max(done, n_full)
        if still:
            self._refused[request_id] = still
        else:
            self._refused.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's tail blocks beyond those ``num_tokens`` slots need (rejected proposals)."""
        keep = cdiv(num_tokens, self.block_size)
        n_full = num_tokens // self.block_size  # full blocks left: their hashes and offers stand
        if self._num_offered.get(request_id, 0) > n_full:
            self._num_offered[request_id] = n_full
            del self._hashes.get(request_id, [])[n_full:]
            refused = [i for i in self._refused.pop(request_id, ()) if i < n_full]
            if refused:
                self._refused[request_id] = refused
        for blocks in self._blocks.get(request_id, ()):
            if len(blocks) > keep:
                tail = [b for b in blocks[keep:] if b is not None]
                del blocks[keep:]
                self.pool.free_blocks(list(reversed(tail)))

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks (tail first). Unknown ids are ignored."""
        self._hashes.pop(request_id, None)
        self._num_offered.pop(request_id, None)
        self._refused.pop(request_id, None)
        for blocks in self._blocks.pop(request_id, ()):
            self.pool.free_blocks([b for b in reversed(blocks) if b is not None])

    def block_table(self, request_id: str) -> list[int]:
        """The first group's block ids (the only group of a model without sliding-window layers)."""
        return self.block_tables(request_id)[0]

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Block ids per group; ``FREED_BLOCK_ID`` where a sliding group freed a block."""
        tables = self._blocks.get(request_id) or [[] for _ in self.group_windows]
        return [[FREED_BLOCK_ID if b is None else b.block_id for b in t] for t in tables]

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds now, over all groups."""
        return sum(b is not None for t in self._blocks.get(request_id, ()) for b in t)
