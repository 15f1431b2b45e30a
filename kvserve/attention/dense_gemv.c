/* y = x·Wᵀ for a decode step's few rows x [M, K] and a row-major weight W [N, K]: float32 W with float32
 * x and y (nn.Linear of a float32 model), or int8 W with one scale per output row, W[n] = q[n]·s[n], with
 * bfloat16 x and y (kvserve.models.quant.Int8Linear, whose codes torch._weight_int8pack_mm reads).
 *
 * Why: at batch 1 a decode step is ~120 matrix-vector products that each stream a matrix once.
 * Through PyTorch each is an MKL sgemv (or, from 2 rows, an sgemm that is slower still at a few rows)
 * or an int8 pack matmul (SmolLM2's int8 LM head: 2.8 ms, 10 GB/s) behind its own parallel region and
 * Python call; in kvserve's one-call decode step (layer_kernel.c) they run inside one parallel region.
 * Here the weights stream at about the speed of a plain read: each thread takes a contiguous range of
 * output rows (one sequential stream), four rows at a time, with the lines ~9 KB ahead prefetched
 * (AVX2: with prefetchnta for one or two rows of x, whose one pass reads each line once, so the
 * weights do not evict the KV cache from the L2 and L3; see int4_gemm.c's AVX2 section).
 *
 * Arithmetic: A[m, n] = Σ_k x[m, k]·q[n, k] in float32 (bfloat16 x and int8 codes convert exactly):
 * sixteen lane sums (lane i adds the products at k ≡ i mod 16 in increasing k, fused multiply-adds),
 * then the lanes added by _mm512_reduce_add_ps. float32: y = A. int8: y = A·s[n] rounded to bfloat16
 * (nearest even). The order depends only on K, never on M or on the thread count, so a row's result is
 * the same alone or in a batch (batch invariance). It differs from PyTorch's kernels only in the order
 * of the sums. K = 0 gives zeros.
 */
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"

#define DENSE_ROWS 4 /* weight rows per block: four sequential streams */
#define DENSE_PREFETCH 9216 /* bytes ahead in each stream: one block of SmolLM2's float32 576-wide rows */

enum { W_F32 = 3, W_I8 = 0 };  /* weight codes as the KV cache codes: 3 = float32, 0 = int8 */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

int kvs_dense_supported(void) { return 1; }

/* 16 values from i on (the `live` lanes; others zero) as float32; code 3 = float32, 4 = bfloat16, 0 = int8 */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, int code, __mmask16 live) {
    if (code == 3) return _mm512_maskz_loadu_ps(live, (const float *)p + i);
    if (code == 4)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, (const uint16_t *)p + i)), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(live, (const int8_t *)p + i)));
}

/* R (<= DENSE_ROWS) rows of W × MB (<= 4) rows of x: the sums A in out[m * R + r]. pf: elements ahead to
 * prefetch (0: none); es: bytes per weight */
