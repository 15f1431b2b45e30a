"""Per-request timestamps (``time.perf_counter`` seconds) and the latency breakdown derived from them.

Timestamps: ``arrival`` (the caller received the request, before tokenization), ``tokenized``,
``first_scheduled`` (first step that ran any of its tokens), ``token_times`` (each generated token
left the engine, i.e. after the step that sampled it), ``finished``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.outputs import LatencyBreakdown

now = time.perf_counter


@dataclass(slots=True)
class RequestTimeline:
    arrival: float = field(default_factory=now)
    tokenized: float | None = None
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    detokenize_s: float = 0.0

    def breakdown(self, num_prompt_tokens: int, num_preemptions: int = 0) -> LatencyBreakdown:
        """Derive the anatomy in ms. Missing stamps (e.g. aborted before scheduling) count as 0."""
        ms = 1000.0
        tokenized = self.tokenized if self.tokenized is not None else self.arrival
        end = self.finished if self.finished is not None else now()
        first_sched = self.first_scheduled if self.first_scheduled is not None else end
        first_tok = self.token_times[0] if self.token_times else end
        n = len(self.token_times)
        itl = [(b - a) * ms for a, b in zip(self.token_times, self.token_times[1:])]
        e2e = (end - self.arrival) * ms
        ttft = (first_tok - self.arrival) * ms if self.token_times else 0.0
        tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
        last_tok = self.token_times[-1] if self.token_times else end
        return LatencyBreakdown(
            tokenize_ms=(tokenized - self.arrival) * ms,
            queue_ms=max(0.0, (first_sched - tokenized) * ms),
            ttft_ms=ttft,
            itl_ms=itl,
            tpot_ms=tpot,
            e2e_ms=e2e,
            detokenize_ms=self.detokenize_s * ms,
            prefill_ms=max(0.0, (first_tok - first_sched) * ms) if self.token_times else 0.0,
            decode_ms=(last_tok - first_tok) * ms,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=n,
            num_preemptions=num_preemptions,
        )
