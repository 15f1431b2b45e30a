"""Command line: ``kvserve generate | chat | serve | bench | eval | plan | explain | probe``.

``generate`` streams an answer and then prints its latency anatomy; ``chat`` is an interactive
session; ``bench latency`` measures batch-1 TTFT/ITL at several contexts and throughput under
concurrency, beside a plain memory-read roofline and (``--compare hf``) HF transformers.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from kvserve.config import ConfigError
from kvserve.planner.probe import ProbeError
from kvserve.sampling_params import InvalidRequestError, SamplingParams


def add_engine_args(p: argparse.ArgumentParser, multi_step: bool = True) -> None:
    """The engine's flags; ``multi_step=False`` leaves out ``--num-scheduler-steps`` where it cannot
    apply: ``bench spec`` always speculates (which excludes multi-step scheduling), ``eval ppl`` never
    decodes."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default="smollm2-135m",
                   help="catalog name (smollm2-135m), .gguf file, HF directory, or dummy preset")
    g.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file, or the template's text) used instead of the model's; a model "
                        "without one (the bundled Gemma-3 GGUF) needs it to chat")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    g.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "int4"],
                   help="matrix storage: auto keeps a GGUF's Q4_0/Q4_1 (int4) and Q8_0 (int8) packed; "
                        "float32/bfloat16 dequantize (must equal --dtype)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache budget in bytes, e.g. 512MiB (default 1GiB)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache budget in blocks instead")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"],
                   help="KV cache storage; fp8/int8 keep 1 byte per value + a float32 scale per token and head")
    g.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: n-gram prompt lookup or a draft model")
    g.add_argument("--num-speculative-tokens", type=int, default=3, help="proposals verified per step (k)")
    g.add_argument("--draft-model", default=None, help="draft model for --speculative-method draft")
    g.add_argument("--draft-load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse KV blocks of equal prompt prefixes")
    g.add_argument("--max-model-len", type=int, default=0, help="context limit (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    if multi_step:
        g.add_argument("--num-scheduler-steps", type=int, default=1,
                       help="decode steps per engine step, 1-64 (multi-step scheduling: tokens leave in bursts; "
                            "default 1)")
    else:
        p.set_defaults(num_scheduler_steps=1)
    g.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the decoder layers (fewer per-op overheads; the first steps compile)")
    g.add_argument("--seed-engine", type=int, default=0, help=argparse.SUPPRESS)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=a.max_tokens, min_tokens=a.min_tokens, temperature=a.temperature,
                          top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty, seed=a.seed,
                          stop=a.stop, stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos)


def int_at_least(low: int):
    """argparse type: an integer >= ``low`` (the message names the bound; argparse adds the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def _port(text: str) -> int:
    """A TCP port, 1-65535, checked before the model loads (0, any free port, is refused: the banner and
    the logs would say :0, not the port bound)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer port, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def check_writable(flag: str, path: str) -> None:
    """ConfigError naming ``flag`` unless ``path`` could be created or overwritten as a file: checked
    before a long run, so a typo in an output path does not cost the run."""
    import os

    from kvserve.config import ConfigError

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path!r}: cannot write a file there (is the directory missing or read-only, "
                          "or is it a directory?)")


def build_llm(a: argparse.Namespace, progress: bool = True):
    from kvserve.llm import LLM

    return LLM(a.model, dtype=a.dtype, weight_dtype=a.weight_dtype, load_format=a.load_format, kv_cache_memory=a.kv_cache_memory,
               num_kv_blocks=a.num_kv_blocks, block_size=a.block_size, max_model_len=a.max_model_len,
               max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
               num_scheduler_steps=a.num_scheduler_steps, num_threads=a.threads, seed=a.seed_engine, progress=progress,
               enable_prefix_caching=a.enable_prefix_caching, kv_cache_dtype=a.kv_cache_dtype,
               speculative_method=a.speculative_method, num_speculative_tokens=a.num_speculative_tokens,
               draft_model=a.draft_model, draft_load_format=a.draft_load_format, compile=a.compile,
               chat_template=getattr(a, "chat_template", None))


