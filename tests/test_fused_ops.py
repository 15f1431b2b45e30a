"""The C glue kernels of a decoder layer (kvserve/models/fused_ops.py) against their eager PyTorch
definitions: RoPE + KV write bit-identical (every product rounded as eager rounds it), the residual
add bit-identical, RMSNorm and SiLU·up within float32 rounding (float32 activations: 2e-6 relative)
or one bfloat16 rounding step (bfloat16 activations: 2^-7 relative)."""
import pytest
import torch

from kvserve.attention import AttentionMetadata, kv_quant_kernel
from kvserve.attention.kv_quant import QuantizedKVCache
from kvserve.models import fused_ops
from kvserve.models.linear import gemv_kernel
from kvserve.models.quant import Int8Linear, int4_kernel
from kvserve.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(kv_quant_kernel.load() is None, reason="no C compiler: kernels not built here")

DTYPES = [torch.float32, torch.bfloat16]
REL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}


def _close(got, ref, dtype):
    got, ref = got.float(), ref.float()
    bound = REL[dtype] * ref.abs() + 1e-6
    assert ((got - ref).abs() <= bound).all(), (got - ref).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40 rows: the threaded loop
@pytest.mark.parametrize("n", [576, 37])  # 37: 16-lane loops with a tail
def test_rms_norm_matches_eager(dtype, rows, n):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    ref = fused_ops.rms_norm_reference(x, w, 1e-5)
    out, stream = fused_ops.rms_norm(x, w, 1e-5)
    assert stream is x
    _close(out, ref, dtype)
    expect_stream = delta + x  # eager add in the activation dtype
    ref = fused_ops.rms_norm_reference(expect_stream, w, 1e-5)
    stream_in = x.clone()
    out, stream = fused_ops.rms_norm(delta, w, 1e-5, residual=stream_in)
    assert stream is stream_in  # updated in place
    assert torch.equal(stream, expect_stream)
    _close(out, ref, dtype)