static inline __attribute__((always_inline)) void dense_block(const void *w, int wc, int es, const void *x, int xc,
                                                             int64_t xs, int K, int R, int MB, int64_t pf,
                                                             float *out) {
    __m512 acc[DENSE_ROWS][4];
    for (int r = 0; r < DENSE_ROWS; r++)
        for (int m = 0; m < 4; m++) acc[r][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[4];
        for (int m = 0; m < MB; m++) xv[m] = load16(x, m * xs + k, xc, 0xffff);
        for (int r = 0; r < R; r++) {
            if (pf && ((k * es) & 63) == 0) __builtin_prefetch((const char *)w + (r * (int64_t)K + k + pf) * es, 0, 3);
            const __m512 wv = load16(w, r * (int64_t)K + k, wc, 0xffff);
            for (int m = 0; m < MB; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    if (k < K) {  /* the tail: lanes beyond K load as zero */
        const __mmask16 live = (__mmask16)((1u << (K - k)) - 1u);
        __m512 xv[4];
        for (int m = 0; m < MB; m++) xv[m] = load16(x, m * xs + k, xc, live);
        for (int r = 0; r < R; r++) {
            const __m512 wv = load16(w, r * (int64_t)K + k, wc, live);
            for (int m = 0; m < MB; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* One block of weight rows for every row of x, with the codes as constants so the loops unroll. */
static inline __attribute__((always_inline)) void dense_rows(const void *w, int wc, const uint16_t *scales,
                                                            const void *x, int xc, int64_t M, int K, int N,
                                                            int64_t n0, int64_t pf, void *y) {
    const int es = wc == W_F32 ? 4 : 1, R = N - n0 < DENSE_ROWS ? (int)(N - n0) : DENSE_ROWS;
    const void *wb = (const char *)w + n0 * K * es;
    float out[4 * DENSE_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int MB = M - m0 < 4 ? (int)(M - m0) : 4;
        const void *xb = (const char *)x + m0 * K * (xc == 3 ? 4 : 2);
        const int64_t p = m0 ? 0 : pf;  /* prefetch while the first rows of x pass */
        if (R < DENSE_ROWS) dense_block(wb, wc, es, xb, xc, K, K, R, MB, p, out);
        else if (MB == 1) dense_block(wb, wc, es, xb, xc, K, K, DENSE_ROWS, 1, p, out);
        else if (MB == 2) dense_block(wb, wc, es, xb, xc, K, K, DENSE_ROWS, 2, p, out);
        else if (MB == 3) dense_block(wb, wc, es, xb, xc, K, K, DENSE_ROWS, 3, p, out);
        else dense_block(wb, wc, es, xb, xc, K, K, DENSE_ROWS, 4, p, out);
        for (int m = 0; m < MB; m++)
            for (int r = 0; r < R; r++) {
                const int64_t i = (m0 + m) * N + n0 + r;
                if (wc == W_F32) ((float *)y)[i] = out[m * R + r];
                else ((uint16_t *)y)[i] = float_to_bf16(out[m * R + r] * bf16_to_float(scales[n0 + r]));
            }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
/* CPUs with AVX2 but no AVX-512 (AMD Zen 2, older Intel): the same arithmetic with each 16-lane sum held
 * as two 8-lane halves (lane i still adds the products at k ≡ i mod 16, in increasing k), reduced in
 * _mm512_reduce_add_ps's order (halves, then quarters, pairs, neighbours); one row of x per pass over a
 * block of weight rows, so the block's 4·2 accumulators fit in the 16 ymm registers (more rows of x read
 * the block again, from L1 or L2). */
#include <immintrin.h>

int kvs_dense_supported(void) { return 1; }

/* 16 values from i on as two halves of float32; code 3 = float32, 4 = bfloat16, 0 = int8. Whole vectors
 * only (the tail goes through a zero-padded copy). */
static inline __attribute__((always_inline)) void load16(const void *p, int64_t i, int code, __m256 *lo, __m256 *hi) {
    if (code == 3) {
        *lo = _mm256_loadu_ps((const float *)p + i), *hi = _mm256_loadu_ps((const float *)p + i + 8);
    } else if (code == 4) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
    } else {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)p + i));
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
    }
}

static inline float reduce16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);  /* lane i + lane i + 8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}

/* R rows of W × MB rows of x (R·MB <= 4: the 2·R·MB accumulators and MB rows of x in ymm registers):
 * the sums A in out[m * R + r]. pf: elements ahead to prefetch (0: none); es: bytes per weight */
static inline __attribute__((always_inline)) void dense_block(const void *w, int wc, int es, const void *x, int xc,
                                                             int64_t xs, int K, const int R, const int MB, int64_t pf,
                                                             int nta, float *out) {
    __m256 lo[4], hi[4];  /* [r * MB + m] */
    for (int i = 0; i < R * MB; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 xl[2], xh[2];
        for (int m = 0; m < MB; m++) load16(x, m * xs + k, xc, &xl[m], &xh[m]);
        for (int r = 0; r < R; r++) {
            if (pf && ((k * es) & 63) == 0) {
                const char *a = (const char *)w + (r * (int64_t)K + k + pf) * es;
                if (nta) __builtin_prefetch(a, 0, 0);  /* prefetchnta */
                else __builtin_prefetch(a, 0, 3);
            }
            __m256 wl, wh;
            load16(w, r * (int64_t)K + k, wc, &wl, &wh);
            for (int m = 0; m < MB; m++) {
                lo[r * MB + m] = _mm256_fmadd_ps(wl, xl[m], lo[r * MB + m]);
                hi[r * MB + m] = _mm256_fmadd_ps(wh, xh[m], hi[r * MB + m]);
            }
        }
    }
    if (k < K) {  /* the tail through zero-padded copies: lanes beyond K add zero */
        const int n = K - k, xes = xc == 3 ? 4 : 2;
        __m256 xl[2], xh[2];
        for (int m = 0; m < MB; m++) {
            char xt[64] = {0};
            memcpy(xt, (const char *)x + (m * xs + k) * xes, (size_t)n * xes);
            load16(xt, 0, xc, &xl[m], &xh[m]);
        }
        for (int r = 0; r < R; r++) {
            char wt[64] = {0};
            memcpy(wt, (const char *)w + (r * (int64_t)K + k) * es, (size_t)n * es);
            __m256 wl, wh;
            load16(wt, 0, wc, &wl, &wh);
            for (int m = 0; m < MB; m++) {
                lo[r * MB + m] = _mm256_fmadd_ps(wl, xl[m], lo[r * MB + m]);
                hi[r * MB + m] = _mm256_fmadd_ps(wh, xh[m], hi[r * MB + m]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = reduce16(lo[r * MB + m], hi[r * MB + m]);
}

/* One block of DENSE_ROWS weight rows for every row of x: four weight rows per pass for one row of x,
 * two by two rows of x otherwise (each pass reads the block again, from L1). */
static inline __attribute__((always_inline)) void dense_rows(const void *w, int wc, const uint16_t *scales,
                                                            const void *x, int xc, int64_t M, int K, int N,
                                                            int64_t n0, int64_t pf, void *y) {
    const int es = wc == W_F32 ? 4 : 1, R = N - n0 < DENSE_ROWS ? (int)(N - n0) : DENSE_ROWS;
    const int xes = xc == 3 ? 4 : 2;
    float out[DENSE_ROWS * 2];
    for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const int MB = M - m0 < 2 ? 1 : 2;
        const void *xb = (const char *)x + m0 * K * xes;
        const int64_t p = m0 ? 0 : pf;  /* prefetch while the first rows of x pass */
        const int nta = M <= 2;  /* one pass over the block: its lines are not needed again */
        for (int r0 = 0; r0 < R; r0 += MB == 1 ? DENSE_ROWS : 2) {
            const int Rb = MB == 1 ? R : (R - r0 < 2 ? R - r0 : 2);
            const void *wb = (const char *)w + (n0 + r0) * K * es;
            if (MB == 1 && Rb == 4) dense_block(wb, wc, es, xb, xc, K, K, 4, 1, p, nta, out);
            else if (MB == 1 && Rb == 3) dense_block(wb, wc, es, xb, xc, K, K, 3, 1, p, nta, out);
            else if (MB == 1 && Rb == 2) dense_block(wb, wc, es, xb, xc, K, K, 2, 1, p, nta, out);
            else if (MB == 1) dense_block(wb, wc, es, xb, xc, K, K, 1, 1, p, nta, out);
            else if (Rb == 2) dense_block(wb, wc, es, xb, xc, K, K, 2, 2, p, nta, out);
            else dense_block(wb, wc, es, xb, xc, K, K, 1, 2, p, nta, out);
            for (int m = 0; m < MB; m++)
                for (int r = 0; r < Rb; r++) {
                    const int64_t i = (m0 + m) * N + n0 + r0 + r;
                    if (wc == W_F32) ((float *)y)[i] = out[m * Rb + r];
                    else ((uint16_t *)y)[i] = float_to_bf16(out[m * Rb + r] * bf16_to_float(scales[n0 + r0 + r]));
                }
        }
    }
}

/* The matmul, run by every thread of an enclosing parallel region (outside one: by the caller alone), on either section's dense_rows:
 * blocks of DENSE_ROWS weight rows split statically, so each thread streams one contiguous range.
 * w_code 3: x, w, y float32 (scales unused); w_code 0: w int8, scales [N] bfloat16, x and y bfloat16.
 * x: [M, K], w: [N, K], y: [M, N]. Ends with a barrier. */
void kvs_dense_linear_team(const void *x, int64_t M, int K, const void *w, int w_code, const uint16_t *scales, int N,
                           void *y) {
    const int64_t blocks = (N + DENSE_ROWS - 1) / DENSE_ROWS;
    const int es = w_code == W_F32 ? 4 : 1;
    int64_t ahead = K > 0 ? DENSE_PREFETCH / ((int64_t)DENSE_ROWS * K * es) : 1;  /* blocks */
    if (ahead < 1) ahead = 1;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t pf = b + ahead < blocks ? ahead * DENSE_ROWS * K : 0;  /* same row, `ahead` blocks on */
        if (w_code == W_F32) dense_rows(w, W_F32, scales, x, 3, M, K, N, b * DENSE_ROWS, pf, y);
        else dense_rows(w, W_I8, scales, x, 4, M, K, N, b * DENSE_ROWS, pf, y);
    }
}
#else
int kvs_dense_supported(void) { return 0; }

void kvs_dense_linear_team(const void *x, int64_t M, int K, const void *w, int w_code, const uint16_t *scales, int N,
                           void *y) {
    (void)x; (void)M; (void)K; (void)w; (void)w_code; (void)scales; (void)N; (void)y;
}
#endif

/* y [M, N] = x [M, K] · Wᵀ as above, on num_threads threads. */
void kvs_dense_linear(const void *x, int64_t M, int K, const void *w, int w_code, const uint16_t *scales, int N,
                      void *y, int num_threads) {
#pragma omp parallel num_threads(num_threads) if ((int64_t)N * K >= 65536)
    kvs_dense_linear_team(x, M, K, w, w_code, scales, N, y);
}
