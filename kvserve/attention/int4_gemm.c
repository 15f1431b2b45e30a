/* y = x·Wᵀ with W as 4-bit codes and a bfloat16 (scale, zero) per group of 32 inputs, the weight
 * format of kvserve.models.quant.Int4Linear: w[n, k] = (q[n, k] − 8)·scale[n, g] + zero[n, g], g = k / 32
 * (the same dequantization as torch._weight_int4pack_mm_for_cpu).
 *
 * Why: a decode step's time is weight bytes ÷ bandwidth. PyTorch's int4 kernel streams SmolLM2's
 * 576-wide matrices at ~16 GB/s and dequantizes every weight again for each few rows of x. Here each
 * 4-bit code becomes a bfloat16 weight with one table lookup (vpermw) and goes straight into an
 * AVX512-BF16 pair dot product (vdpbf16ps) with the bfloat16 activations, with software prefetch
 * (SmolLM2's 120 matrices from memory: ~3 ms vs PyTorch's 3.6-4.0). From 4 rows of x, where the CPU and
 * the kernel grant AMX, the 16 unpacked code vectors of a record are stored as an AMX B tile (their
 * lanes are already in its VNNI pair layout) and one tile product serves 16 rows (SmolLM2's 120 matrices
 * at 16 rows: 6.9 ms vs 25 on the vdpbf16ps path; from 2 rows, see int4_tile_amx).
 *
 * Packed layout (built by kvserve.models.quant.pack_int4_tiles): rows in tiles of 16; per (tile, group)
 * a record of 160 uint16:
 *   [0, 128)   codes: four chunks of 32 lanes; lane L of chunk c holds, in its bits 4j..4j+3, the code of
 *              row L/2 at input k = 32g + 8c + 2j + L%2 (j = 0..3): one vdpbf16ps lane pairs inputs k, k+1
 *              of one row;
 *   [128, 144) the 16 rows' scales, bfloat16;
 *   [144, 160) their zeros, bfloat16.
 * Records follow each other tile by tile, group by group: one sequential stream per tile.
 *
 * Arithmetic: per group, A = Σ_k (q − 8)·x_k in float32 (products of two bfloat16 are exact in float32;
 * vdpbf16ps accumulates with round-to-nearest-even and treats denormals as zero), X = Σ_k x_k, and
 * y += scale·A + zero·X. The AMX tile product (tdpbf16ps) computes the same A with the same rounding
 * rules (float32 accumulation, denormals flushed) in another order. Differs from the dequantized float32
 * matmul only in summation order and in the denormal flush.
 *
 * Up to INT4_Q8_MAX_ROWS (7) rows of x (decode steps of small batches), where the CPU has AVX512-VNNI,
 * each row of x is quantized per group of 32 to int8 with one float32 scale d = max|x_g| / 127
 * (llama.cpp's Q8_1 activations for Q4_1 weights) and each
 * group's Σ q·x_q is an exact integer from vpdpbusd on the codes as stored (int4_tile_q8). Error against the
 * dequantized float32 matmul: |x_k − d·x_q,k| ≤ d/2 per input, plus float32 roundings of the per-group
 * terms (tested with that bound). Why: the bfloat16 path spends three vector instructions per 32 weights
 * (shift, vpermw, vdpbf16ps) and ran at ~17 GB/s per core even from L1; this one spends ~1.5 per 32
 * (mask or shift, vpdpbusd for 64): SmolLM2's 120 layer matrices at one row, 2 threads, weights in the
 * L3: 2.2-2.5 -> 1.4-1.5 ms (the speed of a plain read of the same bytes); 2 rows 4.5 -> 2.3 ms and 4
 * rows 5.8 -> 2.9 ms against the AMX path; at 8 rows the two are even. Perplexity of the bundled Q4_1
 * model over 4 × 256 tokens scored one token per step: 18.27 (bfloat16 x) vs 18.24 (int8 x). Each
 * row's result depends on that row alone, as on the other paths.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define INT4_RECORD 160 /* uint16 per (tile, group) record */
#define INT4_PREFETCH (24 * INT4_RECORD) /* prefetch distance, uint16: 24 records, tuned on SmolLM2's matrices */

/* Floats of scratch kvs_int4_linear_team needs for M rows of K inputs: the group sums of x [M, K/32], or
 * (int8 x, up to INT4_Q8_MAX_ROWS rows) the rows' int8 codes (K bytes each) and two floats per group. */
int64_t kvs_int4_scratch_floats(int64_t M, int K) {
    const int64_t sums = M * (K / 32), q8 = M * (K / 4 + 2 * (K / 32));
    return sums > q8 ? sums : q8;
}

#ifndef INT4_GEMM_MIN_ROWS
#define INT4_GEMM_MIN_ROWS 56 /* from this many rows of x, int4_gemm_amx */
#endif
/* INT4_GEMM_MIN_ROWS, the one definition: kvserve.models.quant.int4_gemm_min_rows asks here. Outside the
 * AVX512-BF16 section, so the library exports it on every CPU (kv_quant_kernel.load() declares it). */
int kvs_int4_gemm_min_rows(void) { return INT4_GEMM_MIN_ROWS; }

