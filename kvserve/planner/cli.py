"""``kvserve plan | explain | probe`` sub-commands."""
from __future__ import annotations

import argparse
import json
import sys


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


# the engine's dtype names (generate/bench/serve) as the planner's short ones
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def _plan_dtype(text: str) -> str:
    from kvserve.planner.shapes import DTYPE_BYTES

    name = _DTYPE_ALIASES.get(text, text)
    if name not in DTYPE_BYTES or len(name) > 4:
        known = sorted(k for k in DTYPE_BYTES if len(k) <= 4) + sorted(_DTYPE_ALIASES)
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; one of {', '.join(known)}")
    return name


def add_planner_parsers(sub) -> None:
    p = sub.add_parser("plan", help="predict TTFT, ITL and E2E of a model on hardware (roofline)")
    p.add_argument("--model", default=None, help="table name, HF config.json / directory, or .gguf (default "
                   "llama-3-70b; on --hardware local the bundled smollm2-135m)")
    p.add_argument("--hardware", default="h100-sxm", help="a100-80gb-sxm, h100-sxm, h100-pcie, h200, b200, "
                   "mi300x, l40s, or local (after `kvserve probe`)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel GPUs: they must split the attention heads, the KV heads (or be a "
                   "multiple of them) and the MLP width evenly, as vLLM requires (default: the fewest of 1, 2, 4, 8 "
                   "that do and whose usable memory holds the weights and the workload's KV cache; 1 on "
                   "--hardware local)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="default 8192, or the longest prompt the model's context length leaves room for "
                   "with --output-tokens")
    p.add_argument("--output-tokens", type=int, default=250)
    p.add_argument("--batch", type=int, default=1,
                   help="concurrent sequences decoding together (with more than 1, a second TTFT: the last of "
                        "them when they all arrive together, the done ones decoding meanwhile; assumes the engine "
                        "runs them all at once: max_num_seqs >= batch, no preemption)")
    p.add_argument("--weight-dtype", default=None, type=_plan_dtype,
                   help="fp32|bf16|fp16|fp8|int8|int4 (or float32, bfloat16, fp8_e4m3 ...); default bf16, on "
                   "--hardware local what `kvserve generate` runs: a GGUF's Q4_0/Q4_1 matrices as int4 and "
                   "Q8_0 as int8, the rest fp32 (the bundled model: int4 with an int8 LM head); fp32 without "
                   "a GGUF")
    p.add_argument("--kv-dtype", default=None, type=_plan_dtype,
                   help="as --weight-dtype; default bf16, on --hardware local fp32 (the engine's default, the "
                   "float32 compute dtype)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="prefill chunk (max_num_batched_tokens); 0 = one step; default 0, on --hardware local "
                   "the engine's own max_num_batched_tokens (2048)")
    p.add_argument("--tokenize-ms", type=float, default=0.0, help="measured tokenization time to add")
    p.add_argument("--queue-ms", type=float, default=0.0,
                   help="measured queueing time to add to TTFT (not to --batch's arrive-together TTFT, which "
                        "models that batch's own queueing)")
    p.add_argument("--network-ms", type=float, default=0.0, help="measured network/detokenize time to add")
    p.add_argument("--spec-acceptance", type=float, default=None, help="speculative decoding: acceptance rate α")
    p.add_argument("--spec-tokens", type=int, default=4, help="speculative decoding: draft length γ")
    p.add_argument("--draft-model", default=None, help="draft model for speculative decoding (its cost is added)")
    p.add_argument("--json", action="store_true", help="print one JSON object (with --sweep: its rows, and a PNG "
                   "only if --plot names one)")
    p.add_argument("--sweep", choices=["context", "batch"], default=None, help="table + PNG over context or batch")
    p.add_argument("--plot", default=None, help="PNG path for --sweep (default plan-<model>-<axis>.png)")
    p.set_defaults(func=cmd_plan)

    e = sub.add_parser("explain", help="measured vs predicted TTFT/ITL here, at several contexts")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.add_argument("--contexts", type=_ints, default=[128, 1024, 4096])
    e.add_argument("--output-tokens", type=int, default=32)
    e.add_argument("--probe", action="store_true", help="re-run `kvserve probe` first (same sitting)")
    e.add_argument("--probe-overhead-generic", action="store_true",
                   help="use the saved probe's per-layer overhead (width-64 tiny model) instead of re-measuring it "
                        "at this model's head shapes")
    e.add_argument("--plot", default="explain-itl.png", help="PNG of ITL vs context ('' = none)")
    e.add_argument("--json", default=None, help="also write the rows to this JSON file")
    e.set_defaults(func=cmd_explain)

    pr = sub.add_parser("probe", help="measure this machine's bandwidth, FLOP/s and engine overhead")
    pr.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="dtype `local` plans with where a plan does not choose (plan: float32 rates for fp32 "
                         "weights, bfloat16 otherwise)")
    pr.add_argument("--no-engine", action="store_true", help="skip the engine overhead measurement")
    pr.add_argument("--output", default=None, help="JSON path (default $KVSERVE_CACHE_DIR/probe.json)")
    pr.set_defaults(func=cmd_probe)


