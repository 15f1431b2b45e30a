"""Optional ``torch.compile`` of the decoder layers (``--compile``).

Each decoder layer's forward is compiled once with dynamic shapes (all layers share the code, so
one compilation serves them all); Inductor fuses the norms, RoPE, SwiGLU and residual adds into a few
C++ kernels and calls the matmul and attention kernels directly, which removes most of the per-op
overhead of an eager decode step on CPU. The first steps pay the compilation (tens of seconds on
2 cores); shapes it has not seen (a new batch size or a prefill) may compile again.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """Compile every module in ``model.layers`` in place; returns how many. ConfigError-free: a model
    without ``layers`` is left as is (0)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return 0
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.quant import unpack_dense

    unpack_dense(model)  # Inductor cannot lower oneDNN's opaque prepacked weights
    if isinstance(model, LlamaForCausalLM):
        model.use_decode_plan = False  # the flat decode loop would bypass the compiled layers
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile(dynamic=True)
    logger.info("compiled %d decoder layers (first steps compile)", len(layers))
    return len(layers)
