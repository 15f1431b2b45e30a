"""llama.cpp (through llama-cpp-python, the optional ``bench`` extra) as a same-run peer on the same
GGUF file: its own quantized kernels and f16 KV cache, greedy decode (or sampling at a temperature),
each token timed."""
from __future__ import annotations

import time

from kvserve.config import ConfigError
from kvserve.models.catalog import ModelSource


def load_llamacpp_peer(source: ModelSource, n_ctx: int, n_threads: int):
    """``llama_cpp.Llama`` on ``source``'s GGUF file with a context of ``n_ctx`` tokens. ConfigError when
    llama-cpp-python is not installed (``make setup-bench`` compiles it, 6-15 min) or the model
    is not a GGUF file."""
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ConfigError("--compare llama.cpp needs llama-cpp-python: `make setup-bench` "
                          "(it compiles llama.cpp from source, about 6-15 minutes)") from e
    if source.kind != "gguf":
        raise ConfigError("--compare llama.cpp needs a GGUF model file, got a "
                          f"{source.kind} model ({source.name})")
    return Llama(model_path=source.path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                 n_batch=512, verbose=False)


def llamacpp_latency(llm, prompt_ids: list[int], output_tokens: int, temperature: float = 0.0) -> dict:
    """Batch-1 decode of ``output_tokens`` after ``prompt_ids`` from an empty cache (EOS not checked):
    greedy, or at ``temperature`` > 0 sampling the whole distribution (top-k 0 and top-p 1 are off in
    llama.cpp's sampler chain). Returns TTFT (prefill + first token, ms) and the gaps between later
    tokens (ms)."""
    llm.reset()
    times = []
    top_k = 1 if temperature == 0 else 0
    t0 = time.perf_counter()
    for _ in llm.generate(prompt_ids, top_k=top_k, top_p=1.0, min_p=0.0, temp=temperature, repeat_penalty=1.0,
                          reset=True):
        times.append(time.perf_counter())
        if len(times) == output_tokens:
            break
    return {"ttft_ms": (times[0] - t0) * 1e3, "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])]}


def run_llamacpp_in_subprocess(source: ModelSource, contexts: list[int], output_tokens: int, vocab_size: int,
                               n_threads: int, temperature: float = 0.0, round_: int = 0) -> dict[int, dict]:
    """Run :func:`llamacpp_latency` for each context in a fresh Python process (see
    :mod:`kvserve.bench.peer_process`) on round ``round_``'s prompts (``kvserve.bench.latency.context_seed``).
    Returns {context: {"ttft_ms", "itl_ms"}}. ConfigError if the peer cannot run."""
    from kvserve.bench.peer_process import run_peer_process

    if source.kind != "gguf":
        raise ConfigError(f"--compare llama.cpp needs a GGUF model file, got a {source.kind} model ({source.name})")
    out = run_peer_process("kvserve.bench.llamacpp_peer", [source.path, str(output_tokens), str(vocab_size),
                                                           str(n_threads), repr(temperature), str(round_),
                                                           *map(str, contexts)],
                           "llama.cpp")
    return {int(k): v for k, v in out.items()}


def _main(argv: list[str]) -> None:
    """``python -m kvserve.bench.llamacpp_peer GGUF OUTPUT_TOKENS VOCAB THREADS TEMPERATURE ROUND CTX...``:
    one JSON line."""
    import json

    from kvserve.bench.latency import context_seed, random_prompt

    path, output_tokens, vocab, threads, temperature, round_, *contexts = argv
    ctxs = [int(c) for c in contexts]
    llm = load_llamacpp_peer(ModelSource("gguf", path, path), max(ctxs) + int(output_tokens) + 16, int(threads))
    llamacpp_latency(llm, random_prompt(16, int(vocab), 0), 4)  # warm-up
    out = {c: llamacpp_latency(llm, random_prompt(c, int(vocab), seed=context_seed(c, int(round_))),
                               int(output_tokens), float(temperature))
           for c in ctxs}
    print(json.dumps(out))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
