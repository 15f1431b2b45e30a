/* Causal prefill attention on AMX tiles (an AVX2 section further down takes CPUs without AMX): L queries
 * of one sequence over its S keys, the last L of which are the queries' own (query i sits at key position S − L + i and sees keys 0 .. S − L + i).
 *
 * Why: PyTorch's CPU flash attention (the path F.scaled_dot_product_attention takes) runs at ~0.24 TFLOPS
 * here, and at 4096 prompt tokens SmolLM2's prefill attention was ~2 of its ~3 s of TTFT. A tile
 * product (tdpbf16ps) does 16 × 16 × 32 multiply-adds; here one block of 16 queries × 32 keys of one
 * head costs 8 of them (4 for the scores, 4 for P·V at d = 64) plus the softmax in AVX-512.
 *
 * Per (query head, block of 16 queries), over blocks of 32 keys (the flash-attention loop of Dao et al.,
 * arXiv:2205.14135, with the online softmax of Milakov & Gimelshein, arXiv:1805.02867):
 *   S = Q·Kᵀ (bfloat16 products, float32 sums: two C tiles of 16 × 16) → memory → per row
 *   p = 2^(S·scale·log2(e) − m) in float32 (exp2_nonpos_ps), the row sums l += Σ p, P rounded to
 *   bfloat16 (nearest even) → O += P·V in d/16 C tiles that stay in the tile registers over the whole
 *   key loop.
 * m is a reference above each row's running maximum (log2 units): when a block's row maximum passes it,
 * m becomes that maximum + PF_HEADROOM and the row's O and l are multiplied by 2^(m_old − m_new) (O's
 * tiles go through memory for it). The headroom makes that rare after the first blocks; every p stays
 * <= 1 (<= 2^-PF_HEADROOM right after a rescale), and a p below 2^-125 of m is 0 (of the true maximum,
 * 2^-117 at most).
 * out = O / l, rounded to bfloat16 (nearest even).
 *
 * Rounding is that of PyTorch's CPU flash attention for bfloat16 inputs (float32 scores and softmax, P
 * rounded to bfloat16 for the P·V product, float32 accumulation), in another summation order; tdpbf16ps
 * reads a denormal input as zero. Keys after a query's position are set to −inf before the maximum, so
 * a NaN or inf there never reaches the query; a NaN in the V row of such a key inside the query's last
 * key block does (0 · NaN in the tile product), as in PyTorch's kernel.
 *
 * K and V are first laid out per KV head in the tiles' VNNI pair layout (zero rows past S):
 *   kp [Hkv][Sp/16][d/32][16 dim pairs][16 keys][2]: B tiles of the scores (k-dim = head dims);
 *   vp [Hkv][Sp/32][d/16][16 key pairs][16 dims][2]: B tiles of P·V (k-dim = keys);
 * Sp = S rounded up to 32. The G query heads of a KV head are one work item per query block, so the
 * laid-out K and V of a head are read from L2 by every item after the first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define PF_QB 16         /* queries per block: one tile's rows */
#define PF_KB 32         /* keys per block: two score tiles, one P tile's 32 bf16 columns */
/* 2^f for |f| <= 1/2 as p(f) = ((((C4·f + C3)·f + C2)·f + C1)·f + 1: the exp2 polynomial of both sections */
#define EXP2_C4 0.009600402787327766f
#define EXP2_C3 0.055916935205459595f
#define EXP2_C2 0.24023719131946564f
#define EXP2_C1 0.6931219696998596f
#ifndef PF_HEADROOM  /* the reference maximum's lead over a row's running maximum, log2 units */
#define PF_HEADROOM 8.f
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int kvs_amx_granted(void); /* int4_gemm.c */

/* Head dims the kernel takes: 32 and 64 (O's d/16 C tiles and the other four fit the 8 tile registers) */
int kvs_prefill_attention_supported(int d) { return kvs_amx_granted() && (d == 32 || d == 64); }

/* Tiles: 0, 1 = S (16 queries × 16 keys each, float32); 2 .. 2 + d/16 − 1 = O (16 queries × 16 dims,
 * float32); 6 = A (16 queries × 32 bfloat16: Q's dims, or P's keys); 7 = B (16 pairs × 16 × 2 bfloat16) */
static void pf_configure(void) { amx_configure_full(); }

