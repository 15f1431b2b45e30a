"""``kvserve bench latency``: batch-1 TTFT and ITL at several contexts, throughput at several
concurrencies, each beside the plain-read roofline measured in the same run and, optionally, a peer
on the same weights: HF transformers (``hf``) or llama.cpp (``llama.cpp``, llama-cpp-python)."""
from __future__ import annotations

import json
import random
import statistics
import time
import zlib
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from kvserve.bench.bandwidth import measure_read_bandwidth
from kvserve.metrics.stats import mean, percentile
from kvserve.sampling_params import SamplingParams


@dataclass
class ContextResult:
    context_tokens: int
    ttft_ms: float
    itl_mean_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    decode_bytes_per_step: float
    achieved_gb_per_s: float
    roofline_itl_ms: float
    peer_ttft_ms: float | None = None
    peer_itl_p50_ms: float | None = None
    # plain read of a buffer of one decode step's bytes, read again and again as the steps read theirs
    # (GB/s): above the 1 GiB read when that many bytes stay in the last-level cache between steps
    step_read_gb_per_s: float | None = None
    # achieved GB/s ÷ the 1 GiB plain read measured in the same round (None: use the report's read)
    read_share: float | None = None
    rounds: int = 1  # with --repeats: every figure above is the median over this many rounds
    itl_p50_rounds_ms: list[float] = field(default_factory=list)  # each round's ITL p50
    peer_itl_p50_rounds_ms: list[float] = field(default_factory=list)
    itl_mean_rounds_ms: list[float] = field(default_factory=list)  # each round's mean ITL (TPOT)


@dataclass
class ThroughputResult:
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    mean_ttft_ms: float
    mean_itl_ms: float
    roofline_tokens_per_s: float | None = None
    rounds: int = 1  # with --repeats: medians over this many rounds
    tokens_per_s_rounds: list[float] = field(default_factory=list)  # each round's output tokens/s


@dataclass
class LatencyReport:
    model: str
    dtype: str
    read_gb_per_s: float
    peer: str | None = None
    contexts: list[ContextResult] = field(default_factory=list)
    setup: str = ""  # matrix storage and KV cache dtype, e.g. "matrices: 120 int4, 1 int8; KV int8"
    threads: int = 0  # torch / kernel threads of the run (0: not recorded)
    throughput: list[ThroughputResult] = field(default_factory=list)
    temperature: float = 0.0  # of every run; 0 = greedy
    read_rounds_gb_per_s: list[float] = field(default_factory=list)  # the 1 GiB plain read of each round
    # decode steps per engine step (multi-step scheduling): above 1, tokens leave in bursts, the ITL p50
    # is ~0 and the per-token figure compared (with the peer, across contexts) is the mean ITL (TPOT)
    num_scheduler_steps: int = 1


def random_prompt(n: int, vocab: int, seed: int | str) -> list[int]:
    """``n`` token ids drawn from the ordinary part of the vocabulary (ids 100 .. min(vocab, 30000)).
    Prompts of one seed share their prefix (the shorter is the start of the longer)."""
    rng = random.Random(seed)
    return [rng.randrange(100, min(vocab, 30000)) for _ in range(n)]


def context_seed(ctx: int, round_: int) -> str:
    """The seed of the ``ctx``-token prompt of round ``round_`` (the peers use the same): each round's
    prompt is new to the prefix cache, which would otherwise skip the repeated prefill. A string, so it
    never equals a concurrency run's seed (:func:`concurrency_seed`): with integer seeds, round 2's
    4-request run drew seed 1024, whose prompt starts with the 1024-token context's."""
    return f"context {ctx} round {round_}"


def concurrency_seed(i: int) -> str:
    """The seed of a concurrency run's ``i``-th prompt, counted over all runs and rounds."""
    return f"concurrency {i}"


