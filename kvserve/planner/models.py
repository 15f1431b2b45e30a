"""The planner's model table and readers for any HF ``config.json`` (dense, MoE, MLA, sliding window)
or GGUF file. Dense Llama-family entries are built from the engine's ``DUMMY_PRESETS`` so the planner
and the engine use one source of shapes.
"""
from __future__ import annotations

import json
import os

from kvserve.config import ConfigError
from kvserve.models.catalog import DUMMY_PRESETS
from kvserve.planner.shapes import ModelShape

_P = {name: ModelShape.from_model_config(cfg) for name, cfg in DUMMY_PRESETS.items()}

# Shapes from each model's Hugging Face config.json (fields as named there):
#   llama-7b:      huggyllama/llama-7b (LLaMA-1: MHA, 32 layers, hidden 4096, FFN 11008, vocab 32000)
#   mixtral-8x7b:  mistralai/Mixtral-8x7B-v0.1 (8 experts top-2, FFN 14336 per expert)
#   qwen2.5-72b:   Qwen/Qwen2.5-72B-Instruct (80 layers, 64/8 heads, FFN 29568, q/k/v bias)
#   deepseek-v3:   deepseek-ai/DeepSeek-V3 (61 layers, MLA kv_lora_rank 512 + qk_rope_head_dim 64,
#                  q_lora_rank 1536, 256 routed experts top-8 + 1 shared of 2048, first 3 layers dense
#                  with FFN 18432; 671B total / 37B active, arXiv:2412.19437 §4.2)
#   gemma-3-27b:   google/gemma-3-27b-it text_config (62 layers, 32/16 heads × 128, sliding_window 1024,
#                  5 sliding layers : 1 global, arXiv:2503.19786 §2)
#   gemma-3-270m:  google/gemma-3-270m (18 layers, 4/1 heads × 256, sliding_window 512, 5:1 pattern)
MODELS: dict[str, ModelShape] = {
    "llama-3-8b": _P["llama-3-8b"],
    "llama-3-70b": _P["llama-3-70b"],
    "llama-3.1-405b": _P["llama-3.1-405b"],
    "mistral-7b": _P["mistral-7b"],
    "qwen2-7b": _P["qwen2-7b"],
    "smollm2-135m": _P["smollm2-135m"],
    "llama-7b": ModelShape("llama-7b", 32000, 4096, 11008, 32, 32, 32, 128, max_position_embeddings=2048),
    "mixtral-8x7b": ModelShape("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, 128, max_position_embeddings=32768,
                               num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 152064, 8192, 29568, 80, 64, 8, 128, attention_bias=True,
                              max_position_embeddings=32768),
    "deepseek-v3": ModelShape("deepseek-v3", 129280, 7168, 18432, 61, 128, 128, 192,
                              max_position_embeddings=163840, attention="mla", q_lora_rank=1536,
                              kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                              num_experts=256, num_experts_per_tok=8, num_shared_experts=1,
                              moe_intermediate_size=2048, first_k_dense_replace=3),
    "gemma-3-27b": ModelShape("gemma-3-27b", 262208, 5376, 21504, 62, 32, 16, 128, tie_word_embeddings=True,
                              max_position_embeddings=131072, sliding_window=1024, num_sliding_layers=62 - 62 // 6),
    "gemma-3-270m": ModelShape("gemma-3-270m", 262144, 640, 2048, 18, 4, 1, 256, tie_word_embeddings=True,
                               max_position_embeddings=32768, sliding_window=512, num_sliding_layers=18 - 18 // 6),
}

# Names of the same shape (Llama 3.1 / 3.3 keep Llama 3's shape; the context limit differs).
ALIASES = {"llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b", "llama-3.3-70b": "llama-3-70b",
           "mistral-7b-v0.3": "mistral-7b", "deepseek-r1": "deepseek-v3",
           "gemma3-270m": "gemma-3-270m"}  # the engine's catalog name of the bundled Gemma 3
# an alias's own context length where it differs from its shape's (max_position_embeddings of
# meta-llama/Llama-3.1-8B, Llama-3.1-70B and Llama-3.3-70B-Instruct config.json: 131072; Llama 3: 8192)
ALIAS_CONTEXT = {"llama-3.1-8b": 131072, "llama-3.1-70b": 131072, "llama-3.3-70b": 131072}


def known_models() -> list[str]:
    return sorted(set(MODELS) | set(ALIASES))


def get_model(name_or_path: str) -> ModelShape:
    """A table name, an alias, an HF ``config.json`` (or its directory), or a ``.gguf`` file.
    Raises ConfigError listing the known names for anything else."""
    key = name_or_path.lower()
    if key in MODELS or key in ALIASES:
        shape = MODELS[ALIASES.get(key, key)]
        if key not in ALIASES:
            return shape
        return shape.replace(name=key, max_position_embeddings=ALIAS_CONTEXT.get(key, shape.max_position_embeddings))
    if name_or_path.lower().endswith(".gguf") and os.path.isfile(name_or_path):
        return shape_from_gguf(name_or_path)
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if os.path.isfile(path) and path.endswith(".json"):
        with open(path) as f:
            return shape_from_hf_config(json.load(f), os.path.basename(os.path.dirname(os.path.abspath(path))))
    if name_or_path.lower().endswith((".json", ".gguf")) or os.sep in name_or_path:  # meant as a path
        what = "a directory without config.json" if os.path.isdir(name_or_path) else "no such file"
        raise ConfigError(f"model {name_or_path!r}: {what} (give a config.json, an HF directory with one, "
                          f"a .gguf file, or a known name)")
    raise ConfigError(f"unknown model {name_or_path!r}: give a config.json, an HF directory, a .gguf file, "
                      f"or one of {known_models()}")


def _layer_counts(cfg: dict, num_layers: int) -> tuple[int, int]:
    """(sliding_window, number of sliding layers) from layer_types / sliding_window_pattern."""
    window = int(cfg.get("sliding_window") or 0)
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    if cfg.get("layer_types"):
        return window, sum(1 for t in cfg["layer_types"] if t == "sliding_attention")
    pattern = int(cfg.get("sliding_window_pattern") or 0)
    if pattern:  # Gemma 3: every pattern-th layer is global
        return window, num_layers - num_layers // pattern
    return window, num_layers  # Mistral v0.1: every layer slides


def shape_from_hf_config(cfg: dict, name: str = "custom") -> ModelShape:
    """ModelShape from an HF config dict (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Gemma 3,
    DeepSeek-V2/V3). Multimodal configs use their ``text_config``. KeyError → ConfigError naming the
    missing field; ConfigError too for a Qwen2-MoE layout other than every layer sparse
    (``decoder_sparse_step`` 1, no ``mlp_only_layers``)."""
    cfg = {**cfg, **cfg.get("text_config", {})}
    step, dense_only = int(cfg.get("decoder_sparse_step") or 1), cfg.get("mlp_only_layers") or []
    if step != 1 or dense_only:
        field = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
        raise ConfigError(f"config.json of {name!r}: {field} {cfg[field]!r} mixes dense and MoE layers in a "
                          f"pattern the planner does not model (it takes dense layers first, then MoE ones)")
    try:
        layers, heads, hidden = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        window, sliding = _layer_counts(cfg, layers)
        mla = bool(cfg.get("kv_lora_rank"))
        experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        nope, rope = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("qk_rope_head_dim") or 0)
        return ModelShape(
            name=name, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or (nope + rope) or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=cfg.get("model_type") in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            attention="mla" if mla else "gqa", sliding_window=window, num_sliding_layers=sliding,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg.get("v_head_dim") or 0),
            num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0)
    except KeyError as e:
        raise ConfigError(f"config.json of {name!r} lacks the field {e.args[0]!r}") from None


