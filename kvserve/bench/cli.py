"""``kvserve bench`` sub-commands."""
from __future__ import annotations

import argparse


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:  # an empty list ran nothing and printed an empty table, or none
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _temperature(text: str) -> float:
    """argparse type: a sampling temperature in SamplingParams' range [0, TEMPERATURE_MAX]."""
    from kvserve.sampling_params import TEMPERATURE_MAX

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= TEMPERATURE_MAX:
        raise argparse.ArgumentTypeError(f"must be in [0, {TEMPERATURE_MAX:g}], got {text}")
    return value


def add_bench_parser(sub) -> None:
    from kvserve.cli import add_engine_args, int_at_least

    b = sub.add_parser("bench", help="benchmarks beside the roofline / a peer")
    bsub = b.add_subparsers(dest="bench", required=True)
    lat = bsub.add_parser("latency", help="batch-1 TTFT/ITL at several contexts; throughput under concurrency")
    lat.add_argument("--contexts", type=_ints, default=[128, 1024, 4096],
                     help="prompt lengths of the batch-1 runs, each run once if listed twice (default: 128,1024,4096)")
    lat.add_argument("--output-tokens", type=int_at_least(2), default=32,
                     help="tokens generated per batch-1 run (>= 2: ITL needs a decode step; default: 32)")
    lat.add_argument("--concurrency", type=_ints, default=[1, 4, 16],
                     help="concurrent requests per throughput run, each run once if listed twice; include 1 for "
                          "the 'vs batch 1' ratios (default: 1,4,16)")
    lat.add_argument("--concurrency-prompt-tokens", type=int_at_least(1), default=128,
                     help="prompt length of each concurrent request (default: 128)")
    lat.add_argument("--concurrency-output-tokens", type=int_at_least(1), default=64,
                     help="tokens each concurrent request generates (default: 64)")
    lat.add_argument("--compare", choices=["hf", "llama.cpp"], default=None,
                     help="run a peer on the same weights too: HF transformers, or llama.cpp (llama-cpp-python, "
                          "the optional 'bench' extra)")
    lat.add_argument("--temperature", type=_temperature, default=0.0,
                     help="sampling temperature of every run, in [0, 2] (default 0: greedy); above 0 the whole "
                          "distribution is sampled (no top-k/top-p), so the sampler's cost is in the ITL; the "
                          "llama.cpp peer samples the same way")
    lat.add_argument("--repeats", type=int_at_least(1), default=1,
                     help="rounds (>= 1), each running the plain read, the contexts, the concurrency runs and the "
                          "peer; every column is reported as its median over the rounds, each round's %% read "
                          "against its own plain read: for hosts whose bandwidth moves with other tenants' load "
                          "(default: 1; use an odd count)")
    lat.add_argument("--json", default=None, help="also write the figures to this JSON file")
    add_engine_args(lat)
    lat.set_defaults(func=cmd_bench_latency)
    pre = bsub.add_parser("prefix", help="TTFT of requests sharing a system prompt, prefix caching on vs off")
    pre.add_argument("--num-requests", type=int_at_least(1), default=16)
    pre.add_argument("--system-tokens", type=int, default=1000)
    pre.add_argument("--question-tokens", type=int, default=24)
    pre.add_argument("--output-tokens", type=int, default=4)
    add_engine_args(pre)
    pre.set_defaults(func=cmd_bench_prefix)
    spec = bsub.add_parser("spec", help="batch-1 speed with and without speculation (n-gram, or "
                                        "--draft-model), copy-heavy and chat")
    spec.add_argument("--output-tokens", type=int_at_least(2), default=96)
    spec.add_argument("--temperature", type=_temperature, default=0.0,
                      help="sampling temperature of both runs, in [0, 2] (default 0: greedy); above 0 the "
                           "speculative run verifies by rejection sampling")
    spec.add_argument("--top-p", type=float, default=1.0, help="top-p of both runs when sampling (default 1: off)")
    spec.add_argument("--min-p", type=float, default=0.0, help="min-p of both runs when sampling (default 0: off)")
    spec.add_argument("--seed", type=int, default=0, help="each request's seed when sampling (default 0)")
    add_engine_args(spec, multi_step=False)
    spec.set_defaults(func=cmd_bench_spec)
    _add_serve_parser(bsub)


def _slo(text: str) -> tuple[str, float]:
    from kvserve.bench.serve import parse_slo

    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_serve_parser(bsub) -> None:
    s = bsub.add_parser("serve", help="HTTP load generator for an OpenAI-compatible server (vLLM bench serve metrics)",
                        description="Stream requests at Poisson arrivals to a running server and report TTFT, TPOT, "
                                    "ITL, E2E latency, throughput and goodput (see kvserve/bench/serve.py).")
    s.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    s.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    s.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean arrivals per second of a Poisson process; inf sends all at once")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: unlimited)")
    s.add_argument("--input-tokens", type=int, default=128, help="prompt length (words ~ tokens; exact with token-ids)")
    s.add_argument("--output-tokens", type=int, default=64, help="max_tokens of each request (ignore_eos)")
    s.add_argument("--prompt-format", choices=["words", "token-ids"], default="words",
                   help="random words (any endpoint) or token-id lists (/v1/completions, exact length)")
    s.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    s.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (e2e is accepted for e2el)")
    s.add_argument("--save-result", default=None, metavar="PATH", help="write config, metrics and requests as JSON")
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--timeout-s", type=float, default=600.0, help="per-request HTTP timeout")
    s.set_defaults(func=cmd_bench_serve)


