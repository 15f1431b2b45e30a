"""DeepSeek-V2/V3 decoder: multi-head latent attention (MLA) and DeepSeekMoE.

Reads top-down: config notes → attention (MLA, arXiv:2405.04434 §2.1) → MLP and MoE (router, routed
and shared experts; DeepSeekMoE arXiv:2401.06066, V3's aux-loss-free router arXiv:2412.19437 §2.1.2)
→ block → model. The KV cache holds one latent row per token and layer (kvserve/attention/mla.py).
Checkpoint names and layouts (kv_b_proj split per head, interleaved RoPE rows) are mapped in
kvserve/models/deepseek_weights.py, never in ``forward``.

Config notes. ``head_dim`` = qk_nope + qk_rope (the query/key head). RoPE acts on the last
``qk_rope_head_dim`` values of each query head and on the shared key ``k_pe``; DeepSeek checkpoints
rotate interleaved pairs, which the loader permutes to the rotate-half layout used here (a permutation
of both q and k leaves every dot product unchanged). Softmax scale ``head_dim ** -0.5``, times
``mscale(factor, mscale_all_dim)²`` under YaRN (as DeepSeek's and HF's code).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.attention.mla import LatentCache, mla_attention, write_latent
from kvserve.config import ModelConfig
from kvserve.models.linear import Linear, linear
from kvserve.models.llama import RMSNorm
from kvserve.models.rope import RotaryEmbedding, apply_rope, yarn_mscale

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, qk_rope_head_dim // 2]
LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use RMSNorm's default eps in DeepSeek's code


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """(qk_nope + qk_rope) ** -0.5, times mscale(factor, mscale_all_dim)² when YaRN sets mscale_all_dim."""
    scale = cfg.head_dim ** -0.5
    s = cfg.rope_scaling_dict or {}
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


# ------------------------------------------------------------------------------------ attention
class MLAttention(nn.Module):
    """q: low-rank (q_a → norm → q_b) or plain q_proj. kv_a_proj_with_mqa: hidden → [c_kv (L) | k_pe (R)];
    kv_b_proj as per-head ``w_uk`` [H, dn, L] and ``w_uv`` [H, dv, L]; o_proj: H·dv → hidden."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.v_head_dim, self.scale = cfg.num_heads, cfg.v_head_dim, mla_softmax_scale(cfg)
        self.nope, self.rope, self.kv_lora_rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        h, H, r = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank
        self.q_lora_rank = r
        self.q_proj = None if r else Linear(h, H * cfg.head_dim, bias=False)
        self.q_a_proj = Linear(h, r, bias=cfg.attention_bias) if r else None
        self.q_a_layernorm = RMSNorm(r, LORA_NORM_EPS) if r else None
        self.q_b_proj = Linear(r, H * cfg.head_dim, bias=False) if r else None
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.w_uk = nn.Parameter(torch.empty(H, self.nope, self.kv_lora_rank))  # kv_b_proj's k_nope rows
        self.w_uv = nn.Parameter(torch.empty(H, self.v_head_dim, self.kv_lora_rank))  # kv_b_proj's v rows
        self.o_proj = Linear(H * self.v_head_dim, h, bias=cfg.attention_bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: LatentCache, meta: AttentionMetadata) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q = self._query(x).view(T, H, self.nope + self.rope)  # [T, H * (dn + R)] -> [T, H, dn + R]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)  # [T, L], [T, R]
        k_pe = apply_rope(k_pe.view(T, 1, self.rope), *rope)  # [T, R] -> [T, 1, R]: one key shared by all heads
        q_pe = apply_rope(q_pe, *rope)  # [T, H, R]
        write_latent(kv_cache, torch.cat([self.kv_a_layernorm(c_kv), k_pe[:, 0]], dim=-1), meta.slot_mapping)
        o = mla_attention(q_nope, q_pe, kv_cache, self.w_uk, self.w_uv, meta, self.scale)  # [T, H, dv]
        return self.o_proj(o.reshape(T, H * self.v_head_dim))  # [T, H, dv] -> [T, H * dv]