def shape_from_gguf(path: str) -> ModelShape:
    """ModelShape of a GGUF file through the engine's reader (Llama/Mistral/Qwen2 architectures)."""
    from kvserve.models.loader import read_gguf_config

    cfg = read_gguf_config(path)
    return ModelShape.from_model_config(cfg, os.path.splitext(os.path.basename(path))[0])


# the matrices kvserve fuses into one module (QKV; gate/up): one kind for the group, as the engine's
# quantize step decides per module (kvserve.models.quant: a module of mixed checkpoint types stays float)
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up"}


def gguf_auto_weights(path: str, float_bytes: float) -> tuple[str, float, str]:
    """What ``--weight-dtype auto`` keeps of a GGUF file's matrices, for the planner: (the weight dtype
    of most parameters, bytes per parameter read per step, the matrix counts as "120 int4, 1 int8").
    Per module by the engine's own rule (kvserve.models.quant._choose): Q4_0/Q4_1 → int4, Q8_0 → int8,
    anything else (or a fused module of mixed types) → float of ``float_bytes``. The LM head is
    ``output.weight``, or the token embedding where the file has none (tied). Reads tensor types only.
    Raises ConfigError for a file the reader cannot open."""
    from kvserve.models.quant import _choose
    from kvserve.planner.shapes import dtype_bytes

    try:
        from kvserve.models.gguf_reader import FastGGUFReader  # the engine's parse: 16 -> 2.8 s on Gemma 3's file

        tensors = FastGGUFReader(path, "r").tensors
    except Exception as exc:  # a truncated or foreign file
        raise ConfigError(f"cannot read GGUF tensor types from {path}: {exc}") from None
    modules: dict[str, list] = {}
    names = {t.name for t in tensors}
    for t in tensors:
        if len(t.shape) != 2 or not t.name.endswith(".weight"):
            continue
        stem = t.name.removesuffix(".weight")
        if stem == "token_embd" and "output.weight" in names:
            continue  # an input table: only the looked-up rows are read (the cost model adds them)
        blk, _, part = stem.rpartition(".")
        key = f"{blk}.{_FUSED[part]}" if blk and part in _FUSED else stem
        modules.setdefault(key, []).append((t.tensor_type.name, int(t.n_elements)))
    kind_bytes = {"int4": dtype_bytes("int4"), "int8": dtype_bytes("int8"), "float": float_bytes}
    counts: dict[str, int] = {}
    params: dict[str, int] = {}
    for parts in modules.values():
        types = {ty for ty, _ in parts}
        ty = types.pop() if len(types) == 1 else None
        kind = _choose("auto", ty)  # the engine's own rule: 'int4' | 'int8' | 'float'
        counts[kind] = counts.get(kind, 0) + 1
        params[kind] = params.get(kind, 0) + sum(n for _, n in parts)
    total = sum(params.values())
    if not total:
        raise ConfigError(f"{path} holds no 2-D weight matrices")
    per_param = sum(kind_bytes[k] * n for k, n in params.items()) / total
    main = max(params, key=params.get)
    return main, per_param, ", ".join(f"{counts[k]} {k}" for k in ("int4", "int8", "float") if k in counts)
