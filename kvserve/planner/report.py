"""Text, JSON and plot forms of a :class:`~kvserve.planner.cost.Plan`, and sweeps over context or batch."""
from __future__ import annotations

from dataclasses import asdict, replace

from kvserve.planner.cost import MAX_BATCH_PREFILL_ROWS, MAX_PREFILL_STEPS, Plan, StepCost, Workload, plan
from kvserve.planner.hardware import Efficiency, Hardware
from kvserve.planner.shapes import ModelShape

GPUS_PER_NODE = 8  # an HGX/DGX or MI300X platform: the GPUs one NVLink/xGMI domain joins


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def plan_dict(p: Plan, shape: ModelShape, hw: Hardware, w: Workload) -> dict:
    """The figures as one JSON-able object: ttft_ms, itl_ms, e2e_ms, the decode terms, fits, ...;
    ``notes``: what the text plan prints as NOTE lines about the GPUs (more than one node)."""
    d = p.decode_mean
    return {
        "model": shape.name, "hardware": hw.name, "workload": asdict(w),
        "ttft_ms": p.ttft_ms, "ttft_batch_ms": p.ttft_batch_ms, "itl_ms": p.itl_ms, "e2e_ms": p.e2e_ms,
        "itl_first_ms": p.decode_first.time_s * 1e3, "itl_last_ms": p.decode_last.time_s * 1e3,
        "terms": {**d.terms_ms(), "weight_bytes": d.weight_bytes, "kv_bytes": d.kv_bytes, "flops": d.flops},
        "bound": d.bound, "dominant": d.dominant,
        "prefill": {"num_steps": len(p.prefill), "flops": sum(s.flops for s in p.prefill),
                    "bound": p.prefill[-1].bound if p.prefill else None},
        # the batch's requests arriving together (ttft_batch_ms); num_steps 0 where not costed
        "prefill_batch": {"num_steps": len(p.batch_prefill), "flops": sum(s.flops for s in p.batch_prefill)},
        "kv_bytes_per_token": shape.kv_bytes_per_token(w.kv_dtype),
        "fits": p.capacity.fits, "capacity": asdict(p.capacity), "within_context": within_context(shape, w),
        "efficiency": asdict(p.efficiency),
        "notes": _multi_node_notes(w, hw),
    }


def _prefill_steps(p: Plan, w: Workload) -> str:
    """The first TTFT line's step count, with the chunk size where there is more than one step."""
    n = len(p.prefill)
    return "1 prefill step" if n == 1 else f"{n:,} prefill steps of up to {w.chunk_tokens:,} tokens"


def _batch_ttft_line(p: Plan, w: Workload) -> str:
    """The plan's second TTFT line: the last of ``w.batch`` requests that arrive together."""
    size = min(w.chunk_tokens or w.batch * w.prompt_tokens, w.batch * w.prompt_tokens)
    if p.ttft_batch_ms is None:
        return (f"  TTFT        n/a      for the last of {w.batch:,} requests arriving together: over "
                f"{MAX_PREFILL_STEPS:,} steps of up to {size:,} tokens (or over {MAX_BATCH_PREFILL_ROWS:,} "
                "prompt pieces and decodes in them), not costed")
    n = len(p.batch_prefill)
    return (f"  TTFT {p.ttft_batch_ms:10.1f} ms   for the last of {w.batch:,} requests arriving together "
            f"({n:,} step{'' if n == 1 else 's'} of up to {size:,} tokens, the done ones decoding meanwhile)")


def within_context(shape: ModelShape, w: Workload) -> bool:
    """prompt + output tokens fit the model's context length (the engine rejects a request past it)."""
    return w.prompt_tokens + w.output_tokens <= shape.max_position_embeddings


def _weights(w: Workload) -> str:
    """The weight dtype, and the bytes per weight where a mix overrides it."""
    if not w.weight_bytes_per_param:
        return w.weight_dtype
    return f"{w.weight_dtype} ({w.weight_note or 'a mix'}: {8 * w.weight_bytes_per_param:.2f} bits per weight read)"


