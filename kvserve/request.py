"""The single owner of one request's progress: token ids, ``num_computed_tokens``, status.

The scheduler moves a :class:`Request` between states; the KV cache manager holds its blocks by
``request_id``; the detokenizer keeps its text. Times come from :class:`RequestTimeline`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvserve.metrics.timeline import RequestTimeline
from kvserve.outputs import TokenLogprobs
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


class FinishReason(str, enum.Enum):
    """OpenAI's ``finish_reason`` values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_OF_STATUS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                     RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                     RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding counters of one sequence: drafts verified, tokens proposed, tokens
    accepted, and accepted counts per draft position (position 0 = the first proposal)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    disabled: bool = False  # turned off for this sequence after poor acceptance

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted + 1), averaged over drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Request:
    """One sequence being generated (a choice of an ``n > 1`` request is its own Request).

    ``max_tokens`` is the resolved output cap: ``sampling_params.max_tokens`` or, when None,
    whatever fits in ``max_model_len`` after the prompt.
    """

    __slots__ = ("request_id", "parent_id", "index", "prompt", "prompt_token_ids", "sampling_params",
                 "output_token_ids", "all_token_ids", "num_computed_tokens", "status", "stop_reason",
                 "logprobs", "prompt_logprobs", "cache_salt", "num_cached_tokens", "spec_token_ids", "spec_stats", "timeline", "generator", "max_tokens", "num_preemptions", "eos_token_ids")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, eos_token_ids: tuple[int, ...], timeline: RequestTimeline,
                 prompt: str | None = None, parent_id: str | None = None, index: int = 0,
                 generator: torch.Generator | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprobs] | None = [] if sampling_params.logprobs is not None else None
        # one entry per prompt token; the first has no logprob (None)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        self.timeline = timeline
        self.generator = generator
        self.max_tokens = max_tokens
        self.num_preemptions = 0
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt  # isolates this request's prefix-cache entries from others'
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.spec_token_ids: list[int] = []  # proposals waiting to be verified in the next step
        self.spec_stats = SpecStats()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def cache_keys(self) -> tuple:
        """Extra keys mixed into the first block's hash."""
        return (self.cache_salt,) if self.cache_salt else ()

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_OF_STATUS.get(self.status)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)

    def extend_prompt_logprobs(self, start_pos: int, entries: list[TokenLogprobs]) -> None:
        """Record logprobs of prompt tokens ``start_pos + 1 ...`` (computed from positions
        ``start_pos ...``); entries already known (a recompute after preemption) are skipped."""
        have = len(self.prompt_logprobs)
        skip = have - (start_pos + 1)
        if skip < len(entries):
            self.prompt_logprobs.extend(entries[max(0, skip):])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
