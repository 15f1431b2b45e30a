"""Fast paged attention vs the plain reference (float64 softmax), for MHA/GQA/MQA, block boundaries,
chunked prefill with context, and mixed decode + prefill batches. Tolerance: 1e-5 abs in float32."""
import pytest
import torch

from kvserve.attention import AttentionMetadata, paged_attention, write_kv
from kvserve.attention.reference import reference_paged_attention
from tests.paged_cases import fill_context, scattered_tables

TOL = 1e-5


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    """Decodes through the C kernel (when it builds here) and through the gather + SDPA fallback."""
    from kvserve.attention import kv_quant_kernel

    if request.param == "torch":
        monkeypatch.setattr(kv_quant_kernel, "load", lambda: None)
    elif kv_quant_kernel.load() is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    return request.param


def _run(num_heads, num_kv_heads, context_lens, query_lens, block_size=4, head_dim=8, seed=0,
         dtype=torch.float32, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    tables = scattered_tables(torch.randperm(num_blocks, generator=g).tolist(), context_lens, query_lens, block_size)
    fill_context(kc, vc, tables, context_lens, block_size, num_kv_heads, head_dim, g, dtype)
    meta = AttentionMetadata.build(tables, list(context_lens), list(query_lens), block_size)
    T = sum(query_lens)
    q = torch.randn(T, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    write_kv(kc, vc, k, v, meta.slot_mapping)
    scale = head_dim ** -0.5
    fast = paged_attention(q, k, v, kc, vc, meta, scale)
    ref = reference_paged_attention(q, kc, vc, meta, scale)
    return fast, ref


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("case", [
    ([0], [7]),                      # prefill from scratch, crosses block boundaries
    ([0], [8]),                      # ends exactly on a block boundary
    ([5], [6]),                      # chunked prefill: second chunk over cached context
    ([8], [4]),                      # chunk starting on a block boundary
    ([3, 8, 15], [1, 1, 1]),         # batched decode, different lengths
    ([4, 7, 0, 9], [1, 1, 5, 3]),    # mixed: decodes first, then prefills with and without context
])
def test_fast_matches_reference(heads, case, decode_path):
    fast, ref = _run(*heads, *case)
    assert torch.allclose(fast, ref, atol=TOL, rtol=0), (fast - ref).abs().max()


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (6, 1)], ids=["GQA", "MHA", "MQA"])
@pytest.mark.parametrize("context,query", [(1, 512), (700, 600), (37, 1000)])
def test_long_chunk_after_context_in_two_mask_free_calls(heads, context, query, monkeypatch):
    """From SPLIT_MIN_QUERIES queries after earlier context, prefill attends to the context and to its own
    causal block in two flash-attention calls merged by their log-sum-exps: against the float64-softmax
    reference, and with a decode and a short chunk in the same step (which keep the other paths)."""
    from kvserve.attention import paged

    assert query >= paged.SPLIT_MIN_QUERIES and paged._FLASH_CPU is not None
    monkeypatch.setattr(paged, "_prefill_kernel", lambda *a: None)  # bfloat16 would take the C kernel
    fast, ref = _run(*heads, [5, context, 9], [1, query, 3], block_size=16, head_dim=32, num_blocks=128)
    assert torch.allclose(fast, ref, atol=TOL, rtol=0), (fast - ref).abs().max()
    fast, ref = _run(*heads, [context], [query], block_size=16, head_dim=32, dtype=torch.bfloat16, num_blocks=128)
    assert (fast.float() - ref.float()).abs().max() <= 2 * 2.0 ** -8 * ref.float().abs().max() + 1e-3


def _prefill_kernel_here():
    from kvserve.attention import kv_quant_kernel

    dll = kv_quant_kernel.load()
    if dll is None or not dll.prefill_attention_supported(64):
        pytest.skip("no prefill attention kernel here (needs a C compiler, and AMX-BF16 with Linux's tile grant "
                    "or AVX2)")
    return dll