/* 2^x for x <= 0 (x = score·log2(e)·scale − m), lanes of `live` only (others 0): 2^round(x) by vscalefps
 * times a degree-4 polynomial for 2^f, |f| <= 1/2 (a least-squares fit with p(0) = 1, relative error
 * < 3.1e-6: P is rounded to bfloat16, 2^-8, right after; 2^0 is exactly 1, as e^0 is in PyTorch's
 * kernel). Below x = -125 the result is 0 (a lane mask), so every result is 0 or a normal float (a
 * denormal would cost a microcode assist), and a 2^-126 · V of ~2^127 cannot reach the output. The math
 * runs on x clamped at -125, so -inf lanes compute no NaN. NaN stays NaN (maxps returns its second
 * operand for NaN; the unordered compare keeps the lane). */
static inline __m512 exp2_nonpos_ps(__m512 x, __mmask16 live) {
    live = _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-125.f), x);
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP2_C4), f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* K's B tiles of 16 keys (kt) × 32 dims (dc) for one KV head: tile[p][n] = the dim pair (32dc + 2p,
 * 32dc + 2p + 1) of key 16kt + n, one 16-lane gather per p; zero for keys >= S. k: the head's first row,
 * rows k_row elements apart. */
static void pack_k(const uint16_t *k, int64_t k_row, int64_t S, int d, int64_t kt, uint16_t *dst) {
    const int64_t n_live = S - 16 * kt < 16 ? S - 16 * kt : 16;
    const __mmask16 live = n_live <= 0 ? 0 : (__mmask16)((1u << n_live) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(k_row / 2)));
    for (int dc = 0; dc < d / 32; dc++) {
        const uint16_t *base = k + 16 * kt * k_row + 32 * dc;
        uint16_t *t = dst + dc * 512;
        for (int p = 0; p < 16; p++)
            _mm512_store_si512(t + 32 * p, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows,
                                                                        (const uint32_t *)base + p, 4));
    }
}

/* V's B tiles of 32 keys (kb) × 16 dims (c): tile[p][n] = (V[32kb + 2p][16c + n], V[32kb + 2p + 1][16c + n]);
 * zero for keys >= S. */
static void pack_v(const uint16_t *v, int64_t v_row, int64_t S, int d, int64_t kb, uint16_t *dst) {
    for (int c = 0; c < d / 16; c++)
        for (int p = 0; p < 16; p++) {
            const int64_t a = 32 * kb + 2 * p;
            const __m512i lo = a < S ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(v + a * v_row + 16 * c)))
                                     : _mm512_setzero_si512();
            const __m512i hi = a + 1 < S
                ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(v + (a + 1) * v_row + 16 * c)))
                : _mm512_setzero_si512();
            _mm512_store_si512(dst + c * 512 + 32 * p, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
}

/* O's tile t (0 .. 3 = tiles 2 .. 5): tile numbers are immediates, hence the switches */
static inline __attribute__((always_inline)) void o_zero(int t) {
    switch (t) {
        case 0: _tile_zero(2); break;
        case 1: _tile_zero(3); break;
        case 2: _tile_zero(4); break;
        default: _tile_zero(5);
    }
}
static inline __attribute__((always_inline)) void o_store(int t, float *p, int64_t stride) {
    switch (t) {
        case 0: _tile_stored(2, p, stride); break;
        case 1: _tile_stored(3, p, stride); break;
        case 2: _tile_stored(4, p, stride); break;
        default: _tile_stored(5, p, stride);
    }
}
static inline __attribute__((always_inline)) void o_load(int t, const float *p, int64_t stride) {
    switch (t) {
        case 0: _tile_loadd(2, p, stride); break;
        case 1: _tile_loadd(3, p, stride); break;
        case 2: _tile_loadd(4, p, stride); break;
        default: _tile_loadd(5, p, stride);
    }
}
/* O's tile t += A (tile 6) · B (tile 7) */
static inline __attribute__((always_inline)) void o_dp(int t) {
    switch (t) {
        case 0: _tile_dpbf16ps(2, 6, 7); break;
        case 1: _tile_dpbf16ps(3, 6, 7); break;
        case 2: _tile_dpbf16ps(4, 6, 7); break;
        default: _tile_dpbf16ps(5, 6, 7);
    }
}

