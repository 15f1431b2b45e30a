"""Gemma 3: the engine against HF transformers, and sliding-window KV blocks freed as context grows.

* Tiny random-weight Gemma 3 (``tiny-gemma3``: MQA, QK-norm, 16-token window on 4 of 6 layers, block
  size 4) with weights copied from an HF ``Gemma3ForCausalLM`` (norm weights randomised, so a wrong
  ``1 + w`` would show): greedy output token-identical to HF's ``generate`` over ~110-token contexts
  (7× the window) under chunked prefill and preemption; local layers never hold more than their
  window's blocks; n > 1, abort and speculative decoding (n-gram and draft model) give HF's tokens;
  the pool is entirely free at the end; KV bytes per step follow the hand formula.
* The real Gemma-3-270M (Q4_K_M GGUF, float32 weights) against HF loading the same GGUF: logits at
  every 5th position and the last 8 within 2e-3 absolute (both dequantize the same blocks; the rest is
  matmul order and RoPE tables: measured 1e-5 at 6 tokens, 1.3-2.3e-4 at 712 tokens), fed in chunks
  through the paged cache on a prompt past the 512-token window; greedy generation token-identical.
"""
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata
from kvserve.kv_cache.manager import FREED_BLOCK_ID
from kvserve.models.catalog import DUMMY_PRESETS

TINY = DUMMY_PRESETS["tiny-gemma3"]
GREEDY = dict(temperature=0, ignore_eos=True)


# ---------------------------------------------------------------------------------- tiny model
def _hf_config(cfg):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types),
        max_position_embeddings=cfg.max_position_embeddings, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq}})


