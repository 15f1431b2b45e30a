"""Dense float32 matmuls of decode steps on kvserve's GEMV kernel.

A float32 decode step is ~120 matrix-vector products that each stream one matrix from memory. PyTorch
runs each as an MKL sgemv (or, from 2 rows, an sgemm that is slower still at a few rows) behind its own
parallel region. ``kvs_dense_linear`` (``kvserve/attention/dense_gemv.c``) streams them at about the
plain read's bandwidth, and :class:`kvserve.models.llama_decode.LlamaDecodePlan` runs a whole float32
decode step as one call of it. Steps of more rows (prefill) keep PyTorch's matmul.

Each row's result depends only on its input row and W, never on how many rows (up to
``GEMV_MAX_ROWS``) share the step: a decode row gets the same bits alone and in a batch of up to 32.
Steps of more rows (prefill chunks, bigger batches) run MKL, whose sums differ in order, so a request's
bits can still change with what shares its prefill. Against MKL the sums differ only in order.
"""
from __future__ import annotations

import functools

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F

GEMV_MAX_ROWS = 32  # up to this many rows the kernel beats MKL on SmolLM2's matrices (2 cores: 1 row 23 vs
                    # 25 ms for all 121, 16 rows 48 vs 69 ms, 32 rows 67 vs 79 ms)


@functools.cache
def gemv_kernel():
    """The compiled library when the dense GEMV runs here (an AVX-512 or AVX2 CPU, a C compiler), else None."""
    from kvserve.attention import kv_quant_kernel
    dll = kv_quant_kernel.load()
    return dll if dll is not None and dll.kvs_dense_supported() else None


def plain_cpu(t: torch.Tensor) -> bool:
    """A CPU tensor with its values at its data pointer: no subclass (fake, functorch-wrapped) or
    meta tensor, no lazy negation bit."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and not t.is_neg()
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` multiplies x [M, K] by weight [N, K] on the kernel: both float32 plain CPU
    tensors, the weight contiguous, 1 ≤ M ≤ GEMV_MAX_ROWS, K ≥ 1 and the same in both, no gradient
    (backward or forward mode) or autocast wanted, eager mode, kernel available. Anything else goes to
    F.linear, which also raises its usual errors for mismatched shapes."""
    return (x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS
            and x.shape[1] == weight.shape[1] > 0
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_contiguous()
            and plain_cpu(x) and plain_cpu(weight)
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and fwAD._current_level < 0 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and gemv_kernel() is not None)


@torch.compiler.disable  # ctypes on data pointers: opaque to torch.compile
def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    gemv_kernel().kvs_dense_linear(x.data_ptr(), M, K, weight.data_ptr(), 3, None, N, y.data_ptr(),
                                   torch.get_num_threads())
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., K], weight [N, K] → [..., N]. A decode step's few float32
    rows (:func:`uses_gemv`) run ``kvs_dense_linear``; anything else runs ``F.linear``."""
    if not uses_gemv(x, weight):
        return F.linear(x, weight, bias)
    y = _gemv(x, weight)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 decode-step products run :func:`linear` (same parameters, same
    state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
