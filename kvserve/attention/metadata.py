"""Per-step attention metadata, built by the model runner and passed to every layer as an argument.

Tokens of all sequences in the step are flattened into one ``[num_tokens]`` axis. Sequences with a
query of one token (decodes) come first: ``num_decodes`` of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """
    slot_mapping:    [num_tokens] int64, cache slot of each new token = block_id * block_size + offset
    block_tables:    [num_seqs, max_blocks] int64, block ids of each sequence (padding = 0)
    seq_lens:        [num_seqs] int64, tokens in cache after this step (context + query)
    query_start_loc: [num_seqs + 1] int64, offsets of each sequence's query tokens
    seq_lens_list / query_lens_list: the same as Python ints (no device syncs in the layer loop)
    num_decodes:     sequences (at the front) whose query is one token
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_list: list[int]
    query_lens_list: list[int]
    num_decodes: int
    block_size: int
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, S] bool, True = attend; None = all


    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """From per-sequence block tables, cached-token counts and query lengths (decodes first)."""
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        slots: list[int] = []
        for table, ctx, q in zip(block_tables, context_lens, query_lens):
            for pos in range(ctx, ctx + q):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        meta = cls(slot_mapping=as_t(slots), block_tables=as_t(padded).view(len(padded), max_blocks),
                   seq_lens=as_t(seq_lens), query_start_loc=as_t(qsl), seq_lens_list=seq_lens,
                   query_lens_list=list(query_lens), num_decodes=num_decodes, block_size=block_size)
        meta.decode_mask = meta._build_decode_mask()
        return meta

    def _build_decode_mask(self) -> torch.Tensor | None:
        """Padding mask for the batched decode path, shared by all layers (None when not needed)."""
        if not self.num_decodes:
            return None
        lens = self.seq_lens_list[:self.num_decodes]
        span = -(-max(lens) // self.block_size) * self.block_size
        if self.num_decodes == 1:  # the decode path slices one sequence to its exact length
            return None
        keys = torch.arange(span, device=self.seq_lens.device)
        return (keys[None, :] < self.seq_lens[:self.num_decodes, None])[:, None, None, :]
