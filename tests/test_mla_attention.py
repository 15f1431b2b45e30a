"""MLA attention over a paged latent cache: absorbed (decode form) and expanded (prefill form) against
each other and against the float64 expanded reference, over scattered blocks, block boundaries,
chunked prefill with context, and mixed decode + prefill batches. Tolerance: 2e-5 abs in float32
(outputs are O(0.1-1); the two forms differ only in float32 summation order)."""
import pytest
import torch

from kvserve.attention import AttentionMetadata
from kvserve.attention.kv_quant import QuantizedKVCache
from kvserve.attention.mla import MODES, mla_attention, reference_mla_attention, write_latent

TOL = 2e-5
H, DN, R, L, DV = 4, 16, 8, 32, 12


def _setup(context_lens, query_lens, block_size=4, seed=0, quant=None):
    """A cache with each sequence's earlier context written by a "previous step", this step's rows
    written, and random queries / up-projections."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    cache = (QuantizedKVCache.zeros(quant, num_blocks, block_size, 1, L + R) if quant
             else torch.zeros(num_blocks, block_size, 1, L + R))
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    tables = [[perm.pop() for _ in range(-(-(c + q) // block_size))] for c, q in zip(context_lens, query_lens)]
    prev = AttentionMetadata.build(tables, [0] * len(tables), list(context_lens), block_size)
    if sum(context_lens):
        write_latent(cache, torch.randn(sum(context_lens), L + R, generator=g), prev.slot_mapping)
    meta = AttentionMetadata.build(tables, list(context_lens), list(query_lens), block_size)
    T = sum(query_lens)
    write_latent(cache, torch.randn(T, L + R, generator=g), meta.slot_mapping)
    q_nope, q_pe = torch.randn(T, H, DN, generator=g), torch.randn(T, H, R, generator=g)
    w_uk, w_uv = torch.randn(H, DN, L, generator=g) * 0.2, torch.randn(H, DV, L, generator=g) * 0.2
    return q_nope, q_pe, cache, w_uk, w_uv, meta, (DN + R) ** -0.5


CASES = [
    ([0], [7]),                      # prefill from scratch, crosses block boundaries
    ([0], [8]),                      # ends exactly on a block boundary
    ([5], [6]),                      # chunked prefill: second chunk over cached context
    ([8], [4]),                      # chunk starting on a block boundary
    ([15], [1]),                     # one decode, 4 full blocks
    ([3, 8, 15], [1, 1, 1]),         # batched decode, different lengths (padding mask)
    ([4, 7, 0, 9], [1, 1, 5, 3]),    # mixed: decodes first, then prefills with and without context
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_each_mode_matches_float64_reference(mode, case):
    args = _setup(*case)
    out = mla_attention(*args, mode=mode)
    ref = reference_mla_attention(*args)
    assert out.shape == (sum(case[1]), H, DV)
    assert torch.allclose(out, ref, atol=TOL, rtol=0), (out - ref).abs().max()


@pytest.mark.parametrize("case", CASES)
def test_absorbed_matches_expanded(case):
    args = _setup(*case, seed=1)
    absorbed, expanded = mla_attention(*args, mode="absorbed"), mla_attention(*args, mode="expanded")
    assert torch.allclose(absorbed, expanded, atol=TOL, rtol=0), (absorbed - expanded).abs().max()


def test_cache_rows_are_latent_only():
    """One row of L + R values per token: the latent and the rope key, nothing per head."""
    q_nope, q_pe, cache, *_ = _setup([0], [5])
    assert cache.shape == (64, 4, 1, L + R)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_latent_cache(kind):
    """1-byte latent rows (one float32 scale per row): both forms equal the reference over the same
    dequantized rows, and stay close to the float cache."""
    case = ([4, 7, 0, 9], [1, 1, 5, 3])
    args = _setup(*case, quant=kind)
    ref = reference_mla_attention(*args)
    for mode in MODES:
        out = mla_attention(*args, mode=mode)
        assert torch.allclose(out, ref, atol=TOL, rtol=0), (mode, (out - ref).abs().max())
    exact = reference_mla_attention(*_setup(*case))
    err = (ref - exact).abs().max().item()
    assert 0 < err < (0.02 if kind == "int8" else 0.1), err


def test_bfloat16_close_to_reference():
    args = list(_setup([4, 7, 0], [1, 1, 6]))
    for i in (0, 1, 3, 4):
        args[i] = args[i].bfloat16()
    args[2] = args[2].bfloat16()
    out = mla_attention(*args)
    ref = reference_mla_attention(*args)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() < 3e-2