def _resolve(a: argparse.Namespace):
    from kvserve.config import ConfigError
    from kvserve.planner.cost import Workload, tp_split_error
    from kvserve.planner.hardware import efficiency_for, get_hardware
    from kvserve.planner.models import get_model

    local = a.hardware.lower() == "local"
    if a.draft_model and a.spec_acceptance is None:
        raise ConfigError("--draft-model enters only the speculative estimate, which needs --spec-acceptance "
                          "(the acceptance rate α, 0-1); give both or neither")
    if a.spec_acceptance is not None and not 0 <= a.spec_acceptance <= 1:
        raise ConfigError(f"--spec-acceptance is an acceptance rate in [0, 1], got {a.spec_acceptance}")
    if not 1 <= a.spec_tokens <= 16:  # the engine's --num-speculative-tokens range
        raise ConfigError(f"--spec-tokens must be in [1, 16], as the engine takes, got {a.spec_tokens}")
    for flag, value in (("--tp", a.tp), ("--batch", a.batch)):  # named here: Workload says tp, batch
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if local and a.tp not in (None, 1):
        raise ConfigError(f"--hardware local plans this one machine, which kvserve runs without tensor "
                          f"parallelism; --tp must be 1, got {a.tp}")
    model = a.model or ("smollm2-135m" if local else "llama-3-70b")
    per_param, note = 0.0, ""
    if local and a.weight_dtype is None:  # what `generate --model <the same>` keeps (weight_dtype auto)
        a.weight_dtype, per_param, note = _engine_weights(model)
    a.weight_dtype = a.weight_dtype or "bf16"
    a.kv_dtype = a.kv_dtype or ("fp32" if local else "bf16")  # local: the engine's float32 compute dtype
    if a.chunk_tokens is None:  # local: the chunks `generate` and `serve` prefill in
        from kvserve.config import SchedulerConfig

        a.chunk_tokens = SchedulerConfig.max_num_batched_tokens if local else 0
    a.model = model
    shape = get_model(a.model)
    if a.tp is not None and a.tp >= 1 and (why := tp_split_error(shape, a.tp)):
        raise ConfigError(f"--tp {a.tp} {why}: tensor parallelism gives each GPU an equal share of the heads "
                          f"and the MLP (vLLM requires it too)")
    a.draft_shape = draft = _draft_shape(a)  # resolved once: the fit, the GPU count and the estimate use it
    if draft is not None and draft.vocab_size != shape.vocab_size:
        raise ConfigError(f"draft model {draft.name}: its vocabulary ({draft.vocab_size}) differs from "
                          f"{shape.name}'s ({shape.vocab_size}); a draft must share the target's tokenizer")
    if a.prompt_tokens is None:  # a request the engine would accept (prompt + output <= context length)
        a.prompt_tokens = max(min(8192, shape.max_position_embeddings - a.output_tokens), 1)
    tp = 1 if a.tp is None else a.tp  # not given: 1 here, the fewest GPUs that hold it below (not on local)
    w = Workload(a.prompt_tokens, a.output_tokens, a.batch, tp, a.weight_dtype, a.kv_dtype, a.chunk_tokens,
                 a.tokenize_ms, a.queue_ms, a.network_ms, weight_bytes_per_param=per_param,
                 weight_note=note).validate()
    if local:  # this machine's rates for the dtype the engine would compute in (packed weights: bf16)
        from dataclasses import replace

        from kvserve.models.quant import MKLDNN_BF16
        from kvserve.planner.probe import load_probe

        probe = load_probe()
        # where oneDNN has no bf16 (an AVX2 CPU) packed weights run on kvserve's AVX2 kernels (int8 or
        # float32 sums, no bf16 copy): the float32 rates are the closer stand-in (Zen 2's probe: bf16
        # matmul 0.3 GFLOP/s against 64 for float32, and an int4 plan 100x too slow on the bf16 ones)
        packed_f32 = w.weight_dtype in ("int4", "int8") and not MKLDNN_BF16
        compute = "float32" if w.weight_dtype == "fp32" or packed_f32 else "bfloat16"
        if compute in probe.gemv_bytes_per_s and compute in probe.matmul_flops and compute in probe.kv_read_bytes_per_s:
            probe = replace(probe, dtype=compute)
        return shape, probe.hardware(), probe.efficiency(), w
    hw = get_hardware(a.hardware)
    if a.tp is None:
        w = _fewest_gpus(shape, hw, w, draft)
    return shape, hw, efficiency_for(hw), w