/* out [rows, 16] float32 → rows m0.. of y [M, N] (out_code 3 = float32, 4 = bfloat16), columns of tile t */
static inline __attribute__((unused)) void store_rows(const float *out, int rows, int64_t m0, int64_t N, int t, void *y,
                                                      int out_code) {
    for (int m = 0; m < rows; m++) {
        const int64_t base = (m0 + m) * N + 16 * (int64_t)t;
        if (out_code == 3) memcpy((float *)y + base, out + 16 * m, 16 * sizeof(float));
        else
            for (int i = 0; i < 16; i++) ((uint16_t *)y)[base + i] = float_to_bf16(out[16 * m + i]);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

int kvs_int4_supported(void) { return 1; }

/* bf16 bit patterns of q − 8 for q = 0..15, twice: vpermw reads 5 index bits, the code is the low 4 */
static const uint16_t q_minus_8_lut[32] __attribute__((aligned(64))) = {
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
    0x40C0, 0x40E0, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040,
    0x4080, 0x40A0, 0x40C0, 0x40E0};

/* MB rows of x (bfloat16, row stride xs) times one tile of 16 weight rows: out[m][0..16) float32. */
static inline __attribute__((always_inline)) void int4_tile(const uint16_t *rec, int G, const uint16_t *x, int64_t xs,
                                                            const float *xsum, float *out, const int MB) {
    const __m512i table = _mm512_load_si512(q_minus_8_lut);
    __m512 y[4];
    for (int m = 0; m < MB; m++) y[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++, rec += INT4_RECORD) {
        /* one core keeps too few misses in flight on its own to stream at memory speed: ask early */
        for (int l = 0; l < INT4_RECORD * 2; l += 64) __builtin_prefetch((const char *)(rec + INT4_PREFETCH) + l, 0, 3);
        __m512 acc[4][4];
        for (int m = 0; m < MB; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(rec + 32 * c);
            for (int j = 0; j < 4; j++) {
                const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * j), table);
                for (int m = 0; m < MB; m++) {
                    int32_t pair;
                    memcpy(&pair, x + m * xs + 32 * g + 8 * c + 2 * j, 4);
                    acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w, (__m512bh)_mm512_set1_epi32(pair));
                }
            }
        }
        const __m512 scale = bf16x16_to_ps(rec + 128), zero = bf16x16_to_ps(rec + 144);
        for (int m = 0; m < MB; m++) {
            const __m512 a = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
            y[m] = _mm512_fmadd_ps(a, scale, y[m]);
            y[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * G + g]), zero, y[m]);
        }
    }
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(out + 16 * m, y[m]);
}

#ifdef __AVX512VNNI__
#define INT4_Q8 1
#ifndef INT4_Q8_MAX_ROWS
#define INT4_Q8_MAX_ROWS 7 /* up to this many rows of x: int8 x (int4_tile_q8); from 8 rows AMX is as fast */
#endif

/* One row of x as int8 codes per group of 32 inputs, as llama.cpp quantizes activations for its Q4/Q8
 * dot products (Q8_0/Q8_1): d = max|x_g| / 127, q = x / d rounded to nearest even (|q| <= 127).
 * xq [32]: the codes in the order the packed records hold each row's inputs within a chunk of 8 (see
 * int4_tile_q8): 0, 4, 1, 5, 2, 6, 3, 7. *dx = d; *cx = d · Σ q (the group sum of x as quantized).
 * A NaN or an infinity in the group makes d NaN, so the output row is NaN (bf16 x would give ±inf for
 * an infinity). Below max|x| = 2^-64, where 127 / max|x| could overflow, q = x / d by division. */
static inline __attribute__((always_inline)) void quantize_group_q8(const uint16_t *x, int8_t *xq, float *dx,
                                                                    float *cx) {
    const __m512 a = bf16x16_to_ps(x), b = bf16x16_to_ps(x + 16);
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __mmask16 bad = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)
                          | _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ)
                          | _mm512_cmp_ps_mask(_mm512_abs_ps(b), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
    const float d0 = m / 127.f;
    __m512 sa, sb;
    if (m >= 0x1p-64f && !bad) {
        const __m512 inv = _mm512_set1_ps(127.f / m);
        sa = _mm512_mul_ps(a, inv), sb = _mm512_mul_ps(b, inv);
    } else if (d0 > 0.f && !bad) {
        sa = _mm512_div_ps(a, _mm512_set1_ps(d0)), sb = _mm512_div_ps(b, _mm512_set1_ps(d0));
    } else {  /* all zeros (or a NaN / infinity: d is NaN below) */
        sa = sb = _mm512_setzero_ps();
    }
    const __m512i perm = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const __m512i qa = _mm512_permutexvar_epi32(perm, _mm512_cvtps_epi32(sa));
    const __m512i qb = _mm512_permutexvar_epi32(perm, _mm512_cvtps_epi32(sb));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtepi32_epi8(qb));
    const float d = bad ? NAN : d0;
    *dx = d;
    *cx = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

