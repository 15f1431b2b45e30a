"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2 with q/k/v bias).

Reads top-down: config → attention → MLP → block → model. Tokens of all sequences in a step are
flattened into one axis of ``num_tokens``; attention metadata is an argument, never global state.
Q/K/V and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from kvserve.attention import AttentionMetadata, paged_attention
from kvserve.config import ModelConfig
from kvserve.models.fused_ops import rms_norm, rms_norm_reference, rope_write_kv, silu_mul
from kvserve.models.linear import Linear, linear
from kvserve.models.llama_decode import LlamaDecodePlan
from kvserve.models.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # ([num_blocks, block_size, Hkv, d], same)
Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # positions [T] int64; cos, sin tables [max_pos, head_dim // 2]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), computed in float32.

    ``norm(x)`` returns y; ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``, the
    residual add fused in (:func:`kvserve.models.fused_ops.rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None and x.dim() != 2:
            return rms_norm_reference(x, self.weight, self.eps)
        out, stream = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, stream)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T, H, Hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) d]
        q, k, v = rope_write_kv(qkv, *rope, kv_cache[0], kv_cache[1], meta.slot_mapping, H, Hkv, d,
                                need_kv=meta.num_decodes < len(meta.seq_lens_list))  # [T, H|Hkv, d]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, d]
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output [T, hidden]; residual: the stream before it (None at layer 0).
        Returns (this layer's MLP output, the stream before it): the adds are fused into the norms."""
        h, residual = self.input_layernorm(x, residual) if residual is not None else (self.input_layernorm(x), x)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h, kv_cache, meta), residual)
        return self.mlp(h), residual


MAX_ROWS_PER_SEQ_ON_DECODE_PLAN = 17  # 1 + the most proposals a verification step checks


def per_token_decode_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """``meta`` with every query token as a sequence of its own, for the decode plan: token i of a
    sequence whose context before the step is c sees keys 0 .. c + i (causal attention within the
    chunk), so its row gets that sequence's block table and seq_len c + i + 1. The plan writes every
    row's K/V before any row attends, so each row finds the keys of the rows before it. A
    speculative verification step (1 + k tokens per sequence, ``meta.all_decoding``) then runs on the
    decode kernels instead of the module path's per-op loop; prefill chunks stay on the module path
    (their numerics and cost are the prefill's). Returns ``meta`` itself when every query is one token."""
    if meta.num_decodes == meta.num_seqs:
        return meta
    q = torch.tensor(meta.query_lens_list, dtype=torch.int64, device=meta.seq_lens.device)
    seq_of_token = torch.repeat_interleave(torch.arange(meta.num_seqs, device=q.device), q)
    first = (meta.seq_lens - q)[seq_of_token]  # context before the step, per token
    offset = torch.arange(len(seq_of_token), device=q.device) - meta.query_start_loc[:-1][seq_of_token]
    seq_lens = first + offset + 1
    lens = seq_lens.tolist()
    return AttentionMetadata(slot_mapping=meta.slot_mapping, block_tables=meta.block_tables[seq_of_token],
                             seq_lens=seq_lens, query_start_loc=torch.arange(len(lens) + 1, device=q.device),
                             seq_lens_list=lens, query_lens_list=[1] * len(lens), num_decodes=len(lens),
                             block_size=meta.block_size)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden_size]``;
    ``compute_logits(hidden [N, hidden_size]) -> [N, vocab_size]`` float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling_dict)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.use_decode_plan = True  # decode-only steps as one flat loop of kernel calls (llama_decode.py)
        self._plans: dict[int, tuple[list[KVCache], LlamaDecodePlan | None]] = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        """``meta``: one AttentionMetadata for all layers, or one per layer (sliding and full layers in
        separate KV cache groups, e.g. a Mistral/Qwen2 config with mixed ``layer_types``)."""
        plan = self._plan_for(kv_caches, meta, verify=True)
        if plan is not None:
            return plan(input_ids, positions, per_token_decode_metadata(meta))
        metas = meta if isinstance(meta, (list, tuple)) else [meta] * len(self.layers)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = (positions, self.rotary_emb.cos, self.rotary_emb.sin)
        residual = None
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas):
            x, residual = layer(rope, x, residual, kv_cache, m)
        return self.norm(x, residual)[0]

    def greedy_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata | Sequence[AttentionMetadata],
                      follow_storage: bool = True) -> list[int] | None:
        """A decode step (every sequence one new token) and each sequence's greedy next token,
        ``argmax(compute_logits(forward(...)))`` (the first maximum, or the first NaN), with the LM head in
        the decode plan's one C call (:meth:`LlamaDecodePlan.greedy`, which says what ``follow_storage``
        skips). None, with nothing run, where that path does not apply: then ``forward`` and
        ``compute_logits`` give the same ids."""
        plan = self._plan_for(kv_caches, meta, verify=False)
        return None if plan is None else plan.greedy(input_ids, positions, meta, follow_storage)

    def decode_sample(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata | Sequence[AttentionMetadata],
                      draw: Callable[[], tuple[np.ndarray, ...]],
                      follow_storage: bool = True) -> tuple[list[int], torch.Tensor] | None:
        """A decode step whose rows are greedy or sample from the raw logits, its LM head and
        sampling in the decode plan's one C call (:meth:`LlamaDecodePlan.sample`, which says what ``draw``
        gives): (ids, logits). None, with nothing run, where :meth:`greedy_decode` would return None."""
        plan = self._plan_for(kv_caches, meta, verify=False)
        return None if plan is None else plan.sample(input_ids, positions, meta, draw, follow_storage)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                      meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor | None:
        """A decode step's logits [B, vocab], ``compute_logits(forward(...), float32=False)``'s values, with
        the LM head in the decode plan's one C call (:meth:`LlamaDecodePlan.logits`; a view of a buffer the
        next step overwrites). None, with nothing run, where :meth:`greedy_decode` would return None."""
        plan = self._plan_for(kv_caches, meta, verify=False)
        return None if plan is None else plan.logits(input_ids, positions, meta)

    def _plan_for(self, kv_caches: list[KVCache], meta: AttentionMetadata | Sequence[AttentionMetadata],
                  verify: bool) -> LlamaDecodePlan | None:
        """The decode plan where this step may run on it: one metadata for all layers, no sliding window,
        every query one token (``verify``: or a speculative verification of up to
        ``MAX_ROWS_PER_SEQ_ON_DECODE_PLAN`` tokens per sequence); else None."""
        if isinstance(meta, (list, tuple)) or meta.sliding_window or not self.use_decode_plan \
                or torch.compiler.is_compiling():
            return None
        if meta.num_decodes != meta.num_seqs and not (
                verify and meta.all_decoding and max(meta.query_lens_list) <= MAX_ROWS_PER_SEQ_ON_DECODE_PLAN):
            return None
        return self.decode_plan(kv_caches)

    def decode_plan(self, kv_caches: list[KVCache]) -> LlamaDecodePlan | None:
        """The flat decode loop for these caches, built on first use (the weights are final by then);
        None when some part has no kernel here."""
        entry = self._plans.get(id(kv_caches))
        if entry is None or entry[0] is not kv_caches:
            entry = self._plans[id(kv_caches)] = (kv_caches, LlamaDecodePlan.build(self, kv_caches))
        return entry[1]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[N, vocab_size] logits of hidden [N, hidden_size]: float32, or with ``float32=False`` in the LM
        head's output dtype (bfloat16 for a packed or bfloat16 head), for a caller that casts only when
        it needs to (the sampler; a greedy decode step's argmax takes bfloat16 as it is)."""
        if self.lm_head is None:  # tied
            logits = linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def weight_rows(self, hf_name: str) -> tuple[str | None, int | None]:
        """(our parameter name, row offset in a fused matrix) for a checkpoint tensor name."""
        return _fused_target(hf_name, self.config)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. KeyError names an unknown tensor;
        ValueError reports missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, offset = _fused_target(name, self.config)
            if target is None:  # e.g. rotary inv_freq buffers, or lm_head of a tied model
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            p = params[target]
            with torch.no_grad():
                rows = tensor.shape[0]
                dst = p.data[offset:offset + rows] if offset is not None else p.data
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
                dst.copy_(tensor)
            loaded.add(f"{target}@{offset}")
        missing = _expected_slots(self.config, params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def init_dummy_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random normal(0, std) matrices and unit norms, reproducible from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "norm.weight":
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _fused_target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    """HF name -> (our parameter name, row offset into a fused parameter or None)."""
    if "rotary_emb" in name:
        return None, None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None, None
    name = name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, idx = _FUSED[part]
            parts[i] = fused
            q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
            offsets = [0, q, q + kv] if fused == "qkv_proj" else [0, inter]
            return ".".join(parts), offsets[idx]
    return name, None


def _expected_slots(cfg: ModelConfig, params: dict) -> set[str]:
    slots = set()
    for name in params:
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            slots |= {f"{name}@{o}" for o in (0, cfg.num_heads * cfg.head_dim,
                                               (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim)}
        elif name.endswith("gate_up_proj.weight"):
            slots |= {f"{name}@0", f"{name}@{cfg.intermediate_size}"}
        else:
            slots.add(f"{name}@None")
    return slots