@pytest.fixture(scope="module")
def tiny_hf():
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(_hf_config(TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)  # HF initialises norms to 0 (scale 1): randomise to test 1 + w
    model.generation_config.eos_token_id = None
    return model


def _tiny_llm(hf, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    llm = LLM("tiny-gemma3", load_format="dummy", progress=False, block_size=4, **kw)
    llm.engine.model.load_weights((k, v.clone()) for k, v in hf.state_dict().items())
    return llm


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(hf, prompt, n):
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _live(table):
    return sum(b != FREED_BLOCK_ID for b in table)


def test_tiny_matches_hf_over_long_contexts_with_freeing_and_preemption(tiny_hf):
    prompts, n = _prompts([70, 60, 50]), 40
    expected = [_hf_greedy(tiny_hf, p, n) for p in prompts]
    # 84 blocks: one request of 128 tokens needs 82 (full groups 2 x 32, sliding 2 x 9), so three
    # requests of 90-110 tokens (full groups alone: 2 x 28, 2 x 25, 2 x 23) must preempt
    llm = _tiny_llm(tiny_hf, num_kv_blocks=84, max_num_batched_tokens=16)
    eng, kv = llm.engine, llm.engine.kv_manager
    assert [g.sliding_window for g in eng.kv_spec.groups] == [0, 16, 16]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=n, **GREEDY))
    outs, max_live = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        for req in eng.scheduler.running:
            for table in kv.block_tables(req.request_id)[1:]:  # the sliding groups
                max_live = max(max_live, _live(table))
                assert len(table) * 4 >= req.num_computed_tokens
    assert [outs[str(i)] for i in range(3)] == expected
    assert eng.scheduler.num_preemptions > 0
    assert max_live <= -(-(16 - 1 + 16) // 4) + 1  # window + one chunk, not the ~28 blocks of 110 tokens
    assert kv.num_free_blocks == eng.num_kv_blocks


def test_tiny_n2_abort_and_speculative_match_hf(tiny_hf):
    prompt = _prompts([12])[0] * 3  # repeats: the n-gram proposer finds matches
    expected = _hf_greedy(tiny_hf, prompt, 30)
    llm = _tiny_llm(tiny_hf, num_kv_blocks=200, max_num_batched_tokens=32)
    out = llm.generate([prompt], SamplingParams(n=2, max_tokens=30, **GREEDY))[0]
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    eng = llm.engine
    eng.add_request("long", _prompts([90])[0], SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(6):
        eng.step()
    assert eng.kv_manager.num_free_blocks < eng.num_kv_blocks
    eng.abort_request("long")
    assert eng.kv_manager.num_free_blocks == eng.num_kv_blocks
    for method in ("ngram", "draft"):  # draft: tiny-gemma3 with its own (dummy) weights, mostly rejected
        spec = _tiny_llm(tiny_hf, num_kv_blocks=200, max_num_batched_tokens=32, speculative_method=method,
                         draft_model="tiny-gemma3" if method == "draft" else None,
                         draft_load_format="dummy" if method == "draft" else "auto", num_speculative_tokens=3)
        got = spec.generate([prompt], SamplingParams(max_tokens=30, **GREEDY))[0].outputs[0]
        assert got.token_ids == expected, method
        assert got.latency.num_drafts > 0
        assert spec.engine.kv_manager.num_free_blocks == spec.engine.num_kv_blocks


def test_tiny_kv_bytes_per_step_follow_the_window(tiny_hf, caplog):
    with caplog.at_level("WARNING"):
        llm = _tiny_llm(tiny_hf, num_kv_blocks=200)
    assert "prefix caching is off" in caplog.text and not llm.engine.kv_manager.enable_prefix_caching
    eng = llm.engine
    llm.generate([_prompts([30])[0]], SamplingParams(max_tokens=20, **GREEDY))
    per_layer = 2 * TINY.num_kv_heads * TINY.head_dim * 4  # K + V, float32
    decodes = [s for s in eng.step_stats if s.is_decode_only]
    assert len(decodes) == 19
    for i, s in enumerate(decodes):
        ctx = 31 + i  # tokens in the cache after this step
        assert s.kv_bytes_read == per_layer * (2 * ctx + 4 * min(ctx, 16)), (i, s.kv_bytes_read)
    assert eng.kv_spec.bytes_per_token == 6 * per_layer


# ---------------------------------------------------------------------------------- real model
def _long_text() -> str:
    """~640 tokens of CPython's own documentation (pydoc_data ships with every CPython)."""
    from pydoc_data.topics import topics

    return topics["assignment"][:3200]


@pytest.fixture(scope="module")
def gemma():
    return LLM("gemma3-270m", progress=False, weight_dtype="float32", max_model_len=2048)


@pytest.fixture(scope="module")
def hf_gemma(gemma):
    """HF's own GGUF loader. gguf's GGUFReader is swapped for kvserve's FastGGUFReader (the same parse,
    ~6× faster on a 262k vocabulary) and shared by HF's two reads of the file: test time only."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import gguf

    from kvserve.models.catalog import catalog_path
    from kvserve.models.gguf_reader import FastGGUFReader

    path = catalog_path("gemma3-270m")
    readers = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "GGUFReader", lambda p, mode="r": readers.setdefault((p, mode), FastGGUFReader(p, mode)))
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    finally:
        mp.undo()
    model.generation_config.eos_token_id = None
    return model.eval()


def _chunked_logits(llm, ids, chunk, keep):
    """Logits at positions ``keep`` (sorted), feeding ``chunk`` tokens per step through the engine's own
    paged cache: KV cache groups, window freeing and cached-context attention all take part."""
    eng = llm.engine
    kv, runner, bs = eng.kv_manager, eng.runner, eng.kv_spec.block_size
    out, freed = [], False
    try:
        for c in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - c)
            assert kv.allocate_slots("probe", c + n, num_computed_tokens=c)
            metas = [AttentionMetadata.build([t], [c], [n], bs, sliding_window=g.sliding_window)
                     for t, g in zip(kv.block_tables("probe"), runner.groups)]
            with torch.inference_mode():
                hidden = eng.model(torch.tensor(ids[c:c + n]), torch.arange(c, c + n), runner.kv_caches,
                                   runner.per_layer_metadata(metas))
                rows = [p - c for p in keep if c <= p < c + n]
                out.append(eng.model.compute_logits(hidden[rows]))
        freed = any(FREED_BLOCK_ID in t for t in kv.block_tables("probe"))
    finally:
        kv.free("probe")
    return torch.cat(out), freed


@pytest.mark.slow
def test_real_logits_match_hf(gemma, hf_gemma):
    tok = gemma.tokenizer
    for text, chunk in (("The capital of France is", 64), (_long_text(), 160)):
        ids = tok.encode(text)
        keep = sorted(set(range(0, len(ids), 5)) | set(range(max(0, len(ids) - 8), len(ids))))  # LM head: ~5x less
        ours, freed = _chunked_logits(gemma, ids, chunk, keep)
        assert freed == (len(ids) > 600)  # local layers released the blocks behind the window
        with torch.inference_mode():
            ref = hf_gemma(torch.tensor([ids]), logits_to_keep=torch.tensor(keep)).logits[0].float()
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < 2e-3, (len(ids), err)
        print(f"gemma3-270m logits vs HF: {len(ids)} tokens, max |diff| {err:.2e}")
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert len(ids) > 600  # the long prompt is past the 512-token window


@pytest.mark.slow
def test_real_greedy_identical_to_hf(gemma, hf_gemma):
    prompts = ["The capital of France is", "def fibonacci(n):", _long_text()]
    ours = gemma.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for prompt, out in zip(prompts, ours):
        ids = gemma.tokenizer.encode(prompt)
        assert out.outputs[0].token_ids == _hf_greedy(hf_gemma, ids, 12), prompt


@pytest.mark.slow
def test_real_shape_header_and_kv_bytes(gemma):
    from kvserve.cli import model_header

    cfg, spec = gemma.engine.model_config, gemma.engine.kv_spec
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (4, 1, 256, 512)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert cfg.rope_theta == 1e6 and cfg.rope_local_base_freq == 1e4 and cfg.tie_word_embeddings
    per_layer = 2 * 1 * 256 * 4
    assert spec.bytes_per_token == 18 * per_layer  # 36,864 B: every layer stores the newest token
    for ctx in (100, 512, 2048, 4096):
        assert spec.kv_bytes_read(ctx) == per_layer * (3 * ctx + 15 * min(ctx, 512))
    assert "15 of 18 layers" in model_header(gemma) and "512" in model_header(gemma)
