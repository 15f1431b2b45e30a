"""Speculative decoding in the roofline: expected tokens per target step and the speed-up, with the
draft's own cost, from Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding", ICML 2023 (arXiv:2211.17192).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError


def expected_tokens_per_step(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """E[tokens per target step] = (1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023, eq. 1), with
    α the per-token acceptance rate and γ the draft length; α = 1 gives γ + 1. ConfigError for α ∉ [0, 1]."""
    a, g = acceptance_rate, num_speculative_tokens
    if not 0.0 <= a <= 1.0 or g < 0:
        raise ConfigError(f"acceptance_rate must be in [0, 1] and num_speculative_tokens >= 0, got {a}, {g}")
    return float(g + 1) if a == 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)


@dataclass(slots=True)
class SpecDecodeEstimate:
    """tokens_per_step: expected tokens per verification; step_ms: γ draft steps + one target step over
    γ + 1 tokens; itl_ms: step_ms / tokens_per_step; speedup: plain ITL / itl_ms."""

    tokens_per_step: float
    step_ms: float
    itl_ms: float
    speedup: float


def speculative_itl(target_step_ms: float, verify_step_ms: float, draft_step_ms: float,
                    acceptance_rate: float, num_speculative_tokens: int) -> SpecDecodeEstimate:
    """Mean ITL with speculation: (γ × draft_step + verify_step) / E[tokens], where ``verify_step_ms``
    is the target's step over γ + 1 tokens (≈ target_step_ms while memory-bound). With draft cost ratio
    c = draft/target and verify = target this is Leviathan et al.'s speed-up E / (γc + 1) (Thm 3.8)."""
    e = expected_tokens_per_step(acceptance_rate, num_speculative_tokens)
    step = num_speculative_tokens * draft_step_ms + verify_step_ms
    itl = step / e
    return SpecDecodeEstimate(e, step, itl, target_step_ms / itl)
