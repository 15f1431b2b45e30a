"""Model shapes for the planner: parameter counts (total and active per token) and KV bytes per
token for every attention kind the field uses (MHA/GQA/MQA, sliding window, MLA latent), with MoE.

The engine's :class:`~kvserve.config.ModelConfig` covers dense Llama-family models; ``ModelShape``
adds the MoE, MLA and sliding-window fields the planner needs. For plain attention the KV bytes come
from :class:`~kvserve.kv_cache.spec.KVCacheSpec`, so planner and engine count the same bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.kv_cache.spec import KVCacheSpec

# Bytes per element of a weight or KV dtype name. int4 = 0.625: 4-bit codes plus a 16-bit scale and zero
# point per group of 32 weights (0.5 + 4/32), kvserve's Int4Linear and GGUF Q4_1 (Q4_0 is 0.5625, AWQ/GPTQ at
# group 128 ~0.53). int8's per-row scale is < 0.5 % of a row and left out.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
                                 "float16": 2, "fp8": 1, "int8": 1, "int4": 0.625}
# KV dtypes the engine's KVCacheSpec stores (1-byte caches may add per-head scales there).
_TORCH_KV_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                    "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                    "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def dtype_bytes(name: str) -> float:
    """Bytes per element of ``name`` (fp32|bf16|fp16|fp8|int8|int4); ConfigError otherwise."""
    if name not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer, counts not bytes (HF ``config.json`` names).

    attention: "gqa" (MHA/GQA/MQA: ``num_kv_heads`` K and V heads of ``head_dim``) or "mla"
    (DeepSeek-V2/V3 multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` latent per
    token and layer, arXiv:2405.04434 §2.1). ``num_sliding_layers`` of the layers attend only to the
    last ``sliding_window`` tokens (Gemma 3, arXiv:2503.19786), the rest to the whole context.
    MoE (``num_experts`` > 0): layers from ``first_k_dense_replace`` on have ``num_experts`` routed
    experts of ``moe_intermediate_size`` (``num_experts_per_tok`` chosen per token) plus
    ``num_shared_experts`` always-on experts (DeepSeek) or one always-on shared expert of its own
    ``shared_expert_intermediate_size`` with a one-output gate (Qwen2-MoE); earlier layers are dense
    with ``intermediate_size``.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    attention: str = "gqa"
    sliding_window: int = 0
    num_sliding_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str | None = None) -> "ModelShape":
        """The planner shape of an engine ModelConfig (dense or MoE, GQA or MLA, sliding-window layers)."""
        return cls(name or cfg.name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                   cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings, cfg.attention_bias,
                   cfg.max_position_embeddings, attention=cfg.attention, q_lora_rank=cfg.q_lora_rank,
                   kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                   qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, num_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, num_shared_experts=cfg.num_shared_experts,
                   moe_intermediate_size=cfg.moe_intermediate_size,
                   first_k_dense_replace=cfg.first_k_dense_replace if cfg.num_experts else 0,
                   sliding_window=cfg.sliding_window if any(cfg.layer_windows) else 0,
                   num_sliding_layers=sum(1 for w in cfg.layer_windows if w))

    def replace(self, **changes) -> "ModelShape":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ KV cache
    def kv_bytes_per_token_per_layer(self, kv_dtype: str) -> float:
        """Bytes one token adds to one layer's cache: GQA 2 × num_kv_heads × head_dim × b (K and V);
        MLA (kv_lora_rank + qk_rope_head_dim) × b (the compressed latent and the shared RoPE key). For the
        dtypes the engine stores, its KVCacheSpec's figure (with its scales for 1-byte dtypes)."""
        b = dtype_bytes(kv_dtype)
        if kv_dtype in _TORCH_KV_DTYPES:
            return self._kv_spec(kv_dtype).bytes_per_token_per_layer
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * b
        return 2 * self.num_kv_heads * self.head_dim * b

    def _kv_spec(self, kv_dtype: str) -> KVCacheSpec:
        """The engine's spec for this attention kind (same bytes as the engine's StepStats)."""
        if self.attention == "mla":
            return KVCacheSpec.mla(self.num_layers, self.kv_lora_rank, self.qk_rope_head_dim,
                                   _TORCH_KV_DTYPES[kv_dtype], block_size=16)
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim,
                           _TORCH_KV_DTYPES[kv_dtype], block_size=16)

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """Bytes one token adds to the cache over all layers (sliding layers included: they store the
        token too, until it leaves the window). Llama-3-70B bf16: 2 × 80 × 8 × 128 × 2 = 327,680 B."""
        if kv_dtype in _TORCH_KV_DTYPES:
            return self._kv_spec(kv_dtype).bytes_per_token
        return self.num_layers * self.kv_bytes_per_token_per_layer(kv_dtype)

    def kv_tokens_read(self, context_tokens: float) -> float:
        """Token-layers of K/V one decode query reads at ``context_tokens``, divided by num_layers:
        full layers read the whole context, sliding layers at most ``sliding_window`` tokens."""
        full = self.num_layers - self.num_sliding_layers
        window = min(context_tokens, self.sliding_window) if self.num_sliding_layers else 0
        return (full * context_tokens + self.num_sliding_layers * window) / self.num_layers

    def kv_tokens_read_sum(self, context_tokens: list[float] | float) -> float:
        """Σ kv_tokens_read over sequences (a list of contexts, or one context)."""
        seqs = context_tokens if isinstance(context_tokens, list) else [context_tokens]
        return sum(self.kv_tokens_read(c) for c in seqs)

    def kv_bytes_read(self, context_tokens: int, kv_dtype: str) -> float:
        """KV bytes one sequence's decode step reads at ``context_tokens`` tokens of context."""
        return self.kv_tokens_read(context_tokens) * self.kv_bytes_per_token(kv_dtype)

    def kv_bytes_stored(self, context_tokens: int, kv_dtype: str) -> float:
        """KV bytes one sequence holds at ``context_tokens`` (a sliding layer keeps its window only)."""
        return self.kv_bytes_read(context_tokens, kv_dtype)

    # ------------------------------------------------------------------ parameters
    def attention_params_per_layer(self) -> int:
        """Weights of one attention block. GQA: q, k, v, o projections (+ q/k/v bias). MLA: q_a, q_b
        (or q), kv_a (→ latent + rope key), kv_b (latent → K_nope, V), o (DeepSeek-V2 §2.1.2)."""
        h = self.hidden_size
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk if self.q_lora_rank else \
                h * self.num_heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + self.num_heads * self.v_head_dim * h
        d = self.head_dim
        p = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        return p + (d * (self.num_heads + 2 * self.num_kv_heads) if self.attention_bias else 0)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace if self.num_experts else 0

    def expert_params(self) -> int:
        """One gated-MLP expert: gate, up and down projections (3 × hidden × moe_intermediate)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params_dense_part(self) -> int:
        """All layer weights except the routed experts: attention, dense MLPs, shared experts, routers."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        num_dense = self.num_layers - self.num_moe_layers
        shared = self.num_shared_experts * self.expert_params()
        if self.shared_expert_intermediate_size:  # Qwen2-MoE: gate, up, down and a hidden → 1 gate
            shared += 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size
        moe_fixed = shared + self.hidden_size * self.num_experts  # + the router
        return (self.num_layers * self.attention_params_per_layer() + num_dense * dense_mlp
                + self.num_moe_layers * moe_fixed)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        """All parameters (tied embeddings counted once); norms ignored (< 0.01 %)."""
        routed = self.num_moe_layers * self.num_experts * self.expert_params()
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.layer_params_dense_part() + routed + self.embedding_params() + head

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct routed experts per MoE layer that ``num_tokens`` tokens select, assuming uniform
        independent routing: E × (1 − (1 − k/E)^T). One token: k; many: → E."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** max(num_tokens, 0))

    def params_read_per_step(self, num_tokens: int) -> float:
        """Parameters a step over ``num_tokens`` tokens streams from memory, counted as the engine's
        StepStats does: every layer weight, the LM head (the embedding table when tied), routed experts
        only as touched; the embedding rows looked up are added by the cost model."""
        routed = self.num_moe_layers * self.expected_experts_touched(num_tokens) * self.expert_params()
        return self.layer_params_dense_part() + routed + self.embedding_params()

    def matmul_params_per_token(self) -> int:
        """Parameters each token multiplies with (dense part, k routed experts, LM head): the N in
        the 2·N FLOPs per token of Kaplan et al. 2020 (arXiv:2001.08361, §2.1)."""
        routed = self.num_moe_layers * self.num_experts_per_tok * self.expert_params()
        return self.layer_params_dense_part() + routed + self.embedding_params()

    # ------------------------------------------------------------------ attention FLOPs
    def attention_flops_per_context_token(self, absorbed: bool = True) -> float:
        """FLOPs one query spends per cached token per layer: 2·H·d_qk (scores) + 2·H·d_v (values).
        MLA decodes in absorbed form (d_qk = kv_lora_rank + rope, d_v = kv_lora_rank) and prefills
        unabsorbed (d_qk = nope + rope, d_v = v_head_dim), as in arXiv:2405.04434 §2.1 / vLLM."""
        if self.attention == "mla" and absorbed:
            return 2 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        if self.attention == "mla":
            return 2 * self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 4 * self.num_heads * self.head_dim

    def decode_attention_flops(self, context_tokens: int) -> float:
        """Attention FLOPs of one decode token at ``context_tokens`` over all layers."""
        return self.num_layers * self.kv_tokens_read(context_tokens) * self.attention_flops_per_context_token()

    def prefill_attention_flops(self, start: int, num_tokens: int) -> float:
        """Causal attention FLOPs of prompt positions [start, start + num_tokens) over all layers:
        Σ_p attended(p) × per-token FLOPs, attended(p) = p + 1 (full) or min(p + 1, window) (sliding)."""
        end = start + num_tokens
        total = (end * (end + 1) - start * (start + 1)) / 2  # Σ (p + 1)
        full = self.num_layers - self.num_sliding_layers
        flops = full * total
        if self.num_sliding_layers:
            w = self.sliding_window
            below = max(0, min(end, w) - start)  # positions p < w attend p + 1 tokens
            lo = min(start, w)
            sliding = (lo + below) * (lo + below + 1) / 2 - lo * (lo + 1) / 2 + (num_tokens - below) * w
            flops += self.num_sliding_layers * sliding
        return flops * self.attention_flops_per_context_token(absorbed=False)
