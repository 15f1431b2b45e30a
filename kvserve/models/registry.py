"""Architecture name → model class, and building a model in its compute dtype without wasting time
on random initialisation that checkpoint weights will overwrite."""
from __future__ import annotations

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvserve.models.gemma3 import Gemma3ForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.rope import RotaryEmbedding

MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV2ForCausalLM,  # V2's MLA + MoE with the noaux_tc sigmoid router
    "gemma3": Gemma3ForCausalLM,
}


def build_model(cfg: ModelConfig, dtype: torch.dtype, weights=None, seed: int = 0,
                device: str | torch.device = "cpu") -> torch.nn.Module:
    """Allocate ``cfg``'s model in ``dtype`` and fill it from ``weights`` (iterator of HF-named
    tensors) or, when None, with reproducible random weights. ConfigError for unknown architectures."""
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ConfigError(f"architecture {cfg.architecture!r} is not supported; known: {sorted(MODEL_REGISTRY)}")
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to_empty(device=device).to(dtype)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_tables()
    if weights is None:
        model.init_dummy_weights(seed)
    else:
        model.load_weights(weights)
    return model.eval()