@pytest.mark.parametrize("n", [64, 128, 576])
def test_add_rms_norm_result_does_not_depend_on_the_residual_storage(n):
    """The same residual values, stored as bfloat16 or as float32 (what the decode plan and the module path
    of a float32 model with packed weights pass), must give the very same stream and norm: a sum of squares
    grouped differently per storage type flipped 1-ulp roundings and then greedy tokens."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(n)
    T = 17
    for _ in range(20):
        x0 = torch.randn(T, n, generator=g) * 3
        r16 = torch.randn(T, n, generator=g).to(torch.bfloat16)
        w = 1 + 0.3 * torch.randn(n, generator=g)
        outs = []
        for res, code in ((r16, 4), (r16.float(), 3)):
            x, out = x0.clone(), torch.empty(T, n)
            dll.kvs_add_rms_norm(x.data_ptr(), res.data_ptr(), code, w.data_ptr(), 3, 1e-5, out.data_ptr(), 3, T, n,
                                 3, 2)
            outs.append((x, out))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_float32_weight_on_bfloat16_rows(dtype):
    x = torch.randn(2, 64).to(dtype)
    w = torch.rand(64) + 0.5  # float32 weight with any activation dtype
    _close(fused_ops.rms_norm(x, w, 1e-6)[0], fused_ops.rms_norm_reference(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("inter", [1536, 41])  # 41: 16-lane loops with a tail
def test_silu_mul_matches_eager(dtype, rows, inter):
    g = torch.Generator().manual_seed(7)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 6).to(dtype)
    special = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -1e-30, 20.0, -20.0, -86.9, -87.1]).to(dtype)  # exp's tails
    gu[0, :10] = special
    gu[-1, inter - 10:inter] = special  # in the scalar tail when inter % 16 != 0
    _close(fused_ops.silu_mul(gu), fused_ops.silu_mul_reference(gu), dtype)


def _rope_case(dtype, cache_dtype, T=5, H=9, Hkv=3, d=64, strided=False):
    g = torch.Generator().manual_seed(3)
    rot = RotaryEmbedding(d, 256, 10000.0)
    width = (H + 2 * Hkv) * d
    big = torch.randn(T, width + (32 if strided else 0), generator=g).to(dtype)
    qkv = big[:, :width]  # rows strided like a slice of a wider projection when strided
    positions = torch.randint(0, 256, (T,), generator=g)
    slots = torch.randperm(64, generator=g)[:T]  # distinct cache slots
    caches = []
    for _ in range(2):
        if cache_dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
            caches.append([QuantizedKVCache.zeros(cache_dtype, 4, 16, Hkv, d) for _ in range(2)])
        else:
            caches.append([torch.zeros(4, 16, Hkv, d, dtype=cache_dtype) for _ in range(2)])
    return qkv, positions, rot, slots, caches, (H, Hkv, d)


def _rope_matches_eager(dtype, cache_dtype, T, d, strided, monkeypatch):
    """The kernel's RoPE + cache write against eager RoPE + index_copy; 1-byte caches against the plain
    PyTorch quantize (the reference write runs with the C library hidden)."""
    qkv, pos, rot, slots, (fast_c, ref_c), (H, Hkv, _) = _rope_case(dtype, cache_dtype, T=T, d=d, strided=strided)
    q, k, v = fused_ops.rope_write_kv(qkv, pos, rot.cos, rot.sin, *fast_c, slots, H, Hkv, d)
    monkeypatch.setattr(kv_quant_kernel, "load", lambda: None)
    rq, rk, rv = fused_ops.rope_write_kv_reference(qkv, pos, rot.cos, rot.sin, *ref_c, slots, H, Hkv, d)
    assert q.shape == (T, H, d) and k.shape == (T, Hkv, d) and v.shape == (T, Hkv, d)
    assert torch.equal(q, rq) and torch.equal(k, rk) and torch.equal(v, rv)
    for a, b in zip(fast_c, ref_c):
        if isinstance(a, QuantizedKVCache):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
        else:
            assert torch.equal(a, b)
            assert a.abs().sum() > 0  # something was written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, "int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("T", [5, 40])  # 40 tokens: the threaded loop
def test_rope_write_kv_bit_identical_to_eager(dtype, cache_dtype, strided, T, monkeypatch):
    _rope_matches_eager(dtype, cache_dtype, T, 64, strided, monkeypatch)


@pytest.mark.parametrize("d", [40, 96, 8])  # half = 20: 16 lanes + a scalar tail; 48: three vectors; 4: no vector
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, "int8"])
def test_rope_write_kv_bfloat16_any_head_dim_bit_identical(d, cache_dtype, monkeypatch):
    """The 16-lane rotation of a bfloat16 model with head dims that are not a multiple of 32."""
    _rope_matches_eager(torch.bfloat16, cache_dtype, 20, d, False, monkeypatch)


def test_rope_rotates_by_position():
    """Independent check of the rotation itself: at position p, pair (x_i, x_{i+d/2}) turns by p·θ_i."""
    d = 8
    rot = RotaryEmbedding(d, 64, 10000.0)
    qkv = torch.zeros(1, 3 * d)
    qkv[0, 0] = 1.0  # q: unit vector on the first pair's x1
    kc, vc = torch.zeros(1, 4, 1, d), torch.zeros(1, 4, 1, d)
    q, _, _ = fused_ops.rope_write_kv(qkv, torch.tensor([5]), rot.cos, rot.sin, kc, vc, torch.tensor([2]), 1, 1, d)
    assert q[0, 0, 0].item() == pytest.approx(torch.cos(torch.tensor(5.0)).item(), abs=1e-6)
    assert q[0, 0, d // 2].item() == pytest.approx(torch.sin(torch.tensor(5.0)).item(), abs=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_in_activation_dtype_equals_float_kernel(dtype):
    """kvs_decode_attention on bf16/f32 q is the float32 kernel with exact casts around it."""
    dll = kv_quant_kernel.load()
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(2, 8, 16, 3, 64, generator=g).to(dtype)
    meta = AttentionMetadata.build([[2, 5, 1], [7]], [40, 9], [1, 1], 16)
    q = torch.randn(2, 9, 64, generator=g).to(dtype)
    got = kv_quant_kernel.act_decode_attention(dll, q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    ref = kv_quant_kernel.float_decode_attention(dll, q.float(), kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    assert got.dtype == dtype and torch.equal(got, ref.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_forward_same_with_and_without_kernels(dtype, monkeypatch):
    """A tiny random Llama through the fused glue vs the eager reference ops: prefill and decode logits."""
    from kvserve import SamplingParams
    from tests.conftest import tiny_llm

    def run():
        name = "float32" if dtype == torch.float32 else "bfloat16"
        llm = tiny_llm(dtype=name, weight_dtype=name)
        out = llm.generate([list(range(5, 40))], SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                                                                ignore_eos=True))[0]
        return out.outputs[0]

    fast = run()
    monkeypatch.setattr(kv_quant_kernel, "load", lambda: None)
    ref = run()
    assert fast.token_ids == ref.token_ids
    tol = 1e-4 if dtype == torch.float32 else 0.05
    for a, b in zip(fast.logprobs, ref.logprobs):
        assert a.top_token_ids[0] == b.top_token_ids[0]
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_without_kv_outputs_writes_the_same_cache(dtype):
    """need_kv=False (decode-only steps) returns only q and stores the same K/V."""
    qkv, pos, rot, slots, (fast_c, ref_c), (H, Hkv, d) = _rope_case(dtype, torch.bfloat16)
    q, k, v = fused_ops.rope_write_kv(qkv, pos, rot.cos, rot.sin, *fast_c, slots, H, Hkv, d, need_kv=False)
    rq, _, _ = fused_ops.rope_write_kv_reference(qkv, pos, rot.cos, rot.sin, *ref_c, slots, H, Hkv, d)
    assert k is None and v is None and torch.equal(q, rq)
    assert all(torch.equal(a, b) for a, b in zip(fast_c, ref_c))


@pytest.mark.parametrize("dtype,weight_dtype,bias,kv_dtype", [
    ("float32", "float32", False, "auto"), ("bfloat16", "bfloat16", False, "auto"), ("bfloat16", "int4", False, "auto"),
    ("bfloat16", "int8", False, "auto"), ("float32", "int4", False, "auto"), ("float32", "int8", True, "auto"),
    ("bfloat16", "int4", True, "auto"), ("float32", "float32", False, "int8"),
    ("bfloat16", "bfloat16", False, "fp8_e4m3"), ("float32", "int8", True, "fp8_e5m2"),
    ("float32", "float32", True, "auto")])
def test_decode_plan_bit_identical_to_module_path(dtype, weight_dtype, bias, kv_dtype):
    """The flat decode loop (llama_decode.py) against the modules' forward: same tokens and the very same
    logprobs for a batch of decodes of different lengths (the plan runs the same kernels in the same order;
    a float32 model's packed layers get their bfloat16 inputs straight from the kernels). With q/k/v bias,
    and over 1-byte KV caches (codes and scales written by the same C quantizer on both paths)."""
    from kvserve import SamplingParams
    from kvserve.models.catalog import DUMMY_PRESETS
    from kvserve.models.llama_decode import LlamaDecodePlan
    from tests.conftest import tiny_llm

    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    results = []
    for use_plan in (True, False):
        llm = tiny_llm(dtype=dtype, weight_dtype=weight_dtype, max_num_batched_tokens=64, kv_cache_dtype=kv_dtype,
                       dummy_config=DUMMY_PRESETS["tiny-llama"].replace(attention_bias=bias))
        model = llm.engine.runner.model
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():  # dummy norms are all ones: make each layer's its own
            if "norm" in name:
                p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        model.use_decode_plan = use_plan
        outs = [o.outputs[0] for o in llm.generate(prompts, sp)]
        plans = [p for _, p in model._plans.values()]
        assert (len(plans) == 1 and isinstance(plans[0], LlamaDecodePlan)) if use_plan else not plans
        if use_plan:  # int4, or float32 weights of a float32 model, without bias: the whole step is one C call
            one_call = not bias and ((weight_dtype == "int4" and int4_kernel() is not None)
                                     or (weight_dtype == "int8" and gemv_kernel() is not None)
                                     or (weight_dtype == dtype == "float32" and gemv_kernel() is not None))
            assert (plans[0].one_call_layers is not None) == one_call
        results.append(outs)
    for a, b in zip(*results):
        assert a.token_ids == b.token_ids
        assert [x.top_logprobs for x in a.logprobs] == [x.top_logprobs for x in b.logprobs]  # exact


@pytest.mark.parametrize("dtype,weight_dtype,inter,threads", [
    ("bfloat16", "int4", 128, 2), ("bfloat16", "int4", 96, 3), ("float32", "float32", 40, 2)])
def test_decode_plan_of_one_sequence_bit_identical_to_module_path(dtype, weight_dtype, inter, threads):
    """A decode step of one sequence in the one C call splits its rows' elementwise work (SiLU·up) over
    the threads in pieces of whole 16-element vectors (96 over 3 threads: 32 each; 40 over 2: 32 + 8, a
    tail): the same tokens and the very same logprobs as the module path, which runs each row whole."""
    from kvserve import SamplingParams
    from kvserve.models.catalog import DUMMY_PRESETS
    from tests.conftest import tiny_llm

    if (int4_kernel() if weight_dtype == "int4" else gemv_kernel()) is None:
        pytest.skip("kvserve's int4 kernel needs AVX512-BF16 or AVX2 and cc; the dense GEMV AVX-512 or AVX2 and cc")
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for use_plan in (True, False):
            llm = tiny_llm(dtype=dtype, weight_dtype=weight_dtype,
                           dummy_config=DUMMY_PRESETS["tiny-llama"].replace(intermediate_size=inter))
            model = llm.engine.runner.model
            model.use_decode_plan = use_plan
            results.append(llm.generate([list(range(5, 25))], sp)[0].outputs[0])
            if use_plan:
                assert model.decode_plan(llm.engine.runner.kv_caches).one_call_layers is not None
    finally:
        torch.set_num_threads(before)
    a, b = results
    assert a.token_ids == b.token_ids
    assert [x.top_logprobs for x in a.logprobs] == [x.top_logprobs for x in b.logprobs]  # exact


@pytest.mark.parametrize("weight_dtype", ["int4", "float32"])
def test_one_call_step_checks_the_token_ids_it_gathers(weight_dtype):
    """The one-call step gathers the embedding rows in C: an id outside the table raises IndexError (as
    F.embedding does) before anything runs, for the greedy path too, and leaves the KV cache as it was."""
    if (int4_kernel() if weight_dtype == "int4" else gemv_kernel()) is None:
        pytest.skip("kvserve's int4 kernel needs AVX512-BF16 or AVX2 and cc; the dense GEMV AVX-512 or AVX2 and cc")
    from kvserve import SamplingParams
    from kvserve.attention import AttentionMetadata
    from tests.conftest import tiny_llm

    llm = tiny_llm(dtype="bfloat16" if weight_dtype == "int4" else "float32", weight_dtype=weight_dtype)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))  # builds the plan
    runner = llm.engine.runner
    plan = runner.model.decode_plan(runner.kv_caches)
    assert plan.one_call_layers is not None and plan.lm_head is not None
    vocab = runner.model.config.vocab_size
    meta = AttentionMetadata.build([[3]], [4], [1], runner.kv_spec.block_size)
    before = [t.clone() for kv in runner.kv_caches for t in kv]
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match="input_ids"):
            plan(torch.tensor([bad]), torch.tensor([4]), meta)
        with pytest.raises(IndexError, match="input_ids"):
            plan.greedy(torch.tensor([bad]), torch.tensor([4]), meta)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for kv in runner.kv_caches for t in kv]))
    assert len(plan.greedy(torch.tensor([vocab - 1]), torch.tensor([4]), meta)) == 1
    # int32 ids (F.embedding takes them) are not read as int64 (found by the adversarial review)
    meta2 = AttentionMetadata.build([[3], [4]], [4, 4], [1, 1], runner.kv_spec.block_size)
    caches = [t.clone() for kv in runner.kv_caches for t in kv]
    ids = torch.tensor([5, 9])
    want = plan(ids, torch.tensor([4, 4]), meta2)
    for a, b in zip(caches, [t for kv in runner.kv_caches for t in kv]):  # the same step again
        b.copy_(a)
    assert torch.equal(plan(ids.int(), torch.tensor([4, 4]), meta2), want)


@pytest.mark.parametrize("dtype,weight_dtype,tied", [("bfloat16", "int4", False), ("bfloat16", "bfloat16", True),
                                                    ("float32", "float32", False)])
def test_compute_logits_without_the_float32_cast_is_the_same_values(dtype, weight_dtype, tied):
    """compute_logits(float32=False), which the model runner hands the sampler: the LM head's own dtype
    (bfloat16 for packed and bfloat16 heads), whose float32 cast is exactly the float32 logits."""
    from kvserve.models.catalog import DUMMY_PRESETS
    from tests.conftest import tiny_llm

    llm = tiny_llm(dtype=dtype, weight_dtype=weight_dtype,
                   dummy_config=DUMMY_PRESETS["tiny-llama"].replace(tie_word_embeddings=tied))
    model = llm.engine.runner.model
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    with torch.inference_mode():
        raw, full = model.compute_logits(hidden, float32=False), model.compute_logits(hidden)
    assert raw.dtype == getattr(torch, dtype) and full.dtype == torch.float32
    assert torch.equal(raw.float(), full)


@pytest.mark.parametrize("dtype,weight_dtype,tied,kv_dtype,int8_head", [
    ("bfloat16", "int4", False, "auto", False), ("bfloat16", "int8", False, "int8", False),
    ("float32", "float32", False, "auto", False), ("float32", "float32", True, "fp8_e4m3", False),
    ("float32", "int4", False, "auto", False), ("float32", "int8", False, "auto", False),
    ("bfloat16", "int4", False, "auto", True), ("float32", "int4", False, "int8", True)])
def test_greedy_step_with_the_lm_head_in_the_one_call_gives_the_sampler_tokens(dtype, weight_dtype, tied, kv_dtype,
                                                                               int8_head):
    """A plain greedy decode step runs the LM head and the argmax inside the one C call
    (LlamaDecodePlan.greedy): the very tokens the plan's hidden states, the LM head module and the greedy
    sampler give. The tiny model's random weights give near-even logits, so any difference in the head's
    rounding shows as a different token. Packed heads of a float32 model take their input rounded to
    bfloat16, as the modules cast it; int8_head: an int8 head over int4 layers (a Q4_1 GGUF's Q8_0 head,
    ``weight_dtype="auto"``). A batch mixing a logprobs request keeps the sampler's path."""
    if (int4_kernel() if weight_dtype == "int4" else gemv_kernel()) is None:
        pytest.skip("kvserve's int4 kernel needs AVX512-BF16 or AVX2 and cc; the dense GEMV AVX-512 or AVX2 and cc")
    from kvserve import SamplingParams
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.models.catalog import DUMMY_PRESETS
    from kvserve.models.llama_decode import LlamaDecodePlan
    from tests.conftest import tiny_llm

    prompts = [list(range(3, 3 + n)) for n in (1, 15, 17, 70, 300)]
    greedy = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=1)
    runs = []
    for fused in (True, False):
        llm = tiny_llm(dtype=dtype, weight_dtype=weight_dtype, kv_cache_dtype=kv_dtype, max_num_batched_tokens=512,
                       enable_prefix_caching=False,
                       dummy_config=DUMMY_PRESETS["tiny-llama"].replace(tie_word_embeddings=tied))
        runner = llm.engine.runner
        g = torch.Generator().manual_seed(5)
        for name, p in runner.model.named_parameters():  # dummy norms are all ones: make each its own
            if "norm" in name:
                p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        if int8_head:
            runner.model.lm_head = Int8Linear(runner.model.lm_head.dequantize())
        if not fused:
            runner._fused_greedy = lambda *a: False
        calls = []
        orig = LlamaDecodePlan.greedy

        def counted(self, *a):
            calls.append(orig(self, *a))
            return calls[-1]
        try:
            LlamaDecodePlan.greedy = counted
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy] * 4 + [with_logprobs])]
        finally:
            LlamaDecodePlan.greedy = orig
        if fused:  # one prefill step, then 6 decode steps on the C call's head; none in the mixed batch
            assert len(calls) == 6 and all(c is not None for c in calls)
            assert isinstance(runner, ModelRunner)
        else:
            assert calls == []
        runs.append((outs, mixed))
    assert runs[0] == runs[1]
    assert runs[0][0] == runs[0][1]  # the logprobs row changes nothing in the others