/* MB (<= 4) rows of x (quantize_group_q8 codes xq [MB, K], row stride K; scales dx and cx [MB, G], row
 * stride G) times one tile of 16 weight rows: out[m][0..16) float32. Per group, an integer dot product
 * per weight row: the 32-bit lane r of chunk c holds row r's codes at inputs 8c + (0, 4, 1, 5) in the low
 * nibbles of its four bytes and 8c + (2, 6, 3, 7) in the high nibbles (the record layout above), so a
 * mask and a shift give unsigned bytes for vpdpbusd against xq's matching quads: S = Σ q·xq exactly in
 * int32. Then y += (scale·d)·S + (zero − 8·scale)·cx, which is Σ_k w_k·x̂_k with x̂ = d·xq (the −8 of
 * q − 8 moved into the zero term). Each row's result depends on that row alone. */
static inline __attribute__((always_inline)) void int4_tile_q8(const uint16_t *rec, int G, const int8_t *xq, int K,
                                                               const float *dx, const float *cx, float *out,
                                                               const int MB) {
    const __m512i low = _mm512_set1_epi32(0x0F0F0F0F);
    __m512 y[4];
    for (int m = 0; m < MB; m++) y[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++, rec += INT4_RECORD) {
        for (int l = 0; l < INT4_RECORD * 2; l += 64) __builtin_prefetch((const char *)(rec + INT4_PREFETCH) + l, 0, 3);
        __m512i s0[4], s1[4];
        for (int m = 0; m < MB; m++) s0[m] = s1[m] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(rec + 32 * c);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
            for (int m = 0; m < MB; m++) {
                const int32_t *quads = (const int32_t *)(xq + (int64_t)m * K + 32 * g);
                s0[m] = _mm512_dpbusd_epi32(s0[m], lo, _mm512_set1_epi32(quads[2 * c]));
                s1[m] = _mm512_dpbusd_epi32(s1[m], hi, _mm512_set1_epi32(quads[2 * c + 1]));
            }
        }
        const __m512 scale = bf16x16_to_ps(rec + 128), zero = bf16x16_to_ps(rec + 144);
        const __m512 zz = _mm512_fnmadd_ps(scale, _mm512_set1_ps(8.f), zero);
        for (int m = 0; m < MB; m++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[m], s1[m]));
            y[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(dx[m * G + g])), y[m]);
            y[m] = _mm512_fmadd_ps(zz, _mm512_set1_ps(cx[m * G + g]), y[m]);
        }
    }
    for (int m = 0; m < MB; m++) _mm512_storeu_ps(out + 16 * m, y[m]);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
#endif
#define HAVE_AMX 1

static int amx_granted = 0;

/* Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 1 when granted.
 * Called once, single-threaded, when the library loads. */
int kvs_int4_amx_enable(void) {
    amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
}

/* 1 when kvs_int4_amx_enable was granted the tile state (decode attention's key pass asks too) */
int kvs_amx_granted(void) { return amx_granted; }

/* Two sets of tiles, for two groups at a time: tiles 0 and 3: C [rows × 16] float32; tiles 1 and 4: A =
 * rows of x [rows × 32] bfloat16; tiles 2 and 5: B = one record's weights as 16 input pairs × (16 outputs
 * × 2) bfloat16, the VNNI layout the records' lanes already have */
static void amx_configure(int rows) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int s = 0; s < 6; s += 3) {
        cfg.rows[s] = cfg.rows[s + 1] = (uint8_t)rows;
        cfg.rows[s + 2] = 16;
        cfg.colsb[s] = cfg.colsb[s + 1] = cfg.colsb[s + 2] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* A record's 16 code vectors as bf16 (q − 8), stored as a B tile at b [16 × 32] */
static inline __attribute__((always_inline)) void unpack_b(const uint16_t *rec, uint16_t *b, __m512i table) {
    for (int ch = 0; ch < 4; ch++) {
        const __m512i v = _mm512_loadu_si512(rec + 32 * ch);
        for (int j = 0; j < 4; j++)
            _mm512_store_si512(b + 32 * (4 * ch + j), _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * j), table));
    }
}

/* y[m] += scale·A_g[m] + zero·X_g[m] for the group of record rec, A_g in c [rows × 16] */
static inline __attribute__((always_inline)) void amx_apply(const uint16_t *rec, const float *c, const float *xs_g,
                                                            int G, __m512 *y, int rows) {
    const __m512 scale = bf16x16_to_ps(rec + 128), zero = bf16x16_to_ps(rec + 144);
    for (int m = 0; m < rows; m++) {
        y[m] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * m), scale, y[m]);
        y[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs_g[m * G]), zero, y[m]);
    }
}

/* rows (<= 16) rows of x × one tile of 16 weight rows with AMX: per group, the 16 code vectors become
 * bf16 (q − 8) (as in int4_tile) and are stored as the B tile; C = A·B holds each row's 16 group sums
 * A_g, and y += scale·A_g + zero·X_g as in int4_tile. The same products and float32 sums as int4_tile,
 * in another order. Two groups at a time (CHUNK), in three phases: unpack their records, run their tile
 * products (one on each of the two sets of tiles) into two C buffers, then add their terms to y in group
 * order. Group by group, each group's unpack → tile load → product → store → scale waited on the one
 * before (tiles are not renamed), and the core idled between AMX and vector work. SmolLM2's 120
 * matrices: 7.7 → 4.2 ms at 4 rows, 9.4 → 6.9 ms at 16, 29 → 22 ms at 64; at 2 and 3 rows it now beats
 * the vdpbf16ps path (hence INT4_AMX_MIN_ROWS 2; at 1 row it does not). That was eight groups at a
 * time; two are faster (their 4 KB of buffers against eight's 16 KB in a 48 KB L1 that also holds the
 * weight stream and x): SmolLM2's 49152 × 576 LM head, interleaved medians, 16 rows 2.05 → 1.82 ms,
 * 64 rows 8.0 → 6.6 ms, 256 rows 30.6 → 26.3 ms; bit-identical; one at a time is as slow as eight.
 * The tile configuration must be amx_configure(rows). */