def run_context(llm, ctx: int, output_tokens: int, read_bw: float, temperature: float = 0.0,
                round_: int = 0) -> ContextResult:
    eng = llm.engine
    seed = context_seed(ctx, round_)
    prompt = random_prompt(ctx, eng.vocab_size, seed=seed)
    sp = SamplingParams(temperature=temperature, max_tokens=output_tokens, ignore_eos=True,
                        seed=zlib.crc32(seed.encode()))
    first = eng.num_steps + 1
    lat = llm.generate([prompt], sp)[0].latency
    decode = [s for s in eng.step_stats if s.step >= first and s.is_decode_only]
    bytes_per_step = sum(s.total_bytes for s in decode) / sum(s.num_steps for s in decode)  # per forward pass
    achieved = sum(s.total_bytes for s in decode) / sum(s.wall_s for s in decode)
    step_read = step_read_gb_per_s(bytes_per_step, read_bw)
    return ContextResult(ctx, lat.ttft_ms, lat.mean_itl_ms, lat.percentile_itl_ms(50), lat.percentile_itl_ms(90),
                         bytes_per_step, achieved / 1e9, bytes_per_step / read_bw * 1e3,
                         step_read_gb_per_s=step_read, read_share=achieved / read_bw,
                         itl_p50_rounds_ms=[lat.percentile_itl_ms(50)], itl_mean_rounds_ms=[lat.mean_itl_ms])


STEP_READ_MAX_BYTES = 1 << 30  # from the plain read's own size up, a step's bytes stream from DRAM anyway


def step_read_gb_per_s(step_bytes: float, read_bw: float) -> float | None:
    """GB/s of a plain read of a buffer of ``step_bytes`` (read again and again), or the plain read
    ``read_bw`` (bytes/s) itself from 1 GiB up: no second model-sized buffer for big models. None below
    4 bytes."""
    if step_bytes < 4:
        return None
    if step_bytes >= STEP_READ_MAX_BYTES:
        return read_bw / 1e9
    return measure_read_bandwidth(int(step_bytes), repeats=10) / 1e9


def run_concurrency(llm, c: int, prompt_tokens: int, output_tokens: int,
                    read_bw: float | None = None, temperature: float = 0.0, first_seed: int = 0) -> ThroughputResult:
    """``c`` requests at once, prompts from ``concurrency_seed(first_seed)`` .. ``(first_seed + c - 1)``.
    Give each run its own seeds: a prompt an earlier run already sent is a prefix-cache hit and skips
    its prefill."""
    prompts = [random_prompt(prompt_tokens, llm.engine.vocab_size, seed=concurrency_seed(first_seed + i))
               for i in range(c)]
    sp = SamplingParams(temperature=temperature, max_tokens=output_tokens, ignore_eos=True)
    first = llm.engine.num_steps + 1
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    lats = [o.latency for o in outs]
    steps = [s for s in llm.engine.step_stats if s.step >= first]
    roof = c * output_tokens / roofline_seconds(steps, read_bw) if read_bw and steps else None
    return ThroughputResult(c, prompt_tokens, output_tokens, wall, c * output_tokens / wall,
                            mean([x.ttft_ms for x in lats]), mean([x.mean_itl_ms for x in lats]), roof,
                            tokens_per_s_rounds=[c * output_tokens / wall])


def roofline_seconds(steps, read_bw: float) -> float:
    """The run's time if every decode-only step streamed its bytes at ``read_bw`` (bytes/s) and every
    step with prefill tokens took what it took (prefill is compute-bound): Σ bytes ÷ read_bw over
    decode-only steps + Σ wall over the others. Engine bookkeeping between steps counts as zero. The
    plain read is a DRAM read: a model whose bytes stay in the caches can beat this "roofline"."""
    return sum(s.total_bytes / read_bw if s.is_decode_only else s.wall_s for s in steps)


