"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv:2405.04434 §2.1) over a paged latent cache.

The cache holds one row per token: ``[c_kv | k_pe]``, the RMS-normed latent (``kv_lora_rank`` = L
values) and the rotated key shared by all heads (``qk_rope_head_dim`` = R). Per head h the keys and
values are ``k_h = [W_UK[h] c | k_pe]`` and ``v_h = W_UV[h] c`` (``W_UK[h]``: [dn, L], ``W_UV[h]``: [dv, L]).

* expanded (prefill): up-project the latent to per-head K [S, H, dn + R] and V [S, H, dv], then
  ordinary attention. Cheaper when many queries share the keys.
* absorbed (decode): ``q_nope·k_nope = (W_UK[h]ᵀ q_nope)·c``, so the query moves into latent space
  (``q_lat`` [H, L]) and every head attends the latent rows themselves (MQA with one KV "head" of
  L + R); the output is latent [H, L] and ``W_UV`` is applied after. Reads L + R values per token
  instead of H × (dn + R + dv).

Both read the sequence's rows from the cache (dequantized for int8/fp8 caches: one float32 scale per
row, kvserve/attention/kv_quant.py), so a result never depends on how a prompt was chunked.
:func:`reference_mla_attention` is the plain float64 oracle (expanded, token by token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.kv_quant import QuantizedKVCache, dequantize, gather_dequantized, quantize
from kvserve.attention.metadata import AttentionMetadata

LatentCache = torch.Tensor | QuantizedKVCache  # [num_blocks, block_size, 1, L + R]
MODES = ("auto", "absorbed", "expanded")


def write_latent(cache: LatentCache, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new rows. latent: [num_tokens, L + R] (``c_kv`` then rotated ``k_pe``); slot_mapping: [num_tokens]."""
    D = latent.shape[-1]
    rows = latent.view(-1, 1, D)  # [T, 1, L + R]: one KV "head"
    if isinstance(cache, QuantizedKVCache):
        codes, scale = quantize(rows, cache.kind)  # one scale per row
        cache.codes.view(-1, 1, D).index_copy_(0, slot_mapping, codes)  # [num_slots, 1, L + R]
        cache.scale.view(-1, 1).index_copy_(0, slot_mapping, scale)  # [num_slots, 1]
    else:
        cache.view(-1, 1, D).index_copy_(0, slot_mapping, rows.to(cache.dtype))  # [num_slots, 1, L + R]


def gather_latent(cache: LatentCache, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, L + R] rows of one sequence through its block table (float32 if quantized)."""
    if isinstance(cache, QuantizedKVCache):
        return gather_dequantized(cache, block_table, seq_len)[:, 0]
    bs, D = cache.shape[1], cache.shape[3]
    nb = -(-seq_len // bs)
    return cache.index_select(0, block_table[:nb]).view(nb * bs, D)[:seq_len]  # [nb, bs, 1, D] -> [S, D]


def _gather_batch(cache: LatentCache, block_tables: torch.Tensor, span: int) -> torch.Tensor:
    """[B, span, L + R] rows of B sequences (padded rows are garbage, masked by the caller)."""
    B, nb = block_tables.shape
    ids = block_tables.reshape(-1)  # [B, nb] -> [B * nb]
    if isinstance(cache, QuantizedKVCache):
        rows = dequantize(cache.codes.index_select(0, ids), cache.scale.index_select(0, ids), cache.kind)
    else:
        rows = cache.index_select(0, ids)  # [B * nb, bs, 1, D]
    return rows.view(B, nb * rows.shape[1], rows.shape[-1])[:, :span]  # -> [B, nb * bs, D] -> [B, span, D]


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, meta: AttentionMetadata, scale: float, mode: str = "auto") -> torch.Tensor:
    """Causal MLA of this step's queries over each sequence's cached latent rows (new rows already written).

    q_nope: [T, H, dn]; q_pe: [T, H, R] (rotated); cache: [num_blocks, block_size, 1, L + R];
    w_uk: [H, dn, L]; w_uv: [H, dv, L]; scale: softmax scale. Returns [T, H, dv] in q's dtype.
    ``mode`` "auto": decodes absorbed, prefills expanded; "absorbed"/"expanded": every sequence so.
    """
    assert mode in MODES, mode
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    nd = meta.num_decodes if mode == "auto" else 0
    if nd:
        out[:nd] = _decode_absorbed(q_nope[:nd], q_pe[:nd], cache, w_uk, w_uv, meta, scale)
    start = sum(meta.query_lens_list[:nd])
    for s in range(nd, meta.num_seqs):
        qlen, slen = meta.query_lens_list[s], meta.seq_lens_list[s]
        latent = gather_latent(cache, meta.block_tables[s], slen)
        rows = slice(start, start + qlen)
        attend = _expanded if mode in ("auto", "expanded") else _absorbed
        out[rows] = attend(q_nope[rows], q_pe[rows], latent, w_uk, w_uv, scale)
        start += qlen
    return out


def _causal_mask(qlen: int, slen: int, device) -> torch.Tensor | None:
    """[qlen, slen] bool, query i (at position slen - qlen + i) sees keys 0 .. slen - qlen + i."""
    if qlen == 1:
        return None
    ctx = slen - qlen
    return torch.arange(slen, device=device)[None, :] <= (ctx + torch.arange(qlen, device=device))[:, None]


def _expanded(q_nope, q_pe, latent, w_uk, w_uv, scale) -> torch.Tensor:
    """One sequence, latent up-projected to per-head K and V. q_*: [Lq, H, *]; latent: [S, L + R]."""
    L, (Lq, H, R) = w_uk.shape[2], q_pe.shape
    latent = latent.to(q_nope.dtype)
    c, k_pe = latent[:, :L], latent[:, L:]  # [S, L], [S, R]
    k_nope = torch.einsum("sl,hdl->hsd", c, w_uk)  # [H, S, dn]
    v = torch.einsum("sl,hdl->hsd", c, w_uv)  # [H, S, dv]
    k = torch.cat([k_nope, k_pe[None].expand(H, -1, R)], dim=-1)  # [H, S, dn + R]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [Lq, H, dn + R] -> [H, Lq, dn + R]
    mask = _causal_mask(Lq, latent.shape[0], q.device)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [H, Lq, dv]
    return o.transpose(0, 1)  # [Lq, H, dv]


def _absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """[N, H, dn], [N, H, R] -> [N, H, L + R]: q_lat = W_UKᵀ q_nope per head, then the rope part."""
    q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)  # [N, H, L]
    return torch.cat([q_lat, q_pe], dim=-1)


def _absorbed(q_nope, q_pe, latent, w_uk, w_uv, scale) -> torch.Tensor:
    """One sequence in latent space. q_*: [Lq, H, *]; latent: [S, L + R]. Returns [Lq, H, dv]."""
    L, (Lq, H, _) = w_uk.shape[2], q_pe.shape
    q = _absorb_query(q_nope, q_pe, w_uk).transpose(0, 1)  # [Lq, H, L + R] -> [H, Lq, L + R]
    latent = latent.to(q.dtype)
    k = latent[None].expand(H, -1, -1)  # [H, S, L + R], stride 0 over heads: no copy
    v = latent[None, :, :L].expand(H, -1, -1)  # [H, S, L]
    mask = _causal_mask(Lq, latent.shape[0], q.device)
    o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [H, Lq, L]
    return torch.einsum("hql,hdl->qhd", o_lat, w_uv)  # [Lq, H, dv]


def _decode_absorbed(q_nope, q_pe, cache, w_uk, w_uv, meta: AttentionMetadata, scale) -> torch.Tensor:
    """B decode queries (one token each) at once. q_*: [B, H, *]. Returns [B, H, dv]. One sequence
    reads exactly its rows; several are padded to the longest and masked with ``meta.decode_mask``."""
    B, L = q_nope.shape[0], w_uk.shape[2]
    lens = meta.seq_lens_list[:B]
    bs = meta.block_size
    nb = -(-max(lens) // bs)
    span = lens[0] if B == 1 else nb * bs
    latent = _gather_batch(cache, meta.block_tables[:B, :nb], span).to(q_nope.dtype)  # [B, S, L + R]
    q = _absorb_query(q_nope, q_pe, w_uk)[:, None]  # [B, 1, H, L + R]: the H heads are H query rows
    k, v = latent[:, None], latent[:, None, :, :L]  # [B, 1, S, L + R], [B, 1, S, L]
    mask = None if B == 1 else meta.decode_mask  # [B, 1, 1, S]
    o_lat = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, 1, H, L]
    return torch.einsum("bhl,hdl->bhd", o_lat[:, 0], w_uv)


# ------------------------------------------------------------------------------- plain reference
def reference_mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: LatentCache, w_uk: torch.Tensor,
                            w_uv: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The oracle: per sequence, rows fetched token by token through the block table (dequantized),
    K/V expanded to every head, causal softmax in float64. Same arguments and result as
    :func:`mla_attention`."""
    if isinstance(cache, QuantizedKVCache):
        cache = dequantize(cache.codes, cache.scale, cache.kind)
    L, bs = w_uk.shape[2], meta.block_size
    wk, wv = w_uk.double(), w_uv.double()
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
    for s in range(meta.num_seqs):
        start = int(meta.query_start_loc[s])
        qlen, slen = meta.query_lens_list[s], meta.seq_lens_list[s]
        table = meta.block_tables[s].tolist()
        rows = torch.stack([cache[table[p // bs], p % bs, 0] for p in range(slen)]).double()  # [S, L + R]
        k_nope = torch.einsum("sl,hdl->shd", rows[:, :L], wk)  # [S, H, dn]
        v = torch.einsum("sl,hdl->shd", rows[:, :L], wv)  # [S, H, dv]
        q_nope_s, q_pe_s = q_nope[start:start + qlen].double(), q_pe[start:start + qlen].double()
        scores = (torch.einsum("qhd,shd->hqs", q_nope_s, k_nope)
                  + torch.einsum("qhr,sr->hqs", q_pe_s, rows[:, L:])) * scale
        allowed = torch.arange(slen)[None, :] <= (slen - qlen + torch.arange(qlen))[:, None]
        probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        out[start:start + qlen] = torch.einsum("hqs,shd->qhd", probs, v).to(out.dtype)
    return out
