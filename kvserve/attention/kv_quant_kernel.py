"""Loads the C kernels, compiled on first use into one library: the fused dequantize-and-attend
decode kernel (``kv_quant_kernel.c``), the per-layer glue of a step (``layer_kernel.c``, used by
:mod:`kvserve.models.fused_ops`), the int4 weight matmul (``int4_gemm.c``, used by
:class:`kvserve.models.quant.Int4Linear` where the CPU has AVX512-BF16 or AVX2) and the float32 and int8
matrix-vector products of decode steps (``dense_gemv.c``, used by :class:`kvserve.models.linear.Linear`
and :class:`kvserve.models.quant.Int8Linear` where the CPU has AVX-512 or AVX2) and the causal prefill
attention (``prefill_attention.c``, used by :mod:`kvserve.attention.paged` for bfloat16 heads: on AMX tiles
for heads of 32 or 64, else on AVX2 vectors for multiples of 32 up to 256).

Built with the system C compiler (``cc -O3 -march=native -fopenmp``; ``$CC`` if set) into
``~/.cache/kvserve`` (``$KVSERVE_CACHE_DIR`` if set) under a name that hashes the source, flags, compiler
command and CPU features (a new build deletes other versions' builds unused for 7 days),
and called through ctypes on tensors' data pointers. Returns
None when no compiler is available (set ``KVSERVE_NO_KV_KERNEL=1`` to force that); callers then use
the plain PyTorch path in :mod:`kvserve.attention.kv_quant`.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

_SRCS = [Path(__file__).with_name(n) for n in ("kv_quant_kernel.c", "layer_kernel.c", "int4_gemm.c", "dense_gemv.c",
                                                "prefill_attention.c")]
# no -ffast-math: with GCC < 13 it would set flush-to-zero for the whole process when the library loads
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math"]
CODES = {"int8": 0, "fp8_e4m3": 1, "fp8_e5m2": 2, "float32": 3, "bfloat16": 4}


def cpu_features() -> str:
    """What ``-march=native`` compiles for: the machine name and, on Linux, the first CPU's feature flags
    from /proc/cpuinfo ("" where there is none)."""
    flags = ""
    try:  # x86 "flags", arm64 "Features", s390x "features", riscv "isa"
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.lower().startswith(("flags", "features", "isa"))), "")
    except OSError:
        pass
    return platform.machine() + " " + " ".join(sorted(flags.split(":", 1)[-1].split()))


def build_tag(src: bytes, cc: str, cpu: str) -> str:
    """The library's cache name: a hash of the sources, the flags, the compiler command and the CPU's
    features, so a cache directory shared by machines (an NFS home) never hands one CPU a build made
    with ``-march=native`` on another (an illegal instruction at the first call)."""
    return hashlib.sha256(b"\0".join([src, " ".join(_FLAGS).encode(), cc.encode(), cpu.encode()])).hexdigest()[:16]


def library_path(cc: str | None = None) -> Path:
    """Where load() keeps (or builds) the library for compiler command ``cc`` (default ``$CC`` or "cc"):
    ``$KVSERVE_CACHE_DIR`` (default ``~/.cache/kvserve``) / ``kv_quant_kernel_<build_tag>.so``, the tag over
    the sources and kernel_math.h."""
    src = b"".join(p.read_bytes() for p in (*_SRCS, _SRCS[0].with_name("kernel_math.h")))
    tag = build_tag(src, cc if cc is not None else os.environ.get("CC", "cc"), cpu_features())
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve")) / f"kv_quant_kernel_{tag}.so"


@torch.compiler.disable  # file checks and ctypes: never traced
@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, build failure, or KVSERVE_NO_KV_KERNEL=1)."""
    if os.environ.get("KVSERVE_NO_KV_KERNEL") or not all(p.exists() for p in _SRCS):
        return None
    lib = library_path()
    cache = lib.parent
    if not lib.exists():
        tmp = None
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            # a new user's first run otherwise goes quiet for about a minute after loading the weights
            print(f"kvserve: compiling the C kernels into {lib} (once per source version and CPU; about a "
                  "minute on 2 cores)", file=sys.stderr, flush=True)
            # ~50 s of CPU; on a host at load 5 it took 2 min 38 s of wall time, past the old 120 s limit,
            # and every kernel test skipped as if there were no compiler
            subprocess.run([os.environ.get("CC", "cc"), *_FLAGS, *map(str, _SRCS), "-o", tmp, "-lm"], check=True,
                           capture_output=True, timeout=900)
            os.replace(tmp, lib)  # atomic: concurrent processes never load a half-written file
            tmp = None
        except (OSError, subprocess.SubprocessError):
            return None
        finally:  # a failed or interrupted build leaves no partial file behind
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        prune_old_builds(cache, keep=lib)
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError:  # a damaged file in the cache: callers take the PyTorch path, as for a failed build
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.kvq_decode_attention.argtypes = [p, p, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32, i32, i32]
    dll.kvq_decode_attention.restype = None
    dll.kvq_attention_chunk.argtypes = [p, i32, i32, i32]
    dll.kvq_attention_chunk.restype = i64
    dll.kvq_attention_items.argtypes = [p, i32, i64, p]
    dll.kvq_attention_items.restype = i64
    dll.kvq_dequantize.argtypes = [p, p, p, i64, i32, i32, i32]
    dll.kvq_dequantize.restype = None
    dll.kvq_write_quantized.argtypes = [p, i32, i64, i64, i32, i32, p, p, p, i32, i32]
    dll.kvq_write_quantized.restype = None
    dll.kvs_rope_write_kv.argtypes = [p, i32, i64, p, p, p, p, p, p, p, p, p, p, i64, i32, i32, i32, i32, i32, i32]
    dll.kvs_add_rms_norm.argtypes = [p, p, i32, p, i32, f32, p, i32, i64, i32, i32, i32]
    dll.kvs_silu_mul.argtypes = [p, i32, p, i32, i64, i32, i32, i32]
    dll.kvs_decode_attention.argtypes = [p, p, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, i32, f32, i32, i32,
                                         i32]
    dll.kvs_int4_linear.argtypes = [p, i64, i32, p, i32, p, i32, i32]
    dll.kvs_llama_decode.argtypes = [p, i32, i32, i32, p, p, i64, p, p, p, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, i32,
                                     f32, f32, i32, i32, i32, i32, p, i32, p, i32, p, p, p, p, p, p, p]
    dll.kvs_dense_linear.argtypes = [p, i64, i32, p, i32, p, i32, p, i32]
    dll.kvs_argmax_rows.argtypes = [p, i32, i64, i64, p]
    dll.kvs_prefetch_lines.argtypes = [p, i64, i64]
    dll.kvs_sample_rows.argtypes = [p, i32, i64, p, i64, p, p, p, p, p, p]
    dll.kvs_sample_rows_excluding.argtypes = [p, i32, i64, p, i64, p, p, p, p, p, p, p, p]
    dll.kvs_token_logprobs.argtypes = [p, i32, i64, p, i64, p, i32, p, p, p, p, p]
    dll.kvs_apply_penalties.argtypes = [p, i64, i64, p, p, p, p, p, p, p]
    dll.kvs_apply_penalties.restype = i32
    dll.kvs_dense_supported.argtypes = []
    dll.kvs_dense_supported.restype = i32
    dll.kvs_int4_supported.argtypes = []
    dll.kvs_int4_supported.restype = i32
    dll.kvs_int4_amx_enable.argtypes = []
    dll.kvs_int4_gemm_min_rows.argtypes = []
    dll.kvs_int4_gemm_min_rows.restype = i32
    dll.kvs_int4_q8_max_rows.argtypes = []
    dll.kvs_int4_q8_max_rows.restype = i32
    dll.kvs_prefill_attention.argtypes = [p, i64, p, i64, p, i64, p, i64, i64, i32, i32, i32, f32, i32]
    dll.kvs_prefill_attention_supported.argtypes = [i32]
    dll.kvs_prefill_attention_supported.restype = i32
    dll.kvq_key_pass.argtypes = [i32, i32, i32, i32, i32]
    dll.kvq_key_pass.restype = i32
    dll.kvs_int4_amx_enable.restype = i32
    dll.amx = bool(dll.kvs_int4_amx_enable())  # AMX tile state granted: int4 steps of >= 4 rows use it
    dll.prefill_attention_supported = functools.cache(lambda d: bool(dll.kvs_prefill_attention_supported(d)))
    for f in (dll.kvs_rope_write_kv, dll.kvs_add_rms_norm, dll.kvs_silu_mul, dll.kvs_decode_attention,
              dll.kvs_int4_linear, dll.kvs_dense_linear, dll.kvs_argmax_rows, dll.kvs_prefetch_lines,
              dll.kvs_sample_rows, dll.kvs_sample_rows_excluding, dll.kvs_token_logprobs):
        f.restype = None
    dll.kvs_prefill_attention.restype = i32  # 0; -1: a buffer could not be allocated; -2: arguments refused
    dll.kvs_llama_decode.restype = i32  # -1: a token id outside the embedding, nothing run
    return dll