static inline __attribute__((always_inline)) void int4_tile_amx_rows(const uint16_t *rec, int G, const uint16_t *x,
                                                                     int64_t xs, const float *xsum, float *out,
                                                                     const int rows) {
    enum { CHUNK = 2 };  /* groups per phase */
    const __m512i table = _mm512_load_si512(q_minus_8_lut);
    uint16_t b[CHUNK][16 * 32] __attribute__((aligned(64)));
    float c[CHUNK][16 * 16] __attribute__((aligned(64)));
    __m512 y[16];
    for (int m = 0; m < rows; m++) y[m] = _mm512_setzero_ps();
    for (int g0 = 0; g0 < G; g0 += CHUNK, rec += CHUNK * INT4_RECORD) {
        const int n = G - g0 < CHUNK ? G - g0 : CHUNK;
        for (int i = 0; i < n; i++) {
            for (int l = 0; l < INT4_RECORD * 2; l += 64)
                __builtin_prefetch((const char *)(rec + i * INT4_RECORD + INT4_PREFETCH) + l, 0, 3);
            unpack_b(rec + i * INT4_RECORD, b[i], table);
        }
        for (int i = 0; i < n; i++) {
            if (i % 2 == 0) {
                _tile_zero(0);
                _tile_loadd(1, x + 32 * (g0 + i), xs * 2);
                _tile_loadd(2, b[i], 64);
                _tile_dpbf16ps(0, 1, 2);
                _tile_stored(0, c[i], 64);
            } else {
                _tile_zero(3);
                _tile_loadd(4, x + 32 * (g0 + i), xs * 2);
                _tile_loadd(5, b[i], 64);
                _tile_dpbf16ps(3, 4, 5);
                _tile_stored(3, c[i], 64);
            }
        }
        for (int i = 0; i < n; i++) amx_apply(rec + i * INT4_RECORD, c[i], xsum + g0 + i, G, y, rows);
    }
    for (int m = 0; m < rows; m++) _mm512_storeu_ps(out + 16 * m, y[m]);
}

/* int4_tile_amx_rows with a full block of 16 rows as a constant: the 16 accumulators y[m] then stay in
 * registers (with a runtime row count they lived on the stack, and every scale and zero term cost a
 * load and a store: SmolLM2's 3072 × 576 gate/up matrix at 16 rows, in L2: 67–70 → 63 µs). */
static void int4_tile_amx(const uint16_t *rec, int G, const uint16_t *x, int64_t xs, const float *xsum, float *out,
                          int rows) {
    if (rows == 16) int4_tile_amx_rows(rec, G, x, xs, xsum, out, 16);
    else int4_tile_amx_rows(rec, G, x, xs, xsum, out, rows);
}

/* ---- many rows (prefill chunks): dequantize to bfloat16 tiles once, then a 32 × 32 AMX GEMM ----
 *
 * From INT4_GEMM_MIN_ROWS rows of x, where the per-group path above spends a tile product, a C store and
 * a scale per group and 16 rows however many rows come, each thread dequantizes a slab of its output
 * columns once, w = bf16((q − 8)·scale + zero), into B tiles (16 input pairs × 16 outputs, the VNNI
 * layout) and multiplies every 32 rows of x by them: a 2 × 2 block of tile products accumulated over all
 * K in four C tiles (float32), 4 tile products per 4 tile loads; then rounded to bfloat16 (nearest even).
 * The weights are those of a bfloat16 copy of Int4Linear.dequantize(), bit for bit (dequant_b), so the
 * results are those of a bfloat16 GEMM on that copy up to float32 summation order: for prefill, what
 * oneDNN on a prepacked copy gave before, at its speed, without holding the copy (2 bytes per weight,
 * 3.2 times the int4 weights). SmolLM2's TTFT in the engine, alternating with the oneDNN copy, medians
 * of 6: 64-token prompt 0.98×, 256 1.01×, 1024 0.89×, 2048 1.02×. Its four matrices of a layer alone:
 * 512 rows ~20 % faster than oneDNN, 2048 rows 0-20 % slower (gate/up, 3072 × 576, the slowest). */
#ifndef INT4_GEMM_SLAB_BYTES
#define INT4_GEMM_SLAB_BYTES (1 << 20) /* a slab of dequantized 32-column blocks: at most this (L2 holds it) */
#endif

/* Tiles 0-3: C [16 × 16] float32 (rows 0-15 / 16-31 × columns 0-15 / 16-31); 4, 5: A = 16 rows of x ×
 * 32 inputs; 6, 7: B = 16 input pairs × 16 outputs × 2 */
static void amx_configure_gemm(void) { amx_configure_full(); }

