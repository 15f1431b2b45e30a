"""Sliding-window attention and KV cache groups, without a model.

Paged sliding-window attention (float and int8 caches) against the plain reference (float64 softmax;
tolerance 1e-5 abs in float32, the int8 path against the reference over the same dequantized cache).
Blocks wholly before a sequence's window are pointed at a block of large values (1e3), as a freed block
may hold anything: attending to them would swamp the softmax. (Not NaN: a batched decode may read
padding blocks, masked out with probability exactly 0, and 0 × NaN is NaN.) The KV cache manager frees those blocks back to
the pool, and the KV byte counts follow the hand formula.
"""
import pytest
import torch

from kvserve.attention import AttentionMetadata, paged_attention, write_kv
from kvserve.attention.kv_quant import QuantizedKVCache
from kvserve.attention.reference import reference_paged_attention
from kvserve.config import ModelConfig
from kvserve.kv_cache.manager import FREED_BLOCK_ID, KVCacheManager
from kvserve.kv_cache.spec import KVCacheSpec, kv_cache_groups
from tests.paged_cases import fill_context, scattered_tables

TOL = 1e-5


def _run(context_lens, query_lens, window, num_heads=4, num_kv_heads=1, block_size=4, head_dim=8,
         seed=0, quantized=False):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 128
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if quantized:
        kc, vc = QuantizedKVCache.zeros("int8", *shape), QuantizedKVCache.zeros("int8", *shape)
    else:
        kc, vc = torch.zeros(shape), torch.zeros(shape)
    perm = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()  # block 0: the stale one
    tables = scattered_tables(perm, context_lens, query_lens, block_size)
    fill_context(kc, vc, tables, context_lens, block_size, num_kv_heads, head_dim, g)
    # blocks wholly before each sequence's first visible key are "freed": point them at the stale block
    stale = [[0 if (b + 1) * block_size <= max(0, c - window + 1) else blk for b, blk in enumerate(t)]
             for t, c in zip(tables, context_lens)]
    if not quantized:
        kc[0], vc[0] = 1e3, 1e3
    meta = AttentionMetadata.build(stale, list(context_lens), list(query_lens), block_size, sliding_window=window)
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, head_dim, generator=g) for h in (num_heads, num_kv_heads, num_kv_heads))
    write_kv(kc, vc, k, v, meta.slot_mapping)
    scale = head_dim ** -0.5
    return paged_attention(q, k, v, kc, vc, meta, scale), reference_paged_attention(q, kc, vc, meta, scale), stale


@pytest.mark.parametrize("case", [
    ([0], [13]),                 # prefill longer than the window, from scratch
    ([0], [150]),                # long prefill: tiled queries
    ([9], [7]),                  # chunk over context, window reaches back into the cache
    ([21], [1]),                 # one decode: sliced to the exact window
    ([3, 21, 40, 5], [1, 1, 1, 1]),  # batched decodes: masked per sequence
    ([30, 2, 0, 17], [1, 1, 9, 70]),  # mixed
])
@pytest.mark.parametrize("window", [5, 8])
def test_sliding_matches_reference(case, window):
    fast, ref, stale = _run(*case, window=window)
    assert ref.abs().max() < 100  # the stale block did not leak into the oracle either
    assert torch.allclose(fast, ref, atol=TOL, rtol=0), (fast - ref).abs().max()
    if case == ([21], [1]):
        assert 0 in stale[0]  # the test really hides out-of-window blocks


def test_window_excludes_older_keys():
    """The window changes the output (so the mask is really applied) and equals full attention when
    the window covers the whole context."""
    wide, ref_wide, _ = _run([9], [7], window=64)
    narrow, _, _ = _run([9], [7], window=3)
    assert torch.allclose(wide, ref_wide, atol=TOL, rtol=0)
    assert (wide - narrow).abs().max() > 1e-3


def test_sliding_quantized_matches_reference():
    fast, ref, _ = _run([30, 2, 0, 17], [1, 1, 9, 40], window=8, quantized=True)
    assert torch.allclose(fast, ref, atol=1e-4, rtol=0), (fast - ref).abs().max()


