"""``kvserve bench`` sub-commands."""
from __future__ import annotations

import argparse


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_bench_parser(sub) -> None:
    from kvserve.cli import add_engine_args

    b = sub.add_parser("bench", help="benchmarks beside the roofline / a peer")
    bsub = b.add_subparsers(dest="bench", required=True)
    lat = bsub.add_parser("latency", help="batch-1 TTFT/ITL at several contexts; throughput under concurrency")
    lat.add_argument("--contexts", type=_ints, default=[128, 1024, 4096], help="prompt lengths, e.g. 128,1024,4096")
    lat.add_argument("--output-tokens", type=int, default=32, help="tokens generated per batch-1 run")
    lat.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    lat.add_argument("--concurrency-prompt-tokens", type=int, default=128)
    lat.add_argument("--concurrency-output-tokens", type=int, default=64)
    lat.add_argument("--compare", choices=["hf"], default=None, help="run HF transformers on the same weights too")
    lat.add_argument("--json", default=None, help="also write the figures to this JSON file")
    add_engine_args(lat)
    lat.set_defaults(func=cmd_bench_latency)


def cmd_bench_latency(a: argparse.Namespace) -> int:
    from kvserve.bench.latency import format_report, run_latency_bench, save_json
    from kvserve.cli import build_llm

    llm = build_llm(a)
    rep = run_latency_bench(llm, a.contexts, a.output_tokens, a.concurrency, a.concurrency_prompt_tokens,
                            a.concurrency_output_tokens, compare_hf=a.compare == "hf")
    print(format_report(rep))
    if a.json:
        save_json(rep, a.json)
    return 0