/* One record (16 weight rows × 32 inputs) as the B tile b [16 pairs × 32]: bf16((q − 8)·scale + zero).
 * Lane L of a record's code vector is row L/2 (module comment), so lanes 0-15 take rows 0-7's scales,
 * each twice, and lanes 16-31 rows 8-15's. q − 8 comes from a float32 table (one vpermps), and
 * vcvtne2ps2bf16 rounds to nearest even; it flushes a subnormal weight to zero, which tdpbf16ps would
 * read as zero anyway, and keeps a NaN a NaN. */
static inline __attribute__((always_inline)) void dequant_b(const uint16_t *rec, uint16_t *b, __m512 table) {
    const __m512 sc = bf16x16_to_ps(rec + 128), ze = bf16x16_to_ps(rec + 144);
    const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512 s0 = _mm512_permutexvar_ps(lo, sc), s1 = _mm512_permutexvar_ps(hi, sc);
    const __m512 z0 = _mm512_permutexvar_ps(lo, ze), z1 = _mm512_permutexvar_ps(hi, ze);
    for (int ch = 0; ch < 4; ch++) {
        const __m512i v = _mm512_loadu_si512(rec + 32 * ch);
        for (int j = 0; j < 4; j++) {
            const __m512i q = _mm512_srli_epi16(v, 4 * j); /* vpermps reads the low 4 bits of each index */
            const __m512 q0 = _mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)), table);
            const __m512 q1 = _mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)), table);
            _mm512_store_si512(b + 32 * (4 * ch + j),
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q1, s1, z1), _mm512_fmadd_ps(q0, s0, z0)));
        }
    }
}

/* c [32 × 32] float32 (row stride 32) = 32 rows of x (row stride xs) × one 32-column block bt
 * ([G][2][16 × 32] B tiles). Tiles configured by amx_configure_gemm. */
static inline __attribute__((always_inline)) void gemm_32x32(const uint16_t *x, int64_t xs, const uint16_t *bt, int G,
                                                             float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int g = 0; g < G; g++) {
        _tile_loadd(4, x + 32 * g, xs * 2);
        _tile_loadd(5, x + 16 * xs + 32 * g, xs * 2);
        _tile_loadd(6, bt + 1024 * g, 64);
        _tile_loadd(7, bt + 1024 * g + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 512, 128);
    _tile_stored(3, c + 528, 128);
}

/* y [M, N] = x [M, K] · Wᵀ as described above, run by every thread of the team: each takes slabs of
 * 32-column blocks (the last block of an odd tile count has a zero second half; as many slabs for each
 * thread, each at most INT4_GEMM_SLAB_BYTES), dequantizes them into its own buffer, and runs every 32 rows
 * of x (in L1) past the slab's blocks (in L2): each slab reads all of x once. The last M % 32 rows go
 * through a zero-padded copy. Outputs: float32 (out_code 3) or bfloat16 rounded to nearest even by
 * vcvtne2ps2bf16 (a subnormal result flushes to zero). No barrier at the end. */
static void int4_gemm_amx(const uint16_t *x, int64_t M, int K, const uint16_t *w, int N, void *y, int out_code) {
    const int G = K / 32, tiles = N / 16, blocks = (tiles + 1) / 2;
    const int nt = omp_get_num_threads();
    const int64_t block_bytes = (int64_t)G * 2048;
    const int most = INT4_GEMM_SLAB_BYTES / block_bytes > 1 ? (int)(INT4_GEMM_SLAB_BYTES / block_bytes) : 1;
    int slabs = (blocks + most - 1) / most;
    slabs = (slabs + nt - 1) / nt * nt;
    const int per = (blocks + slabs - 1) / slabs;
    uint16_t *bt = aligned_alloc(64, (size_t)per * block_bytes);
    uint16_t *xt = NULL; /* the last M % 32 rows, zero-padded to 32 */
    float c[32 * 32] __attribute__((aligned(64)));
    const int64_t full = M / 32 * 32;
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    amx_configure_gemm();
#pragma omp for schedule(static) nowait
    for (int s = 0; s < slabs; s++) {
        const int b0 = s * per, nb = blocks - b0 < per ? blocks - b0 : per;
        if (nb <= 0) continue;
        for (int i = 0; i < nb; i++)
            for (int h = 0; h < 2; h++) {
                const int t = 2 * (b0 + i) + h;
                for (int g = 0; g < G; g++) {
                    uint16_t *b = bt + ((int64_t)i * G + g) * 1024 + 512 * h;
                    if (t < tiles) dequant_b(w + ((int64_t)t * G + g) * INT4_RECORD, b, table);
                    else memset(b, 0, 1024);
                }
            }
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const uint16_t *xr = x + m0 * K;
            const int rows = m0 < full ? 32 : (int)(M - full);
            if (rows < 32) {
                if (!xt) {
                    xt = aligned_alloc(64, (size_t)32 * K * 2);
                    memcpy(xt, xr, (size_t)rows * K * 2);
                    memset(xt + (int64_t)rows * K, 0, (size_t)(32 - rows) * K * 2);
                }
                xr = xt;
            }
            for (int i = 0; i < nb; i++) {
                gemm_32x32(xr, K, bt + (int64_t)i * G * 1024, G, c);
                const int n0 = 32 * (b0 + i), cols = N - n0 < 32 ? N - n0 : 32;
                for (int r = 0; r < rows; r++) {
                    const int64_t o = (m0 + r) * N + n0;
                    if (out_code == 3) memcpy((float *)y + o, c + 32 * r, sizeof(float) * cols);
                    else if (cols == 32)
                        _mm512_storeu_si512((uint16_t *)y + o,
                                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c + 32 * r + 16),
                                                                         _mm512_load_ps(c + 32 * r)));
                    else
                        _mm256_storeu_si256((__m256i *)((uint16_t *)y + o),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + 32 * r)));
                }
            }
        }
    }
    _tile_release();
    free(bt);
    free(xt);
}
#else
int kvs_int4_amx_enable(void) { return 0; }
int kvs_amx_granted(void) { return 0; }
#endif