@pytest.mark.parametrize("dtype,weight_dtype,tied,int8_head", [
    ("bfloat16", "int4", False, False), ("bfloat16", "int8", False, False), ("float32", "float32", True, False),
    ("float32", "int4", False, False), ("bfloat16", "int4", False, True)])
def test_sampled_step_with_the_lm_head_in_the_one_call_gives_the_module_path_tokens(dtype, weight_dtype, tied,
                                                                                   int8_head):
    """A decode step that samples runs the LM head inside the one C call (LlamaDecodePlan.logits) and
    hands its logits to the sampler: seeded rows (temperature, min-p, top-p, logprobs) draw the same
    tokens with the same logprobs as on the module path (forward, compute_logits, sampler), and the
    plan ran every decode step. A batch of greedy rows and rows that sample without logprobs draws in the
    call too (LlamaDecodePlan.sample): the module path's tokens, also where a row is left to the PyTorch
    path."""
    if (int4_kernel() if weight_dtype == "int4" else gemv_kernel()) is None:
        pytest.skip("kvserve's int4 kernel needs AVX512-BF16 or AVX2 and cc; the dense GEMV AVX-512 or AVX2 and cc")
    from kvserve import SamplingParams
    from kvserve.models.catalog import DUMMY_PRESETS
    from kvserve.models.llama_decode import LlamaDecodePlan
    from tests.conftest import tiny_llm

    prompts = [list(range(3, 3 + n)) for n in (1, 17, 70, 300)]
    params = [SamplingParams(max_tokens=7, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.3, min_p=0.05, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True,
                             presence_penalty=0.4),
              SamplingParams(max_tokens=7, temperature=1.0, seed=4, logprobs=2, ignore_eos=True)]
    # temperature, top-k, top-p and min-p rows beside greedy ones (top_k=1 is greedy at any temperature):
    # the draws in the call too (LlamaDecodePlan.sample)
    plain = [SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=7, temperature=1.3, top_p=0.7, min_p=0.05, seed=2, ignore_eos=True),
             SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=7, temperature=1.0, top_k=1, ignore_eos=True)]
    runs = []
    for fused in ("logits", "sample", "sample, row 0 left to torch", None):
        llm = tiny_llm(dtype=dtype, weight_dtype=weight_dtype, max_num_batched_tokens=512, enable_prefix_caching=False,
                       dummy_config=DUMMY_PRESETS["tiny-llama"].replace(tie_word_embeddings=tied))
        runner = llm.engine.runner
        if int8_head:
            runner.model.lm_head = Int8Linear(runner.model.lm_head.dequantize())
        if fused is None:
            runner._fused_logits = lambda *a: None
            runner._fused_sample = lambda *a: False
        method = "logits" if fused in ("logits", None) else "sample"
        calls = []
        orig = getattr(LlamaDecodePlan, method)

        def counted(self, *a, fused=fused, orig=orig):
            calls.append(orig(self, *a))
            if fused == "sample, row 0 left to torch":  # as for a NaN row: the runner's PyTorch draw, same u
                calls[-1][0][0] = -1
            return calls[-1]
        try:
            setattr(LlamaDecodePlan, method, counted)
            outs = llm.generate(prompts, params if method == "logits" else plain)
        finally:
            setattr(LlamaDecodePlan, method, orig)
        if fused:  # one prefill step, then 6 decode steps on the C call's head
            assert len(calls) == 6 and all(c is not None for c in calls)
        else:
            assert calls == []
            outs_plain = llm.generate(prompts, plain)
        runs.append([(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top_token_ids)
                                                for lp in o.outputs[0].logprobs or []]) for o in outs])
    logits_run, sample_run, fallback_run, module_run = runs
    assert logits_run == module_run
    assert sample_run == fallback_run == [(o.outputs[0].token_ids, []) for o in outs_plain]
    assert len(set(logits_run[0][0])) > 1 and len(set(sample_run[0][0])) > 1  # they sampled


