"""GGUF checkpoints: config from the metadata, weights dequantized to float32 (any ggml type gguf-py
reads) with llama.cpp's q/k row permutation undone, and how each matrix was quantized (for packed
int4/int8 weights, kvserve/models/quant.py). Names come out as HF names; see :mod:`kvserve.models.loader`.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterator

import numpy as np
import torch

from kvserve.config import ConfigError, ModelConfig
from kvserve.models.quant import SourceQuant, gguf_block_quant

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "gemma3")
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
# Gemma 3 has four norms per block and QK-norm; its "ffn_norm" is the norm *before* the MLP.
_GGUF_GEMMA3_NAMES = {**_GGUF_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                      "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                      "output": "lm_head"}
_CONTROL_TOKEN = 3  # gguf.TokenType.CONTROL
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

def _open_gguf(path: str):
    """GGUFReader for ``path`` (memory-mapped; see kvserve/models/gguf_reader.py for the fast parse)."""
    from kvserve.models.gguf_reader import FastGGUFReader

    if not os.path.isfile(path):
        raise ConfigError(f"GGUF file not found: {path!r}")
    try:
        return FastGGUFReader(path, "r")
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
    """EOS id first, then the ids of end-of-turn tokens present in the vocab as control tokens (GGUF
    token type 3; Gemma's ``</s>`` is an ordinary user-defined token), and GGUF eot/eom ids."""
    ids = [_field(reader, "tokenizer.ggml.eos_token_id")]
    ids += [_field(reader, "tokenizer.ggml.eot_token_id"), _field(reader, "tokenizer.ggml.eom_token_id")]
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    types = _field(reader, "tokenizer.ggml.token_type", [])
    index = {t: i for i, t in enumerate(tokens)
             if t in END_OF_TURN_TOKENS and (i >= len(types) or types[i] == _CONTROL_TOKEN)}
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
        **(_gguf_gemma3(reader, arch) if arch == "gemma3" else {}),
    )


def _gguf_gemma3(reader, arch: str) -> dict:
    """Gemma 3 fields GGUF metadata leaves to llama.cpp's code (src/llama-model.cpp, LLM_ARCH_GEMMA3):
    every 6th layer is global (``sliding_window_pattern`` 6, as HF's default), local layers rotate with
    base 10,000, and scores scale by head_dim^-0.5 except in the 62-layer 27B (hidden / heads). Keys
    newer converters write (``rope.freq_base_swa``, ``attention.sliding_window_pattern``) win."""
    num_layers, hidden = int(_field(reader, f"{arch}.block_count")), int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True = sliding
        types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
    else:
        types = tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    return dict(sliding_window=int(_field(reader, f"{arch}.attention.sliding_window", 0)), layer_types=types,
                rope_local_base_freq=float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)),
                query_pre_attn_scalar=hidden // num_heads if num_layers == 62 else head_dim)


def read_gguf_config(path: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (``general.architecture`` llama — Mistral GGUFs use it too —,
    qwen2 or gemma3). ``tie_word_embeddings`` is True when there is no ``output.weight`` tensor.
    Raises ConfigError if the file is missing or the architecture unsupported."""
    return _config_from_reader(_open_gguf(path), path)


def gguf_to_hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name for a GGUF tensor name of architecture ``arch`` ('blk.3.attn_q.weight' →
    'model.layers.3.self_attn.q_proj.weight'); None for tensors the model does not use (e.g.
    'rope_freqs.weight')."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = (_GGUF_GEMMA3_NAMES if arch == "gemma3" else _GGUF_BLOCK_NAMES).get(part)
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
        name = gguf_to_hf_name(tensor.name, config.architecture)
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        arr = _dequantize(tensor)
        if config.architecture == "gemma3" and tensor.name.endswith("norm.weight"):
            arr = arr - np.float32(1)  # llama.cpp stores Gemma's 1 + w (convert_hf_to_gguf.py); HF keeps w
        # llama.cpp permutes q/k only for the llama architecture (qwen2 and gemma3 use NeoX RoPE, unpermuted).
        if config.architecture == "llama" and ".attn_q." in tensor.name:
            arr = unpermute_qk(arr, config.num_heads)
        elif config.architecture == "llama" and ".attn_k." in tensor.name:
            arr = unpermute_qk(arr, config.num_kv_heads)
        yield name, torch.from_numpy(np.ascontiguousarray(arr))


def gguf_quant_sources(reader, config: ModelConfig) -> dict[str, SourceQuant]:
    """HF name → :class:`SourceQuant` (ggml type, and decoded 4-bit blocks for Q4_0/Q4_1 with the
    same q/k row un-permutation as the float weights) for every tensor the model uses."""
    out = {}
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name, config.architecture)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        blocks = gguf_block_quant(tensor.data, tensor.tensor_type.name, shape) if len(shape) == 2 else None
        if blocks is not None and config.architecture == "llama" and ".attn_q." in tensor.name:
            blocks = blocks.permute_rows(lambda a: unpermute_qk(a, config.num_heads))
        elif blocks is not None and config.architecture == "llama" and ".attn_k." in tensor.name:
            blocks = blocks.permute_rows(lambda a: unpermute_qk(a, config.num_kv_heads))
        out[name] = SourceQuant(tensor.tensor_type.name, blocks)
    return out


def iter_gguf_weights(path: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor in HF shape) for every tensor of a GGUF file.

    Dequantizes every ggml type gguf-py supports (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, ...)
    with ``gguf.quants.dequantize`` and un-permutes llama q/k rows (see :func:`unpermute_qk`). Shows a
    tqdm bar "Loading <name>" unless ``progress`` is False. Raises ConfigError for a missing file or
    unsupported architecture; NotImplementedError for a ggml type gguf-py cannot dequantize.
    """
    reader = _open_gguf(path)
    yield from _iter_reader_weights(reader, _config_from_reader(reader, path), progress)
