"""A decoder layer's glue ops as one C call each on CPU (``kvserve/attention/layer_kernel.c``), each
with its eager PyTorch definition beside it as the reference and the fallback.

At batch 1 a SmolLM2 decode step spent more time in the ~130 small eager ops of each layer (dtype
casts, RMSNorm's pow/mean/rsqrt, RoPE's chunk/mul/cat, index_copy) than in its matmuls; these calls
replace them. The kernels round every intermediate the eager ops round to the activation dtype, so
bfloat16 results match the eager ones up to float32 summation order (RMSNorm's mean, SiLU's exp).
Used when the library is built (``kv_quant_kernel.load()``) and tensors are contiguous CPU
float32/bfloat16; anything else takes the reference path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention import kv_quant_kernel, write_kv
from kvserve.models.rope import apply_rope

ACT_CODES = {torch.float32: 3, torch.bfloat16: 4}
MAX_ROPE_HEAD_DIM = 512  # the RoPE kernel rotates one head in a fixed 512-float buffer


def _kernel(*tensors: torch.Tensor):
    """The library when every tensor is a contiguous CPU float32/bfloat16 tensor, else None."""
    if torch.compiler.is_compiling():  # ctypes calls are opaque to torch.compile: trace the reference
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in ACT_CODES or not t.is_contiguous():
            return None
    return kv_quant_kernel.load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) in float32, after adding ``residual`` when given.

    x, residual: [T, n] in the activation dtype; weight: [n]. Returns ``(norm(s), s)`` with
    ``s = x + residual`` (or ``x``) in the activation dtype. With the kernel, ``s`` is ``residual``
    updated in place (``residual`` is the residual stream; nobody else may hold it)."""
    stream = x if residual is None else residual
    dll = _kernel(x, stream, weight) if x.dim() == 2 and x.dtype == stream.dtype else None
    if dll is None:
        s = x if residual is None else x + residual
        return rms_norm_reference(s, weight, eps), s
    out = torch.empty_like(x)
    act = ACT_CODES[x.dtype]
    dll.kvs_add_rms_norm(stream.data_ptr(), None if residual is None else x.data_ptr(), act, weight.data_ptr(),
                         ACT_CODES[weight.dtype], eps, out.data_ptr(), act, x.shape[0], x.shape[1], act,
                         torch.get_num_threads())
    return out, stream


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's elementwise part (Shazeer 2020): gate_up [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    dll = _kernel(gate_up) if gate_up.dim() == 2 else None
    if dll is None:
        return silu_mul_reference(gate_up)
    T, two_i = gate_up.shape
    out = torch.empty(T, two_i // 2, dtype=gate_up.dtype)
    act = ACT_CODES[gate_up.dtype]
    dll.kvs_silu_mul(gate_up.data_ptr(), act, out.data_ptr(), act, T, two_i // 2, act, torch.get_num_threads())
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  key_cache, value_cache, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int, need_kv: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rotate the query and key heads of a fused QKV projection (rotate-half RoPE, Su et al. 2021) and
    store this step's keys and values in the paged cache.

    qkv: [T, (H + 2 Hkv) d] rows (activation dtype; rows may be strided); positions: [T] int64;
    cos, sin: [max_positions, d/2] float32 tables (cast to the activation dtype before use, as the
    eager path does); caches: [num_blocks, block_size, Hkv, d] tensors or QuantizedKVCache;
    slot_mapping: [T] int64. Returns q [T, H, d], k [T, Hkv, d] (rotated) and v [T, Hkv, d] (a view of qkv);
    k and v are None when ``need_kv`` is False (a decode-only step reads them back from the cache).
    """
    T, H, Hkv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    dll, caches = None, cache_args(key_cache, value_cache)
    if qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.dtype in ACT_CODES and qkv.device.type == "cpu" \
            and d <= MAX_ROPE_HEAD_DIM and caches is not None:
        dll = _kernel(cos, sin)
    if dll is None:
        return rope_write_kv_reference(qkv, positions, cos, sin, key_cache, value_cache, slot_mapping, H, Hkv, d)
    q = torch.empty(T, H, d, dtype=qkv.dtype)
    k = torch.empty(T, Hkv, d, dtype=qkv.dtype) if need_kv else None
    kc, vc, ks, vs, cc = caches
    dll.kvs_rope_write_kv(qkv.data_ptr(), ACT_CODES[qkv.dtype], qkv.stride(0), positions.data_ptr(), cos.data_ptr(),
                          sin.data_ptr(), q.data_ptr(), None if k is None else k.data_ptr(), kc, vc, ks, vs,
                          slot_mapping.data_ptr(), T, H, Hkv, d, ACT_CODES[qkv.dtype], cc, torch.get_num_threads())
    if k is None:
        return q, None, None
    return q, k, qkv[:, (H + Hkv) * d:].view(T, Hkv, d)  # v: [T, Hkv, d]


def cache_args(key_cache, value_cache) -> tuple[int, int, int | None, int | None, int] | None:
    """(K data, V data, K scales, V scales, cache code) pointers for the C kernels: a float32/bfloat16
    cache tensor (no scales) or a QuantizedKVCache (codes + scales); None when the kernels cannot take it
    (another dtype or device, not contiguous)."""
    from kvserve.attention.kv_quant import QuantizedKVCache

    if isinstance(key_cache, QuantizedKVCache):
        parts = (key_cache.codes, value_cache.codes, key_cache.scale, value_cache.scale)
        if all(t.device.type == "cpu" and t.is_contiguous() for t in parts):
            return (parts[0].data_ptr(), parts[1].data_ptr(), parts[2].data_ptr(), parts[3].data_ptr(),
                    kv_quant_kernel.CODES[key_cache.kind])
        return None
    if all(isinstance(c, torch.Tensor) and c.device.type == "cpu" and c.dtype in ACT_CODES and c.is_contiguous()
           for c in (key_cache, value_cache)) and key_cache.dtype == value_cache.dtype:
        return key_cache.data_ptr(), value_cache.data_ptr(), None, None, ACT_CODES[key_cache.dtype]
    return None


def rope_write_kv_reference(qkv, positions, cos, sin, key_cache, value_cache, slot_mapping, H, Hkv, d):
    T = qkv.shape[0]
    rope = cos[positions][:, None, :].to(qkv.dtype), sin[positions][:, None, :].to(qkv.dtype)  # [T, 1, d/2]
    qk = apply_rope(qkv[:, :(H + Hkv) * d].view(T, H + Hkv, d), *rope)  # q and k rotated together
    q, k = qk.split([H, Hkv], dim=1)  # [T, H, d], [T, Hkv, d]
    v = qkv[:, (H + Hkv) * d:].view(T, Hkv, d)  # [T, Hkv, d]
    write_kv(key_cache, value_cache, k, v, slot_mapping)
    return q, k, v
