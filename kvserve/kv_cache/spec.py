"""KV bytes per token and per block for an attention kind and KV dtype.

Per token, standard multi-head / grouped-query / multi-query attention stores K and V for every
layer: ``2 × num_layers × num_kv_heads × head_dim × bytes_per_element`` (GQA: Ainslie et al. 2023;
MQA is num_kv_heads = 1). Example: Llama-3-70B in bf16 = 2 × 80 × 8 × 128 × 2 = 327,680 B.
A 1-byte dtype (int8, fp8) also stores a float32 scale per token and KV head
(kvserve/attention/kv_quant.py): ``2 × num_layers × num_kv_heads × (head_dim × 1 + 4)``.
Multi-head latent attention (attention "mla", DeepSeek-V2 arXiv:2405.04434 §2.1) stores one row per
token and layer, the compressed latent and the shared rotated key, and no V:
``num_layers × (kv_lora_rank + qk_rope_head_dim) × bytes_per_element`` (+ one 4-byte scale per row
for 1-byte dtypes). DeepSeek-V3 in bf16: 61 × (512 + 64) × 2 = 70,272 B.

Sliding-window layers (Gemma 3, arXiv:2503.19786) store a token only while it is inside their window,
and a decode query reads at most ``sliding_window`` tokens there: at context c a step reads
``bytes_per_token_per_layer × (num_full_layers × c + num_sliding_layers × min(c, window))``.
Such models split their layers into KV cache *groups* (as vLLM's hybrid allocator does): layers of one
group share a block table; every group has the same number of layers, so a block (one block of tokens
for ``layers_per_block`` layers) has one size and all groups draw from one pool; sliding groups free
the blocks that fall out of their window (kvserve/kv_cache/manager.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.config import ConfigError, ModelConfig


_QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per request. The i-th layer of ``layer_ids`` keeps its K/V
    in cache tensor slot i; all have the same ``sliding_window`` (0 = full attention)."""

    layer_ids: tuple[int, ...]
    sliding_window: int = 0