def _draft_shape(a: argparse.Namespace):
    """The --draft-model's shape, or None; ConfigError naming the flag for a model it cannot find."""
    from kvserve.config import ConfigError
    from kvserve.planner.models import get_model

    if not a.draft_model:
        return None
    try:
        return get_model(a.draft_model)
    except ConfigError as e:
        raise ConfigError(f"--draft-model: {e}") from None


AUTO_TP = (1, 2, 4, 8)  # the tensor-parallel sizes `plan` tries when --tp is not given


def _fewest_gpus(shape, hw, w, draft=None):
    """``w`` on the fewest GPUs of AUTO_TP that divide the attention heads (as vLLM requires of
    tensor_parallel_size) and whose usable memory holds its weights and KV cache, and a ``draft`` model's
    beside them (:func:`kvserve.planner.cost.capacity`), with a note saying so; on the largest such size
    if none does."""
    from dataclasses import replace

    from kvserve.planner.cost import GPU_MEMORY_UTILIZATION, capacity, tp_split_error

    sizes = [tp for tp in AUTO_TP if tp_split_error(shape, tp) is None]
    heads = "" if sizes == list(AUTO_TP) else \
        f" (of {', '.join(map(str, AUTO_TP))}, those that split its heads and MLP evenly)"
    held = "the weights and this workload's KV cache" + (" (and the draft model's)" if draft is not None else "")
    for tp in sizes:
        if capacity(shape, hw, replace(w, tp=tp), draft).fits:
            break
    else:
        most = sizes[-1]
        draft_alone = capacity(shape, hw, replace(w, tp=most), draft).draft_bytes
        if draft is not None and draft_alone > hw.memory_bytes * GPU_MEMORY_UTILIZATION:
            return replace(w, tp=most, tp_note=f"--tp not given: the draft model alone ({draft_alone / 1e9:,.2f} GB "
                           f"of weights and KV) exceeds one GPU's usable memory, and it runs unsharded: no GPU "
                           f"count holds it; planned on {most}")
        gpus = f"{most} GPUs{heads} hold" if most > 1 else f"1 GPU{heads} holds"
        return replace(w, tp=most, tp_note=f"--tp not given: not even {gpus} {held}; planned on {most}")
    what = f"{tp} GPUs, the fewest of {', '.join(map(str, sizes))}{heads} that hold" if tp > 1 else "1 GPU holds"
    return replace(w, tp=tp, tp_note=f"--tp not given: {what} {held}")


def _engine_weights(model: str) -> tuple[str, float, str]:
    """(weight dtype, bytes per parameter or 0 for the dtype's own, note) of what the engine runs for
    ``model`` by default: a GGUF (a path or a catalog name's bundled file) keeps its Q4_0/Q4_1 and Q8_0
    matrices packed, the rest float32; anything else (a preset, an HF directory) float32."""
    from kvserve.config import ConfigError
    from kvserve.models.catalog import resolve_model
    from kvserve.planner.models import gguf_auto_weights

    try:
        source = resolve_model(model if model.lower().endswith(".gguf") else model.lower())
    except ConfigError:
        return "fp32", 0.0, ""
    if source.kind != "gguf":
        return "fp32", 0.0, ""
    kind, per_param, counts = gguf_auto_weights(source.path, float_bytes=4.0)
    if "," not in counts:  # one kind throughout: the dtype's own size
        return {"float": "fp32"}.get(kind, kind), 0.0, ""
    return {"float": "fp32"}.get(kind, kind), per_param, f"GGUF as kept: {counts}"


def _spec(a, shape, hw, eff, w, p) -> dict | None:
    """Speculative-decoding estimate (Leviathan et al. 2023) when --spec-acceptance is given."""
    if a.spec_acceptance is None:
        return None
    from dataclasses import asdict, replace

    from kvserve.planner.cost import decode_step, prefill_steps, step_cost
    from kvserve.planner.spec_decode import SpecDecodeEstimate, speculative_itl

    ctx = w.prompt_tokens + w.output_tokens / 2
    g = a.spec_tokens
    verify = step_cost(shape, hw, eff, w, w.batch * (g + 1), [ctx] * w.batch,
                       w.batch * (g + 1) * shape.decode_attention_flops(int(ctx)), w.batch * (g + 1)).time_s * 1e3
    draft, draft_prefill = 0.0, 0.0
    if a.draft_model:  # on one GPU; it also prefills the prompt (into its own KV cache) before the first draft
        draft_shape = a.draft_shape
        draft = decode_step(draft_shape, hw, eff, replace(w, tp=1), ctx).time_s * 1e3
        if w.output_tokens > 1:  # a draft runs only for the tokens after the first, which the prefill gives
            draft_prefill = sum(s.time_s for s in prefill_steps(draft_shape, hw, eff, replace(w, tp=1))) * 1e3
    # no decode step runs for 0 or 1 output tokens: nothing to speculate on, no speed-up
    est = (speculative_itl(p.itl_ms, verify, draft, a.spec_acceptance, g) if w.output_tokens > 1
           else SpecDecodeEstimate(1.0, p.itl_ms, p.itl_ms, 1.0))
    # E2E as the plan's, with the draft's prefill added and the speculative mean ITL for the plain one
    e2e = p.ttft_ms + draft_prefill + max(w.output_tokens - 1, 0) * est.itl_ms + w.network_ms
    return {"acceptance_rate": a.spec_acceptance, "num_speculative_tokens": g, "draft_model": a.draft_model} \
        | asdict(est) | {"draft_step_ms": draft, "draft_prefill_ms": draft_prefill, "verify_step_ms": verify,
                         "e2e_ms": e2e, "decode_steps": w.output_tokens > 1}


def cmd_plan(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvserve.planner.cost import plan
    from kvserve.planner.report import format_plan, format_sweep, plan_dict, plot_sweep, sweep

    from kvserve.cli import check_writable

    shape, hw, eff, w = _resolve(a)
    draft_shape = a.draft_shape
    if a.sweep and (a.plot or not a.json):
        check_writable("--plot", a.plot or f"plan-{shape.name}-{a.sweep}.png")
    if a.sweep:
        rows = sweep(shape, hw, eff, w, a.sweep, draft_shape)
        row_w = [replace(w, **({"prompt_tokens": x} if a.sweep == "context" else {"batch": x})) for x, _ in rows]
        specs = [_spec(a, shape, hw, eff, wx, p) for wx, (_, p) in zip(row_w, rows)]  # None without --spec-acceptance
        if a.json:  # one JSON object: the axis and each row's plan; a PNG only where --plot asks for one
            print(json.dumps({"axis": a.sweep, "rows": [
                {a.sweep: x} | plan_dict(p, shape, hw, wx) | ({"speculative": sp} if sp else {})
                for (x, p), wx, sp in zip(rows, row_w, specs)]}))
            if not a.plot:
                return 0
        else:
            spec_note = None
            if a.spec_acceptance is not None:
                spec_note = (f"speculative (α={a.spec_acceptance}, γ={a.spec_tokens}, "
                             + (f"draft {a.draft_model})" if a.draft_model else "drafting taken as free)"))
            print(format_sweep(rows, a.sweep, shape, hw, w, [sp["itl_ms"] for sp in specs] if specs[0] else None,
                               spec_note))
        path = a.plot or f"plan-{shape.name}-{a.sweep}.png"
        what = f"{shape.name} on {w.tp}× {hw.name}, weights {w.weight_dtype}, KV {w.kv_dtype}"
        plot_sweep(rows, a.sweep, f"{what}, batch {w.batch}" if a.sweep == "context"
                   else f"{what}, {w.prompt_tokens} prompt tokens", path)
        print(f"wrote {path}", file=sys.stderr)
        return 0
    p = plan(shape, hw, eff, w, draft_shape)
    spec = _spec(a, shape, hw, eff, w, p)
    if a.json:
        print(json.dumps(plan_dict(p, shape, hw, w) | ({"speculative": spec} if spec else {})))
        return 0
    print(format_plan(p, shape, hw, w))
    if spec and w.output_tokens <= 1:  # the prefill gives the only token: nothing to speculate on
        print(f"  speculative (α={a.spec_acceptance}, γ={a.spec_tokens}): no decode step runs for "
              f"{w.output_tokens} output token{'' if w.output_tokens == 1 else 's'}, so nothing to speculate; "
              f"E2E {spec['e2e_ms']:.1f} ms as above")
    elif spec:
        draft = (f"draft {a.draft_model}: {spec['draft_step_ms']:.2f} ms per step, its prefill "
                 f"{spec['draft_prefill_ms']:.1f} ms in the E2E" if a.draft_model
                 else "no --draft-model: drafting taken as free, as n-gram lookup nearly is")
        print(f"  speculative (α={a.spec_acceptance}, γ={a.spec_tokens}): {spec['tokens_per_step']:.2f} tokens/step, "
              f"ITL {spec['itl_ms']:.2f} ms, E2E {spec['e2e_ms']:.1f} ms, speed-up {spec['speedup']:.2f}× ({draft})")
        total, limit = w.prompt_tokens + w.output_tokens, draft_shape.max_position_embeddings if draft_shape else 0
        if draft_shape is not None and total > limit:
            print(f"  NOTE: the draft's context ({limit:,} tokens) ends before this request's {total:,}: past it the "
                  f"draft proposes nothing (kvserve and vLLM alike) and decoding runs at the plain ITL; the "
                  f"speculative figures assume proposals throughout")
    return 0


def cmd_probe(a: argparse.Namespace) -> int:
    from kvserve.planner.probe import format_probe, run_probe, save_probe

    res = run_probe(dtype=a.dtype, engine_overhead=not a.no_engine)
    print(format_probe(res))
    print(f"saved {save_probe(res, a.output)}", file=sys.stderr)
    return 0


def cmd_explain(a: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.planner.explain import format_explain, plot_explain, rows_as_dicts, run_explain
    from kvserve.planner.probe import load_probe, run_probe, save_probe

    from kvserve.cli import check_writable

    for flag, path in (("--plot", a.plot), ("--json", a.json)):
        if path:
            check_writable(flag, path)
    probe = run_probe(dtype=a.dtype) if a.probe else load_probe()
    if a.probe:
        save_probe(probe)
    probe.dtype = a.dtype
    # dense weights in the probed dtype: the probe measures float GEMVs, not the packed int4/int8 kernels
    llm = LLM(a.model, dtype=a.dtype, weight_dtype=a.dtype, max_model_len=max(a.contexts) + a.output_tokens + 16,
              progress=False)
    from kvserve.planner.probe import measure_engine_overhead, measure_model_gemv, measure_model_matmul
    probe.gemv_bytes_per_s[a.dtype] = measure_model_gemv(llm.engine.model)  # this model's own matrix shapes
    if not a.probe_overhead_generic:  # per-layer overhead at this model's head shapes
        probe.step_overhead_s, probe.overhead_per_layer_s = measure_engine_overhead(a.dtype, like=llm.engine.model_config)
    rates: dict[int, float] = {}

    def matmul_flops_at(rows: int) -> float:  # the model's own GEMMs at this chunk size, measured once
        if rows not in rates:
            rates[rows] = measure_model_matmul(llm.engine.model, rows)
        return rates[rows]

    rows = run_explain(llm, probe, a.contexts, a.output_tokens, matmul_flops_at)
    print(format_explain(rows, probe, llm.engine.model_name))
    if a.plot:
        print(f"wrote {plot_explain(rows, llm, probe, a.output_tokens, a.plot)}", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_as_dicts(rows), f, indent=2)
    return 0
