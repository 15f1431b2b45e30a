"""Gemma 3 text decoder (Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786), computing what
HF ``Gemma3ForCausalLM`` computes.

What differs from Llama: multi-query attention (Gemma-3-270M: 4 query heads, 1 KV head of 256);
an RMSNorm on every query and key head (QK-norm) before RoPE; scores scaled by
``query_pre_attn_scalar ** -0.5``; *local* layers attend to a sliding window of the last
``sliding_window`` tokens and rotate with ``rope_local_base_freq``, *global* layers see the whole
context and rotate with ``rope_theta`` (five local layers per global one); four norms per block
(before and after attention and the MLP); a GeGLU MLP (tanh-approximated GELU); embeddings multiplied
by sqrt(hidden_size); RMSNorm scaling by ``1 + weight``; the LM head is the embedding table.

Reads top-down: norm → attention → MLP → block → model. Attention metadata is an argument: one per
layer, since local and global layers keep different block tables (kvserve/kv_cache/spec.py).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionMetadata, paged_attention, write_kv
from kvserve.config import ModelConfig
from kvserve.models.linear import Linear, linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.rope import RotaryEmbedding, apply_rope

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size, Hkv, d], same)
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim // 2]


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (1 + weight), in float32. The weight is stored as its offset
    from 1 (HF's convention; llama.cpp's GGUF stores 1 + weight and the loader subtracts the 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    """MQA/GQA with QK-norm; a local layer's metadata carries its sliding window."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sliding_window = cfg.layer_window(layer)  # 0: global layer
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.sliding_window == self.sliding_window, "metadata of another KV cache group"
        T, H, Hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) d]
        q = self.q_norm(qkv[:, :self.q_size].view(T, H, d))  # [T, H, d]
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(T, Hkv, d))  # [T, Hkv, d]
        q, k = apply_rope(torch.cat((q, k), dim=1), *rope).split([H, Hkv], dim=1)  # rotated together
        v = qkv[:, self.q_size + self.kv_size:].view(T, Hkv, d)  # [T, Hkv, d]
        write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, d]
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3MLP(nn.Module):
    """GeGLU (Shazeer 2020): down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + post_norm(attn(pre_norm(x))), then the same around the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    @property
    def is_sliding(self) -> bool:
        return bool(self.self_attn.sliding_window)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]`` where
    ``meta`` is one AttentionMetadata per layer (or one shared by all, for a model without local
    layers); ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        d, n = cfg.head_dim, cfg.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(d, n, cfg.rope_theta, cfg.rope_scaling_dict)  # global layers
        self.rotary_emb_local = RotaryEmbedding(d, n, cfg.rope_local_base_freq)  # local layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        metas = meta if isinstance(meta, (list, tuple)) else [meta] * len(self.layers)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)  # rounded to x's dtype, as HF
        ropes = (self.rotary_emb.lookup(positions, x.dtype), self.rotary_emb_local.lookup(positions, x.dtype))
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas):
            x = layer(ropes[layer.is_sliding], x, kv_cache, m)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[N, vocab_size] logits of hidden [N, hidden_size]: float32, or with ``float32=False`` in the LM
        head's output dtype (bfloat16 for a packed or bfloat16 head), for a caller that casts only when
        it needs to (the sampler; a greedy decode step's argmax takes bfloat16 as it is)."""
        if self.lm_head is None:  # tied
            logits = linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    # ------------------------------------------------------------------ weights
    # HF names and the q/k/v and gate/up fusion are Llama's (norm names map one to one).
    load_weights = LlamaForCausalLM.load_weights
    weight_rows = LlamaForCausalLM.weight_rows

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random normal(0, std) matrices, norm offsets 0 (scale 1), reproducible from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