def kv_cache_groups(layer_windows: tuple[int, ...], num_layers: int) -> tuple[KVCacheGroup, ...]:
    """Split layers into groups of equal size g: one group of all layers when no layer slides, else
    g = gcd(#full, #sliding) (Gemma-3-270M: 3 full + 15 sliding -> 6 groups of 3). Full groups come
    first. ``layer_windows`` per layer (0 = full; empty = all full)."""
    windows = layer_windows or (0,) * num_layers
    if not any(windows):
        return (KVCacheGroup(tuple(range(num_layers))),)
    if len(set(w for w in windows if w)) > 1:
        raise ConfigError(f"sliding-window layers must share one window size, got {sorted(set(windows))}")
    full = [i for i, w in enumerate(windows) if not w]
    sliding = [i for i, w in enumerate(windows) if w]
    g = math.gcd(len(full), len(sliding))
    window = windows[sliding[0]]
    return tuple(KVCacheGroup(tuple(full[i:i + g])) for i in range(0, len(full), g)) + \
        tuple(KVCacheGroup(tuple(sliding[i:i + g]), window) for i in range(0, len(sliding), g))


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    attention: str = "gqa"  # "mla": one latent "head" of head_dim = kv_lora_rank + qk_rope_head_dim, no V
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = full; () = all full

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> "KVCacheSpec":
        if cfg.attention == "mla":
            return cls.mla(cfg.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, block_size)
        windows = cfg.layer_windows if any(cfg.layer_windows) else ()
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size, layer_windows=windows)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype,
            block_size: int) -> "KVCacheSpec":
        """The latent cache: per layer one row of kv_lora_rank + qk_rope_head_dim values per token."""
        return cls(num_layers, 1, kv_lora_rank + qk_rope_head_dim, dtype, block_size, "mla", kv_lora_rank,
                   qk_rope_head_dim)

    @property
    def num_kv_tensors(self) -> int:
        """Tensors per layer: K and V (2), or the MLA latent alone (1)."""
        return 1 if self.attention == "mla" else 2

    @property
    def bytes_per_element(self) -> int:
        return self.dtype.itemsize  # read on every step's statistics: no tensor made for it

    @property
    def is_quantized(self) -> bool:
        """One byte per value with a scale beside each head vector (int8 / fp8)."""
        return self.dtype in _QUANTIZED

    @property
    def scale_bytes_per_head(self) -> int:
        """Scale bytes per token, layer, K-or-V and KV head (0 for float caches)."""
        return 4 if self.is_quantized else 0

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.num_kv_tensors * self.num_kv_heads * (self.head_dim * self.bytes_per_element
                                                          + self.scale_bytes_per_head)

    @property
    def bytes_per_token(self) -> int:
        """K + V (or MLA latent) bytes of one token over all layers."""
        return self.num_layers * self.bytes_per_token_per_layer

    # ------------------------------------------------------------------ sliding window / groups
    @property
    def groups(self) -> tuple[KVCacheGroup, ...]:
        return kv_cache_groups(self.layer_windows, self.num_layers)

    @property
    def layers_per_block(self) -> int:
        """Layers one block of the pool holds (all layers unless the model has sliding-window layers)."""
        return len(self.groups[0].layer_ids)

    @property
    def sliding_window(self) -> int:
        return max(self.layer_windows, default=0)

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for w in self.layer_windows if w)

    def kv_tokens_read(self, seq_len: int, query_len: int = 1) -> int:
        """Token-layers of K/V a sequence's step reads when it ends at ``seq_len`` tokens with
        ``query_len`` new ones: full layers read all ``seq_len``, sliding ones the keys some query
        sees, ``min(seq_len, window + query_len - 1)`` (a decode: ``min(seq_len, window)``)."""
        sliding = self.num_sliding_layers
        window = min(seq_len, self.sliding_window + query_len - 1) if sliding else 0
        return (self.num_layers - sliding) * seq_len + sliding * window

    def kv_bytes_read(self, seq_len: int, query_len: int = 1) -> int:
        """K/V bytes of :meth:`kv_tokens_read` (for the formula see the module docstring)."""
        return self.kv_tokens_read(seq_len, query_len) * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block: ``block_size`` tokens of ``layers_per_block`` layers."""
        return self.layers_per_block * self.bytes_per_token_per_layer * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def blocks_for_request(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """Most pool blocks one request of ``num_tokens`` holds at once when it computes at most
        ``chunk_tokens`` tokens per step (None: all at once). A sliding group holds the window's
        blocks plus the chunk's: ``min(cdiv(num_tokens, bs), cdiv(window - 1 + chunk, bs) + 1)``."""
        bs, full = self.block_size, -(-num_tokens // self.block_size)
        chunk = num_tokens if chunk_tokens is None else min(chunk_tokens, num_tokens)
        return sum(min(full, -(-(g.sliding_window - 1 + chunk) // bs) + 1) if g.sliding_window else full
                   for g in self.groups)

    def check_fits(self, num_blocks: int, max_model_len: int, chunk_tokens: int | None = None,
                   setting: str = "kv_cache_memory") -> None:
        """ConfigError naming ``setting`` (what sized the pool: ``kv_cache_memory`` or ``num_kv_blocks``)
        unless ``num_blocks`` hold one request of ``max_model_len`` tokens (computed ``chunk_tokens`` at a
        time, see :meth:`blocks_for_request`)."""
        need = self.blocks_for_request(max_model_len, chunk_tokens)
        if num_blocks < need:
            raise ConfigError(
                f"{setting}: {num_blocks} block{'s' if num_blocks != 1 else ''} of {self.block_size} tokens x "
                f"{self.layers_per_block} layers "
                f"({num_blocks * self.bytes_per_block / 2**20:.1f} MiB) "
                f"cannot hold one request of max_model_len={max_model_len} tokens; give at least "
                f"{need} blocks ({need * self.bytes_per_block / 2**20:.1f} MiB) or lower max_model_len")
