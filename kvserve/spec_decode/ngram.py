"""N-gram prompt lookup (Saxena 2023, "prompt lookup decoding"; vLLM's ``ngram`` method).

Find the longest suffix of the request's tokens, between ``prompt_lookup_min`` and
``prompt_lookup_max`` tokens long, that also occurs earlier in its tokens; propose the ``k`` tokens
that followed that earlier occurrence (the most recent one). Deterministic: the draft distribution
is one-hot on each proposed token.
"""
from __future__ import annotations

from typing import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to ``min(k, max_tokens)`` proposed next tokens for ``token_ids``; [] when no n-gram matches."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < self.min_n + 1:
            return []
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = list(token_ids[n_tokens - n:])
            # scan right to left for the most recent earlier occurrence of the suffix
            for start in range(n_tokens - n - 1, -1, -1):
                if token_ids[start] == suffix[0] and list(token_ids[start:start + n]) == suffix:
                    follow = list(token_ids[start + n:start + n + k])
                    if follow:
                        return follow
        return []