#define INT4_AMX_MIN_ROWS 2 /* from this many rows of x, AMX (1 row: 3.7 ms vdpbf16ps vs ~5 ms AMX on SmolLM2) */

/* The matmul below, run by every thread of an enclosing parallel region (outside one: by the caller
 * alone). xsum: kvs_int4_scratch_floats(M, K) float32 scratch shared by the team. Ends with a barrier. */
void kvs_int4_linear_team(const uint16_t *x, int64_t M, int K, const uint16_t *w, int N, void *y, int out_code,
                          float *xsum) {
    const int G = K / 32, tiles = N / 16;
#ifdef INT4_Q8
    if (M <= INT4_Q8_MAX_ROWS) {  /* int8 x on vpdpbusd (int4_tile_q8), four rows per pass over a tile */
        int8_t *xq = (int8_t *)xsum;
        float *dx = xsum + M * K / 4, *cx = dx + M * G;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * G; i++)
            quantize_group_q8(x + (i / G) * K + 32 * (i % G), xq + (i / G) * K + 32 * (i % G), dx + i, cx + i);
        float out[4 * 16];
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const uint16_t *rec = w + (int64_t)t * G * INT4_RECORD;
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int mb = M - m0 < 4 ? (int)(M - m0) : 4;
                const int8_t *xr = xq + m0 * K;
                const float *dr = dx + m0 * G, *cr = cx + m0 * G;
                switch (mb) {
                    case 4: int4_tile_q8(rec, G, xr, K, dr, cr, out, 4); break;
                    case 3: int4_tile_q8(rec, G, xr, K, dr, cr, out, 3); break;
                    case 2: int4_tile_q8(rec, G, xr, K, dr, cr, out, 2); break;
                    default: int4_tile_q8(rec, G, xr, K, dr, cr, out, 1); break;
                }
                store_rows(out, mb, m0, N, t, y, out_code);
            }
        }
        return;
    }
#endif
#ifdef HAVE_AMX
    if (amx_granted && M >= INT4_GEMM_MIN_ROWS) {
        int4_gemm_amx(x, M, K, w, N, y, out_code);
#pragma omp barrier
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int g = 0; g < G; g++) {
            float s = 0.f;
            for (int k = 0; k < 32; k++) s += bf16_to_float(x[m * K + 32 * g + k]);
            xsum[m * G + g] = s;
        }
#ifdef HAVE_AMX
    if (amx_granted && M >= INT4_AMX_MIN_ROWS) {  /* blocks of 16 rows of x, each over this thread's tiles */
        float out[16 * 16];
        int configured = 0;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
            if (rows != configured) { amx_configure(rows); configured = rows; }
#pragma omp for schedule(static) nowait
            for (int t = 0; t < tiles; t++) {
                int4_tile_amx(w + (int64_t)t * G * INT4_RECORD, G, x + m0 * K, K, xsum + m0 * G, out, rows);
                store_rows(out, rows, m0, N, t, y, out_code);
            }
        }
        _tile_release();