def _weight_kinds(eng) -> str:
    kinds = {k: v for k, v in eng.weight_kinds.items() if v > 0}
    return "" if not kinds else " (matrices: " + ", ".join(f"{v} {k}" for k, v in kinds.items()) + ")"


def kv_dtype_name(spec) -> str:
    """The KV cache dtype as --kv-cache-dtype names it (fp8_e4m3, not float8_e4m3fn)."""
    from kvserve.attention.kv_quant import kind_of_dtype

    return kind_of_dtype(spec.dtype) or str(spec.dtype).removeprefix("torch.")


def model_header(llm) -> str:
    eng = llm.engine
    cfg = eng.model_config
    return (f"  model {eng.model_name}: {cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads "
            f"x {cfg.head_dim}, {str(eng.dtype).removeprefix('torch.')}{_weight_kinds(eng)}, weights {eng.weight_bytes_per_step / 1e6:.1f} MB "
            f"read per step\n  KV cache {kv_dtype_name(eng.kv_spec)}: "
            f"{eng.kv_spec.bytes_per_token:,} B/token{' (incl. float32 scales)' if eng.kv_spec.is_quantized else ''}, "
            f"{eng.num_kv_blocks} blocks x {eng.kv_spec.block_size} tokens{_window_note(eng.kv_spec)}"
            f"{_spec_note(eng.config.spec_decode)}{_multi_step_note(eng.config.scheduler.num_scheduler_steps)}")


def _multi_step_note(steps: int, sep: str = "\n  ") -> str:
    """The multi-step note of the header and of serve's startup line, after ``sep`` ('' at 1 step per
    engine step)."""
    return "" if steps == 1 else f"{sep}multi-step scheduling: up to {steps} decode steps per engine step"


def _spec_note(spec) -> str:
    """The speculative-decoding line of the header ('' when off): method, proposals per step, and the
    draft model or the prompt-lookup n-gram range."""
    if spec.method is None:
        return ""
    source = (f"draft model {spec.draft_model}" if spec.method == "draft"
              else f"prompt lookup of {spec.prompt_lookup_min}-{spec.prompt_lookup_max}-grams")
    return f"\n  speculative decoding: {spec.method}, {spec.num_speculative_tokens} proposals per step ({source})"


def _window_note(spec) -> str:
    """For sliding-window models: which layers slide, and what a decode step reads per context token."""
    if not spec.num_sliding_layers:
        return ""
    w, full = spec.sliding_window, spec.num_layers - spec.num_sliding_layers
    return (f" x {spec.layers_per_block} layers\n  sliding window: {spec.num_sliding_layers} of {spec.num_layers} layers "
            f"attend to the last {w:,} tokens and free older blocks; a decode step at context c reads "
            f"{spec.bytes_per_token_per_layer:,} B x ({full} x c + {spec.num_sliding_layers} x min(c, {w:,}))")


