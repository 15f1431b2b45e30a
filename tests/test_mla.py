"""DeepSeek-V2/V3 (MLA + MoE) against HF transformers on tiny random-weight models saved as safetensors.

Models: hidden 64, 4 heads, kv_lora_rank 32 + qk_rope_head_dim 8, qk_nope 16, v_head_dim 12, 8 routed
experts (top-2) + 1 shared from layer 1 on (layer 0 dense), vocab 512; HF initializer_range 0.1 so
logits are peaked (greedy is not decided by float noise). Tolerances, float32: logits within 1e-4 abs
(logits are O(1-5); the observed difference is ~3e-6, from matmul order and the absorbed form).
"""
import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import AttentionMetadata
from kvserve.attention.kv_quant import QuantizedKVCache
from kvserve.config import ConfigError, ModelConfig
from kvserve.kv_cache.spec import KVCacheSpec
from kvserve.models.deepseek_v2 import select_experts
from kvserve.models.loader import read_hf_config

transformers = pytest.importorskip("transformers")

TOL = 1e-4
L, R, LAYERS = 32, 8, 2
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=L, q_lora_rank=48,
            qk_nope_head_dim=16, qk_rope_head_dim=R, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.1,
            bos_token_id=1, eos_token_id=2)
PROMPTS = [list(range(40, 45)), [7, 300, 12, 99, 250, 3, 64, 18], [(13 * i) % 500 + 5 for i in range(23)]]
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
            mscale=1.0, mscale_all_dim=0.5, beta_fast=32, beta_slow=1)
