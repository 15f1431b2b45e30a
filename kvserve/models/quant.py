"""Weight-only quantized linear layers for CPU decode: 4-bit group-wise and 8-bit per-channel.

A decode step reads every weight once, so its time is weight bytes ÷ bandwidth. These layers keep the
weights packed in memory and multiply with weight-only kernels: nothing dequantizes a whole matrix per
step. int4 runs kvserve's own kernel (``kvserve/attention/int4_gemm.c``: a 4-bit code becomes a bfloat16
weight by one table lookup and feeds an AVX512-BF16 pair dot product) where the CPU has AVX512-BF16 and a
C compiler is present, else ``torch._weight_int4pack_mm_for_cpu``; int8 runs ``torch._weight_int8pack_mm``.
All take bfloat16 activations with bfloat16 scales (PyTorch's float32 paths are ~20× slower on CPU), so a
float32 model converts activations at the layer boundary.

GGUF block formats (llama.cpp ``ggml-quants.c``, blocks of 32 weights along the input dimension):

- ``Q4_1``: ``w = d·q + m`` (q ∈ [0, 15], d and m float16) → 4-bit codes ``q`` as they are; kernel
  scale ``d`` and zero point ``m + 8d`` (the kernel computes ``(q − 8)·scale + zero``). Rounded: d and
  m + 8d to bfloat16 (8 significant bits; relative error ≤ 2⁻⁸ of each).
- ``Q4_0``: ``w = d·(q − 8)`` → codes ``q``, scale ``d``, zero 0. Rounded: d to bfloat16.
- ``Q8_0``: ``w = d_b·q`` (q int8, one float16 ``d_b`` per block) → the int8 kernel has one scale per
  output row, so codes are re-rounded: ``s = max|w_row| / 127``, ``q' = round(w / s)`` (error ≤ s/2).
- anything else (Q4_K, Q6_K, F16, F32, safetensors): quantized from the float weights — int4 with the
  Q4_1 rule per group of 32 (min/max, error ≤ scale/2), int8 per output row as for Q8_0.
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.models.linear import GEMV_MAX_ROWS, gemv_kernel, plain_cpu

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # weights per scale: GGUF's block size
KERNEL_DTYPE = torch.bfloat16
# Steps of at least DENSE_MIN_TOKENS tokens (prefill chunks, large decode batches) multiply with a
# bfloat16 copy of the dequantized weights: the int4/int8 kernels dequantize every weight again for each
# few rows, so their time grows with the rows (SmolLM2's 30 layers, kvserve's int4 kernel on AVX512-BF16
# alone: 3.6 ms at 1 row, 10 at 4, 13 at 8, 19 at 12, 25 at 16), while a bf16 GEMM (AMX / AVX512-BF16)
# stays near its weight-read time (~15-17 ms at 1-16 rows with the copy prepacked in oneDNN's blocked
# layout, ~23 ms unpacked; 4-10x faster than int4 at 256+ rows). The copy is prepacked in oneDNN's
# layout (the crossover is then ~12 rows). Where oneDNN has no bf16 (an AVX2 CPU without AVX-512) there
# is no copy: a plain bf16 matmul there is 4-40x slower than the packed kernels at every row count (Zen 2,
# 512 rows of SmolLM2's 3072 × 576 gate/up: 2195 ms on the copy, 52 ms on PyTorch's int4 kernel; int8:
# 180 ms vs 41), so every step takes the packed kernel.
MKLDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
DENSE_MIN_TOKENS = 12 if MKLDNN_BF16 else 32
# Where kvserve's int4 kernel has AMX there is no copy: up to INT4_GEMM_MIN_ROWS - 1 rows one tile
# product per 16 rows and group of 32 inputs, on the exact weights (30 layers: 4.2 ms at 4 rows, 6.9 at
# 16, 12.8 at 32, 17.5 at 48, against the copy's 15.1 / 15.4 / 18.2 / 19.3); from INT4_GEMM_MIN_ROWS
# rows the kernel dequantizes each call's weights to bfloat16 tiles once and runs a GEMM on them
# (int4_gemm_amx in int4_gemm.c: the copy's weights bit for bit, at oneDNN's speed on the copy), so an
# int4 model holds its int4 weights alone (the copy was 2 bytes per weight: SmolLM2's 270 MB beside
# 85 MB of int4). The row count is int4_gemm.c's INT4_GEMM_MIN_ROWS: int4_gemm_min_rows().


@dataclass(slots=True)
class BlockQuant:
    """One GGUF tensor's 4-bit blocks in HF row order: ``w[n, k] = codes[n, k]·scale[n, k // 32] +
    min[n, k // 32]``. codes: [N, K] uint8 in [0, 15]; scale, min: [N, K // 32] float32."""

    codes: np.ndarray
    scale: np.ndarray
    min: np.ndarray

    def permute_rows(self, fn) -> "BlockQuant":
        return BlockQuant(fn(self.codes), fn(self.scale), fn(self.min))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        n, k = self.codes.shape
        w = self.codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE) * self.scale[..., None] + self.min[..., None]
        return torch.from_numpy(w.reshape(n, k).astype(np.float32))