@pytest.mark.parametrize("dtype,weight_dtype,kv_dtype,lens", [
    ("bfloat16", "int4", "auto", (1, 15, 16, 17, 33, 70) * 3),  # 18 rows: two AMX blocks where the kernel has AMX
    ("float32", "int4", "auto", (1, 15, 16, 17, 33, 70)), ("float32", "int4", "bfloat16", (1, 15, 16, 17, 33, 70)),
    ("bfloat16", "int4", "auto", (300, 47)), ("float32", "int4", "auto", (300,)),  # long rows: several attention chunks
    ("bfloat16", "int4", "int8", (1, 15, 16, 17, 33, 70)), ("float32", "int4", "fp8_e4m3", (300, 47)),
    ("bfloat16", "int4", "fp8_e5m2", (1, 17, 33)),
    ("float32", "float32", "auto", (1, 15, 16, 17, 33, 70) * 3), ("float32", "float32", "int8", (300, 47)),
    ("bfloat16", "int8", "auto", (1, 15, 16, 17, 33, 70)),
    ("bfloat16", "int4", "auto", tuple(range(1, 61)))])  # 60 rows: the int4 GEMM path where the kernel has AMX
def test_one_call_decode_step_equals_the_flat_loop(dtype, weight_dtype, kv_dtype, lens):
    """kvs_llama_decode (int4 tiles, int8 rows, or dense float32 matrices) against the Python loop of the same
    kernels: identical hidden states for a decode batch of uneven lengths (1 to 70 tokens: one to five
    KV blocks; or one or two long sequences whose attention splits into several chunks) over several
    steps, and the same KV cache contents."""
    if (int4_kernel() if weight_dtype == "int4" else gemv_kernel()) is None:  # int8 and float32: the GEMV
        pytest.skip("kvserve's int4 kernel needs AVX512-BF16 or AVX2 and cc; the dense GEMV AVX-512 or AVX2 and cc")
    from kvserve import SamplingParams
    from tests.conftest import tiny_llm

    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    runs = []
    for one_call in (True, False):
        llm = tiny_llm(dtype=dtype, weight_dtype=weight_dtype, kv_cache_dtype=kv_dtype, max_num_batched_tokens=256)
        model = llm.engine.runner.model
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():  # dummy norms are all ones: make each layer's its own
            if "norm" in name:
                p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        if not one_call:  # the Python loop: hide the layer table once the plan exists
            orig = model.decode_plan

            def loop_only(kv_caches, orig=orig):
                plan = orig(kv_caches)
                plan.one_call_layers = None
                return plan
            model.decode_plan = loop_only
        outs = [o.outputs[0] for o in llm.generate([list(range(3, 3 + n)) for n in lens], sp)]
        plan = next(p for _, p in model._plans.values())
        assert (plan.one_call_layers is not None) == one_call
        caches = [t.clone() for kv in llm.engine.runner.kv_caches for c in kv
                  for t in ((c,) if isinstance(c, torch.Tensor) else (c.codes, c.scale))]  # 1-byte: codes + scales
        runs.append((outs, caches))
    (a_outs, a_caches), (b_outs, b_caches) = runs
    for a, b in zip(a_outs, b_outs):
        assert a.token_ids == b.token_ids
        assert [x.top_logprobs for x in a.logprobs] == [x.top_logprobs for x in b.logprobs]
    assert all(torch.equal(x, y) for x, y in zip(a_caches, b_caches))


