"""Rotary position embedding (Su et al. 2021, "RoFormer"), rotate-half layout as in HF Llama,
with Llama-3's frequency scaling (``rope_type: llama3``, as in HF ``_compute_llama3_parameters``) and
YaRN (``rope_type: yarn``, Peng et al. 2023, arXiv:2309.00071, as in HF ``_compute_yarn_parameters``:
blended frequencies, and cos/sin multiplied by the attention factor)."""
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
    if kind == "yarn":
        return _yarn_scale(inv, head_dim, theta, scaling)
    if kind in (None, "default"):
        return inv
    raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear, yarn, default)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 · mscale · ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """Factor YaRN multiplies cos/sin by: ``attention_factor`` if given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek) or mscale(factor). 1 otherwise."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_scale(inv: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    """Interpolated (inv / factor) for low frequencies, extrapolated (inv) for high ones, a linear
    ramp between the dimensions that turn beta_slow and beta_fast times over the original context."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency
    return inv / factor * (1 - extrapolate) + inv * extrapolate


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
        factor = rope_attention_factor(self.scaling)  # 1 except for YaRN
        self.cos = (angles.cos() * factor).float().to(self.cos.device)
        self.sin = (angles.sin() * factor).float().to(self.sin.device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [num_tokens] as [num_tokens, 1, head_dim // 2] in ``dtype``;
        looked up once per step and shared by every layer."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [num_tokens, num_heads, head_dim] (may be a strided view);
    cos, sin: [num_tokens, 1, head_dim // 2]. Returns a new contiguous tensor of x's shape."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
