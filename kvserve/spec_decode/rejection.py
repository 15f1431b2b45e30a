"""Lossless verification of proposed tokens (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Algorithm 1; Chen et al. 2023).

Greedy requests accept the longest prefix of proposals equal to the target's argmax, then take the
target's argmax at the first mismatch (or after the last proposal) as a bonus token. Sampled
requests accept proposal x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection
they sample from the normalised residual max(0, p_i − q_i); if all are accepted, one more token is
sampled from p_{k+1}. The output distribution equals the target's.
"""
from __future__ import annotations

import torch

from kvserve.engine.sampler import greedy_token_ids


def verify_greedy(target_logits: torch.Tensor, proposal: list[int]) -> list[int]:
    """target_logits: [k + 1, vocab] at the positions of (last token, proposals...). Returns the
    accepted proposals followed by the bonus token (1 .. k + 1 tokens)."""
    argmax = greedy_token_ids(target_logits)  # first max = lowest id on ties, as the sampler's greedy rows
    out = []
    for i, tok in enumerate(proposal):
        if argmax[i] != tok:
            break
        out.append(tok)
    out.append(argmax[len(out)])
    return out


def verify_sampled(target_probs: torch.Tensor, proposal: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """target_probs: [k + 1, vocab] (after temperature/top-k/top-p); draft_probs: [k, vocab] or None for
    a deterministic proposer (one-hot q). Returns accepted proposals + one corrected or bonus token."""
    out = []
    for i, tok in enumerate(proposal):
        p = target_probs[i]
        q_tok = 1.0 if draft_probs is None else float(draft_probs[i, tok])
        u = torch.rand((), generator=generator).item()
        if q_tok > 0 and u < min(1.0, float(p[tok]) / q_tok):
            out.append(tok)
            continue
        q = _one_hot(tok, p) if draft_probs is None else draft_probs[i]
        residual = (p - q).clamp(min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else p
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return out


def _one_hot(tok: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[tok] = 1.0
    return q