def _prefill_kernel_head_dims(dll) -> set[int]:
    """The head dims the kernel section compiled here takes: 32 and 64 on AMX tiles, multiples of 32 up
    to 256 on AVX2 (prefill_attention.c)"""
    return {32, 64} if dll.amx else set(range(32, 257, 32))


def _causal_reference(q, k, v, scale):
    """float64 softmax attention; query i at key position S - L + i, keys repeated per query head"""
    L, H, d = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    kd, vd = (t.double().repeat_interleave(H // Hkv, 1) for t in (k, v))
    s = torch.einsum("lhd,shd->hls", q.double(), kd) * scale
    s = s.masked_fill(torch.arange(S)[None, :] > (S - L + torch.arange(L))[:, None], float("-inf"))
    return torch.einsum("hls,shd->lhd", s.softmax(-1), vd)


def _sdpa_prefill(q, k, v, scale):
    """PyTorch's SDPA on the same bfloat16 inputs (the peer whose error sets the bound)"""
    from kvserve.attention import paged

    orig = paged._prefill_kernel
    paged._prefill_kernel = lambda *a: None
    try:
        return paged._prefill(q, k, v, scale)
    finally:
        paged._prefill_kernel = orig


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (6, 1)], ids=["GQA", "MHA", "MQA"])
@pytest.mark.parametrize("L,S,d", [(1, 1, 64), (7, 7, 64), (16, 16, 32), (33, 100, 64), (300, 300, 32),
                                   (200, 1030, 64), (5, 700, 64)])