def _provenance(e: Efficiency) -> str:
    if e.calibrated_on.startswith(("borrowed", "kvserve probe", "uncalibrated")):
        return f" ({e.calibrated_on})"
    return f" (fitted to {e.calibrated_on.count(',') + 1} public measurements)"


def _term_rows(d: StepCost) -> list[str]:
    t = d.terms_ms()
    total = d.time_s * 1e3
    rows = [f"    weights read   {_gb(d.weight_bytes):>12}  {t['weights_ms']:9.2f} ms",
            f"    KV read        {_gb(d.kv_bytes):>12}  {t['kv_ms']:9.2f} ms",
            f"    FLOPs          {d.flops / 1e12:>9.2f} TF  {t['compute_ms']:9.2f} ms"
            f"   ({'hidden under memory' if d.bound == 'memory' else 'the bound'})",
            f"    all-reduce                   {t['comm_ms']:9.2f} ms",
            f"    fixed overhead               {t['overhead_ms']:9.2f} ms",
            f"    = step                       {total:9.2f} ms   {_bound_words(d)}"]
    return rows


def _bound_words(d: StepCost) -> str:
    """What limits the step (``StepCost.limiter``): memory or compute (whichever of the two overlapped
    parts is longer, weights and KV together), or the all-reduce or the fixed overhead where that part
    outweighs them, with the overlapped part's bound beside it; and the largest single term."""
    if d.limiter in ("memory", "compute"):
        if d.dominant in ("weights", "kv", "compute"):
            return f"{d.bound}-bound; largest term: {d.dominant}"
        return f"{d.bound}-bound (weights + KV together; largest single term: {d.dominant})"
    name = {"comm": "all-reduce", "overhead": "fixed overhead"}[d.limiter]
    return f"{name}-bound (largest term: {d.limiter}; of memory vs compute: {d.bound})"


def format_plan(p: Plan, shape: ModelShape, hw: Hardware, w: Workload) -> str:
    c = p.capacity
    e = p.efficiency
    pre_flops = sum(s.flops for s in p.prefill)
    dev = "device" if hw.hardware_class == "local" else "GPU"  # local: this machine (a CPU here)
    draft = ""
    if c.draft_bytes:  # the draft runs unsharded on one of the tp devices: that one is the fullest
        draft = f" + draft model's weights and KV {_gb(c.draft_bytes)}"
        if w.tp > 1:
            draft += f" (on one {dev} of {w.tp})"
    lines = [
        f"kvserve plan — {shape.name} on {w.tp}× {hw.name}: weights {_weights(w)}, KV {w.kv_dtype}, "
        f"batch {w.batch}, {w.prompt_tokens:,} prompt + {w.output_tokens:,} output tokens",
        *([f"  {w.tp_note}"] if w.tp_note else []),
        *(f"  NOTE: {n}" for n in _multi_node_notes(w, hw)),
        *([f"  NOTE: {w.prompt_tokens + w.output_tokens:,} tokens exceed the model's context length "
           f"(max_position_embeddings {shape.max_position_embeddings:,}): the engine would reject this "
           f"request; figures extrapolated"] if not within_context(shape, w) else []),
        f"  TTFT {p.ttft_ms:10.1f} ms   ({_prefill_steps(p, w)}, {pre_flops / 1e12:.1f} TFLOP per {dev}, "
        f"{p.prefill[-1].bound}-bound)",
        *([_batch_ttft_line(p, w)] if w.batch > 1 else []),
        f"  ITL  {p.itl_ms:10.2f} ms   (mean; {p.decode_first.time_s * 1e3:.2f} at the first token, "
        f"{p.decode_last.time_s * 1e3:.2f} at the last)" if w.output_tokens > 1 else
        f"  ITL  {p.itl_ms:10.2f} ms   (if a decode step ran: none does for "
        + ("1 output token, which the prefill gives)" if w.output_tokens == 1 else "0 output tokens)"),
        f"  E2E  {p.e2e_ms:10.1f} ms   = TTFT + {max(w.output_tokens - 1, 0)} × ITL"
        + (f" + {w.network_ms:g} ms network" if w.network_ms else ""),
        f"  decode step at mean context {p.decode_mean.context_tokens / w.batch:,.0f} tokens, per {dev}:",
        *_term_rows(p.decode_mean),
        f"  memory per {dev}: weights {_gb(c.weight_bytes)} + KV {_gb(c.kv_bytes)}{draft} of {_gb(c.memory_bytes)} "
        f"usable → "
        f"{'fits' if c.fits else 'DOES NOT FIT'}; largest batch at this context: {c.max_batch}",
        f"  KV bytes per token {shape.kv_bytes_per_token(w.kv_dtype):,.0f} B; KV read passes weight read at "
        f"batch × context = {c.kv_exceeds_weights_tokens:,.0f} tokens",
        f"  efficiency of class {hw.hardware_class}{_provenance(e)}: bandwidth {e.bandwidth_efficiency:.2f}, FLOP/s "
        f"{e.flops_efficiency:.2f}, overhead {e.step_overhead_s * 1e3:.2f} ms/step, "
        f"all-reduce hop {e.allreduce_hop_latency_s * 1e6:.1f} µs",
    ]
    return "\n".join(lines)