@pytest.mark.parametrize("weight_dtype", ["float32", "int4"])
def test_decode_plan_follows_weights_given_new_storage(weight_dtype):
    """The plan holds weight and norm data pointers; a parameter given new storage after the plan was
    built (``p.data = new``) must be read from its new place: the same tokens and logprobs as the module
    path. (Found by attacking it: the float32 one-call step read freed memory.)"""
    from kvserve import SamplingParams
    from tests.conftest import tiny_llm

    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    runs = []
    for use_plan in (True, False):
        llm = tiny_llm(weight_dtype=weight_dtype)
        model = llm.engine.runner.model
        model.use_decode_plan = use_plan
        llm.generate([[5, 6, 7, 8]], sp)  # builds the plan
        g = torch.Generator().manual_seed(8)
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or "layernorm" in name:
                p.data = (p.data.float() + 0.05 * torch.randn(p.shape, generator=g)).to(p.dtype)
        runs.append([o.outputs[0] for o in llm.generate([[9, 10, 11], [12, 13, 14, 15, 16]], sp)])
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert [x.top_logprobs for x in a.logprobs] == [x.top_logprobs for x in b.logprobs]


def test_decode_plan_prefetches_the_objects_its_pointer_check_reads():
    """After each step the plan prefetches, for every tensor whose pointer it checks, its Python object,
    TensorImpl and StorageImpl (the check's cold misses). Prefetching must never fault: freed, null,
    kernel-space and non-canonical addresses included."""
    from kvserve import SamplingParams
    from kvserve.attention import kv_quant_kernel
    from kvserve.models.llama_decode import _object_addresses
    from tests.conftest import tiny_llm

    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C kernels here")
    freed = torch.empty(1 << 22, dtype=torch.uint8)
    bad = [0, 1, 64, freed.data_ptr(), -4096, -(1 << 63), 0x00007FFFFFFFFFC0, 0x0000800000000000]
    del freed
    addrs = torch.tensor(bad, dtype=torch.int64)
    dll.kvs_prefetch_lines(addrs.data_ptr(), addrs.shape[0], 4096)  # reaching the next line: nothing faulted
    t = torch.zeros(3)
    assert _object_addresses([t]) == [id(t), t._cdata, t.untyped_storage()._cdata]
    llm = tiny_llm(weight_dtype="int4")
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    runner = llm.engine.runner
    plan = runner.model.decode_plan(runner.kv_caches)
    assert plan is not None and len(plan._object_addrs) == 3 * len(plan._pinned)
    assert plan._object_addrs.tolist() == _object_addresses(plan._pinned)


def test_rope_write_kv_head_dim_over_kernel_buffer_takes_reference_path():
    """head_dim > 512 (the kernel's per-head buffer) must not reach the kernel."""
    qkv, pos, rot, slots, (fast_c, ref_c), (H, Hkv, d) = _rope_case(torch.float32, torch.float32, T=2, H=2, Hkv=1, d=640)
    q, k, v = fused_ops.rope_write_kv(qkv, pos, rot.cos, rot.sin, *fast_c, slots, H, Hkv, d)
    rq, rk, rv = fused_ops.rope_write_kv_reference(qkv, pos, rot.cos, rot.sin, *ref_c, slots, H, Hkv, d)
    assert torch.equal(q, rq) and torch.equal(k, rk) and all(torch.equal(a, b) for a, b in zip(fast_c, ref_c))