def run_latency_bench(llm, contexts: list[int], output_tokens: int, concurrency: list[int],
                      conc_prompt_tokens: int, conc_output_tokens: int, compare: str | None = None,
                      temperature: float = 0.0, repeats: int = 1) -> LatencyReport:
    """Every run greedy (``temperature`` 0) or sampling the whole distribution at ``temperature`` (no
    top-k/top-p; the llama.cpp peer likewise), so a sampler's cost shows in TTFT and ITL.

    ``repeats`` rounds, each: the 1 GiB plain read, every context, every concurrency, then the peer on
    the same prompts. Every figure reported is the median over the rounds, and each round's share of
    the plain read is taken against that round's own read: on a host whose bandwidth moves with other
    tenants' load, one round can land on a quiet or a busy moment. ValueError if ``repeats`` < 1;
    ConfigError (a ValueError) if the longest context plus ``output_tokens``, or ``conc_prompt_tokens``
    plus ``conc_output_tokens``, exceeds the engine's max_model_len (checked before any run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    eng = llm.engine
    from kvserve.config import ConfigError

    # before the plain read and the first runs (minutes), not when the run that breaks the limit comes
    limit = eng.max_model_len
    if contexts and max(contexts) + output_tokens > limit:
        raise ConfigError(f"output_tokens {output_tokens} + the longest of contexts ({max(contexts)} tokens) = "
                          f"{max(contexts) + output_tokens} exceeds max_model_len {limit}")
    if concurrency and conc_prompt_tokens + conc_output_tokens > limit:
        raise ConfigError(f"concurrency_prompt_tokens {conc_prompt_tokens} + concurrency_output_tokens "
                          f"{conc_output_tokens} = {conc_prompt_tokens + conc_output_tokens} exceeds max_model_len {limit}")
    from kvserve.cli import _weight_kinds, kv_dtype_name

    setup = f"{_weight_kinds(eng).strip().strip('()')}; KV {kv_dtype_name(eng.kv_spec)}".lstrip("; ")
    report = LatencyReport(eng.model_name, str(eng.dtype).removeprefix("torch."), 0.0, setup=setup,
                           threads=torch.get_num_threads(), temperature=temperature,
                           # where bursts never run (the engine warned), the steps are single: say so
                           num_scheduler_steps=eng.config.scheduler.num_scheduler_steps if eng.runner.may_burst() else 1)
    llm.generate([random_prompt(16, eng.vocab_size, 0)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    contexts, concurrency = list(dict.fromkeys(contexts)), list(dict.fromkeys(concurrency))  # each once, in order
    by_ctx: dict[int, list[ContextResult]] = {c: [] for c in contexts}
    by_conc: dict[int, list[ThroughputResult]] = {c: [] for c in concurrency}
    first_seed = 0  # every run's prompts new to the prefix cache (runs 1, 4, 16 once shared their first seeds)
    for r in range(repeats):
        read_bw = measure_read_bandwidth()
        report.read_rounds_gb_per_s.append(read_bw / 1e9)
        for ctx in contexts:
            by_ctx[ctx].append(run_context(llm, ctx, output_tokens, read_bw, temperature, r))
        for c in concurrency:
            by_conc[c].append(run_concurrency(llm, c, conc_prompt_tokens, conc_output_tokens, read_bw,
                                              temperature, first_seed))
            first_seed += c
        if compare and contexts:
            _add_peer(llm, [by_ctx[c][-1] for c in contexts], output_tokens, compare, temperature, r)
    report.peer = compare if compare and contexts else None
    report.read_gb_per_s = statistics.median(report.read_rounds_gb_per_s)
    report.contexts = [median_result(by_ctx[c]) for c in contexts]
    report.throughput = [median_result(by_conc[c]) for c in concurrency]
    return report


def median_result(results: list):
    """One ContextResult or ThroughputResult from several rounds of the same run: each numeric field the
    median over the rounds (None where any round has None; a value equal in every round, as the ints
    that name the run, kept as it is), the per-round lists joined, ``rounds`` the count. Fields are
    medians independently, so a row need not be any single round."""
    out = {}
    for f in fields(results[0]):
        vals = [getattr(x, f.name) for x in results]
        if f.name == "rounds":
            out[f.name] = sum(vals)
        elif isinstance(vals[0], list):
            out[f.name] = [v for x in vals for v in x]
        elif any(v is None for v in vals):
            out[f.name] = None
        elif all(v == vals[0] for v in vals):  # e.g. the ints that name the run: context, concurrency
            out[f.name] = vals[0]
        else:
            out[f.name] = statistics.median(vals)
    return replace(results[0], **out)


def _add_peer(llm, rows: list[ContextResult], output_tokens: int, peer: str, temperature: float,
              round_: int) -> None:
    """Round ``round_``'s prompts through the peer, after the engine's runs of that round (never
    concurrently with them), in a process of its own with its users' OpenMP settings
    (:mod:`kvserve.bench.peer_process`); fills the peer columns of ``rows``."""
    from kvserve.models.catalog import resolve_model

    eng = llm.engine
    source = resolve_model(eng.config.model, eng.config.load_format)
    contexts, threads = [r.context_tokens for r in rows], torch.get_num_threads()
    if peer == "llama.cpp":
        from kvserve.bench.llamacpp_peer import run_llamacpp_in_subprocess
        results = run_llamacpp_in_subprocess(source, contexts, output_tokens, eng.vocab_size, threads,
                                             temperature, round_)
    else:
        from kvserve.bench.hf_peer import run_hf_in_subprocess
        results = run_hf_in_subprocess(source, eng.dtype, contexts, output_tokens, eng.vocab_size, threads, round_)
    for r in rows:
        res = results[r.context_tokens]
        r.peer_ttft_ms, r.peer_itl_p50_ms = res["ttft_ms"], percentile(res["itl_ms"], 50)
        r.peer_itl_p50_rounds_ms = [r.peer_itl_p50_ms]


def format_report(rep: LatencyReport) -> str:
    peer = rep.peer or ""
    setup = f"; {rep.setup}" if rep.setup else ""
    threads = f"; {rep.threads} thread{'s' if rep.threads != 1 else ''}" if rep.threads else ""
    sampling = f"; temperature {rep.temperature:g}, full distribution" if rep.temperature else "; greedy"
    burst = rep.num_scheduler_steps > 1
    multi = f"; {rep.num_scheduler_steps} steps per burst" if burst else ""
    lines = [f"kvserve bench latency — {rep.model} ({rep.dtype}{setup}{threads}{sampling}{multi}); plain read "
             f"bandwidth {rep.read_gb_per_s:.1f} GB/s",
             "", "batch 1" + (f" (ratios: kvserve ÷ {peer}, < 1 = kvserve faster)" if _has_peer(rep) else "") + ":",
             f"{'context':>8} {'TTFT ms':>9} {'TPOT' if burst else 'ITL p50':>8} {'ITL p90':>8} {'MB/step':>8} "
             f"{'GB/s':>6} {'% read':>7} "
             f"{'roofline ITL':>12} {'step read':>9} {'% step':>6}"
             + (f" {peer + ' TTFT':>14} {'ratio':>6} {peer + ' ITL':>13} {'ratio':>6}" if _has_peer(rep) else "")]
    for r in rep.contexts:
        line = (f"{r.context_tokens:>8} {r.ttft_ms:>9.1f} {_itl_ms(r, rep):>8.2f} {r.itl_p90_ms:>8.2f} "
                f"{r.decode_bytes_per_step / 1e6:>8.1f} {r.achieved_gb_per_s:>6.1f} "
                f"{100 * _read_share(r, rep):>6.0f}% {r.roofline_itl_ms:>9.2f} ms")
        line += (f" {r.step_read_gb_per_s:>9.1f} {100 * r.achieved_gb_per_s / r.step_read_gb_per_s:>5.0f}%"
                 if r.step_read_gb_per_s else f" {'-':>9} {'-':>6}")
        if r.peer_itl_p50_ms is not None:
            line += (f" {r.peer_ttft_ms:>14.1f} {r.ttft_ms / r.peer_ttft_ms:>5.2f}x {r.peer_itl_p50_ms:>13.2f} "
                     f"{_itl_ms(r, rep) / r.peer_itl_p50_ms:>5.2f}x")
        lines.append(line)
    rounds = max((r.rounds for r in rep.contexts), default=1)
    if rounds > 1:
        reads = rep.read_rounds_gb_per_s
        lines.append(f"  medians of {rounds} rounds (plain read {min(reads):.1f}-{max(reads):.1f} GB/s; % read against "
                     f"each round's own); {'TPOT' if burst else 'ITL p50'} per round: "
                     + "; ".join(f"{r.context_tokens}: " + " ".join(
                         f"{v:.2f}" for v in (r.itl_mean_rounds_ms if burst else r.itl_p50_rounds_ms))
                         for r in rep.contexts))
        if _has_peer(rep):
            lines.append(f"  {peer} ITL p50 per round: " + "; ".join(
                f"{r.context_tokens}: " + " ".join(f"{v:.2f}" for v in r.peer_itl_p50_rounds_ms) for r in rep.contexts))
    slope = kv_slope_gb_per_s(rep)
    if burst:
        lines.append(f"  TPOT: mean gap between tokens; tokens leave in bursts of up to {rep.num_scheduler_steps} "
                     "(ITL p50 ~0 inside a burst; ITL p90 a gap between bursts while bursts are under ~10 tokens,"
                     " ~0 for longer ones); MB/step: per forward pass")
    lines += ["  GB/s: bytes ÷ wall time of the decode-only steps (≈ MB/step ÷ mean ITL); "
              "% read: of the plain read (1 GiB, from DRAM); roofline ITL: MB/step at the plain read",
              "  step read: GB/s of a plain read of a buffer of one step's bytes, read again and again (from the cache",
              "  where they fit, so it can beat the plain read); % step: GB/s as a share of it"]
    if slope is not None:
        lines.append(f"  ITL slope over context: extra KV bytes ÷ extra ITL = {slope:.1f} GB/s "
                     f"(plain read {rep.read_gb_per_s:.1f} GB/s; equal = attention time grows with KV bytes ÷ bandwidth)")
    if rep.throughput:
        how = f"temperature {rep.temperature:g}" if rep.temperature else "greedy"
        lines += ["", f"concurrency ({how}, ignore_eos; roofline: decode-only steps at the plain read, steps "
                  "with prefill as measured):",
                  f"{'requests':>8} {'prompt':>7} {'output':>7} {'wall s':>7} {'out tok/s':>10} {'vs batch 1':>10} "
                  f"{'mean TTFT':>10} {'mean ITL':>9} {'roofline tok/s':>15} {'vs batch 1':>10}"]
        one = next((t for t in rep.throughput if t.concurrency == 1), None)  # no batch-1 run: no ratios
        base = one.output_tokens_per_s if one else None
        roof_base = one.roofline_tokens_per_s if one else None
        ratio = lambda v, b: f"{v / b:>9.2f}x" if b else f"{'-':>10}"  # noqa: E731
        for t in rep.throughput:
            line = (f"{t.concurrency:>8} {t.prompt_tokens:>7} {t.output_tokens:>7} {t.wall_s:>7.2f} "
                    f"{t.output_tokens_per_s:>10.1f} {ratio(t.output_tokens_per_s, base)} "
                    f"{t.mean_ttft_ms:>8.1f} ms {t.mean_itl_ms:>6.2f} ms")
            if t.roofline_tokens_per_s is not None:
                line += f" {t.roofline_tokens_per_s:>15.1f} {ratio(t.roofline_tokens_per_s, roof_base)}"
            lines.append(line)
        conc_rounds = max(t.rounds for t in rep.throughput)
        if conc_rounds > 1:
            lines.append(f"  medians of {conc_rounds} rounds, each column its own; the ratios are of the medians; "
                         "out tok/s per round: " + "; ".join(
                             f"{t.concurrency}: " + " ".join(f"{v:.1f}" for v in t.tokens_per_s_rounds)
                             for t in rep.throughput))
    return "\n".join(lines)


def _itl_ms(r: ContextResult, rep: LatencyReport) -> float:
    """The row's per-token figure: its ITL p50, or with multi-step bursts its mean ITL (TPOT)."""
    return r.itl_mean_ms if rep.num_scheduler_steps > 1 else r.itl_p50_ms


def _read_share(r: ContextResult, rep: LatencyReport) -> float:
    """Achieved ÷ plain read: the row's own (median of its rounds' shares) or, without one, against
    the report's read."""
    return r.read_share if r.read_share is not None else r.achieved_gb_per_s / rep.read_gb_per_s


def kv_slope_gb_per_s(rep: LatencyReport) -> float | None:
    """Extra bytes per step ÷ extra ITL between the shortest and longest context (GB/s): the rate at
    which decode reads the added KV cache. None with fewer than two contexts or no ITL growth."""
    if len(rep.contexts) < 2:
        return None
    lo, hi = min(rep.contexts, key=lambda r: r.context_tokens), max(rep.contexts, key=lambda r: r.context_tokens)
    dt = (_itl_ms(hi, rep) - _itl_ms(lo, rep)) / 1e3
    return (hi.decode_bytes_per_step - lo.decode_bytes_per_step) / dt / 1e9 if dt > 0 else None


def _has_peer(rep: LatencyReport) -> bool:
    return any(r.peer_itl_p50_ms is not None for r in rep.contexts)


def save_json(rep: LatencyReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(rep), f, indent=2)