/* One query head's block of 16 queries (rows q0 .. q0 + 15; rows past L were zero-filled by the caller
 * and are not written): the loop of the module comment. q: the block's first row, rows q_stride bytes
 * apart; kp, vp: this KV head's tiles; c = S − L; out: [L, H, d] at the head's first element of row q0,
 * rows o_row elements apart; nr: live rows. */
static inline __attribute__((always_inline)) void attend_block(
        const uint16_t *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vp, int64_t c, int64_t q0, int nr,
        const int d, float scale, uint16_t *out, int64_t o_row) {
    float sbuf[16 * 32] __attribute__((aligned(64)));
    uint16_t pbuf[16 * 32] __attribute__((aligned(64)));
    float obuf[16 * 64] __attribute__((aligned(64)));
    const int DT = d / 16;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i iota16 = _mm512_add_epi32(iota, _mm512_set1_epi32(16));
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
    __m512 mref = ninf, lsum = _mm512_setzero_ps();
    for (int t = 0; t < DT; t++) o_zero(t);
    const int64_t last = c + q0 + nr - 1;  /* the last key a live row sees, <= S − 1: blocks past it are not
                                              * laid out (rows past L see the zeros up to Sp there) */
    const int64_t nkb = last / PF_KB + 1;
    for (int64_t kb = 0; kb < nkb; kb++) {
        _tile_zero(0);
        _tile_zero(1);
        for (int dc = 0; dc < d / 32; dc++) {
            _tile_loadd(6, (const uint8_t *)q + 64 * dc, q_stride);
            _tile_loadd(7, kp + ((2 * kb) * (d / 32) + dc) * 512, 64);
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, kp + ((2 * kb + 1) * (d / 32) + dc) * 512, 64);
            _tile_dpbf16ps(1, 6, 7);
        }
        _tile_stored(0, sbuf, 128);
        _tile_stored(1, sbuf + 16, 128);
        /* a row sees key 32kb + j iff j <= c + q0 + r − 32kb: all 32 for every row when r = 0 does */
        const int diagonal = c + q0 - PF_KB * kb < PF_KB - 1;
        __mmask16 m0[16], m1[16];
        __m512 rm[16];
        for (int r = 0; r < 16; r++) {
            const int lim = diagonal ? (int)(c + q0 + r - PF_KB * kb) : PF_KB;
            m0[r] = _mm512_cmple_epi32_mask(iota, _mm512_set1_epi32(lim));
            m1[r] = _mm512_cmple_epi32_mask(iota16, _mm512_set1_epi32(lim));
            rm[r] = _mm512_max_ps(_mm512_mask_mov_ps(ninf, m0[r], _mm512_load_ps(sbuf + 32 * r)),
                                  _mm512_mask_mov_ps(ninf, m1[r], _mm512_load_ps(sbuf + 32 * r + 16)));
        }
        const __m512 bm = _mm512_mul_ps(transpose_reduce16(rm, 1), vscale);  /* scale > 0: the max of S · scale */
        const __mmask16 grow = _mm512_cmp_ps_mask(bm, mref, _CMP_GT_OQ);
        if (grow) {
            const __m512 mnew = _mm512_mask_add_ps(mref, grow, bm, _mm512_set1_ps(PF_HEADROOM));
            const __m512 alpha = exp2_nonpos_ps(_mm512_sub_ps(mref, mnew), 0xFFFF);  /* 1 for other rows, 0 from -inf */
            lsum = _mm512_mul_ps(lsum, alpha);
            if (kb > 0) {  /* O is zero before the first block */
                for (int t = 0; t < DT; t++) o_store(t, obuf + 16 * t, 4 * d);
                for (int r = 0; r < 16; r++) {
                    const __m512 a = _mm512_permutexvar_ps(_mm512_set1_epi32(r), alpha);
                    for (int t = 0; t < DT; t++)
                        _mm512_store_ps(obuf + r * d + 16 * t, _mm512_mul_ps(_mm512_load_ps(obuf + r * d + 16 * t), a));
                }
                for (int t = 0; t < DT; t++) o_load(t, obuf + 16 * t, 4 * d);
            }
            mref = mnew;
        }
        for (int r = 0; r < 16; r++) {
            const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(r), mref);
            /* the score rounded as bm's maximum was, then − m: x <= 0 exactly, however large the scores
             * (a fused multiply-subtract left x up to half an ulp of S·scale above 0: 2^512 at ~1e10).
             * The empty asm keeps GCC from fusing the two again (-ffp-contract=fast is its default). */
            __m512 s0 = _mm512_mul_ps(_mm512_load_ps(sbuf + 32 * r), vscale);
            __m512 s1 = _mm512_mul_ps(_mm512_load_ps(sbuf + 32 * r + 16), vscale);
            __asm__("" : "+v"(s0), "+v"(s1));
            const __m512 p0 = exp2_nonpos_ps(_mm512_sub_ps(s0, m), m0[r]);
            const __m512 p1 = exp2_nonpos_ps(_mm512_sub_ps(s1, m), m1[r]);
            rm[r] = _mm512_add_ps(p0, p1);
            _mm512_store_si512(pbuf + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        lsum = _mm512_add_ps(lsum, transpose_reduce16(rm, 0));
        _tile_loadd(6, pbuf, 64);
        for (int t = 0; t < DT; t++) {
            _tile_loadd(7, vp + (kb * DT + t) * 512, 64);
            o_dp(t);
        }
    }
    for (int t = 0; t < DT; t++) o_store(t, obuf + 16 * t, 4 * d);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), lsum);
    for (int r = 0; r < nr; r++) {
        const __m512 w = _mm512_permutexvar_ps(_mm512_set1_epi32(r), inv);
        for (int t = 0; t < DT; t++)
            ps_store_bf16(out + r * o_row + 16 * t, _mm512_mul_ps(_mm512_load_ps(obuf + r * d + 16 * t), w));
    }
}

