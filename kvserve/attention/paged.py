"""Fast paged attention on PyTorch's fused ``scaled_dot_product_attention``.

Grouped-query attention without repeating K/V: the ``G = num_heads / num_kv_heads`` query heads that
share a KV head are laid out as extra rows of that KV head's query, so each K/V byte is read once per
step. Decode (one query token) and prefill (many) take separate paths; both are checked against
:mod:`kvserve.attention.reference`. Sliding-window layers (``meta.sliding_window`` > 0) read only the
blocks their window touches and mask the keys before it; long prefills are tiled so the work grows
with ``window × query tokens``, not with the square of the context.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvserve.attention import kv_quant_kernel
from kvserve.attention.kv_quant import QuantizedKVCache, quantized_paged_attention, write_kv_quantized
from kvserve.attention.metadata import AttentionMetadata


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V rows. k, v: [num_tokens, num_kv_heads, head_dim];
    caches: [num_blocks, block_size, num_kv_heads, head_dim] (or QuantizedKVCache); slot_mapping: [num_tokens] int64."""
    if isinstance(key_cache, QuantizedKVCache):
        return write_kv_quantized(key_cache, value_cache, k, v, slot_mapping)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(value_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of this step's queries over each sequence's cached K/V.

    q: [num_tokens, num_heads, head_dim]; k, v: this step's new [num_tokens, num_kv_heads, head_dim]
    (already written to the cache; used directly when a sequence has no earlier context; may be None
    in a decode-only step with a float cache, which reads every key back from the cache).
    Returns [num_tokens, num_heads, head_dim]. Quantized caches go to
    :func:`kvserve.attention.kv_quant.quantized_paged_attention`; sliding-window metadata to
    :func:`sliding_window_attention`.
    """
    if meta.sliding_window:
        return sliding_window_attention(q, k, v, key_cache, value_cache, meta, scale)
    if isinstance(key_cache, QuantizedKVCache):
        return quantized_paged_attention(q, key_cache, value_cache, meta, scale)
    nd = meta.num_decodes
    if nd == meta.num_seqs:  # decode-only step
        return _decode(q, key_cache, value_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], key_cache, value_cache, meta, scale)
    for s in range(nd, meta.num_seqs):
        start = _start(meta, s)
        qlen, slen = meta.query_lens_list[s], meta.seq_lens_list[s]
        if slen == qlen:  # no earlier context: attend to the fresh K/V
            ks, vs = k[start:start + qlen], v[start:start + qlen]
        else:
            ks, vs = _gather(key_cache, meta.block_tables[s], slen), _gather(value_cache, meta.block_tables[s], slen)
        out[start:start + qlen] = _prefill(q[start:start + qlen], ks, vs, scale)
    return out


def _start(meta: AttentionMetadata, s: int) -> int:
    return sum(meta.query_lens_list[:s])


def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] from one sequence's blocks."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    blocks = cache.index_select(0, block_table[:nb])  # [nb, bs, Hkv, d]
    return blocks.view(nb * bs, cache.shape[2], cache.shape[3])[:seq_len]


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q: [L, H, d]; k, v: [S, Hkv, d] with S >= L (the last L keys are the queries' own). ``window`` > 0:
    query i (at key index S - L + i) sees only the ``window`` keys ending at its own. Without a window,
    bfloat16 inputs take the C kernel (AMX or AVX2) where :func:`_prefill_kernel` allows, else PyTorch's SDPA."""
    q, k, v = _same_dtype(q, k, v)  # a 1-byte cache's context comes dequantized in float32
    dll = None if window else _prefill_kernel(q, k, v, scale)
    if dll is not None:
        return kv_quant_kernel.prefill_attention(dll, q, k, v, scale)
    L, H, d = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = H // Hkv
    qg = q.view(L, Hkv, G, d).permute(1, 2, 0, 3)  # [Hkv, G, L, d]
    kg = k.permute(1, 0, 2)[:, None].expand(Hkv, G, S, d)  # stride-0 view: no copy of K
    vg = v.permute(1, 0, 2)[:, None].expand(Hkv, G, S, d)
    if S == L and (not window or L <= window):
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)
    elif (not window and L >= SPLIT_MIN_QUERIES and q.device.type == "cpu" and _FLASH_CPU is not None
          and not torch.compiler.is_compiling() and _scores_stay_finite(q, k, scale)):
        o = _context_then_causal(qg, kg, vg, S - L, scale)
    else:
        kpos = torch.arange(S, device=q.device)[None, :]
        qpos = (S - L + torch.arange(L, device=q.device))[:, None]
        mask = (kpos <= qpos) & (kpos > qpos - window) if window else kpos <= qpos
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
    return o.to(q.dtype).permute(2, 0, 1, 3).reshape(L, H, d)  # [L, Hkv, G, d] -> [L, H, d]


