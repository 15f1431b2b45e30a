"""``kvserve bench prefix``: requests sharing a long system prompt, TTFT with prefix caching on and
off in the same run. The first request fills the cache; the rest should prefill only their own
question (plus the partial last block of the shared prefix)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.bench.latency import random_prompt
from kvserve.metrics.stats import percentile
from kvserve.sampling_params import SamplingParams


@dataclass
class PrefixResult:
    caching: bool
    ttft_ms: list[float]  # per request, in order
    cached_tokens: int

    @property
    def median_after_first_ms(self) -> float:
        return percentile(self.ttft_ms[1:], 50)


def run_prefix(llm, num_requests: int, system_tokens: int, question_tokens: int, output_tokens: int) -> PrefixResult:
    """Sequential batch-1 requests: a shared ``system_tokens`` prefix plus a distinct question each."""
    vocab = llm.engine.vocab_size
    system = random_prompt(system_tokens, vocab, seed=7)
    kv = llm.engine.kv_manager
    hits0 = kv.num_hit_tokens
    sp = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    ttfts = []
    for i in range(num_requests):
        out = llm.generate([system + random_prompt(question_tokens, vocab, seed=100 + i)], sp)[0]
        ttfts.append(out.latency.ttft_ms)
    return PrefixResult(kv.enable_prefix_caching, ttfts, kv.num_hit_tokens - hits0)


def format_prefix(on: PrefixResult, off: PrefixResult, system_tokens: int) -> str:
    ratio = off.median_after_first_ms / on.median_after_first_ms if on.median_after_first_ms else float("inf")
    return "\n".join([
        f"kvserve bench prefix — {len(on.ttft_ms)} requests sharing a {system_tokens}-token system prompt",
        f"{'prefix caching':>15} {'first TTFT':>11} {'median TTFT (rest)':>19} {'cached tokens':>14}",
        f"{'on':>15} {on.ttft_ms[0]:>9.1f}ms {on.median_after_first_ms:>17.1f}ms {on.cached_tokens:>14}",
        f"{'off':>15} {off.ttft_ms[0]:>9.1f}ms {off.median_after_first_ms:>17.1f}ms {off.cached_tokens:>14}",
        f"median TTFT after the first request: {ratio:.1f}x lower with prefix caching",
    ])
