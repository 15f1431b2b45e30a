"""Rotary position embedding (Su et al. 2021, "RoFormer"), rotate-half layout as in HF Llama,
with Llama-3's frequency scaling (``rope_type: llama3``, as in HF ``_compute_llama3_parameters``)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies theta^(-2i/d), rescaled for llama3 rope."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_scale(inv, scaling)
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind in (None, "default"):
        return inv
    raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear, default)")


def _llama3_scale(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables of shape [max_positions, head_dim // 2] (float32)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device (after ``to_empty``)."""
        inv = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        angles = torch.arange(self.max_positions, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = angles.cos().float().to(self.cos.device)
        self.sin = angles.sin().float().to(self.sin.device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [num_tokens] as [num_tokens, 1, head_dim // 2] in ``dtype``;
        looked up once per step and shared by every layer."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [num_tokens, num_heads, head_dim] (may be a strided view);
    cos, sin: [num_tokens, 1, head_dim // 2]. Returns a new contiguous tensor of x's shape."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
