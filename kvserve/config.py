"""Frozen configuration dataclasses, one per concern.

Each has ``validate()`` which raises :class:`ConfigError` naming the field and the limit. Only the
model's own config (HF ``config.json`` or GGUF metadata) is read here; files are parsed elsewhere.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch


MAX_THREADS = 1024  # the most num_threads taken: above some thousands, torch.set_num_threads crashes the process


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


LAYER_TYPES = ("full_attention", "sliding_attention")


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
    # Multi-head latent attention (attention "mla": DeepSeek-V2/V3, arXiv:2405.04434 §2.1). The cache
    # holds one kv_lora_rank + qk_rope_head_dim latent per token and layer; head_dim = qk_nope + qk_rope
    # (the query/key head), num_kv_heads = num_heads. q_lora_rank 0 = a plain q_proj (no low-rank query).
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # checkpoint rotates interleaved pairs (DeepSeek); the loader de-interleaves
    # Mixture of experts (DeepSeekMoE, arXiv:2401.06066): layers i >= first_k_dense_replace with
    # i % moe_layer_freq == 0 have num_experts routed experts (num_experts_per_tok per token) of
    # moe_intermediate_size plus num_shared_experts always-on ones; the router is topk_method
    # greedy | group_limited_greedy (V2) | noaux_tc (V3) over scoring_func softmax | sigmoid scores.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    num_expert_groups: int = 1
    topk_group: int = 1
    # Local/global attention (Gemma 3, arXiv:2503.19786): layer i attends only to the last
    # ``sliding_window`` tokens (itself included) when ``layer_types[i]`` is "sliding_attention", to the
    # whole context when "full_attention" (HF names). Empty ``layer_types``: every layer is full.
    # Sliding layers rotate with ``rope_local_base_freq``, full ones with ``rope_theta`` (+ rope_scaling).
    # Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (0: head_dim ** -0.5).
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_local_base_freq: float = 10000.0
    query_pre_attn_scalar: int = 0
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
        self._validate_mla_moe()
        self._validate_sliding()
        return self

    def _validate_mla_moe(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"model.attention must be gqa or mla, got {self.attention!r}")
        if self.attention == "mla":
            for f in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) <= 0:
                    raise ConfigError(f"model.{f} must be > 0 for MLA, got {getattr(self, f)}")
            if self.qk_rope_head_dim % 2 or self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ConfigError(f"MLA needs an even qk_rope_head_dim ({self.qk_rope_head_dim}) and head_dim "
                                  f"({self.head_dim}) = qk_nope_head_dim + qk_rope_head_dim")
        if not self.num_experts:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
            raise ConfigError(f"MoE needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                              f"({self.num_experts}) and moe_intermediate_size > 0")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"model.topk_method must be greedy|group_limited_greedy|noaux_tc, "
                              f"got {self.topk_method!r}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"model.scoring_func must be softmax or sigmoid, got {self.scoring_func!r}")
        if self.moe_layer_freq <= 0 or self.num_experts % self.num_expert_groups \
                or not 0 < self.topk_group <= self.num_expert_groups:
            raise ConfigError(f"MoE needs moe_layer_freq > 0, num_experts ({self.num_experts}) divisible by "
                              f"n_group ({self.num_expert_groups}) and 0 < topk_group <= n_group")

    def _validate_sliding(self) -> None:
        if self.sliding_window < 0:
            raise ConfigError(f"model.sliding_window must be >= 0 (0 = none), got {self.sliding_window}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"model.layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - set(LAYER_TYPES)
        if bad:
            raise ConfigError(f"model.layer_types entries must be one of {LAYER_TYPES}, got {sorted(bad)}")
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            raise ConfigError("model.layer_types has sliding_attention layers but sliding_window is 0")

    def layer_window(self, layer: int) -> int:
        """Tokens layer ``layer`` (0-based) attends to: ``sliding_window`` for a sliding layer, 0 (all)
        for a full-attention one."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """``layer_window`` of every layer (all 0 for a model without sliding-window layers)."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has routed experts (DeepSeek's rule)."""
        return bool(self.num_experts) and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied; MLA/MoE norms and biases ignored)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.attention == "mla":
            attn = self._mla_params()
        num_moe = sum(self.is_moe_layer(n) for n in range(self.num_layers))
        moe = h * self.num_experts + 3 * h * self.moe_intermediate_size * (self.num_experts + self.num_shared_experts)
        norms = 4 * h + 2 * d if self.architecture == "gemma3" else 2 * h  # Gemma 3: 4 norms + q/k norms
        layers = self.num_layers * (attn + norms) + (self.num_layers - num_moe) * 3 * h * i + num_moe * moe
        emb = self.vocab_size * h
        return layers + emb * (1 if self.tie_word_embeddings else 2) + h

    def _mla_params(self) -> int:
        """q (low-rank or plain), kv_a (latent + rope key), kv_b (latent → k_nope, v), o (arXiv:2405.04434)."""
        h, H, r = self.hidden_size, self.num_heads, self.q_lora_rank
        q = h * r + r * H * self.head_dim if r else h * H * self.head_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + \
            self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + H * self.v_head_dim * h

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


