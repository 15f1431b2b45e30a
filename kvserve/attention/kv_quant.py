"""Quantized KV cache: one byte per value (int8, fp8 e4m3, fp8 e5m2) plus a float32 scale per
(token slot, KV head), and attention that reads those bytes directly.

Granularity: one scale per head vector (``head_dim`` values of one token in one KV head),
``scale = max|x| / QMAX`` computed when the token is written. Why this one:

* A slot's bytes and scale are written once and never change, so a block is a pure function of its
  tokens: blocks can be shared (prefix caching, ``n > 1``), preempted and recomputed with no
  requantization, and no calibration pass is needed (a per-tensor scale needs one: the range of K
  is not known before the first prompt, and a range that grows later would requantize old blocks).
* The scale factors out of the attention sums: ``q·k_t = s_t (q·c_t)`` and ``Σ p_t v_t = Σ (p_t s_t) c_t``,
  so the fused kernel applies one multiply per token, not per value.
* Cost: 4 scale bytes per ``head_dim`` values (6.25% over the 1-byte values at head_dim 64).

Measured against one scale per layer tensor (``max|x|`` of the layer's whole K or V: an oracle
calibration, the best a static per-tensor scale can do) on SmolLM2-135M's K/V of 1,024 pydoc tokens,
30 layers (``python -m kvserve.eval.granularity``; relative RMS errors, mean over layers; "attn" is the
last token's attention output against float32; times: one layer's K, 1 thread)::

    kind      granularity  K err   V err   attn err  quantize  dequantize (torch)
    int8      per-vector   0.0107  0.0073  0.0126    0.41 ms   0.07 ms
    int8      per-tensor   0.0177  0.0177  0.0252    0.35 ms   0.04 ms
    fp8_e4m3  per-vector   0.0212  0.0242  0.0448    0.41 ms   0.81 ms
    fp8_e4m3  per-tensor   0.0270  0.0265  0.0990    0.34 ms   0.78 ms
    fp8_e5m2  per-vector   0.0422  0.0482  0.1018    0.36 ms   0.13 ms
    fp8_e5m2  per-tensor   0.0539  0.0527  0.1779    0.35 ms   0.17 ms

Per-vector halves the attention error for int8 and fp8_e4m3 at ~15% more write-time work (a few
microseconds per token) and equal read speed (the fused kernel applies either scale once per token).

Writes: on CPU the C quantizer (``quantize_row`` in ``kernel_math.h``: these functions' bits, tested on
every rounding tie) runs inside the RoPE kernel and :func:`kv_quant_kernel.write_quantized`; the decode
plan and the one-call int4 step (:mod:`kvserve.models.llama_decode`) take 1-byte caches like float ones.

Attention: decode runs :func:`kvserve.attention.kv_quant_kernel.decode_attention` (gathers the
blocks through the block table, converts 16 codes at a time in registers, one pass over K and one
over V; fp8 through float16 conversion so subnormal codes never reach a float32 multiply); prefill
gathers and dequantizes the sequence's blocks and uses the float attention. Every query, including a
prompt's first chunk, attends to the *dequantized* cache, so the output does not depend on how the
scheduler chunks a prompt or recomputes it after preemption. The plain reference is
``dequantize_cache`` followed by :func:`kvserve.attention.reference.reference_paged_attention`.

Why a C kernel (first sitting's figures): one decode query over 4,096 tokens of one SmolLM2 layer (3 KV
heads x 64), 1 thread, min of 40 (a busy 2-core machine, so ±20%): float32 cache gather + SDPA 1.0-1.2 ms;
1-byte cache with gather → dequantize (eager) → SDPA: int8 1.8-2.7 ms, fp8 17 ms (eager fp8 conversion is slow);
the same under ``torch.compile(dynamic=True)``: int8 1.0-1.1, fp8 1.3-1.5 ms (the float32 copy of K/V it
still writes costs as much as the float32 gather); a compiled elementwise-multiply-and-sum attention
2.0-3.2 ms; this kernel (no float copy of K/V) int8 0.50-0.60, fp8 0.55-0.66 ms. Without a C compiler
the eager path is used (correct, slower).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve import memory
from kvserve.attention import kv_quant_kernel
from kvserve.attention.metadata import AttentionMetadata

# kind -> (storage dtype for the codes, largest representable magnitude)
QUANT_KINDS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
SCALE_DTYPE = torch.float32
_MIN_SCALE = 1e-12  # an all-zero vector gets this scale (codes 0), never a division by zero


@dataclass(slots=True)
class QuantizedKVCache:
    """One layer's K (or V) cache. ``codes``: [num_blocks, block_size, num_kv_heads, head_dim] uint8
    (the bits of ``kind``'s dtype); ``scale``: [num_blocks, block_size, num_kv_heads] float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    kind: str

    @classmethod
    def zeros(cls, kind: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              device: torch.device | str = "cpu") -> "QuantizedKVCache":
        codes, scale = memory.zeros_many(cls.tensor_specs((num_blocks, block_size, num_kv_heads, head_dim)), device)
        return cls(codes, scale, kind)

    @staticmethod
    def tensor_specs(shape: tuple[int, int, int, int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """[(shape, dtype)] of the codes and the scales of a cache of ``shape`` [num_blocks, block_size,
        num_kv_heads, head_dim], for :func:`kvserve.memory.zeros_many`."""
        return [(tuple(shape), torch.uint8), (tuple(shape[:3]), SCALE_DTYPE)]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def kind_of_dtype(dtype: torch.dtype) -> str | None:
    """'int8' | 'fp8_e4m3' | 'fp8_e5m2' for a 1-byte KV storage dtype; None for float dtypes."""
    return next((k for k, (dt, _) in QUANT_KINDS.items() if dt == dtype), None)


# ---------------------------------------------------------------------- quantize / dequantize (plain)
def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] float → (codes [..., head_dim] uint8, scale [...] float32) with
    ``scale = max|x| / QMAX`` per vector (one float32 step lower where QMAX · scale would overflow, so a
    finite row reads back finite). int8 rounds x / scale to nearest (|error| ≤ scale / 2 +
    2^-16 · scale, the second term from the float32 roundings of x / scale and of the read-back); fp8 rounds to
    nearest even in the fp8 format (relative error ≤ 2^-4 for e4m3, 2^-3 for e5m2, for normals).
    A vector holding NaN (inf) gets scale NaN (inf) and codes 0: it dequantizes to NaN, so a NaN
    reaches attention's output as it would from a float cache."""
    dtype, qmax = QUANT_KINDS[kind]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / qmax).clamp_min(_MIN_SCALE)
    # qmax · scale must stay finite: for max|x| within rounding of float32's max, max|x| / qmax can round
    # up and the code ±qmax would read back as ±inf; one float step down (kernel_math.h's quantize_row).
    # In float32 only int8 at exactly the max needs it (max / 448 and max / 57344 are exact).
    over = scale.isfinite() & (scale.double() * qmax > torch.finfo(torch.float32).max)
    scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    y = torch.where(scale.isfinite()[..., None], x / scale[..., None], 0.0)
    if kind == "int8":
        codes = y.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-qmax, qmax).to(dtype)
    return codes.view(torch.uint8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of :func:`quantize`: codes [..., d] uint8, scale [...] → [..., d] float32 (plain PyTorch)."""
    dtype, _ = QUANT_KINDS[kind]
    return codes.view(dtype).float() * scale[..., None].float()


def dequantize_cache(cache: QuantizedKVCache) -> torch.Tensor:
    """The whole cache as float32 [num_blocks, block_size, num_kv_heads, head_dim] (reference path)."""
    return dequantize(cache.codes, cache.scale, cache.kind)


# ---------------------------------------------------------------------- write / attend (fast path)
def write_kv_quantized(key_cache: QuantizedKVCache, value_cache: QuantizedKVCache, k: torch.Tensor,
                       v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize and store new rows. k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens].
    On CPU with the C library, one call per cache (:func:`kv_quant_kernel.write_quantized`, the same bits)."""
    dll = kv_quant_kernel.load() if k.device.type == "cpu" and not torch.compiler.is_compiling() else None
    for cache, x in ((key_cache, k), (value_cache, v)):
        if dll is not None and x.dtype in (torch.float32, torch.bfloat16) and x.stride(2) == 1 \
                and x.stride(1) == x.shape[2] and cache.codes.is_contiguous() and cache.scale.is_contiguous():
            kv_quant_kernel.write_quantized(dll, x, cache.codes, cache.scale, slot_mapping, cache.kind)
            continue
        codes, scale = quantize(x, cache.kind)
        Hkv, d = cache.codes.shape[2], cache.codes.shape[3]
        cache.codes.view(-1, Hkv, d).index_copy_(0, slot_mapping, codes)
        cache.scale.view(-1, Hkv).index_copy_(0, slot_mapping, scale)


def gather_dequantized(cache: QuantizedKVCache, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] float32 from one sequence's blocks (only those blocks)."""
    bs, Hkv, d = cache.codes.shape[1:]
    nb = -(-seq_len // bs)
    ids = block_table[:nb]
    codes, scale = cache.codes.index_select(0, ids), cache.scale.index_select(0, ids)  # [nb, bs, Hkv, (d)]
    dll = kv_quant_kernel.load() if codes.device.type == "cpu" else None
    x = kv_quant_kernel.dequantize(dll, codes, scale, cache.kind) if dll else dequantize(codes, scale, cache.kind)
    return x.view(nb * bs, Hkv, d)[:seq_len]


def quantized_paged_attention(q: torch.Tensor, key_cache: QuantizedKVCache, value_cache: QuantizedKVCache,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Like :func:`kvserve.attention.paged.paged_attention` over a quantized cache (new K/V already
    written). q: [num_tokens, num_heads, head_dim]; returns the same shape and dtype."""
    from kvserve.attention.paged import _prefill

    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], key_cache, value_cache, meta, scale)
    start = sum(meta.query_lens_list[:nd])
    fresh_k = fresh_v = None
    for s in range(nd, meta.num_seqs):
        qlen, slen = meta.query_lens_list[s], meta.seq_lens_list[s]
        if slen == qlen:  # no earlier context: its keys are this step's rows, dequantized once for all of them
            if fresh_k is None:
                fresh_k, fresh_v = (dequantized_rows(c, meta.slot_mapping).to(q.dtype)
                                    for c in (key_cache, value_cache))
            ks, vs = fresh_k[start:start + qlen], fresh_v[start:start + qlen]
        else:
            ks = gather_dequantized(key_cache, meta.block_tables[s], slen)
            vs = gather_dequantized(value_cache, meta.block_tables[s], slen)
        out[start:start + qlen] = _prefill(q[start:start + qlen], ks, vs, scale)
        start += qlen
    return out


def dequantized_rows(cache: QuantizedKVCache, slots: torch.Tensor) -> torch.Tensor:
    """[len(slots), num_kv_heads, head_dim] float32: the cache rows at these slots (the same values as
    :func:`gather_dequantized` reads from the blocks holding them). slots: [T] int64."""
    _, _, Hkv, d = cache.codes.shape
    codes = cache.codes.view(-1, Hkv, d).index_select(0, slots)  # [T, Hkv, d]
    scale = cache.scale.view(-1, Hkv).index_select(0, slots)  # [T, Hkv]
    dll = kv_quant_kernel.load() if codes.device.type == "cpu" else None
    return kv_quant_kernel.dequantize(dll, codes, scale, cache.kind) if dll else dequantize(codes, scale, cache.kind)


def _decode(q: torch.Tensor, key_cache: QuantizedKVCache, value_cache: QuantizedKVCache,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [B, H, d] (one token per sequence) → [B, H, d]: the fused kernel, else gather + dequantize + SDPA."""
    B = q.shape[0]
    dll = kv_quant_kernel.load()
    if dll is not None and q.device.type == "cpu":
        o = kv_quant_kernel.decode_attention(dll, q.float(), key_cache.codes, value_cache.codes, key_cache.scale,
                                             value_cache.scale, meta.block_tables[:B], meta.seq_lens[:B], scale,
                                             key_cache.kind)
        return o.to(q.dtype)
    from kvserve.attention.paged import _prefill

    out = torch.empty_like(q)
    for b in range(B):
        slen = meta.seq_lens_list[b]
        ks = gather_dequantized(key_cache, meta.block_tables[b], slen)
        vs = gather_dequantized(value_cache, meta.block_tables[b], slen)
        out[b:b + 1] = _prefill(q[b:b + 1], ks, vs, scale)
    return out
