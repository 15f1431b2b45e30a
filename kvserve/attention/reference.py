"""Plain PyTorch paged attention: the oracle every fast path is tested against.

Slow on purpose: per sequence it gathers K/V token by token through the block table, repeats KV
heads for the query heads that share them (grouped-query attention, Ainslie et al. 2023) and
applies a causal softmax in float64.
"""
from __future__ import annotations

import torch

from kvserve.attention.kv_quant import QuantizedKVCache, dequantize_cache
from kvserve.attention.metadata import AttentionMetadata


def reference_paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim] in q's dtype. Query token i of a sequence with
    context c sees cache positions 0 .. c + i, or with ``meta.sliding_window`` W > 0 only positions
    c + i - W + 1 .. c + i (positions before the first query's window are never read: their blocks
    may have been freed). A QuantizedKVCache is dequantized first (plain
    quantize → dequantize → attend: the oracle for the fused quantized path)."""
    if isinstance(key_cache, QuantizedKVCache):
        key_cache, value_cache = dequantize_cache(key_cache), dequantize_cache(value_cache)
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    bs = meta.block_size
    for s in range(meta.num_seqs):
        start = int(meta.query_start_loc[s])
        qlen, slen = meta.query_lens_list[s], meta.seq_lens_list[s]
        table = meta.block_tables[s].tolist()
        ctx, W = slen - qlen, meta.sliding_window
        lo = max(0, ctx - W + 1) if W else 0  # first position any query of this sequence sees
        k = torch.stack([key_cache[table[p // bs], p % bs] for p in range(lo, slen)]).double()
        v = torch.stack([value_cache[table[p // bs], p % bs] for p in range(lo, slen)]).double()
        k = k.repeat_interleave(group, dim=1)  # [slen - lo, num_heads, d]
        v = v.repeat_interleave(group, dim=1)
        qs = q[start:start + qlen].double()  # [qlen, H, d]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        kpos = torch.arange(lo, slen, device=q.device)[None, :]  # on q's device: the oracle runs on GPU too
        qpos = (ctx + torch.arange(qlen, device=q.device))[:, None]
        allowed = (kpos <= qpos) & (kpos > qpos - W) if W else kpos <= qpos
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + qlen] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
