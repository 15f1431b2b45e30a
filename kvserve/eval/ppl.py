"""Perplexity over text that ships with every CPython (``pydoc_data/topics.py``), computed through
the engine's real paged path with prompt logprobs, plus a teacher-forced comparison of two KV dtypes.

Each window of ``context`` tokens is one request with ``prompt_logprobs=0``; with
``max_num_batched_tokens`` below the context the prompt is prefilled in chunks, so every chunk after
the first reads the earlier tokens' K/V back from the (possibly quantized) paged cache, as a long
prompt is served. Perplexity = exp(-mean log p(token | previous tokens)) over all scored positions.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from kvserve.sampling_params import SamplingParams


def corpus_text() -> str:
    """The English help text of CPython's ``pydoc_data.topics`` (every topic, in key order).
    Read from the file without importing modules beyond the standard library's own."""
    spec = importlib.util.find_spec("pydoc_data.topics")
    if spec is None:
        raise FileNotFoundError("pydoc_data.topics is not installed with this Python")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def windows(token_ids: list[int], context: int, num_windows: int) -> list[list[int]]:
    """Up to ``num_windows`` consecutive, non-overlapping windows of ``context`` tokens."""
    n = min(num_windows, len(token_ids) // context)
    if n < 1:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one window of {context}")
    return [token_ids[i * context:(i + 1) * context] for i in range(n)]


@dataclass
class PPLResult:
    kv_cache_dtype: str
    context: int
    num_windows: int
    num_scored_tokens: int
    ppl: float
    logprobs: list[list[float]] = field(default_factory=list, repr=False)  # per window, positions 1..context-1
    weight_dtype: str = ""  # how the matrices were stored (auto|float32|bfloat16|int8|int4), "" = not stated


def window_logprobs(llm, ids: list[list[int]]) -> list[list[float]]:
    """log p(ids[w][i] | ids[w][:i]) for i = 1 .. len - 1, one list per window, from the engine."""
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(ids, sp)
    result = []
    for window, out in zip(ids, outs):
        lps = out.prompt_logprobs[1:]  # position 0 has no previous token
        result.append([_logprob_of(entry, tok) for entry, tok in zip(lps, window[1:])])
    return result


def _logprob_of(entry, token_id: int) -> float:
    """One prompt-logprob entry (``TokenLogprobs`` scored against the prompt token) → its logprob."""
    assert entry.token_id == token_id, (entry.token_id, token_id)
    return entry.logprob


def perplexity(llm, kv_cache_dtype: str, ids: list[list[int]], weight_dtype: str = "") -> PPLResult:
    lps = window_logprobs(llm, ids)
    flat = [x for w in lps for x in w]
    return PPLResult(kv_cache_dtype, len(ids[0]), len(ids), len(flat), math.exp(-sum(flat) / len(flat)), lps,
                     weight_dtype)


@dataclass
class Comparison:
    """Teacher-forced: the same tokens scored with two caches. Δ = logprob(test) − logprob(reference)."""

    test: PPLResult
    reference: PPLResult
    mean_abs_delta: float
    max_abs_delta: float
    p99_abs_delta: float


def compare(test: PPLResult, reference: PPLResult) -> Comparison:
    deltas = sorted(abs(a - b) for wa, wb in zip(test.logprobs, reference.logprobs) for a, b in zip(wa, wb))
    return Comparison(test, reference, sum(deltas) / len(deltas), deltas[-1],
                      deltas[min(len(deltas) - 1, int(0.99 * len(deltas)))])


def format_result(r: PPLResult) -> str:
    weights = f"weight_dtype={r.weight_dtype} " if r.weight_dtype else ""
    return (f"{weights}kv_cache_dtype={r.kv_cache_dtype}: perplexity {r.ppl:.4f} over {r.num_scored_tokens} tokens "
            f"({r.num_windows} windows x {r.context} context)")


def format_comparison(c: Comparison) -> str:
    return (f"{format_result(c.test)}\n{format_result(c.reference)}\n"
            f"teacher-forced |Δ logprob| ({_label(c.test, c.reference)} vs {_label(c.reference, c.test)}): "
            f"mean {c.mean_abs_delta:.5f}, p99 {c.p99_abs_delta:.5f}, max {c.max_abs_delta:.5f}; "
            f"Δppl {c.test.ppl - c.reference.ppl:+.4f} ({(c.test.ppl / c.reference.ppl - 1) * 100:+.3f}%)")


def _label(r: PPLResult, other: PPLResult) -> str:
    """The KV dtype, and the weight dtype when the two runs differ in it."""
    return r.kv_cache_dtype + (f" KV, {r.weight_dtype} weights" if r.weight_dtype != other.weight_dtype else "")