/* q: [L, H, d] bfloat16, token rows q_row elements apart; k, v: [S, Hkv, d] bfloat16, rows k_row / v_row
 * apart (each head's d elements contiguous); out: [L, H, d] bfloat16, contiguous. S >= L >= 1; query head
 * h·G + g (G = H / Hkv) reads KV head h; d = 32 or 64 (kvs_prefill_attention_supported). Work items are
 * (KV head, query block, query head of the group), the largest query blocks first within a KV head, so
 * both threads read the same head's laid-out K and V and the last items are the short ones. Returns 0;
 * -1 (out untouched) when a buffer cannot be allocated, -2 for arguments the kernel does not take. */
int kvs_prefill_attention(const uint16_t *q, int64_t q_row, const uint16_t *k, int64_t k_row, const uint16_t *v,
                          int64_t v_row, uint16_t *out, int64_t L, int64_t S, int H, int Hkv, int d, float scale,
                          int num_threads) {
    if (!kvs_prefill_attention_supported(d) || Hkv < 1 || H % Hkv || L < 1 || S < L) return -2;  /* out untouched */
    const int G = H / Hkv;
    const int64_t Sp = (S + PF_KB - 1) / PF_KB * PF_KB, nkt = Sp / 16, nqb = (L + PF_QB - 1) / PF_QB, c = S - L;
    uint16_t *kp = aligned_alloc(64, sizeof(uint16_t) * (size_t)(Hkv * Sp * d));
    uint16_t *vp = aligned_alloc(64, sizeof(uint16_t) * (size_t)(Hkv * Sp * d));
    if (!kp || !vp) {
        free(kp);
        free(vp);
        return -1;
    }
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < Hkv * nkt; i++) {
            const int h = (int)(i / nkt);
            const int64_t kt = i % nkt;
            pack_k(k + h * d, k_row, S, d, kt, kp + (h * nkt + kt) * (d / 32) * 512);
            if (kt % 2 == 0) pack_v(v + h * d, v_row, S, d, kt / 2, vp + (h * (Sp / 32) + kt / 2) * (d / 16) * 512);
        }
        pf_configure();
        uint16_t qtail[PF_QB * 64] __attribute__((aligned(64)));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < Hkv * nqb * G; i++) {
            const int h = (int)(i / (nqb * G)), g = (int)(i % G);
            const int64_t qb = nqb - 1 - (i / G) % nqb, q0 = qb * PF_QB;
            const int head = h * G + g, nr = L - q0 < PF_QB ? (int)(L - q0) : PF_QB;
            const uint16_t *qh = q + q0 * q_row + (int64_t)head * d;
            int64_t qs = q_row * 2;
            if (nr < PF_QB) {  /* the last block: its rows past L read as zeros */
                memset(qtail, 0, sizeof qtail);
                for (int r = 0; r < nr; r++) memcpy(qtail + r * d, qh + r * q_row, sizeof(uint16_t) * d);
                qh = qtail;
                qs = 2 * d;
            }
            const uint16_t *kh = kp + h * nkt * (d / 32) * 512, *vh = vp + h * (Sp / 32) * (d / 16) * 512;
            uint16_t *o = out + q0 * H * d + (int64_t)head * d;
            if (d == 64) attend_block(qh, qs, kh, vh, c, q0, nr, 64, scale, o, (int64_t)H * d);
            else attend_block(qh, qs, kh, vh, c, q0, nr, 32, scale, o, (int64_t)H * d);
        }
        _tile_release();
    }
    free(kp);
    free(vp);
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
/* CPUs without AMX whose vectors are AVX2 (AMD Zen 2 here): the same flash-attention loop on 8-lane float32
 * vectors, register-blocked for GQA. PyTorch's CPU flash attention ran at 51-90 GFLOP/s here (2 threads,
 * SmolLM2's 9 heads over 3 KV heads), ~55 % of TTFT at 4096 prompt tokens; this loop at 105-143.
 *
 * K and V of every KV head are first converted to float32 (exact): K as panels of 8 keys [d][8], so 16
 * keys' scores of one query row take d broadcast-multiply-adds on two vectors; V as rows [S][d]. A work
 * item is (KV head, block of about PA_ROWS query rows): QB = PA_ROWS / G queries times the G query heads
 * that read the head, so every K and V vector loaded serves all of them. Per block of PA_KB keys:
 *   S = Q·Kᵀ (Q pre-multiplied by scale·log2(e) in float32, one rounding) in micro-tiles of 6 rows × 16
 *   keys (12 accumulators); keys after a row's query set to −inf; per row the block maximum; when it
 *   passes the running maximum m, the row's O and l are multiplied by 2^(m_old − m_new); p = 2^(S − m)
 *   (exp2_nonpos_avx2), l += Σ p; O += P·V in micro-tiles of 6 rows × 16 dims (12 accumulators).
 * out = O / l rounded to bfloat16 (nearest even). P stays float32 (PyTorch's kernel and the AMX path
 * round it to bfloat16 first), so the error is at most theirs. Rows past the last query (padding to a
 * multiple of 6) compute on zero queries and are not stored. A NaN score makes its row's p, l and
 * output NaN (it need not survive the block maximum: exp2 of NaN is NaN); keys after a query are
 * replaced by −inf before anything is read, so a NaN there never reaches it.
 * Supported: d % 32 == 0, d <= 256, as in the AMX section (the P·V tiles here would take any d % 16 == 0). */
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PA_KB 64   /* keys per block */
#define PA_QK_ROWS 6  /* rows of the score micro-tile (× 16 keys) */
#define PA_PV_ROWS 6  /* rows of the P·V micro-tile (× 16 dims) */
#define PA_ROWS 48 /* query rows (queries × heads of a group) per work item, about */

