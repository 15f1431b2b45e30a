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

from kvserve.engine.sampler import greedy_token_ids, sample_rows_excluding


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
    """target_probs: [k + 1, vocab] (after temperature/top-k/top-p/min-p, each row summing to 1: they are
    taken as probabilities in the acceptance test); draft_probs: [k, vocab] or None for
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


def verify_sampled_logits(logits: torch.Tensor, proposal: list[int], params,
                          generator: torch.Generator | None) -> list[int] | None:
    """:func:`verify_sampled` for a deterministic proposer (one-hot q) on the sampling kernel, from the raw
    logits [k + 1, vocab] (float32 or bfloat16) and ``params``' temperature, top-k, top-p and min-p: one
    pass over each row gives p_i(x_i) and a draw from the residual (p_i without x_i), instead of the
    PyTorch sampling_probs over all k + 1 rows (2.4-7 ms for 3 proposals over SmolLM2's 49,152 tokens,
    as much as a decode step). The u's come from ``generator`` (None: torch's global RNG), k for the
    acceptance tests and k + 1 for the draws, whatever is accepted. Returns None where the kernel left a
    row to PyTorch (a NaN or only -inf) and that row's draw was needed."""
    k = len(proposal)
    u_accept = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    u_draw = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    ids, p_proposed = sample_rows_excluding(logits, params, u_draw, list(proposal) + [-1])
    out = []
    for i, tok in enumerate(proposal):
        if u_accept[i] < p_proposed[i]:  # min(1, p / q) with q = 1; NaN: never accepted
            out.append(tok)
            continue
        if ids[i] < 0:
            return None
        out.append(ids[i])
        return out
    if ids[k] < 0:
        return None
    out.append(ids[k])
    return out


def _one_hot(tok: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[tok] = 1.0
    return q