MAX_SCHEDULER_STEPS = 64  # decode steps per engine step at most (each holds its KV slots ahead)


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduler limits: at most ``max_num_seqs`` requests and ``max_num_batched_tokens``
    tokens per step; ``max_model_len`` caps prompt + output tokens of one request (0 = model's).

    ``num_scheduler_steps`` (vLLM's multi-step scheduling): up to this many decode steps per engine
    step, run back to back without returning to the scheduler, where every row of a decode-only step
    takes the plain greedy or plain sampled token in the decode plan's C call (otherwise one step;
    the scheduler's ``_add_lookahead`` says when a step gets the KV slots for a burst).
    The engine's bookkeeping between steps (scheduling, stop checks, detokenizing, outputs: a few
    hundred µs on a CPU) then happens once per burst; the tokens of a burst leave together, so a
    streaming client sees them in bursts and the gaps between tokens are ~0 inside a burst (the mean
    gap, TPOT, is the per-token time). The same tokens as one step at a time (each inner step is the
    same C call on the same inputs)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    num_scheduler_steps: int = 1

    def validate(self) -> "SchedulerConfig":
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_scheduler_steps"):
            _require_int(name, getattr(self, name))
        if not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            raise ConfigError(f"num_scheduler_steps must be in [1, {MAX_SCHEDULER_STEPS}], "
                              f"got {self.num_scheduler_steps}")
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
    of its proposals were accepted. ``validate`` raises ConfigError naming the field for any value out of
    range, with speculation off too, and for a ``draft_model`` or non-auto ``draft_load_format`` with a
    method other than 'draft' (they would be silently ignored)."""

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
        if self.method != "draft" and (self.draft_model or self.draft_load_format != "auto"):
            # else the draft settings would be ignored without a word
            what = f"draft_model {self.draft_model!r}" if self.draft_model else \
                f"draft_load_format {self.draft_load_format!r}"
            got = f"got speculative_method {self.method!r}" if self.method else "and no speculative_method was given"
            raise ConfigError(f"{what} is used only with speculative_method 'draft', {got}")
        # every field is checked even with speculation off: a bad value is an error, never ignored
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "min_drafts",
                     "draft_kv_cache_memory_bytes"):
            _require_int(name, getattr(self, name))
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        from kvserve.models.catalog import LOAD_FORMATS  # catalog imports this module

        if self.draft_load_format not in LOAD_FORMATS:
            raise ConfigError(f"draft_load_format must be one of {'|'.join(LOAD_FORMATS)}, "
                              f"got {self.draft_load_format!r}")
        if not (isinstance(self.min_acceptance_rate, (int, float)) and 0.0 <= self.min_acceptance_rate <= 1.0):
            raise ConfigError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate!r}")
        if self.min_drafts < 0:
            raise ConfigError(f"min_drafts must be >= 0, got {self.min_drafts}")
        if self.draft_kv_cache_memory_bytes <= 0:
            raise ConfigError(f"draft_kv_cache_memory_bytes must be > 0, got {self.draft_kv_cache_memory_bytes}")
        if self.method is None:
            return self
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative_method 'draft' needs draft_model (--draft-model: a model name or path)")
        return self


WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")


def _validate_weight_dtype(weight_dtype: str, dtype: str) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype must be one of {'|'.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if weight_dtype in ("float32", "bfloat16") and parse_dtype(weight_dtype) != parse_dtype(dtype):
        raise ConfigError(f"weight_dtype {weight_dtype} needs dtype {weight_dtype} (float weights are "
                          f"multiplied in the compute dtype, here {dtype}); or use weight_dtype int8/int4")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~kvserve.engine.llm_engine.LLMEngine` needs.

    ``model`` is a path (.gguf file or HF directory) or a catalog name; ``load_format`` is
    auto|gguf|safetensors|dummy; ``dummy_config`` gives the shape for dummy weights when ``model``
    is not a preset name. ``dtype`` is the compute dtype (activations, norms, attention);
    ``weight_dtype`` how matrices are stored: auto (a GGUF keeps its Q4_0/Q4_1/Q8_0 quantization,
    anything else uses ``dtype``), float32/bfloat16 (must equal ``dtype``), int8 or int4
    (kvserve/models/quant.py).
    """

    model: str = "smollm2-135m"
    dtype: str = "float32"
    weight_dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None
    dummy_config: ModelConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec_decode: SpecDecodeConfig = field(default_factory=SpecDecodeConfig)
    num_threads: int = 0  # 0 = leave torch's default
    compile: bool = False  # torch.compile the decoder layers (kvserve/engine/compile.py)

    def validate(self) -> "EngineConfig":
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a non-empty string (name or path), got {self.model!r}")
        parse_dtype(self.dtype)
        _validate_weight_dtype(self.weight_dtype, self.dtype)
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile must be true or false, got {self.compile!r}")
        _require_int("seed", self.seed)
        if not -2**63 <= self.seed < 2**63:
            raise ConfigError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        _require_int("num_threads", self.num_threads)
        if not 0 <= self.num_threads <= MAX_THREADS:  # torch.set_num_threads(100000) segfaults
            raise ConfigError(f"num_threads must be in [0, {MAX_THREADS}] (0 = torch's default), "
                              f"got {self.num_threads}")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ConfigError(f"load_format must be auto|gguf|safetensors|dummy, got {self.load_format!r}")
        self.cache.validate()
        self.scheduler.validate()
        self.spec_decode.validate()
        if self.scheduler.num_scheduler_steps > 1 and self.spec_decode.method is not None:
            raise ConfigError(f"num_scheduler_steps must be 1 with speculative decoding (speculative_method "
                              f"{self.spec_decode.method!r}), got {self.scheduler.num_scheduler_steps}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
