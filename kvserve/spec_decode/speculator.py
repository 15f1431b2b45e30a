"""Decides which sequences speculate each step and asks the proposer for their proposals.

A sequence speculates when it is decoding (one known token to compute), its request allows it
(``SamplingParams.speculative``), and nothing it asked for depends on the position in a way the
verifier does not model: no logits processor (``SamplingParams.processes_logits``: penalties,
logit_bias), no logprobs, no pending ``min_tokens``. It stops speculating after poor acceptance (``SpecDecodeConfig.min_acceptance_rate``).
"""
from __future__ import annotations

import torch

from kvserve.config import ConfigError, SpecDecodeConfig
from kvserve.request import Request, RequestStatus
from kvserve.spec_decode.ngram import NgramProposer


class Speculator:
    def __init__(self, config: SpecDecodeConfig, proposer):
        self.config = config
        self.proposer = proposer

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Set ``spec_token_ids`` on every eligible running sequence (k or fewer proposals)."""
        reqs, ks = [], []
        for req in running:
            self._update_disabled(req)
            k = self._budget(req, max_model_len)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if not reqs:
            return
        if isinstance(self.proposer, NgramProposer):
            proposals = [self.proposer.propose(r.all_token_ids, k) for r, k in zip(reqs, ks)]
        else:
            proposals = self.proposer.propose(reqs, ks)
        for req, p in zip(reqs, proposals):
            req.spec_token_ids = list(p)

    def _budget(self, req: Request, max_model_len: int) -> int:
        p = req.sampling_params
        if (req.status != RequestStatus.RUNNING or req.spec_stats.disabled or not p.speculative
                or req.num_computed_tokens != req.num_tokens - 1 or p.logprobs is not None
                or p.prompt_logprobs is not None or p.processes_logits or req.num_output_tokens < p.min_tokens):
            return 0
        room = min(req.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def _update_disabled(self, req: Request) -> None:
        s = req.spec_stats
        if s.num_drafts >= self.config.min_drafts and s.acceptance_rate < self.config.min_acceptance_rate:
            s.disabled = True

    def free(self, request_id: str) -> None:
        if not isinstance(self.proposer, NgramProposer):
            self.proposer.free(request_id)


def load_draft(config: SpecDecodeConfig, target_vocab_size: int, dtype: torch.dtype, seed: int):
    """The draft model's checkpoint (its weights still lazy), or None when the method needs none. Made
    before the target is built, so a draft that cannot work fails at once, not after a long load:
    ConfigError when its vocabulary differs from the target's, or when its weights and KV cache alone
    exceed the memory this process may use (:func:`check_draft_memory` with nothing else resident)."""
    if config.method != "draft":
        return None
    from kvserve.models.catalog import resolve_model
    from kvserve.models.loader import load_checkpoint

    try:
        source = resolve_model(config.draft_model, config.draft_load_format, setting="draft_load_format")
        ckpt = load_checkpoint(source, seed=seed, progress=False)
    except ConfigError as e:  # the loader's words ("model ...") are about the draft here
        raise ConfigError(f"draft_model: {e}") from None
    if ckpt.config.vocab_size != target_vocab_size:
        raise ConfigError(f"draft_model vocabulary ({ckpt.config.vocab_size}) differs from the target's "
                          f"({target_vocab_size}); they must share a tokenizer")
    check_draft_memory(config, ckpt.config, dtype, 0)
    return ckpt


def check_draft_memory(config: SpecDecodeConfig, draft_config, dtype: torch.dtype, resident_bytes: int) -> int:
    """The draft's KV pool in blocks. ConfigError when its weights (parameters × ``dtype``'s size,
    before any packing) and its KV cache (``draft_kv_cache_memory_bytes``, at least 16 blocks), with
    ``resident_bytes`` (what the target holds: its weights as built, packed ones packed, and its KV
    cache; bytes), exceed the memory this process may use (physical, or a lower cgroup limit)."""
    from kvserve import memory
    from kvserve.kv_cache.spec import KVCacheSpec

    kv_spec = KVCacheSpec.from_model(draft_config, dtype, 16)
    num_blocks = max(16, config.draft_kv_cache_memory_bytes // kv_spec.bytes_per_block)
    n = draft_config.num_params()
    weights = memory.nbytes(n, dtype)
    kv = num_blocks * kv_spec.bytes_per_block
    have, what = memory.memory_limit()
    if resident_bytes + weights + kv > have:
        halve = [] if dtype == torch.bfloat16 else ["use --dtype bfloat16"]
        if not resident_bytes:  # the draft alone: only a smaller draft (or a narrower dtype) helps
            advice = " or ".join(["use a smaller draft model (--draft-model)"] + halve)
        elif resident_bytes + kv > have:  # the draft's KV pool alone is over what is left: no smaller draft helps
            advice = " or ".join(["lower the target's KV cache (--kv-cache-memory or --num-kv-blocks)"] + halve)
        else:
            advice = ", ".join(["use a smaller draft model (--draft-model)",
                                "lower the target's KV cache (--kv-cache-memory or --num-kv-blocks)"] + halve)
        count, size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M", memory.format_size
        beside = f" beside the target's weights and KV cache ({size(resident_bytes)})" if resident_bytes else ""
        raise ConfigError(
            f"draft_model {config.draft_model!r}: its weights ({count} parameters in "
            f"{str(dtype).removeprefix('torch.')}: {size(weights)}) and KV cache ({size(kv)}){beside} need "
            f"{size(resident_bytes + weights + kv)}, more than {what} ({size(have)}); {advice}")
    return num_blocks


def build_speculator(config: SpecDecodeConfig, target_vocab_size: int, dtype: torch.dtype, seed: int,
                     resident_bytes: int = 0, draft_ckpt=None):
    """None when speculation is off. For a draft model: ``draft_ckpt`` from :func:`load_draft` (loaded
    here when None, with its checks), then :func:`check_draft_memory` with ``resident_bytes`` (what the
    target holds), before the draft's weights are built, so the error comes instead of the OOM killer."""
    if config.method is None:
        return None
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                                config.prompt_lookup_max))
    from kvserve import memory
    from kvserve.kv_cache.spec import KVCacheSpec
    from kvserve.models.registry import build_model
    from kvserve.spec_decode.draft import DraftModelProposer

    ckpt = draft_ckpt if draft_ckpt is not None else load_draft(config, target_vocab_size, dtype, seed)
    num_blocks = check_draft_memory(config, ckpt.config, dtype, resident_bytes)
    kv_spec = KVCacheSpec.from_model(ckpt.config, dtype, 16)
    model = build_model(ckpt.config, dtype, ckpt.weights, seed=seed)
    memory.model_to_huge_pages(model)  # the draft's decode steps stream its weights too
    return Speculator(config, DraftModelProposer(model, kv_spec, num_blocks, config.num_speculative_tokens,
                                                 ckpt.config.max_position_embeddings))