#pragma omp barrier
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint16_t *rec = w + (int64_t)t * G * INT4_RECORD;
        float out[4 * 16];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mb = M - m0 < 4 ? (int)(M - m0) : 4;
            const uint16_t *xr = x + m0 * K;
            const float *xsr = xsum + m0 * G;
            switch (mb) {
                case 4: int4_tile(rec, G, xr, K, xsr, out, 4); break;
                case 3: int4_tile(rec, G, xr, K, xsr, out, 3); break;
                case 2: int4_tile(rec, G, xr, K, xsr, out, 2); break;
                default: int4_tile(rec, G, xr, K, xsr, out, 1); break;
            }
            store_rows(out, mb, m0, N, t, y, out_code);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* CPUs with AVX2 but no AVX-512 (AMD Zen 2, older Intel): every row count on int8 x, as int4_tile_q8
 * above but with 256-bit vectors and no VNNI (llama.cpp's AVX2 Q4_1 × Q8_1 dot product does the
 * same): vpmaddubsw multiplies the unsigned 4-bit codes by the signed int8 x and adds pairs into int16
 * (|sum| ≤ 2·15·127; eight such pairs per group and row stay within int16: 8·3810 < 32767, exact), one
 * vpmaddwd per 8 weight rows and group widens them to int32. The same codes, scales and arithmetic as
 * int4_tile_q8, so the same error bound against the dequantized float32 matmul. There is no bfloat16
 * path here: on a CPU without oneDNN bf16 (AVX2 only) the layer keeps no bfloat16 copy and prefill runs
 * here too; an AVX-512 CPU without AVX512-BF16 also lands in this section and multiplies steps of
 * DENSE_MIN_TOKENS rows or more on the copy. Like the VNNI path's (and the bfloat16 path's group sums
 * X), the per-group terms are float32: a group of x whose sum overflows float32 (|x| ~1e37 and up)
 * gives ±inf or NaN where the exact result is finite.
 *
 * Prefetch: for one or two rows of x (one pass over each tile: a decode step) the records ahead are
 * asked for with prefetchnta, for more rows (every pass after the first reads the tile from L1) with
 * prefetcht0. A decode step reads each weight once; through prefetcht0 every line of the ~95 MB a
 * SmolLM2 step streams also went into the L2 and, evicted from there, into the L3 (a victim cache on
 * Zen 2), pushing out the KV cache and the activations, which are read again. Zen 2 (2 cores),
 * SmolLM2's 120 layer matrices at one row from DRAM, medians of 40 steps: 2.8 → 2.4 ms; the engine's
 * batch-1 ITL at 128 tokens of context ~5.3 → ~4.8 ms, within noise at 1,024 and 4,096 tokens (the
 * attention's KV reads set the pace there). The AVX-512 sections keep prefetcht0: not measured there. */
#include <immintrin.h>

int kvs_int4_supported(void) { return 1; }
int kvs_int4_amx_enable(void) { return 0; }
int kvs_amx_granted(void) { return 0; }

#define INT4_Q8 1
#undef INT4_Q8_MAX_ROWS
#define INT4_Q8_MAX_ROWS INT32_MAX /* every row count */

static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* quantize_group_q8 of the AVX-512 section, bit for bit: the same d, rounding and code order. */
static inline __attribute__((always_inline)) void quantize_group_q8(const uint16_t *x, int8_t *xq, float *dx,
                                                                    float *cx) {
    __m256 v[4], amax = _mm256_setzero_ps();
    int bad = 0;
    const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
    for (int i = 0; i < 4; i++) {
        v[i] = bf16x8_to_ps(x + 8 * i);
        const __m256 a = _mm256_andnot_ps(sign, v[i]);
        bad |= _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q), _mm256_cmp_ps(a, inf, _CMP_EQ_OQ)));
        amax = _mm256_max_ps(amax, a);
    }
    const float m = hmax8(amax), d0 = m / 127.f;
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        __m256 s;
        if (m >= 0x1p-64f && !bad) s = _mm256_mul_ps(v[i], _mm256_set1_ps(127.f / m));
        else if (d0 > 0.f && !bad) s = _mm256_div_ps(v[i], _mm256_set1_ps(d0));
        else s = _mm256_setzero_ps();  /* all zeros (or a NaN / infinity: d is NaN below) */
        q[i] = _mm256_cvtps_epi32(s);  /* nearest even, as _mm512_cvtps_epi32 */
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    /* packs interleave per 128-bit lane: the bytes come out as dwords [a0-3 b0-3 c0-3 d0-3 a4-7 b4-7 c4-7
     * d4-7] of the four groups of eight; put them back in order, each eight as 0, 4, 1, 5, 2, 6, 3, 7 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i p[4];
    for (int i = 0; i < 4; i++) p[i] = _mm256_permutevar8x32_epi32(q[i], order);
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(p[0], p[1]), _mm256_packs_epi32(p[2], p[3]));
    _mm256_storeu_si256((__m256i *)xq, _mm256_permutevar8x32_epi32(b, order));
    const float d = bad ? NAN : d0;
    *dx = d;
    *cx = d * (float)_mm_cvtsi128_si32(s4);
}

/* MB (<= 2) rows of x times one tile of 16 weight rows, as int4_tile_q8: out[m][0..16) float32. A chunk's
 * 16 dwords (one per weight row) are two 256-bit halves, rows 0-7 and 8-15. */
static inline __attribute__((always_inline)) void int4_tile_q8(const uint16_t *rec, int G, const int8_t *xq, int K,
                                                               const float *dx, const float *cx, float *out,
                                                               const int MB, const int once) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 y[2][2];
    for (int m = 0; m < MB; m++) y[m][0] = y[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++, rec += INT4_RECORD) {
        for (int l = 0; l < INT4_RECORD * 2; l += 64) {
            if (once) __builtin_prefetch((const char *)(rec + INT4_PREFETCH) + l, 0, 0);  /* prefetchnta */
            else __builtin_prefetch((const char *)(rec + INT4_PREFETCH) + l, 0, 3);
        }
        __m256i s[2][2];
        for (int m = 0; m < MB; m++) s[m][0] = s[m][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++)
            for (int half = 0; half < 2; half++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 32 * c + 16 * half));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                for (int m = 0; m < MB; m++) {
                    const int32_t *quads = (const int32_t *)(xq + (int64_t)m * K + 32 * g);
                    s[m][half] = _mm256_add_epi16(s[m][half], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quads[2 * c])));
                    s[m][half] = _mm256_add_epi16(s[m][half], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quads[2 * c + 1])));
                    KVS_KEEP(s[m][half]);  /* the sum in this order, not every product first (kernel_math.h) */
                }
            }
        for (int half = 0; half < 2; half++) {
            const __m256 scale = bf16x8_to_ps(rec + 128 + 8 * half), zero = bf16x8_to_ps(rec + 144 + 8 * half);
            const __m256 zz = _mm256_fnmadd_ps(scale, _mm256_set1_ps(8.f), zero);
            for (int m = 0; m < MB; m++) {
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[m][half], ones));
                y[m][half] = _mm256_fmadd_ps(f, _mm256_mul_ps(scale, _mm256_set1_ps(dx[m * G + g])), y[m][half]);
                y[m][half] = _mm256_fmadd_ps(zz, _mm256_set1_ps(cx[m * G + g]), y[m][half]);
            }
        }
    }
    for (int m = 0; m < MB; m++) {
        _mm256_storeu_ps(out + 16 * m, y[m][0]);
        _mm256_storeu_ps(out + 16 * m + 8, y[m][1]);
    }
}