STALE_BUILD_S = 7 * 24 * 3600


def prune_old_builds(cache: Path, keep: Path, max_age_s: float = STALE_BUILD_S) -> list[Path]:
    """Delete the library builds of other source versions in ``cache`` that nobody has read or written
    for ``max_age_s`` (every source change builds a new ``kv_quant_kernel_<hash>.so``; without this they
    pile up). A version still in use elsewhere has a recent access time, or is simply rebuilt. Returns
    the deleted paths; errors (a file gone already, no permission) are ignored."""
    now, gone = time.time(), []
    for old in cache.glob("kv_quant_kernel_*.so"):
        try:
            st = old.stat()
            if old != keep and now - max(st.st_atime, st.st_mtime) > max_age_s:
                old.unlink()
                gone.append(old)
        except OSError:
            continue
    return gone


@torch.compiler.disable  # ctypes on data pointers: opaque to torch.compile, run eagerly
def decode_attention(dll: ctypes.CDLL, q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                     k_scale: torch.Tensor, v_scale: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    """q: [B, H, d] float32; codes: [num_blocks, bs, Hkv, d] uint8; scales: [num_blocks, bs, Hkv] float32;
    block_tables: [B, max_blocks] int64; seq_lens: [B] int64. Returns [B, H, d] float32."""
    B, H, d = q.shape
    _, bs, Hkv, _ = k_codes.shape
    assert q.dtype == torch.float32
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    dll.kvq_decode_attention(q.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), k_scale.data_ptr(),
                             v_scale.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                             seq_lens.data_ptr(), out.data_ptr(), B, H, Hkv, d, bs, scale, CODES[kind],
                             torch.get_num_threads(), 0)
    return out