/* 2^x for x <= 0 on 8 lanes: 0 below -125 (and for -inf); the polynomial of exp2_nonpos_ps */
static inline __m256 exp2_nonpos_avx2(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-125.f), _CMP_NLT_UQ);
    const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-125.f), x);
    const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(xc, n);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(EXP2_C4), f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

/* s[r][0 .. 16) = qf[r] · key j for PA_QK_ROWS rows of qf (row stride d) and the 16 keys of two 8-key
 * panels kt0, kt1 ([d][8] float32 each); s rows s_row apart */
static inline __attribute__((always_inline)) void qk_tile(const float *qf, const float *kt0, const float *kt1,
                                                         const int d, float *s, int s_row) {
    __m256 a[PA_QK_ROWS][2];
    for (int r = 0; r < PA_QK_ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int i = 0; i < d; i++) {
        const __m256 k0 = _mm256_load_ps(kt0 + 8 * i), k1 = _mm256_load_ps(kt1 + 8 * i);
        for (int r = 0; r < PA_QK_ROWS; r++) {
            const __m256 b = _mm256_broadcast_ss(qf + r * d + i);
            a[r][0] = _mm256_fmadd_ps(b, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(b, k1, a[r][1]);
        }
    }
    for (int r = 0; r < PA_QK_ROWS; r++) {
        _mm256_store_ps(s + r * s_row, a[r][0]);
        _mm256_store_ps(s + r * s_row + 8, a[r][1]);
    }
}

/* o[r][dc .. dc + 16) += Σ_{j < lim[r]} p[r][j] · vf[j][dc .. dc + 16) for PA_PV_ROWS rows (p rows p_row
 * apart, o rows d apart; vf: rows of d float32). A row's keys past lim[r] (after its query) are skipped,
 * not multiplied by their p of 0: 0 · a NaN or inf in V would reach a query that may not see that key.
 * The rows of a micro-tile are one query's heads or neighbouring queries, so the keys that only some of
 * its rows see are at most PA_PV_ROWS − 1 (a masked multiply-add each). Each key's two V vectors are
 * loaded once into registers for the 6 rows (12 accumulators + 2 + 1 broadcast weight = 15 ymm); the
 * earlier 3 rows × 32 dims needed 17, so GCC read V from memory in every multiply-add (12 loads and 3
 * broadcasts per 12 multiply-adds, against 2 and 6 now): Zen 3, one thread, 2,048 queries after 2,048
 * keys (SmolLM2's heads): 71 -> 78 GFLOP/s. Each row sums its keys in the same order as before. */
static inline __attribute__((always_inline)) void pv_tile(const float *p, int p_row, const float *vf, const int d,
                                                         int dc, const int *lim, float *o) {
    __m256 a[PA_PV_ROWS][2];
    int lo = lim[0], hi = lim[0];
    for (int r = 1; r < PA_PV_ROWS; r++) {
        lo = lim[r] < lo ? lim[r] : lo;
        hi = lim[r] > hi ? lim[r] : hi;
    }
    for (int r = 0; r < PA_PV_ROWS; r++)
        for (int c = 0; c < 2; c++) a[r][c] = _mm256_load_ps(o + r * d + dc + 8 * c);
    for (int j = 0; j < lo; j++) {
        const float *vj = vf + (int64_t)j * d + dc;
        const __m256 v0 = _mm256_load_ps(vj), v1 = _mm256_load_ps(vj + 8);
        for (int r = 0; r < PA_PV_ROWS; r++) {
            const __m256 w = _mm256_broadcast_ss(p + r * p_row + j);
            a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
        }
    }
    for (int j = lo; j < hi; j++) {  /* keys only some rows see */
        const float *vj = vf + (int64_t)j * d + dc;
        for (int r = 0; r < PA_PV_ROWS; r++)
            if (j < lim[r]) {
                const __m256 w = _mm256_broadcast_ss(p + r * p_row + j);
                for (int c = 0; c < 2; c++) a[r][c] = _mm256_fmadd_ps(w, _mm256_load_ps(vj + 8 * c), a[r][c]);
            }
    }
    for (int r = 0; r < PA_PV_ROWS; r++)
        for (int c = 0; c < 2; c++) _mm256_store_ps(o + r * d + dc + 8 * c, a[r][c]);
}

/* One work item's flash-attention loop: Rp (a multiple of PA_QK_ROWS) rows of qf [Rp, d] (pre-scaled
 * queries), row r at key position pos[r] (sees keys 0 .. pos[r]), over keys [0, kend) of one KV head (kt:
 * its 8-key panels, vf: its float32 rows, both padded with zero keys to a multiple of PA_KB). Leaves the
 * unnormalized o [Rp, d], row maxima m and sums l [Rp]; s: [Rp, PA_KB] and vis_keys [Rp] scratch. */
static inline __attribute__((always_inline)) void attend_rows(
        const float *qf, int Rp, const int64_t *pos, const float *kt, const float *vf, int64_t kend, const int d,
        float *s, float *o, float *m, float *l, int *vis_keys) {
    for (int r = 0; r < Rp; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(o, 0, sizeof(float) * (size_t)Rp * d);
    for (int64_t kb0 = 0; kb0 < kend; kb0 += PA_KB) {
        const int nk = kend - kb0 < PA_KB ? (int)(kend - kb0) : PA_KB;
        const float *ktb = kt + kb0 * d;  /* panels of 8 keys: [d][8] each, consecutive */
        for (int r0 = 0; r0 < Rp; r0 += PA_QK_ROWS)
            for (int j0 = 0; j0 < PA_KB; j0 += 16)
                qk_tile(qf + (int64_t)r0 * d, ktb + (int64_t)j0 * d, ktb + (int64_t)(j0 + 8) * d, d,
                        s + r0 * PA_KB + j0, PA_KB);
        for (int r = 0; r < Rp; r++) {
            float *sr = s + r * PA_KB;
            const int64_t lim = pos[r] - kb0 + 1;  /* keys visible in this block: [0, lim) */
            const int vis = lim < nk ? (lim < 0 ? 0 : (int)lim) : nk;
            vis_keys[r] = vis;
            for (int j = vis; j < PA_KB; j++) sr[j] = -INFINITY;
            __m256 mv = _mm256_set1_ps(-INFINITY);
            for (int j = 0; j < PA_KB; j += 8) mv = _mm256_max_ps(mv, _mm256_load_ps(sr + j));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float bm = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            if (bm > m[r]) {
                if (m[r] > -INFINITY) {
                    const float alpha = exp2f(m[r] - bm);
                    l[r] *= alpha;
                    const __m256 av = _mm256_set1_ps(alpha);
                    for (int c = 0; c < d; c += 8) _mm256_store_ps(o + r * d + c, _mm256_mul_ps(av, _mm256_load_ps(o + r * d + c)));
                }
                m[r] = bm;
            }
            /* every key so far scored −inf (a key overflowed): p = 2^(−inf − 0) = 0, not 2^(−inf − (−inf)), a
             * NaN that would stay in o and l after a later block's finite keys (adversarial review) */
            const __m256 mr = _mm256_set1_ps(m[r] == -INFINITY ? 0.f : m[r]);
            __m256 z = _mm256_setzero_ps();
            for (int j = 0; j < PA_KB; j += 8) {
                const __m256 p = exp2_nonpos_avx2(_mm256_sub_ps(_mm256_load_ps(sr + j), mr));
                _mm256_store_ps(sr + j, p);
                z = _mm256_add_ps(z, p);
            }
            __m128 z4 = _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));
            z4 = _mm_add_ps(z4, _mm_movehl_ps(z4, z4));
            l[r] += _mm_cvtss_f32(_mm_add_ss(z4, _mm_movehdup_ps(z4)));
        }
        const float *vb = vf + kb0 * d;
        for (int r0 = 0; r0 < Rp; r0 += PA_PV_ROWS)
            for (int dc = 0; dc < d; dc += 16) pv_tile(s + r0 * PA_KB, PA_KB, vb, d, dc, vis_keys + r0, o + (int64_t)r0 * d);
    }
}