# ------------------------------------------------------------------------------------ MLP / MoE
class GatedMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def select_experts(logits: torch.Tensor, cfg: ModelConfig,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] float32 → (weights [T, k] float32, expert ids [T, k]).

    greedy: top-k of the scores. group_limited_greedy (V2): only experts in the ``topk_group`` groups
    with the highest max score. noaux_tc (V3): choose with ``scores + bias`` among the groups with the
    highest sum of their top-2, weigh with the unbiased scores. Weights: V2 normalizes to sum 1 when
    ``norm_topk_prob`` (k > 1) and otherwise scales by ``routed_scaling_factor``; V3 (noaux_tc)
    normalizes when ``norm_topk_prob`` and always scales, as DeepSeek's code does.
    """
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    T, E, G, k = scores.shape[0], scores.shape[1], cfg.num_expert_groups, cfg.num_experts_per_tok
    choice = scores if bias is None else scores + bias.float()
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, k, dim=-1)
    else:
        grouped = choice.view(T, G, E // G)  # [T, E] -> [T, groups, experts per group]
        group_score = grouped.amax(-1) if cfg.topk_method == "group_limited_greedy" else \
            grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        keep = keep[:, :, None].expand(T, G, E // G).reshape(T, E)  # [T, G, E/G] -> [T, E]
        fill = 0.0 if cfg.topk_method == "group_limited_greedy" else float("-inf")
        ids = choice.masked_fill(~keep, fill).topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
    normalize = cfg.norm_topk_prob and (k > 1 or cfg.topk_method == "noaux_tc")
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if not normalize or cfg.topk_method == "noaux_tc":
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class Router(nn.Module):
    """Linear scores over experts in float32 (a plain parameter: weight quantization leaves it alone)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts)) \
            if cfg.topk_method == "noaux_tc" else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


class RoutedExperts(nn.Module):
    """E gated MLPs stored stacked: ``w13`` [E, 2I, hidden] (gate rows, then up), ``w2`` [E, hidden, I].
    Only the experts some token chose are computed (and read); ``num_touched`` records how many the
    latest forward used (a measurement for the step's weight bytes, never read by the forward)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(E, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(E, h, i))
        self.num_touched = 0

    @property
    def bytes_per_expert(self) -> int:
        return (self.w13[0].numel() * self.w13.element_size() + self.w2[0].numel() * self.w2.element_size())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k]. Returns Σ_k weight · expert(x) as [T, hidden]."""
        out = torch.zeros_like(x)
        touched = ids.unique().tolist()
        self.num_touched = len(touched)
        for e in touched:
            tok, slot = (ids == e).nonzero(as_tuple=True)  # tokens that chose e, and in which slot
            gate, up = F.linear(x[tok], self.w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class MoE(nn.Module):
    """Routed experts (top-k per token) plus shared experts that see every token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        n = cfg.num_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * n) if n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


# ------------------------------------------------------------------------------------ block / model
class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: LatentCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2ForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]`` with one
    latent cache ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` per layer;
    ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32. DeepSeek-V3 too."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling_dict)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LatentCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(rope, x, kv_cache, meta)
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

    def _routed_experts(self) -> list[RoutedExperts]:
        return [layer.mlp.experts for layer in self.layers if isinstance(layer.mlp, MoE)]

    def routed_expert_bytes(self) -> int:
        """Bytes of every routed expert of every MoE layer (all of them stored, few read per step)."""
        return sum(e.w13.numel() * e.w13.element_size() + e.w2.numel() * e.w2.element_size()
                   for e in self._routed_experts())

    def routed_expert_bytes_read(self) -> int:
        """Bytes of the routed experts the latest forward used, summed over MoE layers."""
        return sum(e.num_touched * e.bytes_per_expert for e in self._routed_experts())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (kvserve/models/deepseek_weights.py). KeyError names an unknown
        tensor; ValueError a shape mismatch or missing tensors."""
        from kvserve.models.deepseek_weights import load_deepseek_weights

        load_deepseek_weights(self, weights)

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random normal(0, std) matrices, unit norms, zero biases, reproducible from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)