# ---------------------------------------------------------------------- generate / chat
def cmd_generate(a: argparse.Namespace) -> int:
    from kvserve.metrics.report import format_anatomy

    params = sampling_from_args(a)  # a bad sampling flag is named before the model loads, not after
    llm = build_llm(a)
    has_template = getattr(llm.tokenizer, "chat_template", None) is not None
    chat = not a.raw and has_template
    if not a.raw and not has_template:
        print(f"note: {a.model} has no chat template; the prompt is sent as is (as with --raw)", file=sys.stderr)
    prompt = [{"role": "user", "content": a.prompt}] if chat else a.prompt
    if chat and a.system:
        prompt.insert(0, {"role": "system", "content": a.system})
    first_step = llm.engine.num_steps + 1
    last = None
    for out in llm.stream(prompt, params, chat=chat):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    c = last.outputs[0]
    steps = [s for s in llm.engine.step_stats if s.step >= first_step]
    print(format_anatomy(c.latency, steps, model_header(llm)), file=sys.stderr)
    print(f"  finish_reason={c.finish_reason}", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    params = sampling_from_args(a)
    llm = build_llm(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print("kvserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply, last = "", None
        for out in llm.stream(messages, params, chat=True):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            last = out
        sys.stdout.write("\n")
        reply = last.outputs[0].text
        lat = last.outputs[0].latency
        print(f"  [TTFT {lat.ttft_ms:.0f} ms, {len(lat.itl_ms)} tokens x ITL {lat.mean_itl_ms:.1f} ms, "
              f"E2E {lat.e2e_ms:.0f} ms]", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.server.app import create_app

    llm = build_llm(a)
    app = create_app(llm, api_key=a.api_key, model_name=a.served_model_name)
    banner = f"kvserve: serving {app.state.metrics._model} on http://{a.host}:{a.port}/v1"
    print(banner + _multi_step_note(llm.engine.config.scheduler.num_scheduler_steps, "; "), file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    return 0


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream one answer, then its latency anatomy")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    g.add_argument("--system", default=None, help="system message (chat template only)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat session")
    c.add_argument("--system", default=None)
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)
    from kvserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from kvserve.planner.cli import add_planner_parsers

    add_planner_parsers(sub)
    from kvserve.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return p


# Settings of LLM whose flag has another name (build_llm passes --threads as num_threads): their
# messages are rewritten to that flag, though it does not spell the setting.
_RENAMED_FLAGS = {"num_threads": "--threads"}


def _flag_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """dest → its longest option string (``kv_cache_memory`` → ``--kv-cache-memory``) over the parser and
    the sub-commands this command line chose."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                flags |= _flag_names(chosen, args)
        elif action.option_strings and action.dest != "help":
            flags[action.dest] = max(action.option_strings, key=len)
    flags |= {name: flag for name, flag in _RENAMED_FLAGS.items() if flag in flags.values()}
    return flags


def as_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with its subject, a setting named by its first word, written as the flag a CLI user
    types: errors are raised with the Python API's names (``block_size must be ...``), the command line
    has ``--block-size``. Only a name of two or more words whose flag spells it (``max_model_len`` →
    ``--max-model-len``; not ``enable_prefix_caching``, whose flag is ``--no-prefix-caching``), followed
    by a space, ``:``, ``(`` or the end; or a setting of ``_RENAMED_FLAGS`` (``num_threads`` →
    ``--threads``). Names further on can be parts of paths, quoted values or
    another model's settings (a draft's), and one-word names (``model``, ``seed``) English words or
    another flag's: those stay as raised."""
    m = re.match(r"[a-z]+(?:_[a-z0-9]+)+(?=[\s:(]|$)", message)
    flag = flags.get(m.group()) if m else None
    if flag is not None and flag in ("--" + m.group().replace("_", "-"), _RENAMED_FLAGS.get(m.group())):
        return flag + message[m.end():]
    return message


def _param_and_message(e: Exception, flags: dict[str, str]) -> str:
    """``[param]: message`` of an error with a ``param`` (InvalidRequestError), or ``: message``; with the
    names a CLI user types. A message that starts with its own param gets the param's flag as its
    subject and no bracket: the param names the subject, so even a one-word name (``temperature``) or
    a flag that spells it otherwise (``stop_token_ids``: ``--stop-token-id``) is right
    (``error [--temperature]: --temperature must ...`` said it twice)."""
    message, param = str(e), getattr(e, "param", None)
    if not param:
        return f": {as_flags(message, flags)}"
    if re.match(re.escape(param) + r"(?=[\s:(]|$)", message) and param in flags:  # even --stop-token-id
        return f": {flags[param]}{message[len(param):]}"  # for stop_token_ids: the param names the subject
    return f" [{flags.get(param, param)}]: {as_flags(message, flags)}"  # the param is a setting's whole name


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a reader gone early (`| head`) surfaces here, not at interpreter exit
        return rc
    except (ConfigError, InvalidRequestError) as e:
        flags = _flag_names(parser, args)
        print(f"kvserve: error{_param_and_message(e, flags)}", file=sys.stderr)
        return 2
    except ProbeError as e:  # a rate this host cannot measure now (kvserve probe, explain --probe)
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed early (`kvserve plan --sweep batch | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not raise again
        return 1


if __name__ == "__main__":
    sys.exit(main())
