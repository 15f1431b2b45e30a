"""HF transformers as a same-run peer: the same weights (it loads the same GGUF), the same dtype,
its own KV cache (``DynamicCache``); greedy decode one token per forward, each step timed. It runs in
a process of its own with the OpenMP settings HF users get (:mod:`kvserve.bench.peer_process`)."""
from __future__ import annotations

import os
import time

import torch

from kvserve.models.catalog import ModelSource


def load_hf_peer(source: ModelSource, dtype: torch.dtype):
    """AutoModelForCausalLM for a GGUF file or HF directory. ImportError if transformers/accelerate
    are missing; ConfigError for dummy models (HF has no weights for them)."""
    from transformers import AutoModelForCausalLM

    if source.kind == "gguf":
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                    gguf_file=os.path.basename(source.path), dtype=dtype).eval()
    if source.kind == "safetensors":
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).eval()
    from kvserve.config import ConfigError

    raise ConfigError("--compare hf needs real weights (a GGUF file or HF directory), not a dummy model")


class _TokenClock:
    """A ``generate`` streamer that only timestamps: the first ``put`` is the prompt, then one per token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_latency(model, prompt_ids: list[int], output_tokens: int) -> dict:
    """Batch-1 greedy ``generate`` (the way HF users run it; its own DynamicCache), EOS disabled.
    Returns TTFT (call -> first token, no tokenization) and the gaps between tokens, in ms."""
    ids = torch.tensor([prompt_ids])
    clock = _TokenClock()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_tokens,
                   min_new_tokens=output_tokens, do_sample=False, streamer=clock, pad_token_id=0)
    tokens = clock.times[1:]
    return {"ttft_ms": (tokens[0] - t0) * 1e3, "itl_ms": [(b - a) * 1e3 for a, b in zip(tokens, tokens[1:])]}


def run_hf_in_subprocess(source: ModelSource, dtype: torch.dtype, contexts: list[int], output_tokens: int,
                         vocab_size: int, n_threads: int, round_: int = 0) -> dict[int, dict]:
    """:func:`hf_latency` for each context (after a 4-token warm-up) in a fresh Python process with
    ``n_threads`` torch threads, on round ``round_``'s prompts (``kvserve.bench.latency.context_seed``).
    Returns {context: {"ttft_ms", "itl_ms"}}. ConfigError when the peer fails (its message: e.g.
    :func:`load_hf_peer`'s for a dummy model)."""
    from kvserve.bench.peer_process import run_peer_process

    out = run_peer_process("kvserve.bench.hf_peer", [source.kind, source.path, str(dtype).removeprefix("torch."),
                                                     str(output_tokens), str(vocab_size), str(n_threads),
                                                     str(round_), *map(str, contexts)], "hf")
    return {int(k): v for k, v in out.items()}


def _main(argv: list[str]) -> None:
    """``python -m kvserve.bench.hf_peer KIND PATH DTYPE OUTPUT_TOKENS VOCAB THREADS ROUND CTX...``: one
    JSON line."""
    import json

    from kvserve.bench.latency import context_seed, random_prompt

    kind, path, dtype, output_tokens, vocab, threads, round_, *contexts = argv
    torch.set_num_threads(int(threads))
    model = load_hf_peer(ModelSource(kind, path, path), getattr(torch, dtype))
    hf_latency(model, random_prompt(16, int(vocab), 0), 4)  # warm-up
    print(json.dumps({c: hf_latency(model, random_prompt(int(c), int(vocab), seed=context_seed(int(c), int(round_))),
                                         int(output_tokens))
                      for c in contexts}))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
