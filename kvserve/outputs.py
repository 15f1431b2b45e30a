"""What the engine hands back: :class:`RequestOutput` with one :class:`CompletionOutput` per choice,
per-token :class:`TokenLogprobs`, and the per-request :class:`LatencyBreakdown` (milliseconds)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities (natural log, of the model's raw distribution before temperature and other
    processors) at one generated position: the sampled token and the ``k`` most likely tokens,
    sorted by descending logprob."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class LatencyBreakdown:
    """Where one request's time went, in milliseconds (see README "Latency anatomy").

    ``ttft_ms`` runs from arrival (before tokenization) to the first generated token leaving the
    engine; ``itl_ms`` holds one gap per generated token after the first; ``tpot_ms`` is
    ``(e2e - ttft) / (n - 1)``; ``e2e_ms`` is arrival to finish.
    """

    tokenize_ms: float
    queue_ms: float
    ttft_ms: float
    itl_ms: list[float]
    tpot_ms: float
    e2e_ms: float
    detokenize_ms: float
    prefill_ms: float
    decode_ms: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for this sequence
    num_accepted_tokens: int = 0  # ... and accepted by verification
    num_drafts: int = 0  # verification steps that carried proposals

    def percentile_itl_ms(self, q: float) -> float:
        from kvserve.metrics.stats import percentile

        return percentile(self.itl_ms, q)

    @property
    def mean_itl_ms(self) -> float:
        return sum(self.itl_ms) / len(self.itl_ms) if self.itl_ms else 0.0

    def as_dict(self) -> dict:
        return {"tokenize_ms": self.tokenize_ms, "queue_ms": self.queue_ms, "ttft_ms": self.ttft_ms,
                "prefill_ms": self.prefill_ms, "decode_ms": self.decode_ms,
                "mean_itl_ms": self.mean_itl_ms, "p50_itl_ms": self.percentile_itl_ms(50),
                "p90_itl_ms": self.percentile_itl_ms(90), "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms,
                "detokenize_ms": self.detokenize_ms, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens, "num_preemptions": self.num_preemptions,
                "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens}


@dataclass(slots=True)
class CompletionOutput:
    """One choice. ``text`` is cumulative; ``delta_text`` is what is new since the last output of a
    stream (never part of a pending stop string, never half a UTF-8 character)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    latency: LatencyBreakdown | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """All choices of one request. ``latency`` is that of choice 0 (each choice carries its own)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when SamplingParams.prompt_logprobs is set

    @property
    def latency(self) -> LatencyBreakdown | None:
        return self.outputs[0].latency if self.outputs else None