SWEEP_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sweep(shape: ModelShape, hw: Hardware, eff: Efficiency, w: Workload, axis: str,
          draft: ModelShape | None = None) -> list[tuple[int, Plan]]:
    """Plans over prompt length (axis "context": the SWEEP_CONTEXTS up to the longest prompt the model's
    context length, ``max_position_embeddings``, leaves room for the output tokens, and that length
    itself if no step lands on it) or batch (axis "batch")."""
    if axis == "context":
        limit = max(shape.max_position_embeddings - w.output_tokens, 1)
        xs = [x for x in SWEEP_CONTEXTS if x <= limit]
        if not xs or (xs[-1] != limit and limit < SWEEP_CONTEXTS[-1]):
            xs.append(limit)
        return [(x, plan(shape, hw, eff, replace(w, prompt_tokens=x), draft)) for x in xs]
    return [(x, plan(shape, hw, eff, replace(w, batch=x), draft)) for x in SWEEP_BATCHES]


def _multi_node_notes(w: Workload, hw: Hardware) -> list[str]:
    """The note for more GPUs than one node holds (a list of one), or none: the text plan and sweep print
    it as a NOTE line, ``plan_dict`` lists it under ``notes``."""
    if w.tp <= GPUS_PER_NODE or hw.hardware_class == "local":
        return []
    return [f"{w.tp} GPUs span more than one node of {GPUS_PER_NODE}: the all-reduce is timed at "
            f"{hw.name}'s in-node link ({hw.interconnect_bytes_per_s / 1e9:,.0f} GB/s per GPU), but across nodes "
            f"it runs over the network (vLLM's docs advise pipeline parallelism across nodes)"]