#define INT4_OWN_K 16384 /* up to this many inputs, each thread quantizes one or two rows of x itself */

/* As the AVX-512 section's kvs_int4_linear_team, every row count on int8 x, two rows per pass over a tile.
 * One or two rows of x (a decode step; K <= INT4_OWN_K) are quantized by every thread into its own
 * stack buffer, the same codes each time, instead of once into xsum behind a barrier: the barrier cost
 * more than the work (Zen 2 VM, 2 threads: ~0.8 µs per barrier; quantizing 576 inputs is ~400
 * instructions, ~0.2 µs), and a SmolLM2 decode step has 121 of these matmuls. */
void kvs_int4_linear_team(const uint16_t *x, int64_t M, int K, const uint16_t *w, int N, void *y, int out_code,
                          float *xsum) {
    const int G = K / 32, tiles = N / 16, own = M <= 2 && K <= INT4_OWN_K;
    int8_t xq_own[own ? 2 * K : 1] __attribute__((aligned(32)));  /* read as int32 quads below */
    float dcx_own[own ? 4 * G : 1];
    int8_t *xq = own ? xq_own : (int8_t *)xsum;
    float *dx = own ? dcx_own : xsum + M * K / 4, *cx = dx + M * G;
    if (own) {
        for (int64_t i = 0; i < M * G; i++)
            quantize_group_q8(x + (i / G) * K + 32 * (i % G), xq + (i / G) * K + 32 * (i % G), dx + i, cx + i);
    } else {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * G; i++)
            quantize_group_q8(x + (i / G) * K + 32 * (i % G), xq + (i / G) * K + 32 * (i % G), dx + i, cx + i);
    }
    float out[2 * 16];
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        const uint16_t *rec = w + (int64_t)t * G * INT4_RECORD;
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int mb = M - m0 < 2 ? 1 : 2;
            if (M == 1) int4_tile_q8(rec, G, xq, K, dx, cx, out, 1, 1);
            else if (M == 2) int4_tile_q8(rec, G, xq, K, dx, cx, out, 2, 1);
            else if (mb == 2) int4_tile_q8(rec, G, xq + m0 * K, K, dx + m0 * G, cx + m0 * G, out, 2, 0);
            else int4_tile_q8(rec, G, xq + m0 * K, K, dx + m0 * G, cx + m0 * G, out, 1, 0);
            store_rows(out, mb, m0, N, t, y, out_code);
        }
    }
}

#else

int kvs_int4_supported(void) { return 0; }
int kvs_int4_amx_enable(void) { return 0; }
int kvs_amx_granted(void) { return 0; }

void kvs_int4_linear_team(const uint16_t *x, int64_t M, int K, const uint16_t *w, int N, void *y, int out_code,
                          float *xsum) {
    (void)x; (void)M; (void)K; (void)w; (void)N; (void)y; (void)out_code; (void)xsum;
    abort(); /* callers check kvs_int4_supported() first */
}
#endif

/* y [M, N] (out_code 3 = float32, 4 = bfloat16, rounded to nearest even) = x [M, K] bfloat16 · Wᵀ,
 * W packed as above (N % 16 == 0, K % 32 == 0; callers check kvs_int4_supported() first). Tiles of 16
 * rows are split over num_threads threads; each tile's records are read once for every four (AVX2: two)
 * rows of x. */
void kvs_int4_linear(const uint16_t *x, int64_t M, int K, const uint16_t *w, int N, void *y, int out_code,
                     int num_threads) {
    float *xsum = malloc(sizeof(float) * (size_t)kvs_int4_scratch_floats(M, K));
#pragma omp parallel num_threads(num_threads) if (N / 16 >= 8)
    kvs_int4_linear_team(x, M, K, w, N, y, out_code, xsum);
    free(xsum);
}

/* Rows of x up to which the int4 kernel multiplies int8 x (quantize_group_q8): 7 with AVX512-VNNI, every
 * row count on the AVX2 path, 0 where there is no int8 path (x stays bfloat16). Asked by
 * kvserve.models.quant.int4_q8_max_rows. */
int kvs_int4_q8_max_rows(void) {
#ifdef INT4_Q8
    return INT4_Q8_MAX_ROWS;
#else
    return 0;
#endif
}