def gguf_block_quant(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockQuant | None:
    """Decode a Q4_0/Q4_1 GGUF tensor's raw bytes (``ReaderTensor.data``: [N, bytes per row] uint8)
    into codes and per-block scale/min. ``shape`` is (N, K) in HF order. None for other types.

    Block layouts (ggml-common.h): Q4_0 = f16 d, 16 bytes of nibbles; Q4_1 = f16 d, f16 m, 16 bytes.
    Byte j of the nibbles holds weight j in its low 4 bits and weight j + 16 in its high 4 bits.
    """
    if type_name not in ("Q4_0", "Q4_1"):
        return None
    n, k = shape
    header = 2 if type_name == "Q4_0" else 4
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP_SIZE, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    qs = blocks[..., header:]  # [N, K/32, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # [N, K] uint8
    if type_name == "Q4_0":
        return BlockQuant(codes, d, -8.0 * d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return BlockQuant(codes, d, m)


def quantize_int4_minmax(w: torch.Tensor, group_size: int = GROUP_SIZE) -> BlockQuant:
    """Q4_1's rule per group of ``group_size`` along K: scale = (max − min)/15, codes =
    round((w − min)/scale). w: [N, K] float. Max error per weight: scale/2. Raises ValueError unless K
    is a multiple of ``group_size``."""
    n, k = w.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"quantize_int4_minmax needs in_features (K) % group_size == 0, got K={k}, "
                         f"group_size={group_size}")
    g = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return BlockQuant(codes.reshape(n, k).numpy(), scale.numpy(), lo.numpy())


class PackedLinear(nn.Module):
    """``y = x·Wᵀ + b`` with W packed; subclasses give the kernel (``_packed_mm``), ``dequantize`` and
    ``weight_nbytes``. x: [..., in_features] any float dtype → y: [..., out_features] in x's dtype.
    Steps of ≥ ``dense_min_tokens`` rows (``DENSE_MIN_TOKENS`` unless the kernel says otherwise) multiply
    with ``dense``, a bfloat16 copy of ``dequantize()``, where oneDNN has bfloat16 here (elsewhere there
    is no copy and ``dense_min_tokens`` is ``sys.maxsize``)."""

    dense_min_tokens = DENSE_MIN_TOKENS

    in_features: int
    out_features: int

    def _finish(self, bias: torch.Tensor | None, dense_prefill: bool) -> None:
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("dense", None, persistent=False)
        self.dense_prepacked = False
        if dense_prefill and MKLDNN_BF16:
            self.set_dense(prepack=True)
        elif not MKLDNN_BF16:  # no copy (see DENSE_MIN_TOKENS): every row count on the packed kernel
            self.dense_min_tokens = sys.maxsize

    def set_dense(self, prepack: bool) -> None:
        """(Re)build ``dense``, the bfloat16 copy of ``dequantize()`` [N, K] for steps of many rows;
        ``prepack``: in oneDNN's blocked layout (an opaque mkldnn tensor), packed once."""
        dense = self.dequantize().to(KERNEL_DTYPE)
        self.dense = torch.ops.mkldnn._reorder_linear_weight(dense, 16) if prepack else dense
        self.dense_prepacked = prepack

    def _dense_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [T, K] bfloat16 times the bfloat16 copy of W: [T, N] bfloat16."""
        if self.dense_prepacked:
            return torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.dense, None, "none", [], "")
        return F.linear(x2, self.dense)

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == KERNEL_DTYPE and self.bias is None and x.shape[0] < self.dense_min_tokens:
            return self._packed_mm(x)  # a decode step's rows: nothing to reshape or cast
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)  # [T, K]
        dense = self.dense is not None and x2.shape[0] >= self.dense_min_tokens
        y = self._dense_mm(x2) if dense else self._packed_mm(x2)
        y = y.to(x.dtype) if self.bias is None else y.to(x.dtype) + self.bias
        return y.view(*lead, self.out_features)  # [..., N]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


INT4_RECORD = 160  # uint16 per (16-row tile, 32-input group) record of the kvserve int4 layout


@functools.cache
def int4_kernel():
    """The compiled library when kvserve's int4 kernel runs here (a CPU with AVX512-BF16, or AVX2 with FMA
    and F16C, and a C compiler), else None."""
    from kvserve.attention import kv_quant_kernel
    dll = kv_quant_kernel.load()
    return dll if dll is not None and dll.kvs_int4_supported() else None


def int4_gemm_min_rows() -> int | None:
    """Rows of x from which the int4 kernel, where it has AMX, dequantizes a call's weights to bfloat16
    tiles once and runs a GEMM on them (int4_gemm.c's INT4_GEMM_MIN_ROWS, asked of the library); None
    where the int4 kernel does not run."""
    dll = int4_kernel()
    return None if dll is None else int(dll.kvs_int4_gemm_min_rows())


def int4_q8_max_rows() -> int:
    """Rows of x up to which the int4 kernel quantizes x to int8 per group of 32 inputs (int4_gemm.c's
    INT4_Q8_MAX_ROWS, asked of the library): 7 on AVX512-VNNI, every row count on the AVX2 path (which
    has no bfloat16 one), 0 where the kernel keeps x in bfloat16 or does not run."""
    dll = int4_kernel()
    return 0 if dll is None else int(dll.kvs_int4_q8_max_rows())


def pack_int4_tiles(codes: np.ndarray, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The layout ``int4_gemm.c`` streams. codes: [N, K] uint8 in [0, 15]; scale, zero: [N, K/32]
    bfloat16 (N % 16 == 0, K % 32 == 0). Returns [N/16, K/32, 160] int16 holding uint16 bit patterns: per
    (tile of 16 rows, group of 32 inputs) 128 code lanes (lane L of chunk c holds in bits 4j..4j+3 the
    code of row L/2 at input 32g + 8c + 2j + L%2), then the 16 scales, then the 16 zeros.
    Raises ValueError when N is not a multiple of 16 or K of 32."""
    n, k = codes.shape
    if n % 16 or k % GROUP_SIZE:
        raise ValueError(f"the int4 tile layout needs out_features (N) % 16 == 0 and in_features (K) % "
                         f"{GROUP_SIZE} == 0, got N={n}, K={k}")
    t, g = n // 16, k // GROUP_SIZE
    c = codes.reshape(t, 16, g, 4, 4, 2).astype(np.uint16).transpose(0, 2, 3, 1, 5, 4)  # t, g, chunk, row, k%2, j
    lanes = (c[..., 0] | c[..., 1] << 4 | c[..., 2] << 8 | c[..., 3] << 12).reshape(t, g, 128)

    def per_tile(v: torch.Tensor) -> np.ndarray:  # [N, G] bf16 → [T, G, 16] uint16 bits
        return v.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(t, 16, g).transpose(0, 2, 1)

    rec = np.concatenate([lanes, per_tile(scale), per_tile(zero)], axis=-1)
    assert rec.shape[-1] == INT4_RECORD
    return torch.from_numpy(np.ascontiguousarray(rec).view(np.int16))


def unpack_int4_tiles(packed: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int4_tiles`: (codes [N, K] uint8, scale [N, K/32] bf16, zero [N, K/32] bf16)."""
    t, g, _ = packed.shape
    rec = packed.numpy().view(np.uint16)
    lanes = rec[..., :128].reshape(t, g, 4, 16, 2, 1) >> (4 * np.arange(4, dtype=np.uint16)) & 0xF  # ..., row, k%2, j
    codes = lanes.transpose(0, 3, 1, 2, 5, 4).reshape(t * 16, g * GROUP_SIZE).astype(np.uint8)

    def rows(v: np.ndarray) -> torch.Tensor:  # [T, G, 16] → [N, G] bf16
        return torch.from_numpy(np.ascontiguousarray(v.transpose(0, 2, 1).reshape(t * 16, g)).view(np.int16)) \
            .view(KERNEL_DTYPE)

    return codes, rows(rec[..., 128:144]), rows(rec[..., 144:160])


@torch.compiler.disable  # ctypes on data pointers: opaque to torch.compile, run eagerly
def int4_tiles_mm(x2: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x2 [T, K] bfloat16 · Wᵀ with W in :func:`pack_int4_tiles` layout → [T, N] bfloat16 (the float32
    sum rounded to nearest even)."""
    x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], out_features, dtype=KERNEL_DTYPE)
    int4_kernel().kvs_int4_linear(x2.data_ptr(), x2.shape[0], x2.shape[1], packed.data_ptr(), out_features,
                                  y.data_ptr(), 4, torch.get_num_threads())
    return y


class Int4Linear(PackedLinear):
    """W as 4-bit codes and a bfloat16 (scale, zero) per group of 32 inputs: 0.5 byte + 4 bytes per 32
    (0.625 B per weight); ``w = (q − 8)·scale + zero``. Kernel: kvserve's ``kvs_int4_linear`` on the
    tile layout of :func:`pack_int4_tiles` where :func:`int4_kernel` is available (``layout == "tiles"``),
    else ``torch._weight_int4pack_mm_for_cpu`` on its own packing (``layout == "torch"``). The tile
    kernel multiplies bfloat16 x, except up to :func:`int4_q8_max_rows` rows (7, decode steps of small
    batches, on a CPU with AVX512-VNNI; every row count on an AVX2 CPU without AVX-512): each row is
    quantized to int8 per group of 32 inputs (scale max|x| / 127, as llama.cpp's Q8_1) and multiplied in
    integers (error ≤ scale / 2 per input; see int4_gemm.c). Where the kernel has
    AMX it takes every row count and the layer holds no bfloat16 copy: from :func:`int4_gemm_min_rows` rows it
    multiplies by the weights rounded to bfloat16 (the copy's weights) in an AMX GEMM. On an AVX2 CPU
    (no oneDNN bf16) the AVX2 kernel takes every row count (int8 x), with no copy."""

    def __init__(self, block: BlockQuant, bias: torch.Tensor | None = None, dense_prefill: bool = True,
                 layout: str | None = None):
        """``layout``: None picks "tiles" where :func:`int4_kernel` runs, else "torch"; tests force either.
        Raises ValueError unless out_features % 16 == 0 (both kernels' rows come in tiles of 16; the
        loader keeps such matrices in float)."""
        super().__init__()
        n, k = block.codes.shape
        self.in_features, self.out_features, self.group_size = k, n, GROUP_SIZE
        scale, lo = torch.from_numpy(block.scale), torch.from_numpy(block.min)  # [N, K/32] float32
        zeros = lo + 8 * scale  # the kernels dequantize (q − 8)·scale + zero
        if layout not in (None, "tiles", "torch"):
            raise ValueError(f"layout must be 'tiles', 'torch' or None, got {layout!r}")
        if n % 16:
            raise ValueError(f"Int4Linear needs out_features (N) % 16 == 0 (kvserve's and PyTorch's int4 kernels "
                             f"take rows in tiles of 16), got N={n}")
        self.layout = layout or ("tiles" if int4_kernel() is not None else "torch")
        if self.layout == "tiles" and int4_kernel() is None:
            raise ValueError("layout='tiles' needs kvserve's int4 kernel (an AVX512-BF16 or AVX2 CPU and a C "
                             "compiler)")
        if self.layout == "tiles":
            self.register_buffer("packed", pack_int4_tiles(block.codes, scale.to(KERNEL_DTYPE), zeros.to(KERNEL_DTYPE)))
            # every row count on the kernel, no bfloat16 copy: AMX (see int4_gemm_min_rows). Where oneDNN has no
            # bf16 (an AVX2 CPU: the AVX2 kernel, int8 x) _finish keeps no copy either (SmolLM2's 3072 × 576
            # gate/up at 512 rows, Zen 2: 159 ms on the copy, 11.5 on the kernel); an AVX-512 CPU without
            # AVX512-BF16 runs the AVX2 kernel below DENSE_MIN_TOKENS rows and oneDNN's bf16 on the copy above
            if int4_kernel().amx:
                self.dense_min_tokens = sys.maxsize
                dense_prefill = False
        else:
            codes = torch.from_numpy(np.ascontiguousarray(block.codes)).to(torch.int32)
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))  # [N, K/2] uint8
            self.register_buffer("scale_zeros", torch.stack([scale, zeros], -1).transpose(0, 1)
                                 .contiguous().to(KERNEL_DTYPE))  # [K/32, N, 2]
        self._finish(bias, dense_prefill)

    @property
    def weight_nbytes(self) -> int:
        """Bytes a decode step reads (codes + scales; the prefill copy is not counted)."""
        if self.layout == "tiles":
            return self.packed.numel() * self.packed.element_size()
        return self.packed.numel() + self.scale_zeros.numel() * self.scale_zeros.element_size()

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies with, float32 [N, K] (reference for tests)."""
        if self.layout == "tiles":
            codes, scale, zero = unpack_int4_tiles(self.packed)
            q = torch.from_numpy(codes).float().view(self.out_features, -1, GROUP_SIZE)
            return ((q - 8) * scale.float()[..., None] + zero.float()[..., None]).view(self.out_features, -1)
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scale_zeros).float().T

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.layout == "tiles":
            return int4_tiles_mm(x2, self.packed, self.out_features)
        return torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scale_zeros)


class Int8Linear(PackedLinear):
    """W as int8 codes and one bfloat16 scale per output row: ``W[n] = q[n]·s[n]``,
    ``s[n] = max|W[n]| / 127``. Kernel: a decode step's rows (≤ ``GEMV_MAX_ROWS``) on kvserve's GEMV
    (``kvs_dense_linear`` in ``dense_gemv.c``: ``(Σ x·q)·s`` in float32, rounded to bfloat16; SmolLM2's
    int8 LM head 2.7 → 1.6 ms at 1 row), otherwise ``torch._weight_int8pack_mm``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense_prefill: bool = True):
        super().__init__()
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
        self.register_buffer("qweight", (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(KERNEL_DTYPE))
        self._finish(bias, dense_prefill)

    @property
    def weight_nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if (x2.shape[1] == self.in_features > 0 and plain_cpu(x2) and not torch.compiler.is_compiling()
                and gemv_kernel() is not None):
            if x2.shape[0] <= GEMV_MAX_ROWS:
                return int8_gemv(x2, self.qweight, self.scales)
            if self.in_features % 16:  # torch's int8 kernel crashes on such K: the GEMV, GEMV_MAX_ROWS rows at a time
                return torch.cat([int8_gemv(x2[i:i + GEMV_MAX_ROWS], self.qweight, self.scales)
                                  for i in range(0, x2.shape[0], GEMV_MAX_ROWS)])
        return torch._weight_int8pack_mm(x2, self.qweight, self.scales)


@torch.compiler.disable  # ctypes on data pointers: opaque to torch.compile, run eagerly
def int8_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2 [T, K] bfloat16 · (qweight [N, K] int8 · scales [N] bfloat16)ᵀ → [T, N] bfloat16 on kvserve's
    GEMV: the float32 sum times the scale, rounded to nearest even."""
    x2 = x2.contiguous()
    y = torch.empty(x2.shape[0], qweight.shape[0], dtype=KERNEL_DTYPE)
    gemv_kernel().kvs_dense_linear(x2.data_ptr(), x2.shape[0], x2.shape[1], qweight.data_ptr(), 0, scales.data_ptr(),
                                   qweight.shape[0], y.data_ptr(), torch.get_num_threads())
    return y


def reference_linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """Plain float32 ``x·dequantize(W)ᵀ + b`` — the oracle the packed kernels are tested against."""
    y = F.linear(x.float(), layer.dequantize())
    return y if layer.bias is None else y + layer.bias.float()


@dataclass(slots=True)
class SourceQuant:
    """How a checkpoint tensor was stored: its ggml type name ('Q4_1', 'Q8_0', 'F32', ...) and, for
    Q4_0/Q4_1, its decoded blocks (None otherwise)."""

    type_name: str
    blocks: BlockQuant | None = None


def _choose(weight_dtype: str, source: str | None) -> str:
    """'int4' | 'int8' | 'float' for one matrix. ``source`` is the ggml type of its checkpoint tensor."""
    if weight_dtype == "int8":
        return "int8"
    if weight_dtype == "int4":
        return "int4"  # every matrix, the LM head too (its int4 GEMV is ~3x faster than int8's here)
    # auto: keep the checkpoint's own precision
    if source in ("Q4_0", "Q4_1"):
        return "int4"
    if source == "Q8_0":
        return "int8"
    return "float"


def _module_sources(model: nn.Module, sources: dict[str, SourceQuant]) -> dict[str, list[tuple[int, SourceQuant]]]:
    """Linear module name → [(row offset, source)] of the checkpoint tensors fused into it."""
    rows = getattr(model, "weight_rows", None)
    out: dict[str, list[tuple[int, SourceQuant]]] = {}
    if rows is None:
        return out
    for hf_name, src in sources.items():
        param, offset = rows(hf_name)
        if param is not None and param.endswith(".weight"):
            out.setdefault(param.removesuffix(".weight"), []).append((offset or 0, src))
    return out


def _int4_from(linear_weight: torch.Tensor, parts: list[tuple[int, SourceQuant]]) -> BlockQuant:
    """Exact GGUF blocks when every row of the matrix has them, else Q4_1-rule re-quantization."""
    n = linear_weight.shape[0]
    parts = sorted(parts, key=lambda p: p[0])
    if parts and all(src.blocks is not None for _, src in parts):
        covered = sum(src.blocks.codes.shape[0] for _, src in parts)
        if covered == n:
            cat = lambda f: np.concatenate([f(src.blocks) for _, src in parts])  # noqa: E731
            return BlockQuant(cat(lambda b: b.codes), cat(lambda b: b.scale), cat(lambda b: b.min))
    return quantize_int4_minmax(linear_weight)


def int4_packable(out_features: int, in_features: int) -> bool:
    """The int4 packing needs whole groups of 32 inputs and outputs in multiples of 16."""
    return in_features % GROUP_SIZE == 0 and out_features % 16 == 0


def int8_packable(in_features: int) -> bool:
    """torch._weight_int8pack_mm (torch 2.13, CPU) crashes the process (segfault) when the input size is
    not a multiple of 16; such matrices stay float."""
    return in_features % 16 == 0


def unpack_dense(model: nn.Module) -> int:
    """Turn the prepacked (opaque oneDNN) dense copies of ``model``'s packed layers back into plain
    bfloat16 tensors, for code that traces the model (torch.compile cannot lower mkldnn tensors).
    Returns how many layers changed."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, PackedLinear) and mod.dense_prepacked:
            mod.set_dense(prepack=False)
            n += 1
    return n


def quantize_model(model: nn.Module, weight_dtype: str, sources: dict[str, SourceQuant] | None = None) -> dict[str, int]:
    """Replace ``model``'s nn.Linear layers (and a tied LM head) by packed int4/int8 layers in place.

    ``weight_dtype``: 'int4', 'int8' or 'auto' (follow ``sources``: HF name → :class:`SourceQuant`,
    from a GGUF). Models name their fused rows with ``weight_rows(hf_name) -> (param, row offset)``;
    without it every int4 matrix is re-quantized from its float weights. int4 matrices whose input
    size is not a multiple of 32, or output size not a multiple of 16 (the kernel's packing), and int8
    matrices whose input size is not a multiple of 16 (:func:`int8_packable`), stay float. Returns a
    count of layers per kind.
    """
    sources = sources or {}
    by_module = _module_sources(model, sources)
    counts = {"int4": 0, "int8": 0, "float": 0}
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        parts = by_module.get(name, [])
        kinds = {src.type_name for _, src in parts}
        source = kinds.pop() if len(kinds) == 1 else None
        kind = _choose(weight_dtype, source)
        if (kind == "int4" and not int4_packable(mod.out_features, mod.in_features)) or \
                (kind == "int8" and not int8_packable(mod.in_features)):
            kind = "float"
        counts[kind] += 1
        if kind != "float":
            new = Int4Linear(_int4_from(mod.weight, parts), mod.bias) if kind == "int4" else Int8Linear(mod.weight, mod.bias)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None:  # tied: the table is the LM head
        src = sources.get("model.embed_tokens.weight")
        kind = _choose(weight_dtype, src.type_name if src else None)
        if (kind == "int4" and not int4_packable(*embed.weight.shape)) or \
                (kind == "int8" and not int8_packable(embed.weight.shape[1])):
            kind = "float"
        if kind != "float":
            model.lm_head = (Int8Linear(embed.weight) if kind == "int8" else
                             Int4Linear(_int4_from(embed.weight, [(0, src)] if src else [])))
            counts[kind] += 1
    logger.info("weights: %s", ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    return counts
