"""Checkpoint mapping for DeepSeek-V2/V3 (HF safetensors names and layouts → our parameters).

* ``kv_b_proj.weight`` [H·(dn + dv), L] is split per head into ``w_uk`` [H, dn, L] and ``w_uv`` [H, dv, L].
* gate/up projections are fused row-wise (``gate_up_proj``; routed experts into ``w13[e]``); routed
  experts come either per expert (``mlp.experts.{e}.gate_proj.weight``, DeepSeek's and HF's saved
  format) or stacked (``mlp.experts.gate_up_proj`` [E, 2I, hidden], ``mlp.experts.down_proj``).
* With ``rope_interleave`` the RoPE rows of q (last qk_rope_head_dim rows of every head) and of
  ``kv_a_proj_with_mqa`` (its last rows, ``k_pe``) are permuted from interleaved pairs (x0, x1), (x2, x3)
  ... to halves (x0, x2, ... | x1, x3, ...), the rotate-half layout (as llama.cpp does for Llama q/k).
* Layers past ``num_layers`` (DeepSeek-V3's multi-token-prediction layer 61) and rotary buffers are skipped.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from kvserve.config import ModelConfig

Index = tuple | None  # where in the parameter the tensor goes (None: all of it)
_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def deinterleave_rope_rows(w: torch.Tensor, num_heads: int, rope_dim: int) -> torch.Tensor:
    """w: [num_heads · rows_per_head, ...] whose last ``rope_dim`` rows per head are interleaved RoPE
    pairs → the same with those rows as (evens | odds)."""
    perm = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    w = w.reshape(num_heads, -1, *w.shape[1:]).clone()  # [H · rows, ...] -> [H, rows, ...]
    w[:, -rope_dim:] = w[:, -rope_dim:][:, perm]
    return w.reshape(-1, *w.shape[2:])  # -> [H · rows, ...]


def checkpoint_targets(name: str, t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, Index, torch.Tensor]]:
    """HF tensor → [(our parameter name, index into it, tensor to copy)]; [] for tensors we skip."""
    name = name.removeprefix("model.")
    m = _LAYER_RE.match(name)
    if "rotary_emb" in name or (m and int(m.group(1)) >= cfg.num_layers) or \
            (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return []
    base = name.rsplit(".", 1)[0]
    if base.endswith("self_attn.kv_b_proj"):
        w = t.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)  # [H (dn + dv), L] -> [H, dn + dv, L]
        attn = base.removesuffix("kv_b_proj")
        return [(attn + "w_uk", None, w[:, :cfg.qk_nope_head_dim]), (attn + "w_uv", None, w[:, cfg.qk_nope_head_dim:])]
    if cfg.rope_interleave and (base.endswith("self_attn.q_proj") or base.endswith("self_attn.q_b_proj")):
        t = deinterleave_rope_rows(t, cfg.num_heads, cfg.qk_rope_head_dim)
    elif cfg.rope_interleave and base.endswith("self_attn.kv_a_proj_with_mqa"):
        t = deinterleave_rope_rows(t, 1, cfg.qk_rope_head_dim)
    e = _EXPERT_RE.match(name)
    if e:
        prefix, idx, kind = e.group(1), int(e.group(2)), e.group(3)
        i = cfg.moe_intermediate_size
        rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i)}
        return [(f"{prefix}.w2", (idx,), t)] if kind == "down_proj" else [(f"{prefix}.w13", (idx, rows[kind]), t)]
    if name.endswith("mlp.experts.gate_up_proj"):
        return [(name.removesuffix("gate_up_proj") + "w13", None, t)]
    if name.endswith("mlp.experts.down_proj"):
        return [(name.removesuffix("down_proj") + "w2", None, t)]
    for part, offset in (("gate_proj", 0), ("up_proj", 1)):  # dense and shared-expert MLPs
        if base.endswith("mlp." + part) or base.endswith("shared_experts." + part):
            rows = t.shape[0]
            return [(base.removesuffix(part) + "gate_up_proj.weight", (slice(offset * rows, (offset + 1) * rows),), t)]
    return [(name, None, t)]


def load_deepseek_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into ``model`` (in the model's dtype). KeyError for a tensor with no
    place, ValueError for a shape mismatch, a tensor given twice, or parameters left (partly) unfilled."""
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    seen: set[str] = set()
    for hf_name, tensor in weights:
        for target, index, t in checkpoint_targets(hf_name, tensor, model.config):
            if target not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
            dst = params[target].data if index is None else params[target].data[index]
            if dst.shape != t.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(t.shape)} != model {tuple(dst.shape)}")
            key = f"{target}@{index}"
            if key in seen:
                raise ValueError(f"{hf_name}: {target} {index} given twice")
            seen.add(key)
            with torch.no_grad():
                dst.copy_(t)
            filled[target] += t.numel()
    missing = sorted(n for n, p in params.items() if filled[n] != p.numel())
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
