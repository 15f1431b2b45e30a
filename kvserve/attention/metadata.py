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
    sliding_window:  0, or W: query position i sees only keys i - W + 1 .. i (Gemma 3 local layers);
                     entries of blocks wholly before a sequence's window may be freed (-1): never read
    window_block_tables / window_decode_mask: for sliding decodes, each sequence's table from the
                     block holding its first visible key, [num_decodes, nbw], and the mask of its
                     visible keys, [num_decodes, 1, 1, nbw * block_size] (None for one decode)
    all_decoding:    True when every sequence's query starts past its prompt (one new token plus any
                     speculative proposals), set by the model runner; prefill chunks: False
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
    sliding_window: int = 0
    window_block_tables: torch.Tensor | None = None
    window_decode_mask: torch.Tensor | None = None
    all_decoding: bool = False  # every query starts past its prompt: decodes and speculative verifications


    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device | str = "cpu", sliding_window: int = 0) -> "AttentionMetadata":
        """From per-sequence block tables, cached-token counts and query lengths (decodes first);
        ``sliding_window`` > 0 for a group of sliding-window layers."""
        values, seq_lens = cls.flat_values(block_tables, context_lens, query_lens, block_size)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        # one host-to-tensor copy, four views: torch.tensor costs ~5 µs a call even for one int, and
        # several times that on a decode step, whose weights and KV bytes have just evicted the caches
        flat = torch.tensor(values, dtype=torch.int64, device=device)
        a = sum(query_lens)  # flat = slots | tables | seq_lens | query_start_loc
        max_blocks = max((len(t) for t in block_tables), default=0)
        b = a + len(block_tables) * max_blocks
        c = b + len(seq_lens)
        meta = cls(slot_mapping=flat[:a], block_tables=flat[a:b].view(len(block_tables), max_blocks),
                   seq_lens=flat[b:c], query_start_loc=flat[c:], seq_lens_list=seq_lens,
                   query_lens_list=list(query_lens), num_decodes=num_decodes, block_size=block_size,
                   sliding_window=sliding_window)
        if sliding_window:
            meta._build_window_decode(block_tables)
        else:
            meta.decode_mask = meta._build_decode_mask()
        return meta

    @staticmethod
    def flat_values(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                    block_size: int) -> tuple[list[int], list[int]]:
        """The values of slot_mapping, block_tables (padded with 0 to the longest), seq_lens and
        query_start_loc, in that order as one list, and seq_lens."""
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        values: list[int] = []
        for table, ctx, q in zip(block_tables, context_lens, query_lens):
            for pos in range(ctx, ctx + q):
                values.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        for t in block_tables:
            values += t
            if len(t) < max_blocks:
                values += [0] * (max_blocks - len(t))
        values += seq_lens
        values.append(0)
        for q in query_lens:
            values.append(values[-1] + q)
        return values, seq_lens

    def window_start(self, s: int) -> int:
        """First key position sequence ``s``'s first query sees (0 without a sliding window)."""
        ctx = self.seq_lens_list[s] - self.query_lens_list[s]
        return max(0, ctx - self.sliding_window + 1) if self.sliding_window else 0

    def _build_window_decode(self, block_tables: list[list[int]]) -> None:
        """``window_block_tables`` and ``window_decode_mask`` for the sliding decodes."""
        nd, bs = self.num_decodes, self.block_size
        if not nd:
            return
        firsts = [self.window_start(b) for b in range(nd)]
        first_blocks = [f // bs for f in firsts]
        nbw = max((slen - 1) // bs - fb + 1 for slen, fb in zip(self.seq_lens_list, first_blocks))
        rows = [block_tables[b][fb:fb + nbw] for b, fb in enumerate(first_blocks)]
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.seq_lens.device)  # noqa: E731
        self.window_block_tables = as_t([r + [0] * (nbw - len(r)) for r in rows]).view(nd, nbw)
        if nd > 1:
            pos = as_t(first_blocks)[:, None] * bs + torch.arange(nbw * bs, device=self.seq_lens.device)[None]
            visible = (pos >= as_t(firsts)[:, None]) & (pos < self.seq_lens[:nd, None])
            self.window_decode_mask = visible[:, None, None, :]

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
