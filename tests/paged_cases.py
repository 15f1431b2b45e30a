"""Shared set-up of the paged-attention tests: block tables scattered over the pool and the earlier
context of each sequence written through the slot mapping of a "previous step"."""
import torch

from kvserve.attention import AttentionMetadata, write_kv


def scattered_tables(perm: list[int], context_lens, query_lens, block_size: int) -> list[list[int]]:
    """Each sequence's blocks popped from ``perm`` (a shuffled list of block ids): non-contiguous tables."""
    return [[perm.pop() for _ in range(-(-(c + q) // block_size))] for c, q in zip(context_lens, query_lens)]


def fill_context(kc, vc, tables, context_lens, block_size: int, num_kv_heads: int, head_dim: int,
                 g: torch.Generator, dtype: torch.dtype = torch.float32) -> None:
    """Random K and V (drawn in that order from ``g``) for every sequence's ``context_lens`` earlier tokens."""
    prev = AttentionMetadata.build(tables, [0] * len(tables), list(context_lens), block_size)
    n_prev = sum(context_lens)
    if n_prev:
        write_kv(kc, vc, torch.randn(n_prev, num_kv_heads, head_dim, generator=g).to(dtype),
                 torch.randn(n_prev, num_kv_heads, head_dim, generator=g).to(dtype), prev.slot_mapping)
