"""Human-readable latency anatomy: where one request's time went, and what each decode step read."""
from __future__ import annotations

from kvserve.metrics.stats import mean
from kvserve.metrics.step_stats import StepStats
from kvserve.outputs import LatencyBreakdown

MB = 1e6


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_anatomy(lat: LatencyBreakdown, steps: list[StepStats], header: str = "",
                   max_step_rows: int = 8) -> str:
    """The anatomy of one request: TTFT and its parts, N × ITL, E2E, and the bytes each decode step
    read (weights + KV growing with context) with achieved bandwidth. ``steps`` are the engine steps
    this request took part in."""
    n = lat.num_output_tokens
    lines = ["", "── latency anatomy " + "─" * 50]
    if header:
        lines.append(header)
    lines += [
        f"  tokenize     {lat.tokenize_ms:9.2f} ms",
        f"  queue        {lat.queue_ms:9.2f} ms",
    ]
    if n == 0:  # max_tokens 0: the request finishes without a step, so there is no first token to time
        finishing = lat.e2e_ms - lat.tokenize_ms - lat.queue_ms
        lines += [
            f"  prefill      {'-':>9}      (not run: 0 output tokens asked for; {lat.num_prompt_tokens} prompt tokens)",
            f"  TTFT         {'-':>9}      (no token)",
            f"  E2E          {lat.e2e_ms:9.2f} ms   = tokenize + queue + {finishing:.2f} ms finishing",
            "  output       0 tokens",
        ]
        return "\n".join(lines)
    finishing = lat.e2e_ms - lat.ttft_ms - sum(lat.itl_ms)
    lines += [
        f"  prefill      {lat.prefill_ms:9.2f} ms   ({lat.num_prompt_tokens} prompt tokens)",
        f"  TTFT         {lat.ttft_ms:9.2f} ms   (arrival -> first token: tokenize + queue + prefill)",
    ]
    if n > 1:
        lines.append(f"  decode       {sum(lat.itl_ms):9.2f} ms   ({n - 1} tokens x mean ITL {lat.mean_itl_ms:.2f} ms;"
                     f" p50 {lat.percentile_itl_ms(50):.2f}, p90 {lat.percentile_itl_ms(90):.2f})")
        lines.append(f"  TPOT         {lat.tpot_ms:9.2f} ms   ((E2E - TTFT) / (N - 1))")
    lines += [
        f"  detokenize   {lat.detokenize_ms:9.2f} ms   (inside the steps above)",
        f"  E2E          {lat.e2e_ms:9.2f} ms   = TTFT + sum(ITL) + {finishing:.2f} ms finishing",
        f"  output       {n} tokens" + (f", {1000 * (n - 1) / sum(lat.itl_ms):.1f} tokens/s decode" if n > 1 else ""),
    ]
    if lat.num_drafts:
        rate = lat.num_accepted_tokens / lat.num_draft_tokens if lat.num_draft_tokens else 0.0
        lines.append(f"  speculative  {lat.num_drafts} drafts, {lat.num_accepted_tokens}/{lat.num_draft_tokens} proposed "
                     f"tokens accepted ({100 * rate:.0f}%), {1 + lat.num_accepted_tokens / lat.num_drafts:.2f} tokens "
                     f"per verification step (tokens of one step share a timestamp: their ITL is 0)")
    lines += _format_steps(steps, max_step_rows)
    return "\n".join(lines)


def _format_steps(steps: list[StepStats], max_rows: int) -> list[str]:
    decode = [s for s in steps if s.is_decode_only]
    if not decode:
        return []
    sampled = len(decode) > max_rows
    pick = decode if not sampled else [decode[round(i * (len(decode) - 1) / (max_rows - 1))] for i in range(max_rows)]
    shown = f"; {len(pick)} of {len(decode)} steps shown, evenly spaced" if sampled else ""
    out = ["", f"  per decode step (bytes the step had to stream from memory{shown}):",
           f"  {'step':>6} {'seqs':>5} {'tokens':>6} {'weights':>10} {'KV':>10} {'KV/token':>9} {'time':>9} {'achieved':>11}"]
    for s in pick:  # tokens > seqs: speculative proposals verified beside each sequence's new token
        out.append(f"  {s.step:>6} {s.num_seqs:>5} {s.num_tokens:>6} {_fmt_bytes(s.weight_bytes):>10} "
                   f"{_fmt_bytes(s.kv_bytes_read):>10} "
                   f"{s.kv_bytes_per_token:>7} B {s.wall_s * 1e3:>6.2f} ms {s.achieved_bytes_per_s / 1e9:>7.2f} GB/s")
    bw = sum(s.total_bytes for s in decode) / sum(s.wall_s for s in decode)
    kv_share = mean([s.kv_bytes_read / s.total_bytes for s in decode])
    out.append(f"  mean: {bw / 1e9:.2f} GB/s achieved; KV is {100 * kv_share:.1f}% of the bytes per step")
    bursts = [s.num_steps for s in decode if s.num_steps > 1]
    if bursts:
        rows = "1 row is a multi-step burst" if len(bursts) == 1 else f"{len(bursts)} rows are multi-step bursts"
        out.append(f"  {rows} (num_scheduler_steps) of up to {max(bursts)} decode steps: a row's tokens, bytes and "
                   "time are those of all its steps, and 'step' counts engine steps; a burst's tokens leave "
                   "together, so the ITL percentiles above mix ~0 gaps inside bursts with the gaps between them "
                   "(TPOT is the per-token time)")
    return out