def _prefill_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """The C library when its prefill attention (``prefill_attention.c``) takes these inputs, else None:
    CPU, eager (not traced by torch.compile), no autograd, bfloat16 q/k/v whose heads lie ``head_dim``
    elements apart with their elements contiguous (and k's token stride even), a head_dim the kernel
    supports: 32 or 64 on AMX tiles (where the CPU and Linux grant AMX), else multiples of 32 up to 256 on
    AVX2. ``_prefill`` never asks for a sliding window. SmolLM2's layer (9 heads, 2 threads), against the
    flash-attention paths below: AMX (Xeon) 2048 causal queries 14 → 6.2 ms, 2048 after 2048 cached keys
    39 → 18 ms, 256 causal 0.56 → 0.19 ms; AVX2 (Zen 2) 1024 causal 18 → 9.5 ms, 4096 221 → 136 ms."""
    if (q.device.type != "cpu" or torch.compiler.is_compiling() or q.requires_grad or not 0 < scale < math.inf
            or not q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return None
    d = q.shape[-1]
    if any(t.stride(-1) != 1 or t.stride(-2) != d for t in (q, k, v)) or k.stride(0) % 2:
        return None
    dll = kv_quant_kernel.load()
    return dll if dll is not None and dll.prefill_attention_supported(d) else None


# From this many queries after earlier context (a later prefill chunk, or a prompt after a prefix-cache
# hit), _prefill attends in two mask-free calls (_context_then_causal) instead of one with an [L, S] mask:
# PyTorch's CPU flash attention computes every masked-out pair and converts the boolean mask to a float
# one per call. SmolLM2's layer (9 heads, bf16), 2048 queries after 2048 cached keys: 75 -> 45 ms; 512
# after 2048: 7.4 -> 5.9 ms; 256 after 768: even (1.6 vs 1.7 ms).
SPLIT_MIN_QUERIES = 512
try:  # the flash op behind F.scaled_dot_product_attention on the CPU: it also returns the log-sum-exps
    _FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
except (AttributeError, RuntimeError):
    _FLASH_CPU = None


def _scores_stay_finite(q: torch.Tensor, k: torch.Tensor, scale: float) -> bool:
    """No score q·k·scale can reach ±inf (nor is any input NaN or inf): d·max|q|·max|k|·scale < 2^120.
    The split needs it: for a query whose every context score is -inf, the flash op returns log-sum-exp
    0 and output 0, not -inf, and the merge would weigh that part in. Otherwise the masked call runs."""
    bound = q.shape[-1] * q.abs().amax().float() * k.abs().amax().float() * scale
    return bool(bound < 2.0 ** 120)  # False for NaN too


def _context_then_causal(qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, c: int, scale: float) -> torch.Tensor:
    """Causal attention of L queries whose own keys are the last L of kg/vg's S, after c = S − L keys of
    context. qg: [Hkv, G, L, d]; kg, vg: [Hkv, G, S, d]. Returns float32 [Hkv, G, L, d].

    The context keys are all visible to every query and the last L form a square causal block, so two
    flash-attention calls with no mask give each part's output o_i and log-sum-exp l_i (natural log of the
    sum of e^score), and the softmax over all keys is their merge (the online-softmax identity of
    Milakov & Gimelshein, arXiv:1805.02867): o = (e^(l1 − m)·o1 + e^(l2 − m)·o2) / (e^(l1 − m) + e^(l2 − m)),
    m = max(l1, l2). Each part's output is rounded to the input dtype before the merge. Needs every
    score finite (:func:`_scores_stay_finite`); Inductor cannot lower the op, so compiled code takes the
    masked call."""
    o1, l1 = _FLASH_CPU(qg, kg[:, :, :c], vg[:, :, :c], 0.0, False, attn_mask=None, scale=scale)[:2]
    o2, l2 = _FLASH_CPU(qg, kg[:, :, c:], vg[:, :, c:], 0.0, True, attn_mask=None, scale=scale)[:2]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]  # [Hkv, G, L, 1]
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [B, H, d], one token per sequence; returns [B, H, d]. On CPU the C kernel of
    :mod:`kvserve.attention.kv_quant_kernel` reads each K/V row once straight from its block (no gather
    copy: the step reads the KV bytes once). Otherwise gather + SDPA: one sequence's keys are sliced
    to the exact length (no mask); several are padded to the longest with ``meta.decode_mask``."""
    B, H, d = q.shape
    dll = kv_quant_kernel.load() if q.device.type == "cpu" and key_cache.dtype in _KERNEL_DTYPES else None
    if dll is not None and q.dtype in _KERNEL_DTYPES:
        whole = B == len(meta.seq_lens_list)  # a decode-only step: no slicing
        return kv_quant_kernel.act_decode_attention(dll, q, key_cache, value_cache,
                                                    meta.block_tables if whole else meta.block_tables[:B],
                                                    meta.seq_lens if whole else meta.seq_lens[:B], scale)
    if dll is not None:
        return kv_quant_kernel.float_decode_attention(dll, q.float(), key_cache, value_cache, meta.block_tables[:B],
                                                      meta.seq_lens[:B], scale).to(q.dtype)
    Hkv, bs = key_cache.shape[2], key_cache.shape[1]
    G = H // Hkv
    seq_lens = meta.seq_lens_list[:B]
    max_len = max(seq_lens)
    nb = -(-max_len // bs)
    table = meta.block_tables[:B, :nb].reshape(-1)
    span = max_len if B == 1 else nb * bs
    kb = key_cache.index_select(0, table).view(B, nb * bs, Hkv, d)[:, :span].transpose(1, 2)  # [B, Hkv, S, d]
    vb = value_cache.index_select(0, table).view(B, nb * bs, Hkv, d)[:, :span].transpose(1, 2)
    qg = q.view(B, Hkv, G, d)  # the G query heads of a KV head become G query rows
    qg, kb, vb = _same_dtype(qg, kb, vb)
    mask = None if B == 1 else meta.decode_mask
    o = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=mask, scale=scale)  # [B, Hkv, G, d]
    return o.to(q.dtype).reshape(B, H, d)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _same_dtype(q, k, v):
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return q, k, v


# ------------------------------------------------------------------------------ sliding window
def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache, value_cache,
                             meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """:func:`paged_attention` for a sliding-window layer: query position i attends to keys
    ``max(0, i - W + 1) .. i`` (W = ``meta.sliding_window``, as HF's ``sliding_window_overlay``).
    Only blocks from the one holding a sequence's first visible key are gathered. Float decodes run
    batched; a quantized cache is dequantized block by block for the window only."""
    quantized = isinstance(key_cache, QuantizedKVCache)
    out = torch.empty_like(q)
    nd = 0 if quantized else meta.num_decodes
    if nd:
        out[:nd] = _decode_window(q[:nd], key_cache, value_cache, meta, scale)
    bs, window = meta.block_size, meta.sliding_window
    for s in range(nd, meta.num_seqs):
        start = _start(meta, s)
        qlen, slen = meta.query_lens_list[s], meta.seq_lens_list[s]
        if slen == qlen and not quantized:  # no earlier context: attend to the fresh K/V
            ks, vs = k[start:start + qlen], v[start:start + qlen]
        else:
            first = meta.window_start(s) // bs * bs  # block-aligned first key gathered
            ks = _gather_window(key_cache, meta.block_tables[s], first, slen)
            vs = _gather_window(value_cache, meta.block_tables[s], first, slen)
        out[start:start + qlen] = _prefill_window(q[start:start + qlen], ks, vs, scale, window)
    return out


def _gather_window(cache, block_table: torch.Tensor, first: int, seq_len: int) -> torch.Tensor:
    """[seq_len - first, Hkv, d] keys (or values) at positions first .. seq_len - 1 (first block-aligned)."""
    from kvserve.attention.kv_quant import gather_dequantized

    bs = cache.shape[1]
    table = block_table[first // bs:]
    if isinstance(cache, QuantizedKVCache):
        return gather_dequantized(cache, table, seq_len - first)
    return _gather(cache, table, seq_len - first)


def _prefill_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """q: [L, H, d]; k, v: [S, Hkv, d], the last L keys the queries' own. Queries go in tiles of
    ``window`` tokens, each over the keys its window can reach (< 2 × window)."""
    L, S = q.shape[0], k.shape[0]
    ctx, tile = S - L, max(window, 64)
    if L <= tile:
        k0 = max(0, ctx - window + 1)
        return _prefill(q, k[k0:], v[k0:], scale, window)
    out = torch.empty_like(q)
    for t0 in range(0, L, tile):
        t1 = min(L, t0 + tile)
        k0 = max(0, ctx + t0 - window + 1)
        out[t0:t1] = _prefill(q[t0:t1], k[k0:ctx + t1], v[k0:ctx + t1], scale, window)
    return out


def _decode_window(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [B, H, d], one token per sequence, over ``meta.window_block_tables``: one sequence is
    sliced to its exact window, several are masked with ``meta.window_decode_mask``."""
    B, H, d = q.shape
    Hkv, bs = key_cache.shape[2], key_cache.shape[1]
    table = meta.window_block_tables  # [B, nbw]
    span = table.shape[1] * bs
    kb = key_cache.index_select(0, table.reshape(-1)).view(B, span, Hkv, d)
    vb = value_cache.index_select(0, table.reshape(-1)).view(B, span, Hkv, d)
    if B == 1:
        base = meta.window_start(0) // bs * bs
        lo, hi = meta.window_start(0) - base, meta.seq_lens_list[0] - base
        kb, vb = kb[:, lo:hi], vb[:, lo:hi]
    qg, kb, vb = _same_dtype(q.view(B, Hkv, H // Hkv, d), kb.transpose(1, 2), vb.transpose(1, 2))
    o = F.scaled_dot_product_attention(qg, kb, vb, attn_mask=meta.window_decode_mask, scale=scale)  # [B, Hkv, G, d]
    return o.to(q.dtype).reshape(B, H, d)