@torch.compiler.disable
def float_decode_attention(dll: ctypes.CDLL, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention straight from a float32 or bfloat16 paged cache: each K/V row is read once from
    its block (no gather copy). q: [B, H, d] float32; caches: [num_blocks, bs, Hkv, d]; returns
    [B, H, d] float32. Same chunked flash-decoding loop as the quantized kinds, scales omitted."""
    B, H, d = q.shape
    _, bs, Hkv, _ = key_cache.shape
    kind = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[key_cache.dtype]
    assert q.dtype == torch.float32 and key_cache.is_contiguous() and value_cache.is_contiguous()
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    dll.kvq_decode_attention(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), None, None,
                             block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
                             B, H, Hkv, d, bs, scale, CODES[kind], torch.get_num_threads(), 0)
    return out


@torch.compiler.disable
def act_decode_attention(dll: ctypes.CDLL, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`float_decode_attention` on a float32 or bfloat16 q [B, H, d], returning [B, H, d] in q's
    dtype: the same float32 computation, with the casts done inside the kernel call."""
    B, H, d = q.shape
    _, bs, Hkv, _ = key_cache.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    q, block_tables, seq_lens = q.contiguous(), block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    act = CODES[_KINDS[q.dtype]]
    dll.kvs_decode_attention(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), None, None,
                             block_tables.data_ptr(),
                             block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), act, B, H, Hkv, d, bs, scale,
                             CODES[_KINDS[key_cache.dtype]], act, torch.get_num_threads())
    return out