def format_sweep(rows: list[tuple[int, Plan]], axis: str, shape: ModelShape, hw: Hardware, w: Workload,
                 spec_itl_ms: list[float] | None = None, spec_note: str | None = None) -> str:
    """The sweep as a table under a title line that names the model, hardware, dtypes and what is held
    fixed. Columns: the prompt length (context) or batch, TTFT (and, over batch or over context at a
    batch above 1, the TTFT of the last of the batch's requests arriving together) and ITL, the decode
    step's terms at the mean context (weights, KV, compute, comm, overhead; ms), output tokens/s, what
    bounds the step (``StepCost.limiter``, as in the single plan's step line), and whether weights + KV
    fit the usable memory; with ``spec_itl_ms`` (one per row) a last column of the mean ITL with speculative decoding,
    which ``spec_note`` describes."""
    held = (f"batch {w.batch}, {w.output_tokens:,} output tokens" if axis == "context"
            else f"{w.prompt_tokens:,} prompt + {w.output_tokens:,} output tokens")
    all_col = axis == "batch" or w.batch > 1  # a batch of more than one request has a TTFT of its last
    lines = [f"kvserve plan --sweep {axis} — {shape.name} on {w.tp}× {hw.name}: weights {_weights(w)}, "
             f"KV {w.kv_dtype}, {held}",
             *([f"  {w.tp_note} (at the base workload: batch {w.batch}, {w.prompt_tokens:,} prompt tokens; "
                "every row keeps it)"] if w.tp_note else []),
             *(f"  NOTE: {n}" for n in _multi_node_notes(w, hw)),
             "  decode step at each row's mean context, in ms per step (weights, KV, compute, comm, overhead); "
             "tok/s: output tokens per second of the whole batch",
             *(["  TTFT: one request alone (tokenize + queue + prefill); TTFT all: the last of the row's "
                "requests when they all arrive together, the done ones decoding meanwhile (ms; n/a: too many "
                "steps to cost)"] if all_col else []),
             f"{'prompt' if axis == 'context' else 'batch':>8} {'TTFT ms':>10}"
             + (f" {'TTFT all':>10}" if all_col else "")
             + f" {'ITL ms':>8} {'weights':>8} {'KV':>8} "
             f"{'compute':>8} {'comm':>6} {'overhead':>8} {'tok/s':>9} {'bound':>8} {'fits':>5}"
             + (f" {'spec ITL':>9}" if spec_itl_ms else "")]
    if spec_itl_ms:
        lines.insert(-1, f"  spec ITL: mean ITL in ms with {spec_note or 'speculative decoding'}")
    for i, (x, p) in enumerate(rows):
        t = p.decode_mean.terms_ms()
        batch = p.decode_mean.num_tokens
        lines.append(f"{x:>8} {p.ttft_ms:>10.1f}" + (f" {_ms(p.ttft_batch_ms):>10}" if all_col else "")
                     + f" {p.itl_ms:>8.2f} {t['weights_ms']:>8.2f} {t['kv_ms']:>8.2f} "
                     f"{t['compute_ms']:>8.2f} {t['comm_ms']:>6.2f} {t['overhead_ms']:>8.2f} "
                     f"{batch * 1e3 / p.itl_ms:>9.1f} {p.decode_mean.limiter:>8} "
                     f"{'yes' if p.capacity.fits else 'no':>5}"
                     + (f" {spec_itl_ms[i]:>9.2f}" if spec_itl_ms else ""))
    longest = replace(w, prompt_tokens=rows[-1][0]) if axis == "context" else w
    if not within_context(shape, longest):
        lines.append(f"  NOTE: {longest.prompt_tokens:,} prompt + {w.output_tokens:,} output tokens exceed the "
                     f"model's context length ({shape.max_position_embeddings:,}): the engine would reject them; "
                     f"figures extrapolated")
    if not all(p.capacity.fits for _, p in rows):
        draft = " (+ the draft's weights and KV on the device it runs on)" if rows[0][1].capacity.draft_bytes else ""
        lines.append(f"  fits = no: weights + KV per device{draft} exceed its usable memory (more --tp, or smaller "
                     "dtypes)")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def plot_sweep(rows: list[tuple[int, Plan]], axis: str, title: str, path: str) -> str:
    """ITL and its stacked terms vs ``axis`` (log x), written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x for x, _ in rows]
    terms = {k: [p.decode_mean.terms_ms()[k] for _, p in rows] for k in ("weights_ms", "kv_ms", "comm_ms", "overhead_ms")}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.stackplot(xs, *terms.values(), labels=[k.removesuffix("_ms") for k in terms], alpha=0.6)
    ax.plot(xs, [p.itl_ms for _, p in rows], "k.-", label="ITL (max(memory, compute) + comm + overhead)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens" if axis == "context" else "batch (concurrent sequences)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
