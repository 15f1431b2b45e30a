"""Per-step statistics: tokens processed, bytes the step had to read, wall time, achieved bytes/s.

A decode step streams every weight once (the embedding table only for the looked-up rows unless
it doubles as the LM head; routed MoE experts only those some token chose) plus, for each sequence,
the K and V (or MLA latent) of all its cached tokens.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvserve.models.quant import PackedLinear


@runtime_checkable
class HasRoutedExperts(Protocol):
    """A mixture-of-experts model (kvserve/models/deepseek_v2.py) that reports its routed experts."""

    def routed_expert_bytes(self) -> int:
        """Bytes of all routed experts (stored, not read every step)."""

    def routed_expert_bytes_read(self) -> int:
        """Bytes of the routed experts its latest forward used."""


def routed_expert_bytes_read(model: torch.nn.Module) -> int:
    """Routed-expert bytes the model's latest forward read (0 for dense models): add to a step's
    ``weight_bytes_of`` total. The Protocol check (~20 µs: typing walks the protocol's members) is made
    once per model class, not once per step."""
    return model.routed_expert_bytes_read() if _reports_routed_experts(type(model)) else 0


@functools.cache
def _reports_routed_experts(cls: type) -> bool:
    return issubclass(cls, HasRoutedExperts)


@dataclass(slots=True)
class StepStats:
    """One engine step. ``num_decode_tokens``: tokens of sequences that are decoding, i.e. one new token
    each plus, with speculative decoding, the proposals verified beside it; the rest of ``num_tokens``
    are prompt (prefill) tokens. Bytes are those the step had to read; ``wall_s`` in seconds.
    ``num_steps``: forward passes in it, >1 for a multi-step burst (``num_scheduler_steps``), whose
    tokens and bytes are those of all its passes: a row that stopped inside the burst ran to its end, and
    its tokens past the stop were computed (and counted here) but dropped, so a burst's ``num_tokens``
    can exceed the tokens its requests got."""

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
    num_steps: int = 1

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

    The token-embedding table is read only row by row unless it is also the LM head (tied). Packed
    int4/int8 layers (kvserve/models/quant.py) count their codes and scales (``weight_nbytes``)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.weight_nbytes for m in model.modules() if isinstance(m, PackedLinear))  # packed int4/int8
    emb = model.embed_tokens.weight
    row = emb.shape[1] * emb.element_size()
    if getattr(model, "lm_head", None) is not None:  # untied: the table itself is not streamed
        total -= emb.numel() * emb.element_size()
    if isinstance(model, HasRoutedExperts):  # counted per step, as touched (routed_expert_bytes_read)
        total -= model.routed_expert_bytes()
    return total, row