def test_prefill_attention_kernel_matches_float64_softmax(heads, L, S, d):
    """The prefill kernel (bfloat16; AMX: heads of 32/64, query blocks of 16, key blocks of 32; AVX2:
    blocks of 48 query rows of a KV head's queries and 64 keys) against float64 softmax attention, blocks
    cut anywhere (L, S, S − L not multiples of them), q a strided view of a fused QKV row. Bound: P is
    rounded to bfloat16 before P·V on AMX (as in PyTorch's kernel) and so is the output, each up to 2^-8
    relative (bfloat16 keeps 8 significant bits), so |out − ref| <= 2^-7·max|v| (+ 2^-12 for float32
    sums); PyTorch SDPA on the same inputs must meet it too."""
    from kvserve.attention import paged

    _prefill_kernel_here()
    H, Hkv = heads
    g = torch.Generator().manual_seed(L * 1000 + S)
    qkv = torch.randn(L, (H + 2 * Hkv) * d, generator=g).bfloat16()
    q = qkv[:, :H * d].view(L, H, d)  # token rows (H + 2·Hkv)·d apart
    k, v = (torch.randn(S, Hkv, d, generator=g).bfloat16() for _ in range(2))
    assert paged._prefill_kernel(q, k, v, d ** -0.5) is not None
    ref = _causal_reference(q, k, v, d ** -0.5)
    out = paged._prefill(q, k, v, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (L, H, d)
    bound = 2.0 ** -7 * v.float().abs().max().item() + 2.0 ** -12
    assert (out.double() - ref).abs().max().item() <= bound
    assert (_sdpa_prefill(q, k, v, d ** -0.5).double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("H,Hkv,L,S,d", [(2, 1, 70, 70, 96), (4, 2, 129, 200, 128), (8, 1, 50, 50, 256),
                                        (64, 1, 5, 9, 32), (16, 1, 100, 130, 64)])
def test_prefill_attention_kernel_wide_heads_and_groups(H, Hkv, L, S, d):
    """Head dims past 64 (Gemma-3's 256) and query groups larger than a work item's rows (64 query heads
    on one KV head: one query per item) where the kernel here takes them (AVX2), against float64
    softmax attention with the bound above."""
    from kvserve.attention import paged

    dll = _prefill_kernel_here()
    if d not in _prefill_kernel_head_dims(dll):
        pytest.skip(f"head_dim {d} is not one the prefill kernel takes here")
    g = torch.Generator().manual_seed(H * 7 + d)
    q = torch.randn(L, H, d, generator=g).bfloat16()
    k, v = (torch.randn(S, Hkv, d, generator=g).bfloat16() for _ in range(2))
    assert paged._prefill_kernel(q, k, v, d ** -0.5) is not None
    out = paged._prefill(q, k, v, d ** -0.5)
    bound = 2.0 ** -7 * v.float().abs().max().item() + 2.0 ** -12
    assert (out.double() - _causal_reference(q, k, v, d ** -0.5)).abs().max().item() <= bound


def test_prefill_attention_kernel_rescales_as_the_maximum_grows():
    """Keys that grow along the sequence push every query's running maximum up block after block, past
    the kernel's headroom, so its outputs and row sums must be rescaled many times (without the rescale
    the error is of the order of the outputs). Oracle: float64 softmax, bound as above: a query whose
    softmax is one key's shows the P rounding in full (its p is 2^-8·2^f, not 1 as in PyTorch's kernel)."""
    _prefill_kernel_here()
    from kvserve.attention import paged

    g = torch.Generator().manual_seed(1)
    L, S, d = 64, 640, 64
    q = torch.randn(L, 2, d, generator=g).abs().bfloat16()
    k = (torch.randn(S, 1, d, generator=g).abs() * torch.linspace(0.05, 3.0, S)[:, None, None]).bfloat16()
    v = torch.randn(S, 1, d, generator=g).bfloat16()
    ref = _causal_reference(q, k, v, 0.5)
    bound = 2.0 ** -7 * v.float().abs().max().item() + 2.0 ** -12
    assert (paged._prefill(q, k, v, 0.5).double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("case", ["huge scores", "dominant key under the headroom", "vanishing key, huge value",
                                  "huge value rescaled away"])
def test_prefill_attention_kernel_edge_values(case):
    """From the adversarial review, each against float64 softmax with the bound above:
    - scores ~1e10: exp's argument was a fused S·scale − m, up to half an ulp of S·scale above 0, and p
      overflowed (0.5 and NaN for an expected 2);
    - the dominant key in a later block, under the reference the first block set (p ≈ 0.54, rounded to
      bfloat16: the error the 2^-7 bound allows for);
    - a key 1000 below the maximum with a value of 3e38: its p was floored at 2^-125 instead of 0, and
      the output read 1808 for an expected 1;
    - the same value in the first block, then a key 1000 above it: the rescale factor was floored the
      same way (227 for 1)."""
    _prefill_kernel_here()
    from kvserve.attention import kv_quant_kernel

    q, k, v = torch.zeros(1, 1, 32), torch.zeros(2, 1, 32), torch.zeros(2, 1, 32)
    if case == "huge scores":
        q[0, 0, 0], k[0, 0, 0] = 1e5, 1e5
        v[0], v[1] = 2.0, -1.0
    elif case == "dominant key under the headroom":
        q[0, 0, 0] = 1.0
        k, v = torch.zeros(33, 1, 32), torch.zeros(33, 1, 32)
        k[1:32, 0, 0], k[32, 0, 0] = -20.0, 4.9375
        v[32], v[0] = 1.140625, -1.140625
    elif case == "vanishing key, huge value":
        q[0, 0, 0], k[0, 0, 0] = 1.0, -1000.0
        v[0], v[1] = 3e38, 1.0
    else:
        q[0, 0, 0] = 1.0
        k, v = torch.zeros(33, 1, 32), torch.zeros(33, 1, 32)
        k[32, 0, 0], v[0], v[32] = 1000.0, 3e38, 1.0
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = _causal_reference(q, k, v, 1.0)
    out = kv_quant_kernel.prefill_attention(kv_quant_kernel.load(), q, k, v, 1.0)
    v_seen = 1.0 if "huge value" in case else v.float().abs().max().item()  # 3e38 gets weight 0
    assert (out.double() - ref).abs().max().item() <= 2.0 ** -7 * v_seen + 2.0 ** -12, (out[0, 0, 0], ref[0, 0, 0])


def test_prefill_attention_kernel_keeps_a_future_nan_key_from_earlier_queries():
    """A NaN in the key of token j reaches queries at j and after (NaN outputs) and no query before it,
    also inside the query's own key block (masked scores are replaced, not added to)."""
    _prefill_kernel_here()
    from kvserve.attention import paged

    g = torch.Generator().manual_seed(2)
    L, S, d, j = 40, 40, 64, 21
    q, k, v = (torch.randn(S, 3, d, generator=g).bfloat16() for _ in range(3))
    k[j, 1, 5] = float("nan")
    out = paged._prefill(q[:, :3].repeat(1, 3, 1)[:, :9], k, v, d ** -0.5)  # 9 query heads, KV head 1 = heads 3-5
    nan_rows = out[:, 3:6].isnan().any(-1).any(-1)
    assert nan_rows.tolist() == [i >= j for i in range(L)]
    assert not out[:, :3].isnan().any() and not out[:, 6:].isnan().any()


@pytest.mark.parametrize("L,S", [(128, 128), (40, 200)])
def test_prefill_attention_kernel_survives_a_first_block_of_minus_inf_scores(L, S):
    """Every query positive and the first 64 keys −inf: each of those keys scores −inf. A query that also
    sees later, finite keys gets their softmax (the −inf keys weigh 0); one that sees only −inf keys gets
    NaN, as the float64 reference. The AVX2 kernel's running maximum stayed −inf after the first key
    block and the next block computed 2^(−inf − (−inf)) = NaN for every row (adversarial review)."""
    dll = _prefill_kernel_here()
    if dll.amx:
        pytest.skip("the AMX section starts its running maximum the same way; not changed without an AMX "
                    "machine to test it on")
    from kvserve.attention import paged

    g = torch.Generator().manual_seed(L + S)
    q = torch.rand(L, 3, 64, generator=g).add(0.1).bfloat16()
    k, v = (torch.randn(S, 1, 64, generator=g).bfloat16() for _ in range(2))
    k[:64] = float("-inf")
    out = paged._prefill(q, k, v, 0.125)
    ref = _causal_reference(q, k, v, 0.125)
    sees_finite = (S - L + torch.arange(L)) >= 64
    assert out[~sees_finite].isnan().all() and ref[~sees_finite].isnan().all()
    assert sees_finite.any() and out[sees_finite].isfinite().all()
    bound = 2.0 ** -7 * v.float().abs().max().item() + 2.0 ** -12
    assert (out[sees_finite].double() - ref[sees_finite]).abs().max().item() <= bound


@pytest.mark.parametrize("G,L,S,j", [(1, 40, 40, 21), (3, 16, 16, 10), (2, 100, 100, 37), (3, 100, 700, 650)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_prefill_attention_kernel_keeps_a_future_bad_value_from_earlier_queries(G, L, S, j, bad):
    """A NaN or inf in the value of token j reaches no query before j (its weight there is 0, and 0 · NaN
    is NaN: the AVX2 kernel skips such keys instead of multiplying them; PyTorch's SDPA and the AMX tile
    product do not). Queries at j and after see it; the other KV head is untouched. From the adversarial
    review (10 of 10 earlier queries were NaN for G = 3, L = 16)."""
    dll = _prefill_kernel_here()
    if dll.amx:
        pytest.skip("the AMX kernel multiplies masked zeros in its P·V tiles, as PyTorch's kernel does")
    from kvserve.attention import paged

    g = torch.Generator().manual_seed(G * 100 + j)
    q = torch.randn(L, 2 * G, 64, generator=g).bfloat16()
    k, v = (torch.randn(S, 2, 64, generator=g).bfloat16() for _ in range(2))
    v[j, 1, 3] = bad
    out = paged._prefill(q, k, v, 0.125)
    pos = S - L + torch.arange(L)
    bad_rows = ~out[:, G:].isfinite().all(-1).all(-1)
    assert bad_rows.tolist() == (pos >= j).tolist()
    assert out[:, :G].isfinite().all()
    ref = _causal_reference(q[pos < j], k[:S - L + int((pos < j).sum())], v[:S - L + int((pos < j).sum())], 0.125) \
        if (pos < j).any() else None
    if ref is not None:  # the clean rows are right, not just finite
        assert (out[pos < j].double() - ref).abs().max().item() <= 2.0 ** -7 * v[:j].float().abs().max().item() + 2.0 ** -12


def test_prefill_kernel_is_only_taken_where_it_applies():
    """float32, a window, other head dims, scale <= 0, autograd, non-contiguous heads and an odd K token
    stride keep SDPA; the kernel's wrapper refuses an odd stride, other head dims and float32 with a
    ValueError (the C function also returns without writing for an unsupported d)."""
    _prefill_kernel_here()
    from kvserve.attention import kv_quant_kernel, paged

    q, k = torch.randn(8, 4, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16()
    assert paged._prefill_kernel(q, k, k, 0.125) is not None
    assert paged._prefill_kernel(q.float(), k.float(), k.float(), 0.125) is None
    assert paged._prefill_kernel(q[..., :48], k[..., :48], k[..., :48], 0.125) is None
    dll, dims = kv_quant_kernel.load(), _prefill_kernel_head_dims(kv_quant_kernel.load())
    for d in (16, 48, 96, 128, 256, 288):
        assert dll.prefill_attention_supported(d) == (d in dims), d
        taken = paged._prefill_kernel(torch.randn(8, 4, d).bfloat16(), torch.randn(8, 2, d).bfloat16(),
                                      torch.randn(8, 2, d).bfloat16(), 0.125)
        assert (taken is not None) == (d in dims), d
    assert paged._prefill_kernel(q, k, k, 0.0) is None
    assert paged._prefill_kernel(q, k, k, float("inf")) is None and paged._prefill_kernel(q, k, k, float("nan")) is None
    for scale in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            kv_quant_kernel.prefill_attention(kv_quant_kernel.load(), q, k, k, scale)
    assert paged._prefill_kernel(q.requires_grad_(), k, k, 0.125) is None
    assert paged._prefill_kernel(q.detach().transpose(1, 2).contiguous().transpose(1, 2), k, k, 0.125) is None
    k_odd = torch.randn(8 * 129).bfloat16().as_strided((8, 2, 64), (129, 64, 1))  # token rows 129 apart
    assert paged._prefill_kernel(q.detach(), k_odd, k, 0.125) is None
    with pytest.raises(ValueError, match="even"):
        kv_quant_kernel.prefill_attention(kv_quant_kernel.load(), q.detach(), k_odd, k, 0.125)
    # d = 16 corrupted the heap, 128 overran a stack buffer (AMX), before the wrapper checked
    for d in sorted({16, 48, 128, 288} - dims):
        with pytest.raises(ValueError, match=f"head_dim {d}"):
            kv_quant_kernel.prefill_attention(kv_quant_kernel.load(), torch.randn(47, 2, d).bfloat16(),
                                              torch.randn(50, 1, d).bfloat16(), torch.randn(50, 1, d).bfloat16(), 0.1)
    with pytest.raises(ValueError, match="bfloat16"):
        kv_quant_kernel.prefill_attention(kv_quant_kernel.load(), q.detach().float(), k.float(), k.float(), 0.125)
    windowed = []
    orig = kv_quant_kernel.prefill_attention
    kv_quant_kernel.prefill_attention = lambda *a: windowed.append(1)
    try:
        out = paged._prefill(q.detach(), k, k, 0.125, window=4)
    finally:
        kv_quant_kernel.prefill_attention = orig
    assert not windowed and out.shape == q.shape


def test_long_chunk_whose_context_scores_are_all_vanishing():
    """Every context score of every query is ~-4e38 (finite keys of -3e38: in float32 the dot products
    overflow to -inf). The flash op returns log-sum-exp 0 and output 0 for such a part, not -inf, so the
    two-call merge would halve the outputs: the masked call must run. Oracle: float64 softmax attention."""
    from kvserve.attention import paged

    g = torch.Generator().manual_seed(0)
    L, c, d = paged.SPLIT_MIN_QUERIES, 4, 8
    q = torch.randn(L, 1, d, generator=g)
    k, v = torch.randn(c + L, 1, d, generator=g), torch.randn(c + L, 1, d, generator=g)
    q[..., 0] = 4.0
    k[:c, :, 0] = -3e38
    out = paged._prefill(q, k, v, d ** -0.5)
    scores = (q[:, 0].double() @ k[:, 0].double().T) * d ** -0.5  # [L, c + L], finite in float64
    scores = scores.masked_fill(torch.arange(c + L)[None, :] > c + torch.arange(L)[:, None], float("-inf"))
    ref = torch.softmax(scores, -1) @ v[:, 0].double()
    assert (out[:, 0].double() - ref).abs().max() < 1e-5


def test_decode_single_sequence_exact_block_multiple(decode_path):
    fast, ref = _run(8, 2, [15], [1])  # seq_len 16 = 4 full blocks, no padding mask
    assert torch.allclose(fast, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (64, 16), (64, 32), (128, 5), (256, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_kernel_head_dims_and_blocks(head_dim, block_size, dtype, decode_path):
    """Head dims that are multiples of 16 take the kernel's 16-tokens-at-a-time score loop: every lane of
    its transpose-and-add must land on its own token (whole 16-token groups, blocks of 32 = two groups,
    blocks of 5 = partial groups, sequences ending mid-group)."""
    fast, ref = _run(9, 3, [40, 100, 17, 0], [1, 1, 1, 1], block_size=block_size, head_dim=head_dim,
                     dtype=dtype)
    tol = TOL if dtype == torch.float32 else 2e-2
    assert (fast.float() - ref.float()).abs().max() < tol


def test_bfloat16_close_to_reference(decode_path):
    fast, ref = _run(8, 2, [4, 7, 0], [1, 1, 6], dtype=torch.bfloat16)
    assert (fast.float() - ref.float()).abs().max() < 2e-2


def test_slot_mapping_is_block_id_times_block_size_plus_offset():
    meta = AttentionMetadata.build([[7, 3]], [2], [3], block_size=4)
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0]
    assert meta.seq_lens.tolist() == [5] and meta.query_start_loc.tolist() == [0, 3]


def test_decode_with_128_query_heads_per_kv_head(decode_path):
    """No limit on the group size: 128 query heads sharing one KV head, decode and mixed steps."""
    fast, ref = _run(128, 1, [9, 30, 0], [1, 1, 4])
    assert (fast - ref).abs().max() < TOL


def test_gqa_does_not_repeat_kv(monkeypatch):
    """The fast path must never call repeat_interleave/repeat on K or V."""
    calls = []
    orig = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: calls.append(1) or orig(*a, **k))
    monkeypatch.setattr(torch.Tensor, "repeat", lambda *a, **k: calls.append(1) or None)
    kc = torch.randn(8, 4, 2, 8)
    meta = AttentionMetadata.build([[1, 2], [3]], [5, 0], [1, 3], 4)
    q = torch.randn(4, 8, 8)
    paged_attention(q, torch.randn(4, 2, 8), torch.randn(4, 2, 8), kc, kc.clone(), meta, 0.3)
    assert calls == []


def _bf16_kernel_vs_float64(num_heads, num_kv_heads, head_dim, block_size, seq_lens, seed=0):
    """kvq_decode_attention on a bfloat16 cache with bfloat16-valued queries (k_pass_amx: AMX tile products
    where the CPU grants AMX, G <= 16 and bs % 16 == 0; else k_pass_bf16: vdpbf16ps pair dot products, 16
    tokens reduced by one transpose) against float64 attention over the same values.
    Slots past each sequence's end hold NaN and inf: a score loop that lets a row it does not own into
    a score or a running max turns the output NaN."""
    from kvserve.attention import kv_quant_kernel

    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for b, n in enumerate(seq_lens):
        tables.append(perm[at:at + per_seq[b]])
        at += per_seq[b]
        last, used = tables[-1][-1], n - (per_seq[b] - 1) * block_size
        kc[last, used:] = float("nan")
        kc[last, used + 1:] = float("inf")
        vc[last, used:] = float("nan")
    width = max(per_seq)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    sl = torch.tensor(seq_lens, dtype=torch.int64)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(torch.bfloat16).float()
    out = torch.empty_like(q)
    scale = head_dim ** -0.5
    dll.kvq_decode_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), None, None, bt.data_ptr(), bt.stride(0),
                             sl.data_ptr(), out.data_ptr(), len(seq_lens), num_heads, num_kv_heads, head_dim,
                             block_size, scale, kv_quant_kernel.CODES["bfloat16"], torch.get_num_threads(), 1)
    G = num_heads // num_kv_heads
    for b, n in enumerate(seq_lens):
        slots = torch.tensor([tables[b][t // block_size] * block_size + t % block_size for t in range(n)])
        k = kc.reshape(-1, num_kv_heads, head_dim)[slots].double()  # [n, Hkv, d]
        v = vc.reshape(-1, num_kv_heads, head_dim)[slots].double()
        for head in range(num_heads):
            p = torch.softmax(k[:, head // G] @ q[b, head].double() * scale, 0)
            want = p @ v[:, head // G]
            assert (out[b, head].double() - want).abs().max() < 1e-5, (b, head)


@pytest.mark.parametrize("heads", [(9, 3), (16, 1), (2, 2), (17, 1), (8, 4), (8, 2), (68, 17)],
                         ids=["G3", "G16", "G1", "G17", "G2", "G4", "G4x17"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 32), (128, 16), (256, 16), (64, 8)])
def test_bfloat16_pair_dot_k_pass_against_float64(heads, head_dim, block_size):
    """Query groups of 1, 2, 3, 4, 16 and 17 rows, head dims of 1-8 pair-dot vectors, blocks of one and
    two 16-token groups and of 8 (partial groups in every block); sequences of 1, 15, 16, 17 and 300
    tokens (partial groups, several chunks). On AMX: up to 4 queries per KV head and 64 in all take the
    compact C store (G4 fills its four vectors), 68 queries and G16 the gather."""
    _bf16_kernel_vs_float64(*heads, head_dim, block_size, [1, 15, 16, 17, 300])


def test_key_pass_dispatch_takes_amx_tiles_only_where_they_fit():
    """Which key pass each cache and shape takes. bfloat16 caches: AMX tiles for bfloat16 queries, whole
    16-row tiles in every block and at most 16 queries per tile (so the cases above reach it where this
    CPU has AMX; else they test the pair-dot pass alone). 1-byte caches on AMX: at most 4 queries per KV
    head and whole 16-row tiles; int8 on integer tiles for any queries when head_dim % 64 == 0, else (and
    fp8) on codes decoded to bfloat16 for bfloat16 queries; otherwise the vector pass over codes."""
    from kvserve.attention import kv_quant_kernel

    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    bf16, int8 = kv_quant_kernel.CODES["bfloat16"], kv_quant_kernel.CODES["int8"]
    # without AVX512-BF16 no bfloat16 pair-dot pass (2), without AVX-512 no vector pass over codes (1): on
    # an AVX2 CPU the 8-lane pass (6) takes int8, float32 and bfloat16 with head_dim % 32 == 0 and up to 4
    # queries per KV head, attend_chunk's own key loop (0) the rest
    features = kv_quant_kernel.cpu_features().split()
    avx2 = "avx512f" not in features and "avx2" in features and "fma" in features
    pair, codes = (2 if "avx512_bf16" in features else 6 if avx2 else 0), (1 if "avx512f" in features else 0)
    amx = 3 if dll.amx else pair
    assert dll.kvq_key_pass(1, bf16, 64, 3, 16) == amx
    assert dll.kvq_key_pass(1, bf16, 128, 16, 32) == (0 if avx2 else amx)  # 16 queries per KV head: not on AVX2
    assert dll.kvq_key_pass(1, bf16, 64, 3, 8) == pair  # half a tile per block
    assert dll.kvq_key_pass(1, bf16, 64, 17, 16) == (0 if avx2 else pair)  # more query columns than a tile holds
    assert dll.kvq_key_pass(0, bf16, 64, 3, 16) == (6 if avx2 else 0)  # float32 queries: no bfloat16 products
    assert dll.kvq_key_pass(0, kv_quant_kernel.CODES["float32"], 64, 3, 16) == (6 if avx2 else 0)
    # 1-byte codes, up to 4 queries per KV head: int8 on AMX integer tiles for any queries (k_pass_amx_codes, integer),
    # fp8 (and int8 of head_dim 32 mod 64) on codes decoded to bfloat16 for bfloat16 queries (k_pass_amx_codes)
    int8_amx, codes_amx = (5, 4) if dll.amx else (6 if avx2 else codes, codes)
    assert dll.kvq_key_pass(1, int8, 64, 3, 16) == int8_amx
    assert dll.kvq_key_pass(0, int8, 128, 4, 32) == int8_amx  # float32 queries too
    assert dll.kvq_key_pass(1, int8, 96, 3, 16) == (6 if avx2 else codes_amx)  # half an A tile of 64 codes
    assert dll.kvq_key_pass(1, kv_quant_kernel.CODES["fp8_e5m2"], 128, 4, 32) == codes_amx  # fp8: no AVX2 pass
    assert dll.kvq_key_pass(0, kv_quant_kernel.CODES["fp8_e4m3"], 64, 3, 16) == codes  # float32 queries
    assert dll.kvq_key_pass(1, int8, 64, 5, 16) == codes  # more queries than the compact C store holds
    assert dll.kvq_key_pass(1, int8, 64, 3, 8) == (6 if avx2 else codes)  # half a tile per block
    assert dll.kvq_key_pass(1, int8, 48, 3, 16) == codes  # head_dim not a multiple of 32


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
@pytest.mark.parametrize("nan_at,seq_len", [(3, 15), (3, 16), (3, 33), (32, 33)],
                         ids=["tail-only", "vector-16", "vector-33", "tail-33"])
def test_nan_key_inside_sequence_reaches_the_output(kind, nan_at, seq_len):
    """A NaN in a key the sequence owns makes that KV head's outputs NaN, as in float64 attention,
    wherever the token falls: in the softmax's 16-lane part (its exp clamps x to >= -87 with a max
    that must keep NaN) or in its scalar tail. Other KV heads stay finite."""
    from kvserve.attention import kv_quant_kernel

    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    dtype = getattr(torch, kind)
    g = torch.Generator().manual_seed(1)
    H, Hkv, d, bs = 4, 2, 64, 16
    nb = -(-seq_len // bs)
    kc = torch.randn(nb, bs, Hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, Hkv, d, generator=g).to(dtype)
    kc[nan_at // bs, nan_at % bs, 0, 5] = float("nan")  # KV head 0 only
    bt = torch.arange(nb, dtype=torch.int64)[None]
    q = torch.randn(1, H, d, generator=g).to(torch.bfloat16).float()
    out = kv_quant_kernel.float_decode_attention(dll, q, kc, vc, bt, torch.tensor([seq_len]), d ** -0.5)
    assert out[0, :2].isnan().all()  # query heads 0 and 1 read KV head 0
    assert out[0, 2:].isfinite().all()
