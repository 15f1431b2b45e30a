/* y = x·Wᵀ for a decode step's few rows x [M, K] and a float32 weight W [N, K] (row-major, as
 * nn.Linear stores it), float32 in and out.
 *
 * Why: at batch 1 a float32 decode step is ~120 matrix-vector products that each stream a matrix once.
 * Through PyTorch each is an MKL sgemv behind its own parallel region, fork and join, and a Python
 * call; in kvserve's one-call decode step (layer_kernel.c) they run inside one parallel region. The
 * weights stream at the speed of a plain read: each thread takes a contiguous range of output rows
 * (one sequential stream), four rows at a time, with the next four rows' lines prefetched.
 *
 * Arithmetic: y[m, n] = Σ_k x[m, k]·W[n, k] in float32: sixteen lane sums (lane i adds the products at
 * k ≡ i mod 16 in increasing k, fused multiply-adds), then the lanes added by _mm512_reduce_add_ps.
 * The order depends only on K, never on M or on the thread count, so a row's result is the same alone
 * or in a batch (batch invariance). It differs from MKL's sgemv only in summation order.
 */
#include <stdint.h>

#define DENSE_ROWS 4 /* weight rows per block: four sequential streams, each prefetched one block ahead */

#if defined(__AVX512F__)
#include <immintrin.h>

int kvs_dense_supported(void) { return 1; }

/* R (<= DENSE_ROWS) rows of W × MB (<= 4) rows of x: out[m * R + r] */
static inline __attribute__((always_inline)) void dense_block(const float *w, const float *x, int64_t xs, int K,
                                                             int R, int MB, int64_t pf, float *out) {
    __m512 acc[DENSE_ROWS][4];
    for (int r = 0; r < DENSE_ROWS; r++)
        for (int m = 0; m < 4; m++) acc[r][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[4];
        for (int m = 0; m < MB; m++) xv[m] = _mm512_loadu_ps(x + m * xs + k);
        for (int r = 0; r < R; r++) {
            if (pf) __builtin_prefetch(w + r * (int64_t)K + k + pf, 0, 3);
            const __m512 wv = _mm512_loadu_ps(w + r * (int64_t)K + k);
            for (int m = 0; m < MB; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    if (k < K) {  /* the tail: lanes beyond K load as zero */
        const __mmask16 live = (__mmask16)((1u << (K - k)) - 1u);
        __m512 xv[4];
        for (int m = 0; m < MB; m++) xv[m] = _mm512_maskz_loadu_ps(live, x + m * xs + k);
        for (int r = 0; r < R; r++) {
            const __m512 wv = _mm512_maskz_loadu_ps(live, w + r * (int64_t)K + k);
            for (int m = 0; m < MB; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) out[m * R + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* The matmul, run by every thread of an enclosing parallel region (outside one: by the caller alone):
 * blocks of DENSE_ROWS weight rows split statically, so each thread streams one contiguous range.
 * x: [M, K] float32, w: [N, K] float32, y: [M, N] float32. Ends with a barrier. */
void kvs_dense_linear_team(const float *x, int64_t M, int K, const float *w, int N, float *y) {
    const int64_t blocks = (N + DENSE_ROWS - 1) / DENSE_ROWS;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * DENSE_ROWS;
        const int R = N - n0 < DENSE_ROWS ? (int)(N - n0) : DENSE_ROWS;
        const int64_t pf = b + 1 < blocks ? (int64_t)DENSE_ROWS * K : 0;  /* the next block's rows */
        const float *wb = w + n0 * K;
        float out[4 * DENSE_ROWS];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int MB = M - m0 < 4 ? (int)(M - m0) : 4;
            /* R and MB as constants in the common cases so the loops unroll into registers */
            const float *xb = x + m0 * K;
            const int64_t pfb = m0 ? 0 : pf;  /* prefetch while the first rows of x pass */
            if (R < DENSE_ROWS) dense_block(wb, xb, K, K, R, MB, pfb, out);
            else if (MB == 1) dense_block(wb, xb, K, K, DENSE_ROWS, 1, pfb, out);
            else if (MB == 2) dense_block(wb, xb, K, K, DENSE_ROWS, 2, pfb, out);
            else if (MB == 3) dense_block(wb, xb, K, K, DENSE_ROWS, 3, pfb, out);
            else dense_block(wb, xb, K, K, DENSE_ROWS, 4, pfb, out);
            for (int m = 0; m < MB; m++)
                for (int r = 0; r < R; r++) y[(m0 + m) * N + n0 + r] = out[m * R + r];
        }
    }
}
#else
int kvs_dense_supported(void) { return 0; }

void kvs_dense_linear_team(const float *x, int64_t M, int K, const float *w, int N, float *y) {
    (void)x; (void)M; (void)K; (void)w; (void)N; (void)y;
}
#endif

/* y [M, N] = x [M, K] · Wᵀ, all float32 (see above), on num_threads threads. */
void kvs_dense_linear(const float *x, int64_t M, int K, const float *w, int N, float *y, int num_threads) {
#pragma omp parallel num_threads(num_threads) if ((int64_t)N * K >= 65536)
    kvs_dense_linear_team(x, M, K, w, N, y);
}