/* Head dims the kernel takes: multiples of 32 up to 256 */
int kvs_prefill_attention_supported(int d) { return d > 0 && d % 32 == 0 && d <= 256; }

/* Arguments, layout and return value as the AMX kvs_prefill_attention above; d a multiple of 32 up to
 * 256. Work items are (KV head, query block), the largest query blocks first within a KV head. Every
 * buffer (K and V in float32, each thread's scratch) is allocated before the threads start. */
int kvs_prefill_attention(const uint16_t *q, int64_t q_row, const uint16_t *k, int64_t k_row, const uint16_t *v,
                          int64_t v_row, uint16_t *out, int64_t L, int64_t S, int H, int Hkv, int d, float scale,
                          int num_threads) {
    if (!kvs_prefill_attention_supported(d) || Hkv < 1 || H % Hkv || L < 1 || S < L) return -2;
    const int G = H / Hkv, nt = num_threads < 1 ? 1 : num_threads;
    const int QB = PA_ROWS / G > 0 ? PA_ROWS / G : 1;  /* queries per item */
    const int64_t Sp = (S + PA_KB - 1) / PA_KB * PA_KB, nqb = (L + QB - 1) / QB, c = S - L;
    const int Rmax = (QB * G + PA_QK_ROWS - 1) / PA_QK_ROWS * PA_QK_ROWS, R16 = (Rmax + 15) / 16 * 16;
    /* per thread: qf and o [Rmax, d], s [Rmax, PA_KB], m and l, pos (int64), vis_keys (int); 64-byte pieces */
    const int64_t per = 2 * (int64_t)Rmax * d + (int64_t)Rmax * PA_KB + 2 * R16 + 2 * R16 + R16;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(Hkv * Sp * d));  /* [Hkv][Sp/8][d][8] */
    float *vf = aligned_alloc(64, sizeof(float) * (size_t)(Hkv * Sp * d));  /* [Hkv][Sp][d] */
    float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(per * nt));
    if (!kt || !vf || !scratch) {
        free(kt);
        free(vf);
        free(scratch);
        return -1;
    }
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < Hkv * (Sp / 8); i++) {
            const int h = (int)(i / (Sp / 8));
            const int64_t p = i % (Sp / 8);
            float *dst = kt + ((int64_t)h * Sp + 8 * p) * d, *vd = vf + ((int64_t)h * Sp + 8 * p) * d;
            for (int j = 0; j < 8; j++) {
                const int64_t t = 8 * p + j;
                if (t < S) {
                    const uint16_t *kr = k + t * k_row + (int64_t)h * d, *vr = v + t * v_row + (int64_t)h * d;
                    for (int e = 0; e < d; e++) dst[e * 8 + j] = bf16_to_float(kr[e]);
                    for (int e = 0; e < d; e += 8) _mm256_store_ps(vd + j * d + e, bf16x8(vr + e));
                } else {
                    for (int e = 0; e < d; e++) dst[e * 8 + j] = 0.f;
                    memset(vd + j * d, 0, sizeof(float) * d);
                }
            }
        }
#ifdef _OPENMP
        float *qf = scratch + per * omp_get_thread_num();
#else
        float *qf = scratch;
#endif
        float *o = qf + (int64_t)Rmax * d, *s = o + (int64_t)Rmax * d, *ml = s + (int64_t)Rmax * PA_KB;
        int64_t *pos = (int64_t *)(ml + 2 * R16);
        int *vis_keys = (int *)(ml + 4 * R16);
        const float qscale = scale * 1.44269504088896341f;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < Hkv * nqb; i++) {
            const int h = (int)(i / nqb);
            const int64_t qb = nqb - 1 - i % nqb, q0 = qb * QB;
            const int nq = L - q0 < QB ? (int)(L - q0) : QB, R = nq * G;
            const int Rp = (R + PA_QK_ROWS - 1) / PA_QK_ROWS * PA_QK_ROWS;
            for (int r = 0; r < Rp; r++) {  /* row r: query q0 + r / G of head h·G + r % G */
                const int qi = r < R ? r / G : nq - 1, g = r < R ? r % G : 0;
                pos[r] = c + q0 + qi;
                if (r < R) {
                    const uint16_t *qr = q + (q0 + qi) * q_row + (int64_t)(h * G + g) * d;
                    for (int e = 0; e < d; e++) qf[r * d + e] = bf16_to_float(qr[e]) * qscale;
                } else memset(qf + r * d, 0, sizeof(float) * d);
            }
            const int64_t kend = c + q0 + nq;
            const float *kth = kt + (int64_t)h * Sp * d, *vfh = vf + (int64_t)h * Sp * d;
            if (d == 64) attend_rows(qf, Rp, pos, kth, vfh, kend, 64, s, o, ml, ml + Rmax, vis_keys);
            else attend_rows(qf, Rp, pos, kth, vfh, kend, d, s, o, ml, ml + Rmax, vis_keys);
            for (int r = 0; r < R; r++) {
                const int qi = r / G, g = r % G;
                uint16_t *dst = out + (q0 + qi) * (int64_t)H * d + (int64_t)(h * G + g) * d;
                const float inv = 1.f / ml[Rmax + r];
                for (int e = 0; e < d; e++) dst[e] = float_to_bf16(o[r * d + e] * inv);
            }
        }
    }
    free(kt);
    free(vf);
    free(scratch);
    return 0;
}
#else
int kvs_prefill_attention_supported(int d) { (void)d; return 0; }
int kvs_prefill_attention(const uint16_t *q, int64_t q_row, const uint16_t *k, int64_t k_row, const uint16_t *v,
                          int64_t v_row, uint16_t *out, int64_t L, int64_t S, int H, int Hkv, int d, float scale,
                          int num_threads) {
    (void)q; (void)q_row; (void)k; (void)k_row; (void)v; (void)v_row; (void)out; (void)L; (void)S; (void)H;
    (void)Hkv; (void)d; (void)scale; (void)num_threads;
    return -2;
}
#endif
