"""Frozen configuration dataclasses, one per concern.

Each has ``validate()`` which raises :class:`ConfigError` naming the field and the limit. Only the
model's own config (HF ``config.json`` or GGUF metadata) is read here; files are parsed elsewhere.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent; the message names the field."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map 'float32'|'bfloat16'|'float16' (or a torch.dtype) to a torch.dtype; ConfigError otherwise."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[key]


def _require_int(name: str, value, optional: bool = False) -> None:
    """ConfigError unless ``value`` is an int (not a bool; None allowed when ``optional``)."""
    if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool)):
        return
    raise ConfigError(f"{name} must be an integer, got {value!r}")


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Parse '2GiB', '512MB', '1e9'-free plain integers, ... into bytes. ConfigError on bad text."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise ConfigError(f"kv_cache_memory: cannot parse size {text!r} (examples: 2GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama family). Sizes are counts, not bytes.

    ``head_dim`` defaults to hidden_size // num_heads. ``eos_token_ids`` lists every id that ends a
    generation (the tokenizer's EOS plus any end-of-turn token).
    """

    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # HF rope_scaling dict as sorted items
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has bias on q/k/v projections
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    def validate(self) -> "ModelConfig":
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model.{f} must be > 0, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.num_heads ({self.num_heads}) must be a multiple of "
                              f"model.num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        return self

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h
        return self.num_layers * layer + emb * (1 if self.tie_word_embeddings else 2) + h

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# --kv-cache-dtype name -> storage dtype (None: the compute dtype). The 1-byte kinds keep a float32
# scale per token and KV head beside the values (kvserve/attention/kv_quant.py).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def parse_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """KV storage dtype for a ``kv_cache_dtype`` name ('auto' = ``compute_dtype``); ConfigError otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {'|'.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or compute_dtype


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. Give the budget as ``kv_cache_memory_bytes`` or ``num_blocks`` (not both);
    neither means the default of 1 GiB. ``kv_cache_dtype`` 'auto' follows the compute dtype.
    ``enable_prefix_caching`` (default on) reuses cached full blocks of equal prefixes."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True

    DEFAULT_MEMORY_BYTES = 1 << 30

    def validate(self) -> "CacheConfig":
        _require_int("block_size", self.block_size)
        _require_int("kv_cache_memory", self.kv_cache_memory_bytes, optional=True)
        _require_int("num_kv_blocks", self.num_blocks, optional=True)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.num_blocks is not None:
            raise ConfigError("give kv_cache_memory or num_kv_blocks, not both")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_kv_blocks must be > 0, got {self.num_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {'|'.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        return self


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduler limits: at most ``max_num_seqs`` requests and ``max_num_batched_tokens``
    tokens per step; ``max_model_len`` caps prompt + output tokens of one request (0 = model's)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0

    def validate(self) -> "SchedulerConfig":
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _require_int(name, getattr(self, name))
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")
        return self


@dataclass(frozen=True)
class SpecDecodeConfig:
    """Speculative decoding: ``method`` None (off), 'ngram' (prompt lookup) or 'draft' (a smaller model,
    ``draft_model``, sharing the target's vocabulary). ``num_speculative_tokens`` = k proposals per step.
    A sequence stops speculating when, after ``min_drafts`` drafts, fewer than ``min_acceptance_rate``
    of its proposals were accepted."""

    method: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    draft_load_format: str = "auto"
    draft_kv_cache_memory_bytes: int = 256 << 20
    min_acceptance_rate: float = 0.25
    min_drafts: int = 8

    def validate(self) -> "SpecDecodeConfig":
        if self.method not in (None, "ngram", "draft"):
            raise ConfigError(f"speculative_method must be ngram or draft, got {self.method!r}")
        if self.method is None:
            return self
        _require_int("num_speculative_tokens", self.num_speculative_tokens)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative_method 'draft' needs draft_model (a model name or path)")
        return self


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~kvserve.engine.llm_engine.LLMEngine` needs.

    ``model`` is a path (.gguf file or HF directory) or a catalog name; ``load_format`` is
    auto|gguf|safetensors|dummy; ``dummy_config`` gives the shape for dummy weights when ``model``
    is not a preset name.
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    dummy_config: ModelConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec_decode: SpecDecodeConfig = field(default_factory=SpecDecodeConfig)
    num_threads: int = 0  # 0 = leave torch's default

    def validate(self) -> "EngineConfig":
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty string (name or path), got {self.model!r}")
        parse_dtype(self.dtype)
        _require_int("seed", self.seed)
        if not -2**63 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        _require_int("num_threads", self.num_threads)
        if self.num_threads < 0:
            raise ConfigError(f"num_threads must be >= 0 (0 = torch's default), got {self.num_threads}")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ConfigError(f"load_format must be auto|gguf|safetensors|dummy, got {self.load_format!r}")
        self.cache.validate()
        self.scheduler.validate()
        self.spec_decode.validate()
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