VARIANTS = {
    "q_lora": ("DeepseekV2", {}),
    "plain_q": ("DeepseekV2", dict(q_lora_rank=None)),
    "group_limited": ("DeepseekV2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                         routed_scaling_factor=2.0)),
    "yarn": ("DeepseekV2", dict(rope_parameters=YARN)),
    "v3": ("DeepseekV3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
}


@pytest.fixture(scope="module")
def tokenizer():
    from kvserve.models.catalog import catalog_path
    from kvserve.models.loader import load_gguf_tokenizer

    try:
        return load_gguf_tokenizer(catalog_path("smollm2-135m"))
    except ConfigError as e:
        pytest.skip(f"bundled tokenizer unavailable: {e}")


def _save_hf(kind: str, overrides: dict, directory, tokenizer):
    """A random-weight HF model saved (safetensors, config.json, tokenizer) into ``directory``."""
    cfg = getattr(transformers, kind + "Config")(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, kind + "ForCausalLM")(cfg).eval()
    with torch.no_grad():  # V3: a non-zero routing bias, so choosing with it and weighing without it matters
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """variant → (directory, HF model), built on first use."""
    cache = {}

    def get(variant):
        if variant not in cache:
            d = tmp_path_factory.mktemp(variant)
            cache[variant] = (str(d), _save_hf(*VARIANTS[variant], d, tokenizer))
        return cache[variant]
    return get


def _llm(path, **kw):
    kw = {"block_size": 4, "num_kv_blocks": 96, "max_model_len": 256, "progress": False, **kw}
    return LLM(path, **kw)


def _hf_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _run_steps(model, spec: KVCacheSpec, prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Feed ``prompts`` through ``model`` in steps on a private latent cache (scattered blocks): step j
    gives sequence i ``steps[j][i]`` more tokens (0 = not scheduled; one-token queries go first, as the
    scheduler orders them). Returns each sequence's logits at every position."""
    kv = [torch.zeros(64, spec.block_size, 1, spec.head_dim) for _ in range(spec.num_layers)]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[perm.pop() for _ in range(-(-len(p) // spec.block_size))] for p in prompts]
    done, logits = [0] * len(prompts), [[] for _ in prompts]
    for step in steps:
        seqs = sorted((i for i, n in enumerate(step) if n), key=lambda i: step[i] != 1)
        meta = AttentionMetadata.build([tables[i] for i in seqs], [done[i] for i in seqs], [step[i] for i in seqs],
                                       spec.block_size)
        ids = [t for i in seqs for t in prompts[i][done[i]:done[i] + step[i]]]
        pos = [p for i in seqs for p in range(done[i], done[i] + step[i])]
        with torch.inference_mode():
            out = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), kv, meta))
        for i, chunk in zip(seqs, out.split([step[i] for i in seqs])):
            logits[i].append(chunk)
            done[i] += step[i]
    return [torch.cat(x) for x in logits]


# ------------------------------------------------------------------------------------ parity with HF
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(models, variant):
    """Whole prompts in one prefill step each (expanded attention) against HF's forward."""
    path, hf = models(variant)
    llm = _llm(path)
    ours = _run_steps(llm.engine.model, llm.engine.kv_spec, PROMPTS, [[len(p) for p in PROMPTS]])
    for ids, got in zip(PROMPTS, ours):
        ref = _hf_logits(hf, ids)
        assert (got - ref).abs().max() < TOL, (got - ref).abs().max()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_yarn_changes_the_model():
    """Guard for the yarn variant above: its HF logits really differ from default RoPE's."""
    cfgs = [transformers.DeepseekV2Config(**{**BASE, **kw}) for kw in ({}, {"rope_parameters": YARN})]
    outs = []
    for cfg in cfgs:
        torch.manual_seed(0)
        outs.append(_hf_logits(transformers.DeepseekV2ForCausalLM(cfg).eval(), PROMPTS[2]))
    assert (outs[0] - outs[1]).abs().max() > 100 * TOL


@pytest.mark.parametrize("variant", ["q_lora", "plain_q"])
def test_chunked_prefill_and_absorbed_decode_match_hf(models, variant):
    """Two sequences over 4-token blocks: prefill chunks with and without context (expanded), single
    tokens (absorbed decode) batched with another sequence's chunk, against HF's full-prompt logits."""
    path, hf = models(variant)
    llm = _llm(path)
    a, b = PROMPTS[2], PROMPTS[1] + PROMPTS[0]  # 23 and 13 tokens
    steps = [[7, 5], [6, 1], [1, 4], [1, 1], [1, 1], [1, 0], [4, 0], [1, 0], [1, 0]]
    assert [sum(s[i] for s in steps) for i in (0, 1)] == [23, 12]
    got_a, got_b = _run_steps(llm.engine.model, llm.engine.kv_spec, [a, b[:12]], steps)
    for got, ids in ((got_a, a), (got_b, b[:12])):
        ref = _hf_logits(hf, ids)
        assert (got - ref).abs().max() < TOL, (got - ref).abs().max()


def test_absorbed_decode_equals_expanded_prefill(models):
    """The same prompt token by token (every step a decode: absorbed) and in one prefill (expanded)."""
    path, _ = models("q_lora")
    eng = _llm(path).engine
    ids = PROMPTS[2]
    absorbed = _run_steps(eng.model, eng.kv_spec, [ids], [[1]] * len(ids))[0]
    expanded = _run_steps(eng.model, eng.kv_spec, [ids], [[len(ids)]])[0]
    assert (absorbed - expanded).abs().max() < 2e-5, (absorbed - expanded).abs().max()


@pytest.mark.parametrize("variant", ["q_lora", "plain_q", "v3"])
def test_greedy_generation_identical_to_hf_and_pool_freed(models, variant):
    """Three prompts in one continuous batch (batched absorbed decode with padding), 12 tokens each,
    token-identical to HF ``generate``; afterwards every KV block is free again."""
    path, hf = models(variant)
    llm = _llm(path)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    eng = llm.engine
    assert eng.kv_manager.num_free_blocks == eng.num_kv_blocks
    assert any(s.num_decode_tokens == 3 for s in eng.step_stats)  # the batched decode path ran


def test_prefix_cache_hit_and_bfloat16(models):
    """A repeated 23-token prompt starts from its 5 cached latent blocks and gives the same tokens;
    bfloat16 compute runs the same paths (its tokens may differ from float32: not compared)."""
    path, _ = models("q_lora")
    llm = _llm(path)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([PROMPTS[2]], sp)[0].outputs[0].token_ids
    hits = llm.engine.kv_manager.num_hit_tokens
    assert llm.generate([PROMPTS[2]], sp)[0].outputs[0].token_ids == first
    assert llm.engine.kv_manager.num_hit_tokens - hits == 20
    out = _llm(path, dtype="bfloat16").generate([PROMPTS[2]], sp)[0].outputs[0].token_ids
    assert len(out) == 6


# ------------------------------------------------------------------------------------ KV accounting
def test_kv_cache_is_one_latent_row_per_token(models):
    """Engine, cache tensors, step stats and planner all count num_layers × (L + R) × 4 bytes per token."""
    from kvserve.planner.models import shape_from_hf_config
    from kvserve.planner.shapes import ModelShape

    path, _ = models("q_lora")
    llm = _llm(path)
    eng = llm.engine
    per_token = LAYERS * (L + R) * 4
    assert eng.kv_spec.attention == "mla" and eng.kv_spec.bytes_per_token == per_token == 320
    caches = eng.runner.kv_caches
    assert len(caches) == LAYERS and all(isinstance(c, torch.Tensor) for c in caches)  # no (K, V) pairs
    assert caches[0].shape == (eng.num_kv_blocks, 4, 1, L + R)
    assert sum(c.numel() * c.element_size() for c in caches) == eng.num_kv_blocks * eng.kv_spec.bytes_per_block
    with open(f"{path}/config.json") as f:
        planner_shape = shape_from_hf_config(json.load(f))
    assert planner_shape.kv_bytes_per_token("fp32") == per_token
    assert ModelShape.from_model_config(eng.model_config).kv_bytes_per_token("fp32") == per_token
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert eng.step_stats[-1].kv_bytes_per_token == per_token
    assert eng.step_stats[-1].kv_bytes_read == (len(PROMPTS[0]) + 1) * per_token


def test_deepseek_v3_config_bytes_per_token(tmp_path):
    """The published DeepSeek-V3 config.json through the loader: bf16 latent = 61 × 576 × 2 B."""
    cfg = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
           "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
           "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
           "norm_topk_prob": True, "routed_scaling_factor": 2.5, "max_position_embeddings": 163840}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = read_hf_config(str(tmp_path)).validate()
    assert (mc.topk_method, mc.scoring_func, mc.head_dim) == ("noaux_tc", "sigmoid", 192)
    assert KVCacheSpec.from_model(mc, torch.bfloat16, 16).bytes_per_token == 61 * 576 * 2 == 70_272
    assert abs(mc.num_params() / 1e9 - 671) < 1.0  # 671B total (the MTP layer excluded)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_latent_cache(models, kind):
    """1-byte latent rows plus one float32 scale per row: bytes = layers × (L + R + 4); generation runs
    and frees the pool; prefill logits stay close to HF's float model."""
    path, hf = models("q_lora")
    llm = _llm(path, kv_cache_dtype=kind)
    eng = llm.engine
    assert eng.kv_spec.bytes_per_token == LAYERS * (L + R + 4)
    assert isinstance(eng.runner.kv_caches[0], QuantizedKVCache)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert eng.kv_manager.num_free_blocks == eng.num_kv_blocks
    ids = PROMPTS[2]
    bs = eng.kv_spec.block_size
    meta = AttentionMetadata.build([list(range(-(-len(ids) // bs)))], [0], [len(ids)], bs)
    with torch.inference_mode():  # the engine is idle: its (freed) blocks can be borrowed
        got = eng.model.compute_logits(eng.model(torch.tensor(ids), torch.arange(len(ids)), eng.runner.kv_caches, meta))
    err = (got - _hf_logits(hf, ids)).abs().max().item()
    assert TOL < err < (0.05 if kind == "int8" else 0.25), err


# ------------------------------------------------------------------------------------ MoE
def test_step_weight_bytes_count_only_touched_experts(models):
    path, _ = models("q_lora")
    llm = _llm(path)
    eng, model = llm.engine, llm.engine.model
    expert = model.layers[1].mlp.experts
    assert model.routed_expert_bytes() == 8 * expert.bytes_per_expert
    all_params = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.embed_tokens.weight
    assert eng.weight_bytes_per_step == all_params - emb.numel() * emb.element_size() - model.routed_expert_bytes()
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    decode = eng.step_stats[-1]
    assert decode.num_tokens == 1
    routed = decode.weight_bytes - eng.weight_bytes_per_step - emb.shape[1] * emb.element_size()
    assert routed == 2 * expert.bytes_per_expert  # one token, top-2, one MoE layer


def test_select_experts_methods():
    cfg = ModelConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, num_expert_groups=4,
                      topk_group=1, routed_scaling_factor=3.0)
    logits = torch.tensor([[0.0, 5.0, 4.0, 0.0, 4.5, 4.4, 0.0, 0.0]])
    w, ids = select_experts(logits, cfg.replace(topk_method="greedy"))
    assert sorted(ids[0].tolist()) == [1, 4]
    assert torch.allclose(w.sum(), logits.softmax(-1)[0, [1, 4]].sum() * 3.0)
    w, ids = select_experts(logits, cfg.replace(topk_method="group_limited_greedy"))
    assert sorted(ids[0].tolist()) == [0, 1]  # only group {0, 1} (max 5.0); expert 0 fills the second slot
    w, ids = select_experts(logits, cfg.replace(topk_method="greedy", norm_topk_prob=True))
    assert torch.allclose(w.sum(), torch.tensor(1.0))  # V2: normalized, not scaled
    v3 = cfg.replace(topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, topk_group=2)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 9.0])  # group {6, 7}: chosen by bias alone
    w, ids = select_experts(logits, v3, bias)
    assert sorted(ids[0].tolist()) == [6, 7]
    assert torch.allclose(w.sum(), torch.tensor(3.0))  # V3: normalized unbiased scores, then scaled


# ------------------------------------------------------------------------------------ config / loading
def test_bad_mla_and_moe_configs_raise():
    mla = ModelConfig(attention="mla", num_heads=4, num_kv_heads=4, head_dim=24, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    mla.validate()
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        mla.replace(kv_lora_rank=0).validate()
    with pytest.raises(ConfigError, match="head_dim"):
        mla.replace(head_dim=32).validate()
    moe = mla.replace(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    moe.validate()
    with pytest.raises(ConfigError, match="topk_method"):
        moe.replace(topk_method="random").validate()
    with pytest.raises(ConfigError, match="n_group"):
        moe.replace(num_expert_groups=3).validate()


def test_missing_checkpoint_tensor_is_named(models):
    from kvserve.models.loader import iter_safetensors_weights
    from kvserve.models.registry import build_model

    path, _ = models("q_lora")
    cfg = read_hf_config(path)
    weights = ((n, t) for n, t in iter_safetensors_weights(path) if "layers.1.self_attn.kv_b_proj" not in n)
    with pytest.raises(ValueError, match="missing 2 tensors.*layers.1.self_attn.w_u"):
        build_model(cfg, torch.float32, weights)


def test_dummy_weights_generate(models):
    path, _ = models("q_lora")
    llm = _llm(path, load_format="dummy")
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks
