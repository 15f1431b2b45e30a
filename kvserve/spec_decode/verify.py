"""Verification inside the model runner: for each sequence that carried proposals, the target's
logits at its last ``k + 1`` positions decide which proposals stand (see :mod:`rejection`)."""
from __future__ import annotations

import torch

from kvserve.engine.sampler import sampling_kernel, sampling_probs
from kvserve.spec_decode.rejection import verify_greedy, verify_sampled, verify_sampled_logits


def verify(logits: torch.Tensor, proposal: list[int], params, generator: torch.Generator | None) -> list[int]:
    """logits: [k + 1, vocab] raw target logits at (last known token, proposal 1 .. k). Returns the
    accepted proposals plus one corrected or bonus token. Requests with penalties, logprobs or a
    pending ``min_tokens`` never get proposals (their processors depend on the position)."""
    if params.greedy:
        return verify_greedy(logits, proposal)
    if sampling_kernel(logits) is not None:
        out = verify_sampled_logits(logits, proposal, params, generator)
        if out is not None:
            return out
    probs = sampling_probs(logits.float(), [params] * logits.shape[0])  # [k + 1, vocab]
    probs /= probs.sum(dim=-1, keepdim=True)  # min-p leaves rows short of 1; acceptance needs probabilities
    return verify_sampled(probs, proposal, None, generator)
