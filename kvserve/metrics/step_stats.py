"""Per-step statistics: tokens processed, bytes the step had to read, wall time, achieved bytes/s.

A decode step streams every weight once (the embedding table only for the looked-up rows unless
it doubles as the LM head) plus, for each sequence, the K and V of all its cached tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepStats:
    step: int
    start_s: float
    wall_s: float
    num_seqs: int
    num_tokens: int
    num_decode_tokens: int
    weight_bytes: int
    kv_bytes_read: int
    kv_bytes_per_token: int
    request_ids: tuple[str, ...] = ()

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes_read

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.total_bytes / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_decode_tokens


def weight_bytes_of(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every weight read each step, bytes of one embedding row).

    The token-embedding table is read only row by row unless it is also the LM head (tied)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    row = emb.shape[1] * emb.element_size()
    if getattr(model, "lm_head", None) is not None:  # untied: the table itself is not streamed
        total -= emb.numel() * emb.element_size()
    return total, row