_KINDS = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@torch.compiler.disable
def prefill_attention(dll: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal attention of one sequence's L queries over its S keys, the last L of them the queries' own
    (query i sees keys 0 .. S − L + i), on AMX tiles or, without AMX, AVX2 vectors (``prefill_attention.c``).

    q: [L, H, d] bfloat16; k, v: [S, Hkv, d] bfloat16 (S >= L >= 1, H a multiple of Hkv; query head
    h·G + g reads KV head h), token rows at any stride (k's even), heads d elements apart and each head's
    d elements contiguous (else ValueError, as for another dtype or shape); d where
    ``dll.prefill_attention_supported(d)`` (AMX: 32, 64; AVX2: multiples of 32 up to 256); scale > 0 and
    finite (else ValueError). Returns [L, H, d] bfloat16; MemoryError when the kernel cannot allocate its
    buffers (K and V in float32 or tile layout: 2·Hkv·S·d·4 bytes at most). Float32 scores and softmax; P rounded to bfloat16 for P·V on AMX, as in
    PyTorch's CPU flash attention, kept float32 on AVX2 (tested against float64 softmax attention:
    |Δ| <= 2^-7·max|v| + 2^-12, which SDPA meets too)."""
    L, H, d = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    if not (1 <= L <= S and H % Hkv == 0 and v.shape == k.shape and k.shape[2] == d):
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "must be [L, H, d], [S, Hkv, d], [S, Hkv, d] with 1 <= L <= S and H % Hkv == 0")
    if not dll.prefill_attention_supported(d):
        raise ValueError(f"prefill_attention: head_dim {d} is not one the kernel takes here (AMX: 32 or 64; AVX2: a multiple of 32 up to 256)")
    if any(t.dtype != torch.bfloat16 or t.stride(2) != 1 or t.stride(1) != d for t in (q, k, v)) or k.stride(0) % 2:
        raise ValueError("prefill_attention: q, k, v must be bfloat16 with each head's d elements contiguous "
                         "(and k's token stride even: its dim pairs are gathered as 32-bit words)")
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"prefill_attention: scale {scale} must be finite and > 0")
    out = torch.empty(L, H, d, dtype=torch.bfloat16)
    rc = dll.kvs_prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                   out.data_ptr(), L, S, H, Hkv, d, scale, torch.get_num_threads())
    if rc == -1:
        raise MemoryError(f"prefill_attention: no memory for the kernel's buffers (S={S}, Hkv={Hkv}, d={d})")
    if rc:  # the checks above cover every argument the kernel refuses
        raise ValueError(f"prefill_attention: the kernel refused L={L}, S={S}, H={H}, Hkv={Hkv}, d={d}")
    return out


@torch.compiler.disable
def write_quantized(dll: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    slot_mapping: torch.Tensor, kind: str) -> None:
    """Quantize x [T, Hkv, d] (float32/bfloat16, rows of each token contiguous) into the slots
    ``slot_mapping`` [T] of codes [num_blocks, bs, Hkv, d] uint8 and scales [num_blocks, bs, Hkv]
    float32: the same bits as :func:`kvserve.attention.kv_quant.quantize` + index_copy (tested)."""
    T, Hkv, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d and codes.is_contiguous() and scales.is_contiguous()
    slot_mapping = slot_mapping.contiguous()
    dll.kvq_write_quantized(x.data_ptr(), CODES[_KINDS[x.dtype]], x.stride(0), T, Hkv, d, slot_mapping.data_ptr(),
                            codes.data_ptr(), scales.data_ptr(), CODES[kind], torch.get_num_threads())


@torch.compiler.disable
def dequantize(dll: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """codes: [..., d] uint8 (contiguous); scales: [...] float32. Returns [..., d] float32."""
    codes, scales = codes.contiguous(), scales.contiguous().float()
    out = torch.empty(codes.shape, dtype=torch.float32)
    d = codes.shape[-1]
    dll.kvq_dequantize(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), codes.numel() // d, d, CODES[kind],
                       torch.get_num_threads())
    return out