# ------------------------------------------------------------------------------ KV cache groups
def _gemma_like(num_layers=6, window=8) -> ModelConfig:
    types = tuple("full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers))
    return ModelConfig(architecture="gemma3", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=num_layers, num_heads=4, num_kv_heads=1, head_dim=16, sliding_window=window,
                       layer_types=types).validate()


def test_groups_of_gemma3_270m_layout():
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18))
    groups = kv_cache_groups(windows, 18)
    assert [g.layer_ids for g in groups][:2] == [(5, 11, 17), (0, 1, 2)]
    assert len(groups) == 6 and {len(g.layer_ids) for g in groups} == {3}
    assert [g.sliding_window for g in groups] == [0] + [512] * 5


def test_kv_bytes_formula():
    cfg = _gemma_like()  # layers 2, 5 full; 0, 1, 3, 4 sliding (window 8)
    spec = KVCacheSpec.from_model(cfg, torch.float32, 4)
    per_layer = 2 * 1 * 16 * 4  # K and V, 1 KV head, head_dim 16, float32
    assert spec.bytes_per_token_per_layer == per_layer
    assert spec.bytes_per_token == 6 * per_layer
    assert spec.layers_per_block == 2 and spec.bytes_per_block == 2 * per_layer * 4
    for ctx in (1, 5, 8, 9, 100, 4096):
        assert spec.kv_bytes_read(ctx) == per_layer * (2 * ctx + 4 * min(ctx, 8))
    assert spec.kv_bytes_read(100, query_len=10) == per_layer * (2 * 100 + 4 * (8 + 9))
    llama = KVCacheSpec(4, 2, 8, torch.float32, 16)
    assert llama.kv_bytes_read(100) == 100 * llama.bytes_per_token and llama.layers_per_block == 4


def test_manager_frees_blocks_out_of_the_window():
    spec = KVCacheSpec.from_model(_gemma_like(window=8), torch.float32, 4)
    windows = [g.sliding_window for g in spec.groups]  # [0, 8, 8]
    kv = KVCacheManager(64, 4, group_windows=windows)
    computed = 0
    for n in [10] + [1] * 40:  # a 10-token prefill, then 40 decodes
        assert kv.allocate_slots("a", computed + n, num_computed_tokens=computed)
        computed += n
        tables = kv.block_tables("a")
        assert len(tables[0]) == -(-computed // 4)  # the full group keeps every block
        for t in tables[1:]:
            live = [b for b in t if b != FREED_BLOCK_ID]
            first_needed = max(0, computed - n - 8 + 1) // 4
            assert len(t) == -(-computed // 4) and t[:first_needed] == [FREED_BLOCK_ID] * first_needed
            assert FREED_BLOCK_ID not in t[first_needed:]
            assert len(live) <= -(-(8 - 1 + n) // 4) + 1
    live_sliding = len([b for b in kv.block_tables("a")[1] if b != FREED_BLOCK_ID])
    assert live_sliding <= 3 and 64 - kv.num_free_blocks == -(-computed // 4) + 2 * live_sliding
    assert kv.num_blocks_of("a") == 64 - kv.num_free_blocks
    kv.free("a")
    assert kv.num_free_blocks == 64


@pytest.mark.parametrize("types", [("sliding_attention", "full_attention"), ("sliding_attention", "sliding_attention")],
                         ids=["mixed", "all-sliding"])
def test_llama_with_a_window_longer_than_any_context_equals_full_attention(types):
    """A Llama/Mistral-style config with sliding layers (per-layer metadata for mixed layer types;
    prefix caching turned off) gives the full-attention model's tokens when the window covers every context."""
    from kvserve import SamplingParams
    from kvserve.models.catalog import DUMMY_PRESETS
    from tests.conftest import tiny_llm

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 70))]
    full = tiny_llm().generate(prompts, sp)
    cfg = DUMMY_PRESETS["tiny-llama"].replace(sliding_window=4096, layer_types=types)
    windowed = tiny_llm(dummy_config=cfg, max_num_batched_tokens=32).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in full] == [o.outputs[0].token_ids for o in windowed]
