"""``kvserve eval ppl``: perplexity through the engine, optionally beside a reference KV dtype."""
from __future__ import annotations

import argparse
import json


def add_eval_parser(sub) -> None:
    from kvserve.cli import add_engine_args, int_at_least

    e = sub.add_parser("eval", help="quality measurements (perplexity, KV dtype comparison)")
    esub = e.add_subparsers(dest="eval", required=True)
    p = esub.add_parser("ppl", help="perplexity over CPython's pydoc_data text through the paged engine",
                        description="Perplexity over the English text of CPython's pydoc_data.topics, each window "
                                    "one request scored with prompt logprobs and prefilled in chunks of "
                                    "--max-num-batched-tokens (default 256 here) so later chunks read the cache.")
    p.add_argument("--context", type=int_at_least(2), default=2048, help="tokens per window (>= 2)")
    p.add_argument("--num-windows", type=int_at_least(1), default=1, help="consecutive windows of the text to score")
    p.add_argument("--compare-kv-dtype", default=None,
                   choices=["auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"],
                   help="also score with this KV dtype and report teacher-forced mean/max |Δ logprob|")
    p.add_argument("--compare-weight-dtype", default=None, choices=["auto", "float32", "bfloat16", "int8", "int4"],
                   help="also score with the matrices stored this way (e.g. float32 against --weight-dtype int4)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    add_engine_args(p, multi_step=False)  # it scores prompts and never decodes
    p.set_defaults(func=cmd_eval_ppl, max_num_batched_tokens=256)


def cmd_eval_ppl(a: argparse.Namespace) -> int:
    import gc

    from kvserve.cli import build_llm, check_writable
    from kvserve.config import ConfigError
    from kvserve.eval.ppl import compare, corpus_text, format_comparison, format_result, perplexity, windows

    a.enable_prefix_caching = False  # every window is scored in full, never served from another's blocks
    a.max_model_len = max(a.max_model_len, a.context + 1)
    if a.json:  # before the run, not after
        check_writable("--json", a.json)
    try:
        llm = build_llm(a)
    except ConfigError as e:  # max_model_len is set from --context above: say which flag set it
        if a.max_model_len == a.context + 1 and str(e).startswith("max_model_len"):
            raise ConfigError(f"--context {a.context}: {e}") from None
        if a.max_model_len == a.context + 1 and "max_model_len" in str(e):  # a KV pool sized for it
            raise ConfigError(f"{e} (here max_model_len is --context + 1: lower --context)") from None
        raise
    ids = windows(llm.tokenizer.encode(corpus_text(), add_special_tokens=False), a.context, a.num_windows)
    result = perplexity(llm, a.kv_cache_dtype, ids, a.weight_dtype)
    report: dict = {"test": _summary(result)}
    if a.compare_kv_dtype is None and a.compare_weight_dtype is None:
        print(format_result(result))
    else:
        del llm
        gc.collect()
        a.kv_cache_dtype = a.compare_kv_dtype or a.kv_cache_dtype
        a.weight_dtype = a.compare_weight_dtype or a.weight_dtype
        if a.weight_dtype in ("float32", "bfloat16"):
            a.dtype = a.weight_dtype  # float weights are multiplied in their own dtype
        ref = perplexity(build_llm(a, progress=False), a.kv_cache_dtype, ids, a.weight_dtype)
        c = compare(result, ref)
        print(format_comparison(c))
        report.update(reference=_summary(ref), mean_abs_delta=c.mean_abs_delta, p99_abs_delta=c.p99_abs_delta,
                      max_abs_delta=c.max_abs_delta)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _summary(r) -> dict:
    return {"kv_cache_dtype": r.kv_cache_dtype, "weight_dtype": r.weight_dtype, "ppl": r.ppl, "context": r.context, "num_windows": r.num_windows,
            "num_scored_tokens": r.num_scored_tokens}
