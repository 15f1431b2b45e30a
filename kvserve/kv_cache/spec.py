"""KV bytes per token and per block for an attention kind and KV dtype.

Per token, standard multi-head / grouped-query / multi-query attention stores K and V for every
layer: ``2 × num_layers × num_kv_heads × head_dim × bytes_per_element`` (GQA: Ainslie et al. 2023;
MQA is num_kv_heads = 1). Example: Llama-3-70B in bf16 = 2 × 80 × 8 × 128 × 2 = 327,680 B.
A 1-byte dtype (int8, fp8) also stores a float32 scale per token and KV head
(kvserve/attention/kv_quant.py): ``2 × num_layers × num_kv_heads × (head_dim × 1 + 4)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import ConfigError, ModelConfig


_QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_model(cls, cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> "KVCacheSpec":
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size)

    @property
    def bytes_per_element(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

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
        return 2 * self.num_kv_heads * (self.head_dim * self.bytes_per_element + self.scale_bytes_per_head)

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return memory_bytes // self.bytes_per_block

    def check_fits(self, num_blocks: int, max_model_len: int) -> None:
        """ConfigError unless ``num_blocks`` hold one request of ``max_model_len`` tokens."""
        need = -(-max_model_len // self.block_size)
        if num_blocks < need:
            raise ConfigError(
                f"kv_cache_memory: {num_blocks} blocks x {self.block_size} tokens = "
                f"{num_blocks * self.block_size} tokens ({num_blocks * self.bytes_per_block / 2**20:.1f} MiB) "
                f"cannot hold one request of max_model_len={max_model_len} tokens; give at least "
                f"{need} blocks ({need * self.bytes_per_block / 2**20:.1f} MiB) or lower max_model_len")
