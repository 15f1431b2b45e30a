"""Draft-model proposer: a smaller model sharing the target's vocabulary proposes ``k`` tokens by
greedy decoding. It keeps its own paged KV cache per request, brought up to date with the target's
tokens before each proposal and rolled back to the target's verified length after it (positions
whose tokens were rejected are simply recomputed next time).

Proposals are greedy, so the draft distribution is one-hot and the verifier's rejection sampling
stays exact for sampled requests (accept x with probability p(x)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.spec import KVCacheSpec
from kvserve.metrics.timeline import RequestTimeline
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0, max_tokens=None)


@dataclass(slots=True)
class _DraftSeq:
    shadow: Request  # the draft's view of the target request (token ids copied in each step)


class DraftModelProposer:
    """``max_model_len``: the draft's own context length (its ``max_position_embeddings``). A sequence
    proposes only as many tokens as keep the draft's positions inside it, none beyond: past its context
    a draft extrapolates positions it was never trained on (vLLM's Top1Proposer likewise gives such a
    sequence no proposals). The target then decodes it one token per step."""

    def __init__(self, model: torch.nn.Module, kv_spec: KVCacheSpec, num_blocks: int, num_speculative_tokens: int,
                 max_model_len: int | None = None):
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model, kv_spec, num_blocks)
        # sliding groups free nothing here (allocate_slots gets no num_computed_tokens): a proposal
        # round rolls back to the target's verified length, which may reach before a freed window
        self.kv = KVCacheManager(num_blocks, kv_spec.block_size,
                                 group_windows=[g.sliding_window for g in kv_spec.groups])
        self._seqs: dict[str, _DraftSeq] = {}

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Greedy proposals, ``ks[i]`` tokens for ``requests[i]`` (fewer or none if the draft's
        KV pool is full, or where the draft's context ends: the last proposal's position is then the
        draft's last, ``max_model_len`` - 1)."""
        active = []
        for req, k in zip(requests, ks):
            if self.max_model_len is not None:  # proposals sit at positions len .. len + k - 1
                k = max(0, min(k, self.max_model_len - len(req.all_token_ids)))
            seq = self._seqs.get(req.request_id)
            if seq is None:
                seq = self._seqs[req.request_id] = _DraftSeq(Request(req.request_id, [], _GREEDY, 0, (), RequestTimeline()))
            shadow = seq.shadow
            shadow.all_token_ids = list(req.all_token_ids)
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, req.num_computed_tokens)
            if k > 0 and self.kv.allocate_slots(req.request_id, len(shadow.all_token_ids) + k):
                active.append((req, shadow, k))
        proposals = {r.request_id: [] for r in requests}
        for step in range(max((k for _, _, k in active), default=0)):
            batch = [(r, sh) for r, sh, k in active if k > step]
            batch.sort(key=lambda b: len(b[1].all_token_ids) - b[1].num_computed_tokens != 1)  # decodes first
            sched = SchedulerOutput([self._entry(sh) for _, sh in batch])
            result = self.runner.execute(sched)
            for (req, sh), entry in zip(batch, sched.scheduled):
                sh.num_computed_tokens += entry.num_scheduled_tokens
                token = result.sampled[req.request_id][0]
                sh.all_token_ids.append(token)
                proposals[req.request_id].append(token)
        return [proposals[r.request_id] for r in requests]

    def _entry(self, shadow: Request) -> ScheduledRequest:
        n = len(shadow.all_token_ids) - shadow.num_computed_tokens
        return ScheduledRequest(shadow, shadow.num_computed_tokens, n, self.kv.block_tables(shadow.request_id), True)

    def free(self, request_id: str) -> None:
        """The target request finished: drop its draft KV blocks."""
        self._seqs.pop(request_id, None)
        self.kv.free(request_id)