def _is_dummy(model: str, load_format: str) -> bool:
    from kvserve.models.catalog import resolve_model

    try:
        return resolve_model(model, load_format).kind == "dummy"
    except ValueError:  # unreadable model: building the engine reports it
        return False


def cmd_bench_latency(a: argparse.Namespace) -> int:
    import importlib.util

    from kvserve.bench.latency import format_report, run_latency_bench, save_json
    from kvserve.cli import build_llm, check_writable
    from kvserve.config import ConfigError

    if a.compare == "hf" and importlib.util.find_spec("accelerate") is None:  # check before minutes of benchmarking
        raise ConfigError("--compare hf needs HF transformers' GGUF loading, which needs accelerate: "
                          "`make setup-test` (or `.venv/bin/pip install -e '.[hf]'`)")
    if a.compare == "hf" and a.temperature:
        raise ConfigError("--temperature with --compare hf: the HF peer decodes greedily; use --compare llama.cpp "
                          "or temperature 0")
    if a.compare and (a.load_format == "dummy" or _is_dummy(a.model, a.load_format)):
        raise ConfigError(f"--compare {a.compare} needs real weights (a GGUF file or HF directory, "
                          f"llama.cpp: a GGUF file), not the dummy model {a.model!r}")
    if a.compare == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
        raise ConfigError("--compare llama.cpp needs llama-cpp-python: `make setup-bench` "
                          "(it compiles llama.cpp from source, about 6-15 minutes)")

    if a.json:  # before minutes of benchmarking, not after
        check_writable("--json", a.json)
    llm = build_llm(a)
    rep = run_latency_bench(llm, a.contexts, a.output_tokens, a.concurrency, a.concurrency_prompt_tokens,
                            a.concurrency_output_tokens, compare=a.compare, temperature=a.temperature,
                            repeats=a.repeats)
    print(format_report(rep))
    if a.json:
        save_json(rep, a.json)
    return 0


def cmd_bench_serve(a: argparse.Namespace) -> int:
    import os
    import sys

    from kvserve.bench.serve import ServeBenchConfig, format_report, run_serve_bench, save_result, validate_config
    from kvserve.cli import check_writable
    from kvserve.config import ConfigError

    if a.save_result:  # before the whole run, not after
        check_writable("--save-result", a.save_result)
    cfg = ServeBenchConfig(url=a.url, endpoint=a.endpoint, model=a.model, num_prompts=a.num_prompts,
                           request_rate=a.request_rate, max_concurrency=a.max_concurrency,
                           input_tokens=a.input_tokens, output_tokens=a.output_tokens, seed=a.seed,
                           prompt_format=a.prompt_format, goodput_ms=dict(a.goodput),
                           api_key=a.api_key or os.environ.get("OPENAI_API_KEY"), timeout_s=a.timeout_s)
    try:  # as a ConfigError, so that the CLI names the flags (--num-prompts, not num_prompts)
        validate_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        res = run_serve_bench(cfg)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    if a.save_result:
        save_result(res, a.save_result)
    if not res.metrics.completed:  # a table of zeros says nothing: say why, as vLLM's failed test run does
        why = "; ".join(f"{n} x {msg}" for msg, n in list(res.metrics.errors.items())[:3])
        unreached = all(msg.startswith(("ConnectError", "ConnectTimeout")) for msg in res.metrics.errors)
        print(f"kvserve: error: none of the {cfg.num_prompts} requests to {cfg.url} completed ({why})"
              + ("; is a server running there?" if unreached else ""), file=sys.stderr)
        return 1
    print(format_report(res))
    return 0


def cmd_bench_prefix(a: argparse.Namespace) -> int:
    from kvserve.bench.prefix import format_prefix, run_prefix
    from kvserve.cli import build_llm

    results = {}
    for caching in (True, False):
        a.enable_prefix_caching = caching
        llm = build_llm(a, progress=caching)
        results[caching] = run_prefix(llm, a.num_requests, a.system_tokens, a.question_tokens, a.output_tokens)
        del llm
    print(format_prefix(results[True], results[False], a.system_tokens))
    return 0


def cmd_bench_spec(a: argparse.Namespace) -> int:
    from kvserve.bench.spec import CHAT_PROMPTS, COPY_PROMPTS, format_spec, run_workload
    from kvserve.cli import build_llm
    from kvserve.sampling_params import SamplingParams

    if a.speculative_method is None:  # bench spec picks the method: the draft model when one is given
        a.speculative_method = "draft" if a.draft_model else "ngram"
    # checked before the model loads (a bad --top-p is an error naming it)
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                            max_tokens=a.output_tokens)
    llm = build_llm(a)
    rows = [run_workload(llm, "copy", COPY_PROMPTS, a.output_tokens, a.num_speculative_tokens, params),
            run_workload(llm, "chat", CHAT_PROMPTS, a.output_tokens, a.num_speculative_tokens, params)]
    method = f"draft model {a.draft_model}" if a.speculative_method == "draft" else "n-gram"
    print(format_spec(rows, a.num_speculative_tokens, method, params))
    return 0
