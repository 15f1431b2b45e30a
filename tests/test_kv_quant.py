"""Quantized KV cache: round-trip error bounds per dtype, fused kernel vs the plain reference
(quantize → dequantize → float64 attention), the torch fallback vs the kernel, bytes per token by hand,
config validation, and engine behaviour (chunking and preemption invariance) on the tiny model."""
import os

import pytest
import torch

from kvserve.attention import AttentionMetadata, kv_quant, kv_quant_kernel, paged_attention, write_kv
from kvserve.attention.kv_quant import QuantizedKVCache, dequantize, quantize
from kvserve.attention.reference import reference_paged_attention
from kvserve.config import CacheConfig, ConfigError, ModelConfig, parse_kv_cache_dtype
from kvserve.kv_cache.spec import KVCacheSpec
from kvserve.sampling_params import SamplingParams
from tests.paged_cases import fill_context, scattered_tables
from tests.conftest import tiny_llm

KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Largest |x - dequantize(quantize(x))| relative to the vector's max|x|: int8 rounds to 1/254 of the range;
# fp8 relative to each value: e4m3 2^-4 (3 mantissa bits, round to nearest), e5m2 2^-3.
ROUND_TRIP = {"int8": 1 / 254 + 1e-6, "fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}
# Fused kernel vs reference on the same quantized cache: float32 summation order only.
KERNEL_TOL = 2e-5


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_bound(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 64, generator=g) * torch.logspace(-3, 2, 512)[:, None, None]  # 5 decades of scale
    codes, scale = quantize(x, kind)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.shape == x.shape[:-1]
    y = dequantize(codes, scale, kind)
    amax = x.abs().amax(-1, keepdim=True)
    if kind == "int8":
        err = ((y - x).abs() / amax).max()
    else:  # relative to each value, for values in fp8's normal range after scaling
        normal = x.abs() / amax * QMAX[kind] >= SMALLEST_NORMAL[kind]
        err = ((y - x).abs() / x.abs())[normal].max()
    assert err <= ROUND_TRIP[kind], err
    assert (y.abs().amax(-1) - amax[..., 0]).abs().max() <= 1e-6 * amax.max()  # max|x| is exact


QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
SMALLEST_NORMAL = {"fp8_e4m3": 2 ** -6, "fp8_e5m2": 2 ** -14}


def test_zero_vector_quantizes_to_zero():
    codes, scale = quantize(torch.zeros(2, 1, 8), "int8")
    assert (dequantize(codes, scale, "int8") == 0).all() and (scale > 0).all()


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_kernel_fp8_decoding_matches_torch_for_every_code(kind):
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    dtype = kv_quant.QUANT_KINDS[kind][0]
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(dtype).float()
    finite = want.isfinite()
    got = kv_quant_kernel.dequantize(dll, codes[None], torch.ones(1), kind)[0]
    assert torch.equal(got[finite], want[finite])


def test_old_library_builds_are_pruned(tmp_path):
    """Builds of other source versions unused for 7 days go; recent ones, the current one and other
    files stay."""
    import os
    import time

    now = time.time()
    files = {name: tmp_path / name for name in ("kv_quant_kernel_old.so", "kv_quant_kernel_recent.so",
                                                "kv_quant_kernel_current.so", "probe.json")}
    for name, path in files.items():
        path.write_bytes(b"x")
        age = 0 if name == "kv_quant_kernel_recent.so" else 8 * 24 * 3600
        os.utime(path, (now - age, now - age))
    gone = kv_quant_kernel.prune_old_builds(tmp_path, keep=files["kv_quant_kernel_current.so"])
    assert gone == [files["kv_quant_kernel_old.so"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv_quant_kernel_current.so", "kv_quant_kernel_recent.so",
                                                          "probe.json"]


@pytest.mark.parametrize("flags", ["-mno-avx512bf16 -mno-amx-tile -mno-amx-bf16 -mno-amx-int8", "-mno-avx512f",
                                   "-mno-avx512bf16", "-mno-avx2"],
                         ids=["no-bf16-no-amx", "no-avx512", "amx-without-bf16", "no-avx2"])
def test_library_loads_where_the_cpu_lacks_avx512_bf16_or_amx(tmp_path, flags):
    """load() declares every symbol it calls, so a library built for a CPU without AVX512-BF16 and AMX (or
    without AVX-512, or AVX2) must still export them all: kvs_int4_gemm_min_rows was once defined only
    inside the AVX512-BF16 section, and there load() raised AttributeError and every kernel path was lost;
    AMX without AVX512-BF16 (a VM can show one and hide the other) failed the whole build. Without
    AVX512-BF16 the int4 kernel is the AVX2 one (int8 x at every row count, no AMX) where the CPU has
    AVX2, FMA and F16C, and there is none without AVX2. Built by load() itself through a compiler wrapper
    that turns those features off (at -O0: this checks symbols, not speed), in a fresh process with its
    own cache directory."""
    import shutil
    import subprocess
    import sys

    cc = shutil.which("cc")
    if cc is None or subprocess.run([cc, *flags.split(), "-x", "c", "-c", "/dev/null", "-o", os.devnull],
                                    capture_output=True).returncode:
        pytest.skip(f"no cc that takes {flags}")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {cc} "$@" {flags} -O0\n')
    wrapper.chmod(0o755)
    code = ("from kvserve.attention import kv_quant_kernel\n"
            "from kvserve.models.quant import int4_gemm_min_rows\n"
            "dll = kv_quant_kernel.load()\n"
            "assert dll is not None, 'no library'\n"
            "from kvserve.models.quant import int4_q8_max_rows\n"
            "sup = dll.kvs_int4_supported()\n"
            f"assert sup == 0 or {'-mno-avx2' not in flags}\n"
            "assert dll.kvs_int4_amx_enable() == 0\n"
            "assert (int4_gemm_min_rows() is None) == (sup == 0)\n"
            "assert int4_q8_max_rows() == (2**31 - 1 if sup else 0), int4_q8_max_rows()\n"
            "assert dll.kvs_int4_gemm_min_rows() > 0\n")
    env = {**os.environ, "CC": str(wrapper), "KVSERVE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVSERVE_NO_KV_KERNEL", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    # the wrapper's build has a name of its own: a plain cc build in the same directory never loads it
    built = [p.name for p in (tmp_path / "cache").glob("kv_quant_kernel_*.so")]
    assert built == [kv_quant_kernel.library_path(str(wrapper)).name]
    assert built != [kv_quant_kernel.library_path("cc").name]


def test_a_damaged_cached_library_returns_none(tmp_path):
    """A file under the library's cache name that does not load (truncated, another libc's): load()
    returns None, as for a failed build, instead of raising OSError from ctypes."""
    import subprocess
    import sys

    code = ("import os\n"
            "from kvserve.attention import kv_quant_kernel as k\n"
            "os.makedirs(os.environ['KVSERVE_CACHE_DIR'], exist_ok=True)\n"
            "k.library_path().write_bytes(b'junk')\n"
            "assert k.load() is None\n")
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVSERVE_NO_KV_KERNEL", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compiling" not in run.stderr  # a cached file, even a bad one, is not rebuilt


def test_build_name_changes_with_the_cpu_and_the_compiler():
    """-march=native code from one CPU can hold instructions another lacks (an NFS home shared by
    machines): the cache name covers the CPU's features and the compiler command, and only what changed
    moves it."""
    cpu = kv_quant_kernel.cpu_features()
    if os.path.exists("/proc/cpuinfo") and cpu.split()[0] in ("x86_64", "aarch64"):
        assert len(cpu.split()) > 1  # the machine name, then the feature flags
    base = kv_quant_kernel.build_tag(b"src", "cc", cpu)
    assert base == kv_quant_kernel.build_tag(b"src", "cc", cpu)
    others = {kv_quant_kernel.build_tag(b"src", "cc", cpu + " amx_fp16"),
              kv_quant_kernel.build_tag(b"src", "cc", "aarch64 asimd fp"),
              kv_quant_kernel.build_tag(b"src", "clang", cpu),
              kv_quant_kernel.build_tag(b"src2", "cc", cpu)}
    assert base not in others and len(others) == 4


def test_a_failed_build_returns_none_and_leaves_no_file(tmp_path):
    """A compiler that fails: load() returns None (callers take the PyTorch path) and the cache directory
    keeps no half-written tmp*.so (each failed start used to leave one)."""
    import subprocess
    import sys

    wrapper = tmp_path / "cc"
    wrapper.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    wrapper.chmod(0o755)
    code = ("from kvserve.attention import kv_quant_kernel\n"
            "assert kv_quant_kernel.load() is None\n")
    env = {**os.environ, "CC": str(wrapper), "KVSERVE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("KVSERVE_NO_KV_KERNEL", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert list((tmp_path / "cache").iterdir()) == []
    assert "kvserve: compiling the C kernels into" in run.stderr  # said before the quiet minute of a build


def _tie_rows(kind: str, d: int) -> torch.Tensor:
    """Rows whose first value is QMAX (so the scale is exactly 1 and x / scale = x) followed by every tie
    of the format (the midpoint of two neighbouring codes, both signs, subnormals included), -0.0 and 0."""
    if kind == "int8":
        ties, top = torch.arange(-127, 127, dtype=torch.float32) + 0.5, 127.0
    else:
        dtype, top = kv_quant.QUANT_KINDS[kind]
        vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        vals = vals[vals.isfinite() & (vals >= 0) & (vals <= top)].unique().sort().values  # 0 .. QMAX
        mid = (vals[1:] + vals[:-1]) / 2  # exact in float32
        ties = torch.cat([mid, -mid, vals, -vals])
    ties = torch.cat([ties, torch.tensor([-0.0, 0.0])])
    ties = torch.cat([ties, ties[: (-len(ties)) % (d - 1)]])  # whole rows
    return torch.cat([torch.full((len(ties) // (d - 1), 1), top), ties.view(-1, d - 1)], dim=1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_quantize_writes_the_bits_of_torch_quantize(kind, dtype):
    """kvq_write_quantized (the C write path of prefill, RoPE and the decode plan) against the plain
    PyTorch quantize + index_copy, bit for bit: random rows over 6 decades, an all-zero row, and rows
    made of every rounding tie of the format at scale 1 (round half to even, subnormals, signed zeros)."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    d, Hkv = 64, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, Hkv, d, generator=g) * torch.logspace(-3, 3, 200)[:, None, None]
    ties = _tie_rows(kind, d)
    ties = torch.cat([ties, ties[: len(ties) % Hkv]]).view(-1, Hkv, d)
    x = torch.cat([x, torch.zeros(1, Hkv, d), ties]).to(dtype)
    if dtype == torch.bfloat16:
        assert torch.equal(x[-len(ties):].float(), ties) or kind != "int8"  # int8 ties are bf16-exact
    T = x.shape[0]
    slots = torch.randperm(T + 5, generator=g)[:T]
    cache = QuantizedKVCache.zeros(kind, (T + 5 + 3) // 4, 4, Hkv, d)
    kv_quant_kernel.write_quantized(dll, x, cache.codes, cache.scale, slots, kind)
    codes, scale = quantize(x, kind)
    assert torch.equal(cache.codes.view(-1, Hkv, d)[slots], codes)
    assert torch.equal(cache.scale.view(-1, Hkv)[slots], scale)


def test_c_quantize_any_head_dim():
    """The C write path holds one row per thread on the heap: a head_dim past any fixed buffer (4096)
    gives torch's bits too (it overflowed a 1024-float stack buffer)."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    x = torch.randn(20, 2, 4096, generator=torch.Generator().manual_seed(1))
    cache = QuantizedKVCache.zeros("int8", 5, 4, 2, 4096)
    slots = torch.arange(20).flip(0)
    kv_quant_kernel.write_quantized(dll, x, cache.codes, cache.scale, slots, "int8")
    codes, scale = quantize(x, "int8")
    assert torch.equal(cache.codes.view(-1, 2, 4096)[slots], codes) and torch.equal(cache.scale.view(-1, 2)[slots], scale)


@pytest.mark.parametrize("kind", KINDS)
def test_nan_or_inf_row_reads_back_nan_in_c_and_torch(kind):
    """A K or V row holding NaN (or inf) quantizes to scale NaN (inf) and codes 0 in both write paths, so
    it dequantizes to NaN; a decode step reading it gives NaN for the query heads of that KV head only
    (as a float cache does), where the C path's max|x| used to skip the NaN and hide it."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    Hkv, d, bs, T = 2, 64, 16, 40
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, Hkv, d, generator=g)
    x[3, 0, 7] = float("nan")
    x[20, 1, 0] = float("-inf")
    codes, scale = quantize(x, kind)
    assert scale[3, 0].isnan() and scale[20, 1].isinf() and scale.isfinite().sum() == T * Hkv - 2
    assert not codes[3, 0].any() and not codes[20, 1].any()
    assert dequantize(codes, scale, kind)[3, 0].isnan().all()
    cache = QuantizedKVCache.zeros(kind, 3, bs, Hkv, d)
    slots = torch.arange(T)
    kv_quant_kernel.write_quantized(dll, x, cache.codes, cache.scale, slots, kind)
    assert torch.equal(cache.codes.view(-1, Hkv, d)[:T], codes)
    assert torch.equal(cache.scale.view(-1, Hkv)[:T].nan_to_num(), scale.nan_to_num())
    vc = QuantizedKVCache.zeros(kind, 3, bs, Hkv, d)
    kv_quant_kernel.write_quantized(dll, torch.randn(T, Hkv, d, generator=g), vc.codes, vc.scale, slots, kind)
    q = torch.randn(2, 4, d, generator=g)
    bt = torch.arange(3, dtype=torch.int64)[None].repeat(2, 1)
    out = kv_quant_kernel.decode_attention(dll, q, cache.codes, vc.codes, cache.scale, vc.scale, bt,
                                           torch.tensor([T, 3]), d ** -0.5, kind)
    assert out[0, :2].isnan().all() and out[0, 2:].isnan().all()  # token 3 in KV head 0, 20 in head 1
    assert out[1].isfinite().all()  # the other sequence ends before both


@pytest.mark.parametrize("kind", KINDS)
def test_rows_near_float32_max_read_back_finite_in_c_and_torch(kind):
    """A finite row whose max|x| is within rounding of float32's max (3.4028235e38) reads back finite:
    int8's scale fl(max / 127) rounded up at exactly the max, and code 127 read back as inf. That is the
    only float32 input that overflowed (an adversarial review checked every float in [2^127, max]); fp8
    never did, since max / 448 and max / 57344 are exact, and its cases here guard against a regression.
    The 4096 floats just below the max and the max itself, each as a row [a, -a, a/3, random × a]: finite,
    within the round-trip bound of test_round_trip_error_bound (int8: max|x| / 254; fp8: relative, for
    values in the format's normal range), and the C write path stores torch's bits."""
    fmax = torch.finfo(torch.float32).max
    a = (torch.tensor(fmax).view(torch.int32) - torch.arange(4097, dtype=torch.int32)).view(torch.float32)
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(len(a), 1, 64, generator=g) * 2 - 1) * a[:, None, None]
    x[:, 0, 0], x[:, 0, 1], x[:, 0, 2] = a, -a, a / 3
    codes, scale = quantize(x, kind)
    y = dequantize(codes, scale, kind)
    assert y.isfinite().all(), int((~y.isfinite()).any(-1).sum())
    amax = a[:, None, None].double()
    if kind == "int8":
        assert ((y.double() - x.double()).abs() / amax).max() <= ROUND_TRIP[kind]
    else:
        normal = x.abs().double() / amax * QMAX[kind] >= SMALLEST_NORMAL[kind]
        assert ((y.double() - x.double()).abs() / x.abs().double())[normal].max() <= ROUND_TRIP[kind]
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    cache = QuantizedKVCache.zeros(kind, (len(a) + 15) // 16, 16, 1, 64)
    slots = torch.arange(len(a))
    kv_quant_kernel.write_quantized(dll, x, cache.codes, cache.scale, slots, kind)
    assert torch.equal(cache.codes.view(-1, 1, 64)[slots], codes)
    assert torch.equal(cache.scale.view(-1, 1)[slots], scale)


def _run(kind, num_heads, num_kv_heads, context_lens, query_lens, block_size=4, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 400
    kc = QuantizedKVCache.zeros(kind, num_blocks, block_size, num_kv_heads, head_dim)
    vc = QuantizedKVCache.zeros(kind, num_blocks, block_size, num_kv_heads, head_dim)
    tables = scattered_tables(torch.randperm(num_blocks, generator=g).tolist(), context_lens, query_lens, block_size)
    fill_context(kc, vc, tables, context_lens, block_size, num_kv_heads, head_dim, g)
    meta = AttentionMetadata.build(tables, list(context_lens), list(query_lens), block_size)
    T = sum(query_lens)
    q = torch.randn(T, num_heads, head_dim, generator=g)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    write_kv(kc, vc, k, v, meta.slot_mapping)
    scale = head_dim ** -0.5
    return paged_attention(q, k, v, kc, vc, meta, scale), reference_paged_attention(q, kc, vc, meta, scale)


CASES = [([0], [7]), ([5], [6]), ([8], [4]), ([3, 8, 15], [1, 1, 1]), ([4, 7, 0, 9], [1, 1, 5, 3]), ([40], [1]),
         ([1100, 3], [1, 1])]  # > 512 tokens: the kernel splits a sequence into chunks and merges them


@pytest.mark.parametrize("lens,threads,chunk", [
    ([192], 2, 96),  # 2 items of 96 tokens, one a thread (was 3 of 64: one thread took two)
    ([129], 2, 80),  # 80 + 49
    ([1088], 2, 272),  # 4 even items (was 256: 5 items, 3 + 2)
    ([4096], 2, 512),  # 8 items of the 512 cap
    ([4100], 2, 416),  # 10 items, 5 a thread (was 9 of 512: 5 + 4, the fifth 4 tokens)
    ([100] * 4, 2, 208),  # a batch: one item per sequence
    ([5000], 1, 512),  # one thread: items of at most 512 (10 of 500, rounded up to whole blocks)
    ([300], 0, 304),  # fewer than 1 thread counts as 1
    ([10], 2, 16),
    ([], 2, 16)])  # no tokens: no items, any whole block
def test_attention_work_items_even(lens, threads, chunk):
    """kvq_attention_chunk splits a step's tokens into num_threads × r items of whole 16-token blocks, r
    the fewest rounds that keeps them within 512 tokens (values worked out by hand)."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    seq_lens = torch.tensor(lens or [0], dtype=torch.int64)
    assert dll.kvq_attention_chunk(seq_lens.data_ptr(), len(lens), 16, threads) == chunk
    first = torch.empty(len(lens) + 1, dtype=torch.int64)
    items = dll.kvq_attention_items(seq_lens.data_ptr(), len(lens), chunk, first.data_ptr())
    assert items == sum(-(-n // chunk) for n in lens) == first[-1]


def test_attention_work_items_balanced():
    """For one sequence of any length: items are whole blocks of at most 512 tokens, no more of them than
    threads × the fewest rounds, and each at most a block longer than an exact split into that many."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler")
    for threads in (1, 2, 3, 4):
        for n in range(1, 6000, 7):
            seq_lens = torch.tensor([n], dtype=torch.int64)
            chunk = dll.kvq_attention_chunk(seq_lens.data_ptr(), 1, 16, threads)
            slots = threads * -(-n // (512 * threads))
            assert chunk % 16 == 0 and 0 < chunk <= 512, (n, threads, chunk)
            assert -(-n // chunk) <= slots and chunk < -(-n // slots) + 16, (n, threads, chunk)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("case", CASES)
def test_fast_matches_quantized_reference(kind, heads, case):
    fast, ref = _run(kind, *heads, *case)
    assert (fast - ref).abs().max() <= KERNEL_TOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim,block_size,heads,lens", [
    (64, 16, (9, 3), ([0, 15, 16, 17, 40, 600], [1] * 6)),  # SmolLM2's heads; 16-token groups, partial blocks
    (128, 16, (8, 2), ([3, 31, 1030], [1, 1, 1])),  # Llama-3's head_dim; a sequence over two chunks
    (64, 5, (4, 1), ([0, 4, 5, 23], [1, 1, 1, 1])),  # blocks smaller than a 16-row group
    (64, 32, (6, 6), ([70, 33], [1, 1])),  # MHA; 32-token blocks: two groups per block
    (256, 16, (2, 1), ([20, 47], [1, 1])),
    (16, 16, (4, 2), ([9, 50], [1, 1]))])
def test_vectorized_decode_matches_quantized_reference(kind, head_dim, block_size, heads, lens):
    """The vectorized K and V passes over 1-byte caches (head_dim a multiple of 16: every model's) against
    the reference over the same codes, at decode (one new token per sequence)."""
    fast, ref = _run(kind, *heads, *lens, block_size=block_size, head_dim=head_dim)
    assert (fast - ref).abs().max() <= KERNEL_TOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim,block_size,heads,lens", [
    (64, 16, (9, 3), [0, 14, 15, 16, 39, 600]),  # SmolLM2's heads; partial and whole 16-row tiles
    (128, 32, (8, 2), [2, 31, 1029]),  # two tiles per block; a sequence over three chunks
    (64, 16, (4, 4), [1, 17, 530]),  # one query per KV head
    (256, 16, (2, 1), [20, 47]),  # 8 tile products per 16 rows
    (64, 8, (9, 3), [5, 23]),  # half a tile per block: k_pass_codes
    (64, 16, (16, 1), [19, 46])])  # 16 queries: k_pass_codes
def test_key_pass_on_bfloat16_queries_matches_quantized_reference(kind, head_dim, block_size, heads, lens):
    """The decode step of a bfloat16 model over a 1-byte cache (queries hold bfloat16 values, q_bf16 = 1,
    as the one-call step passes them): where the CPU grants AMX (up to 4 queries per KV head, 16-row
    blocks) k_pass_amx_codes, on integer tiles for int8 with head_dim % 64 == 0 and on codes decoded to
    bfloat16 for the rest, else k_pass_codes on AVX-512, else attend_chunk's own key loop, against the
    reference over the same codes. Slots past each
    sequence's end hold NaN scales and code 0x7F (NaN in both fp8 formats): a 16-row group that lets one
    into a score turns the output NaN."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(3)
    kc = QuantizedKVCache.zeros(kind, 300, block_size, num_kv_heads, head_dim)
    vc = QuantizedKVCache.zeros(kind, 300, block_size, num_kv_heads, head_dim)
    tables = scattered_tables(torch.randperm(300, generator=g).tolist(), lens, [1] * len(lens), block_size)
    fill_context(kc, vc, tables, lens, block_size, num_kv_heads, head_dim, g)
    meta = AttentionMetadata.build(tables, list(lens), [1] * len(lens), block_size)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).bfloat16().float()
    write_kv(kc, vc, torch.randn(len(lens), num_kv_heads, head_dim, generator=g),
             torch.randn(len(lens), num_kv_heads, head_dim, generator=g), meta.slot_mapping)
    for table, n in zip(tables, lens):  # stale slots after the last token of the last block
        kc.scale[table[-1], (n + 1) - (len(table) - 1) * block_size:] = float("nan")
        vc.scale[table[-1], (n + 1) - (len(table) - 1) * block_size:] = float("nan")
        kc.codes[table[-1], (n + 1) - (len(table) - 1) * block_size:] = 0x7F
    code, G = kv_quant_kernel.CODES[kind], num_heads // num_kv_heads
    fits = dll.amx and G <= 4 and block_size % 16 == 0  # 5: int8 integer tiles, 4: codes decoded to bfloat16
    features = kv_quant_kernel.cpu_features().split()  # k_pass_codes on AVX-512; on AVX2 k_pass_avx2 (6) for
    avx2 = "avx512f" not in features and "avx2" in features  # int8 of head_dim % 32 == 0, G <= 4; else 0
    other = 1 if "avx512f" in features else 6 if avx2 and kind == "int8" and head_dim % 32 == 0 and G <= 4 else 0
    want = (5 if kind == "int8" and head_dim % 64 == 0 else 4) if fits and head_dim % 32 == 0 else other
    assert dll.kvq_key_pass(1, code, head_dim, G, block_size) == want
    bt, sl, out = meta.block_tables.contiguous(), meta.seq_lens.contiguous(), torch.empty_like(q)
    scale = head_dim ** -0.5
    dll.kvq_decode_attention(q.data_ptr(), kc.codes.data_ptr(), vc.codes.data_ptr(), kc.scale.data_ptr(),
                             vc.scale.data_ptr(), bt.data_ptr(), bt.stride(0), sl.data_ptr(), out.data_ptr(),
                             len(lens), num_heads, num_kv_heads, head_dim, block_size, scale, code,
                             torch.get_num_threads(), 1)
    ref = reference_paged_attention(q, kc, vc, meta, scale)
    assert (out - ref).abs().max() <= KERNEL_TOL


@pytest.mark.parametrize("head_dim,block_size,heads,lens", [
    (64, 16, (9, 3), [1, 15, 16, 17, 600]),  # SmolLM2's heads; partial 16-row tiles; a sequence over two chunks
    (128, 32, (8, 2), [31, 1029]),  # two A tiles per 16 rows, two tiles per block; three chunks
    (256, 16, (4, 1), [20, 47]),  # four A tiles; G = 4 fills the compact C store
    (64, 16, (4, 4), [5, 530])])  # one query per KV head
@pytest.mark.parametrize("q_bf16", [0, 1], ids=["f32-queries", "bf16-queries"])
def test_int8_integer_key_pass_against_float64(head_dim, block_size, heads, lens, q_bf16):
    """k_pass_amx_codes on integer tiles (where the CPU grants AMX: tdpbssd over the codes, each query row
    an integer of 23 bits in three signed base-256 digits times a power of two) against float64 attention over the same
    codes. Query elements span 8 decades; one row is zero, one below 2^-104 (its power of two clamps at
    2^-126), one of ~1e30, one holds a NaN and one an inf: those two rows' outputs are NaN, as the float64
    reference's, and the rows beside them unaffected. Bound per row: each query element rounds to within
    2^-22 · max|q_row| (half a step of 2^(e - 22), max|q_row| >= 2^(e - 1)), so a score moves by at most
    δ = 2^-22 · max|q_row| · max_t Σ|k_t| · scale (k_t a dequantized key row), each softmax weight by a
    factor within e^(±2δ), the output by at most (e^(2δ) - 1) · max|v|, plus KERNEL_TOL for float32
    sums. The kernel stays within 1 % of the bound; rounding the query at 2^-15 instead (two digits)
    exceeds it in the SmolLM2-shaped cases."""
    dll = kv_quant_kernel.load()
    if dll is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    num_heads, num_kv_heads = heads
    G, code = num_heads // num_kv_heads, kv_quant_kernel.CODES["int8"]
    features = kv_quant_kernel.cpu_features().split()  # k_pass_codes on AVX-512, k_pass_avx2 (6) on AVX2
    other = 1 if "avx512f" in features else 6 if "avx2" in features and head_dim % 32 == 0 and G <= 4 else 0
    assert dll.kvq_key_pass(q_bf16, code, head_dim, G, block_size) == (5 if dll.amx else other)
    g = torch.Generator().manual_seed(5)
    kc = QuantizedKVCache.zeros("int8", 300, block_size, num_kv_heads, head_dim)
    vc = QuantizedKVCache.zeros("int8", 300, block_size, num_kv_heads, head_dim)
    tables = scattered_tables(torch.randperm(300, generator=g).tolist(), lens, [1] * len(lens), block_size)
    fill_context(kc, vc, tables, lens, block_size, num_kv_heads, head_dim, g)
    meta = AttentionMetadata.build(tables, list(lens), [1] * len(lens), block_size)
    write_kv(kc, vc, torch.randn(len(lens), num_kv_heads, head_dim, generator=g),
             torch.randn(len(lens), num_kv_heads, head_dim, generator=g), meta.slot_mapping)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    q = q * 10 ** (torch.rand(q.shape, generator=g) * 8 - 8)  # |q| from ~1e-8 to ~3
    q[0, 0] = 0.0
    q[0, 1 % num_heads] *= 1e-25  # max below 2^-104
    q[-1, 0] *= 1e30
    nan_row, inf_row = (len(lens) - 1, num_heads - 1), (0, num_heads - 1)
    q[nan_row][head_dim // 2] = float("nan")
    q[inf_row][3] = float("inf")
    if q_bf16:
        q = q.bfloat16().float()
    bt, sl, out = meta.block_tables.contiguous(), meta.seq_lens.contiguous(), torch.empty_like(q)
    scale = head_dim ** -0.5
    dll.kvq_decode_attention(q.data_ptr(), kc.codes.data_ptr(), vc.codes.data_ptr(), kc.scale.data_ptr(),
                             vc.scale.data_ptr(), bt.data_ptr(), bt.stride(0), sl.data_ptr(), out.data_ptr(),
                             len(lens), num_heads, num_kv_heads, head_dim, block_size, scale, code,
                             torch.get_num_threads(), q_bf16)
    ref = reference_paged_attention(q, kc, vc, meta, scale)
    bad = torch.zeros(q.shape[:2], dtype=torch.bool)
    bad[nan_row] = bad[inf_row] = True
    assert out[bad].isnan().all() and ref[bad].isnan().all()
    assert out[~bad].isfinite().all()
    k_sum = dequantize(kc.codes, kc.scale, "int8").double().abs().sum(-1).max()
    v_max = dequantize(vc.codes, vc.scale, "int8").double().abs().max()
    delta = 2.0 ** -22 * q.double().abs().amax(-1) * k_sum * scale  # [T, H]
    bound = (torch.exp(2 * delta) - 1) * v_max + KERNEL_TOL
    err = (out.double() - ref.double()).abs().amax(-1)
    assert (err[~bad] <= bound[~bad]).all(), (err - bound)[~bad].max()


def test_int8_integer_key_pass_bound_where_max_q_is_a_power_of_two():
    """The query rounding's worst case (an adversarial helper's): max|q| = 1 exactly, so the step is 2^-21
    of it, and the other elements sit half a step off, rounding up in one key's dims and down in the
    other's. Two nearly equal scores of ~9900 then move apart by ~2^-21 · 9900; the output stays within
    the 2^-22 bound (it exceeded the 2^-23 first claimed)."""
    dll = kv_quant_kernel.load()
    if dll is None or not dll.amx:
        pytest.skip("the integer key pass needs the kernel and AMX")
    d, bs = 64, 16
    assert dll.kvq_key_pass(0, kv_quant_kernel.CODES["int8"], d, 1, bs) == 5
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    q[0, 0, 1:32] = 1 - 2.0 ** -22
    q[0, 0, 32:64] = 1 - 3 * 2.0 ** -22
    kc, vc = QuantizedKVCache.zeros("int8", 1, bs, 1, d), QuantizedKVCache.zeros("int8", 1, bs, 1, d)
    kc.codes.view(torch.int8)[0, 0, 0, 1:32] = 127
    kc.codes.view(torch.int8)[0, 1, 0, 32:63] = 127
    vc.codes.view(torch.int8)[0, 0, 0, 0] = 127
    vc.codes.view(torch.int8)[0, 1, 0, 0] = -127
    scale = d ** -0.5
    k1 = 9900 / (127 * 31 * scale)
    kc.scale[0, 0, 0], kc.scale[0, 1, 0] = k1, k1 * (1 - 2 ** -22) / (1 - 3 * 2 ** -22)
    vc.scale[0, :2, 0] = 1000 / 127
    meta = AttentionMetadata.build([[0]], [1], [1], bs)
    bt, sl, out = meta.block_tables.contiguous(), meta.seq_lens.contiguous(), torch.empty_like(q)
    dll.kvq_decode_attention(q.data_ptr(), kc.codes.data_ptr(), vc.codes.data_ptr(), kc.scale.data_ptr(),
                             vc.scale.data_ptr(), bt.data_ptr(), bt.stride(0), sl.data_ptr(), out.data_ptr(),
                             1, 1, 1, d, bs, scale, kv_quant_kernel.CODES["int8"], torch.get_num_threads(), 0)
    ref = reference_paged_attention(q, kc, vc, meta, scale)
    k = dequantize(kc.codes, kc.scale, "int8").double()[0, :2, 0]
    delta = 2.0 ** -22 * 1.0 * k.abs().sum(-1).max() * scale
    bound = (torch.exp(2 * delta) - 1) * 1000 + KERNEL_TOL
    assert (out - ref).abs().max() <= bound


@pytest.mark.parametrize("kind", KINDS)
def test_torch_fallback_matches_kernel(kind, monkeypatch):
    fast, ref = _run(kind, 8, 2, [4, 7, 0, 9], [1, 1, 5, 3])
    monkeypatch.setattr(kv_quant_kernel, "load", lambda: None)
    slow, _ = _run(kind, 8, 2, [4, 7, 0, 9], [1, 1, 5, 3])
    assert (slow - ref).abs().max() <= KERNEL_TOL and (slow - fast).abs().max() <= KERNEL_TOL


# ---------------------------------------------------------------------- bytes per token, config
@pytest.mark.parametrize("name,per_value,scale", [("float32", 4, 0), ("bfloat16", 2, 0), ("fp8_e4m3", 1, 4),
                                                  ("fp8_e5m2", 1, 4), ("int8", 1, 4)])
def test_bytes_per_token_by_hand(name, per_value, scale):
    smol = ModelConfig(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576)
    spec = KVCacheSpec.from_model(smol, parse_kv_cache_dtype(name, torch.float32), block_size=16)
    # K and V x 30 layers x 3 KV heads x (64 values x bytes + scale bytes)
    assert spec.bytes_per_token == 2 * 30 * 3 * (64 * per_value + scale)
    assert spec.bytes_per_token == {"float32": 46080, "bfloat16": 23040}.get(name, 12240)
    assert spec.bytes_per_block == 16 * spec.bytes_per_token


def test_bad_kv_cache_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto|.*int8.*got 'fp4'"):
        CacheConfig(kv_cache_dtype="fp4").validate()
    with pytest.raises(ConfigError):
        tiny_llm(kv_cache_dtype="float8")


@pytest.mark.parametrize("kind", KINDS)
def test_engine_reports_quantized_bytes(kind):
    llm = tiny_llm(kv_cache_dtype=kind)
    spec = llm.engine.kv_spec
    cfg = llm.engine.model_config
    assert spec.bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    llm.generate("hello", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert llm.engine.step_stats[-1].kv_bytes_per_token == spec.bytes_per_token
    k, v = llm.engine.runner.kv_caches[0]
    assert isinstance(k, QuantizedKVCache) and k.codes.dtype == torch.uint8 and k.kind == kind


# ---------------------------------------------------------------------- engine invariance
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_chunked_prefill_reads_the_cache_like_a_whole_prefill(kind):
    """Every query attends to the dequantized cache, so chunking does not change the answer."""
    prompt = "chunk " * 100
    whole = tiny_llm(kv_cache_dtype=kind).generate(prompt, GREEDY)[0].outputs[0].token_ids
    chunked = tiny_llm(kv_cache_dtype=kind, max_num_batched_tokens=16).generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert chunked == whole


@pytest.mark.parametrize("kind", ["fp8_e5m2", "int8"])
def test_preemption_with_quantized_cache_gives_the_same_tokens(kind):
    prompts = [f"request number {i} " + "word " * (10 + 7 * i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for _ in range(7)]
    params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2))
    ids = lambda outs: [[c.token_ids for c in o.outputs] for o in outs]  # noqa: E731
    ref = ids(tiny_llm(max_model_len=256, kv_cache_dtype=kind).generate(prompts, params))
    small = tiny_llm(max_model_len=256, num_kv_blocks=18, block_size=16, kv_cache_dtype=kind)
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert ids(got) == ref
    assert small.engine.kv_manager.num_free_blocks == small.engine.num_kv_blocks


def test_metrics_gauge_reports_quantized_bytes():
    from kvserve.metrics.prometheus import ServerMetrics

    llm = tiny_llm(kv_cache_dtype="int8")
    m = ServerMetrics("tiny")
    m.on_step(llm.engine, [])
    assert b'kvserve:kv_cache_bytes_per_token{model_name="tiny"} 160.0' in m.render()  # K,V x 2 x 2 x (16 + 4)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_prefix_cache_hit_on_quantized_blocks_gives_the_same_tokens(kind):
    """Blocks are just blocks: a request that starts from cached quantized blocks (and their scales)
    generates what a cold run generates."""
    prompt = "shared system prompt " * 12 + "and then a question?"
    cold = tiny_llm(kv_cache_dtype=kind, enable_prefix_caching=False).generate(prompt, GREEDY)[0].outputs[0].token_ids
    warm = tiny_llm(kv_cache_dtype=kind)
    first = warm.generate(prompt, GREEDY)[0]
    hits = warm.engine.kv_manager.num_hit_tokens
    second = warm.generate(prompt, GREEDY)[0]
    assert warm.engine.kv_manager.num_hit_tokens - hits >= 16  # the second request started from cached blocks
    assert first.outputs[0].token_ids == cold and second.outputs[0].token_ids == cold


def test_every_kernel_source_ships_in_the_package():
    """Found by a new-user trial: package-data listed three of the five C sources, so a non-editable
    install (a wheel) lacked dense_gemv.c and prefill_attention.c, and load(), which builds only when
    every source is there, silently fell back to eager PyTorch. Each source load() compiles, and
    kernel_math.h, must match a package-data pattern of kvserve.attention."""
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(kv_quant_kernel.__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "kvserve.attention"]
    for src in [*kv_quant_kernel._SRCS, kv_quant_kernel._SRCS[0].with_name("kernel_math.h")]:
        assert any(fnmatch.fnmatch(src.name, p) for p in patterns), src.name
