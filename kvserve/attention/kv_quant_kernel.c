/* Fused dequantize + decode attention over a paged KV cache (see kv_quant_kernel.py).
 *
 * Codes: 0 = int8, 1 = float8 e4m3fn, 2 = float8 e5m2 (1 byte each), 3 = float32, 4 = bfloat16 (no
 * scales: pass NULL). A cached value is code_to_float(element) * scale, one float32 scale per
 * (slot, kv head). The scale of K folds into the score, the scale of V into the
 * softmax weight, so the inner loops only convert bytes to floats (in registers, never to memory).
 * fp8 -> float: place the 7 magnitude bits at the top of a float's exponent/mantissa fields and
 * multiply by 2^(127 - bias) (bias 7 for e4m3, 15 for e5m2); exact for normals and subnormals.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline int elem_size(int code) { return code == 3 ? 4 : code == 4 ? 2 : 1; }

/* Asks for the cache row of kv head h of token j of the block at slot next_base (the block after the one
 * being read; nothing when next_base < 0). Every loop over a block's rows calls it for the same row of the
 * next block, so memory streams the next block at the pace the loop consumes this one. A burst of a
 * whole block's prefetches at the block's start held the loop until memory had taken them all, so
 * compute and memory took turns: SmolLM2's 30-layer bf16 attention over 16 sequences of 266 tokens took
 * 10.4 ms that way, 10.7 ms with no prefetch and 5.5 ms paced (2 cores; 1 × 4096 tokens: 10.4 → 5.0 ms).
 * Inlined: a call would spill the caller's accumulators (every zmm register is caller-saved). Each line
 * once: a second prefetch of a line in flight cost as much as a new one. */
static inline __attribute__((always_inline)) void prefetch_row(const uint8_t *cache, int64_t next_base, int64_t j,
                                                               int Hkv, int h, int64_t row_bytes) {
    if (next_base < 0) return;
    const uint8_t *p = cache + ((next_base + j) * Hkv + h) * row_bytes;
    for (const uint8_t *a = p - ((uintptr_t)p & 63); a < p + row_bytes; a += 64) __builtin_prefetch(a, 0, 3);
}

/* The first slot of the block after the one starting at token t0 of [.., t_end), or -1 at the end. */
static inline int64_t next_block_base(const int64_t *table, int64_t t0, int64_t t_end, int bs) {
    return t0 + bs < t_end ? table[t0 / bs + 1] * bs : -1;
}

/* The key passes' prefetch of the next block (slot next, -1: none): its bs rows of row_bytes, in
 * address order, asked for in equal shares, one before each of the current block's `units` units of
 * work, so the requests spread over the block's compute instead of bunching at its start. */
typedef struct { const char *p; int64_t lines, per, at; } paced_prefetch;

static inline __attribute__((always_inline)) paced_prefetch pace_next_block(const uint8_t *cache, int64_t next, int bs,
                                                                            int64_t row_bytes, int64_t units) {
    const int64_t lines = bs * row_bytes / 64;
    return (paced_prefetch){next < 0 ? NULL : (const char *)(cache + next * row_bytes), lines,
                            (lines + units - 1) / units, 0};
}

static inline __attribute__((always_inline)) void pace_step(paced_prefetch *pp) {
    for (int64_t i = 0; pp->p && i < pp->per && pp->at < pp->lines; i++, pp->at++)
        __builtin_prefetch(pp->p + pp->at * 64, 0, 3);
}

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef int8_t v16c __attribute__((vector_size(16)));
typedef uint8_t v16b __attribute__((vector_size(16)));

/* 16 values of a row of any cache code as a vector of floats (exact, unscaled; decode_row_scalar's
 * values, tested for every fp8 code) */
static inline __attribute__((always_inline)) v16f load16(const uint8_t *p, const int code) {
    if (code == 3) { v16f v; memcpy(&v, p, sizeof v); return v; }
#ifdef __AVX512F__  /* GCC lowers the generic conversions to 128-bit pieces (bf16) or scalar inserts (bytes) */
    if (code == 4) return (v16f)bf16x16_to_ps((const uint16_t *)p);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    if (code == 0) return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    /* fp8 through float16 (vcvtph2ps): e5m2 is a float16's top byte; e4m3's 7 magnitude bits placed at
     * bit 7 of a float16 read 2^-8 of the value, subnormals included (e4m3 2^(e-7), m 2^-9 ↔ float16
     * 2^(e-15), m 2^-17). The float16 route keeps subnormal codes off the float32 multiply: a float32
     * denormal operand costs a microcode assist (fp8 attention ran 4× slower than int8 with them). */
    const __m256i x16 = _mm256_cvtepu8_epi16(bytes);
    if (code == 2) return (v16f)_mm512_cvtph_ps(_mm256_slli_epi16(x16, 8));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x16, _mm256_set1_epi16(0x7F)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(x16, _mm256_set1_epi16(0x80)), 8));
    return (v16f)_mm512_cvtph_ps(h) * 256.f;
#else
    if (code == 4) {
        v16h h;
        memcpy(&h, p, sizeof h);
        return (v16f)(__builtin_convertvector(h, v16u) << 16);
    }
    if (code == 0) {
        v16c c;
        memcpy(&c, p, sizeof c);
        return __builtin_convertvector(__builtin_convertvector(c, v16i), v16f);
    }
    v16b c;
    memcpy(&c, p, sizeof c);
    const v16u x = __builtin_convertvector(c, v16u);
    if (code == 1) return (v16f)(((x & 0x80u) << 24) | ((x & 0x7Fu) << 20)) * 0x1p120f;
    return (v16f)(((x & 0x80u) << 24) | ((x & 0x7Fu) << 21)) * 0x1p112f;
#endif
}

static inline void decode_row_scalar(const uint8_t *src, float *dst, int d, int code) {
    if (code == 3) {
        memcpy(dst, src, sizeof(float) * (size_t)d);
    } else if (code == 4) {
        const uint16_t *h = (const uint16_t *)src;
        for (int i = 0; i < d; i++) dst[i] = bits_to_float((uint32_t)h[i] << 16);
    } else if (code == 0) {
        for (int i = 0; i < d; i++) dst[i] = (float)(int8_t)src[i];
    } else if (code == 1) {
        for (int i = 0; i < d; i++) {
            uint32_t x = src[i];
            dst[i] = bits_to_float(((x & 0x80u) << 24) | ((x & 0x7Fu) << 20)) * 0x1p120f;
        }
    } else {
        for (int i = 0; i < d; i++) {
            uint32_t x = src[i];
            dst[i] = bits_to_float(((x & 0x80u) << 24) | ((x & 0x7Fu) << 21)) * 0x1p112f;
        }
    }
}

/* A row of d elements of any code as floats (unscaled): 16 at a time through load16, the rest one by one. */
static inline void decode_row(const uint8_t *src, float *dst, int d, int code) {
    const int64_t es = elem_size(code);
    int i = 0;
    for (; i + 16 <= d; i += 16) {
        v16f v;
        switch (code) {
            case 0: v = load16(src + i * es, 0); break;
            case 1: v = load16(src + i * es, 1); break;
            case 2: v = load16(src + i * es, 2); break;
            case 3: v = load16(src + i * es, 3); break;
            default: v = load16(src + i * es, 4);
        }
        memcpy(dst + i, &v, sizeof v);
    }
    if (i < d) decode_row_scalar(src + i * es, dst + i, d - i, code);
}

/* The scale lines of the block at slot next_base, every KV head's (1-byte caches: scales [num_slots, Hkv];
 * nothing for float caches or past the end) */
static inline __attribute__((always_inline)) void prefetch_scales(const float *scales, int64_t next_base, int bs,
                                                                  int Hkv) {
    if (!scales || next_base < 0) return;
    const char *p = (const char *)(scales + next_base * Hkv), *e = (const char *)(scales + (next_base + bs) * Hkv);
    for (const char *a = p - ((uintptr_t)p & 63); a < e; a += 64) __builtin_prefetch(a, 0, 3);
}

/* The softmax-weighted sum of V over a chunk: acc[g, :] = Σ_t w[g, t] s_t V[t, :] (s_t: the token's V scale,
 * 1 for float caches),
 * one query row at a time so its d/16 accumulators stay in registers over the whole chunk (the chunk's V
 * rows come again from L1/L2 for each row). d is a multiple of 16, at most 256. */
static inline __attribute__((always_inline)) void v_pass_float(
        const uint8_t *vc, const float *vs, const int64_t *table, int64_t t_begin, int64_t t_end, const float *scores,
        int64_t L, float *acc, int G, int Hkv, int h, const int d, int bs, const int code) {
    const int64_t es = elem_size(code);
    for (int g = 0; g < G; g++) {
        v16f a[16];
        for (int c = 0; c < d / 16; c++) a[c] = (v16f){0};
        const float *w = scores + g * L - t_begin;
        for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
            const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
            const int64_t next = g == 0 ? next_block_base(table, t0, t_end, bs) : -1;  /* later rows: from L2 */
            prefetch_scales(vs, next, bs, Hkv);
            for (int64_t j = 0; j < n; j++) {
                const uint8_t *row = vc + ((base + j) * Hkv + h) * d * es;
                prefetch_row(vc, next, j, Hkv, h, d * es);
                const float wt = vs ? w[t0 + j] * vs[(base + j) * Hkv + h] : w[t0 + j];
                for (int c = 0; c < d / 16; c++) a[c] += wt * load16(row + c * 16 * es, code);
            }
        }
        for (int c = 0; c < d / 16; c++) memcpy(acc + g * d + c * 16, &a[c], sizeof a[c]);
    }
}

/* v_pass_float for all G query rows at once, when their G·d/16 accumulators fit in registers (≤ 16):
 * each V row is loaded and converted once instead of once per query row. Every accumulator sums over
 * the tokens in the same order as in v_pass_float. */
static inline __attribute__((always_inline)) void v_pass_float_rows(
        const uint8_t *vc, const float *vs, const int64_t *table, int64_t t_begin, int64_t t_end, const float *scores,
        int64_t L, float *acc, const int G, int Hkv, int h, const int d, int bs, const int code) {
    const int64_t es = elem_size(code);
    const int C = d / 16;
    v16f a[16];
    for (int i = 0; i < G * C; i++) a[i] = (v16f){0};
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        const int64_t next = next_block_base(table, t0, t_end, bs);
        prefetch_scales(vs, next, bs, Hkv);
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *row = vc + ((base + j) * Hkv + h) * d * es;
            prefetch_row(vc, next, j, Hkv, h, d * es);
            const float *w = scores + (t0 + j - t_begin);
            float wg[16];
            for (int g = 0; g < G; g++) wg[g] = vs ? w[g * L] * vs[(base + j) * Hkv + h] : w[g * L];
            for (int c = 0; c < C; c++) {
                const v16f v = load16(row + c * 16 * es, code);
                for (int g = 0; g < G; g++) a[g * C + c] += wg[g] * v;
            }
        }
    }
    for (int i = 0; i < G * C; i++) memcpy(acc + i * 16, &a[i], sizeof a[i]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX2_PASSES 1
/* CPUs with AVX2 but no AVX-512 (AMD Zen 2): the key and V passes of int8, float32 and bfloat16 caches
 * on 8-lane vectors. attend_chunk's own loops convert every row through memory and reduce each dot
 * product alone, and v_pass_float_rows' accumulators (3 queries × 64 dims) outgrow the 16 ymm registers:
 * SmolLM2's 30-layer attention over 4096 bfloat16 tokens took 44 ms (2.1 GB/s, Zen 2, 2 threads). */

/* 8 elements of a row from element i on, as float32 (exact, unscaled); code 0 = int8, 3 = float32, 4 =
 * bfloat16 */
static inline __attribute__((always_inline)) __m256 load8_avx2(const uint8_t *row, int i, const int code) {
    if (code == 3) return _mm256_loadu_ps((const float *)row + i);
    if (code == 4)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))), 16));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
}

/* lane j = the sum of the 8 lanes of v[j] */
static inline __m256 transpose_sum8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a: lanes (0 1 2 3 | 0 1 2 3) of rows 0-3 as low | high halves' sums; b the same of rows 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* The scores of every KV head's G queries against the keys of tokens [t_begin, t_end), block by block
 * (each block serves every head right after it arrives; the next block's rows are prefetched as this
 * one's are read, its V rows (vc, same layout) into L2 for the V pass that follows, which otherwise
 * waited on DRAM head by head): scores[(h·G + g)·L + t] = q·k_t · scale (· the token's K scale for
 * int8), mx [H] the running maxima. q: [H, d] float32; d % 8 == 0, d <= 256. Per token and head the row
 * is converted once and each query's dot product kept as 8 lane sums, stored; every 8 tokens
 * transpose_sum8 turns them into 8 scores. */
static inline __attribute__((always_inline)) void k_pass_avx2(
        const float *q, const uint8_t *kc, const uint8_t *vc, const float *ks, const int64_t *table, int64_t t_begin,
        int64_t t_end, float *scores, int64_t L, float *mx, int G, int Hkv, const int d, int bs, float scale,
        const int code) {
    const int64_t es = elem_size(code), token_bytes = (int64_t)Hkv * d * es;
    const int H = G * Hkv;
    __m256 lane[8 * 64];  /* [h·G + g][token % 8]: up to 64 query heads */
    __m256 mxv[64];  /* [h·G + g]: lane j = the largest score of tokens ≡ j mod 8 in whole groups of 8 */
    for (int i = 0; i < H; i++) mxv[i] = _mm256_set1_ps(-INFINITY);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        const int64_t next = next_block_base(table, t0, t_end, bs);
        for (int64_t j0 = 0; j0 < n; j0 += 8) {
            const int nj = n - j0 < 8 ? (int)(n - j0) : 8;
            for (int j = 0; j < 8; j++) {
                if (next >= 0) {  /* the same token of the next block, every head; its V rows into L2 */
                    const uint8_t *p = kc + (next + j0 + j) * token_bytes, *pv = vc + (next + j0 + j) * token_bytes;
                    for (int64_t o = 0; o < token_bytes; o += 64) {
                        __builtin_prefetch(p + o, 0, 3);
                        __builtin_prefetch(pv + o, 0, 2);
                    }
                }
                if (j >= nj) {
                    for (int i = 0; i < H; i++) lane[i * 8 + j] = _mm256_setzero_ps();
                    continue;
                }
                for (int h = 0; h < Hkv; h++) {
                    const uint8_t *row = kc + ((base + j0 + j) * Hkv + h) * d * es;
                    __m256 k[32];
                    for (int c = 0; c < d / 8; c++) k[c] = load8_avx2(row, 8 * c, code);
                    for (int g = 0; g < G; g++) {
                        const float *qg = q + (h * G + g) * d;
                        __m256 a0 = _mm256_mul_ps(k[0], _mm256_loadu_ps(qg)), a1 = _mm256_setzero_ps();
                        for (int c = 1; c < d / 8; c++) {
                            if (c & 1) a1 = _mm256_fmadd_ps(k[c], _mm256_loadu_ps(qg + 8 * c), a1);
                            else a0 = _mm256_fmadd_ps(k[c], _mm256_loadu_ps(qg + 8 * c), a0);
                        }
                        lane[(h * G + g) * 8 + j] = _mm256_add_ps(a0, a1);
                    }
                }
            }
            const int64_t t = t0 + j0 - t_begin;
            __m256 mul = _mm256_set1_ps(scale);
            for (int h = 0; h < Hkv; h++) {
                if (ks) {
                    float f[8] = {0};
                    for (int j = 0; j < nj; j++) f[j] = ks[(base + j0 + j) * Hkv + h] * scale;
                    mul = _mm256_loadu_ps(f);
                }
                for (int g = 0; g < G; g++) {
                    const int i = h * G + g;
                    const __m256 sc = _mm256_mul_ps(transpose_sum8(lane + i * 8), mul);
                    if (nj == 8) {  /* a NaN score stays out of the maximum, as in the scalar comparison below */
                        _mm256_storeu_ps(scores + i * L + t, sc);
                        mxv[i] = _mm256_max_ps(sc, mxv[i]);  /* maxps: the 2nd operand where either is NaN */
                        continue;
                    }
                    float out[8];
                    _mm256_storeu_ps(out, sc);
                    for (int j = 0; j < nj; j++) {
                        scores[i * L + t + j] = out[j];
                        if (out[j] > mx[i]) mx[i] = out[j];
                    }
                }
            }
        }
    }
    for (int i = 0; i < H; i++) {  /* NaN never entered mxv */
        float m8[8];
        _mm256_storeu_ps(m8, mxv[i]);
        for (int j = 0; j < 8; j++)
            if (m8[j] > mx[i]) mx[i] = m8[j];
    }
}

/* The V pass on 8-lane vectors for G (<= 4, a constant) query rows, NV·8 dims per pass over the chunk:
 * acc[g, :] = Σ_t w[g, t] s_t V[t, :] (s_t the token's V scale for int8, 1 otherwise). The G·NV
 * accumulators, the G weights of a token and one V vector at a time stay in the 16 ymm registers (G = 3,
 * NV = 4: 12 + 3 + 1); the chunk's rows come again from L1/L2 for each further pass. With G a run-time
 * value the accumulators lived on the stack, each token's multiply-add waiting on the last one's store
 * (SmolLM2, 4096 tokens from L3: 5.3 ms for the 30 layers' attention). d % (8·NV) == 0. */
static inline __attribute__((always_inline)) void v_pass_avx2_g(
        const uint8_t *vc, const float *vs, const int64_t *table, int64_t t_begin, int64_t t_end, const float *scores,
        int64_t L, float *acc, const int G, const int NV, int Hkv, int h, const int d, int bs, const int code) {
    const int64_t es = elem_size(code);
    for (int dc = 0; dc < d; dc += 8 * NV) {
        __m256 a[4][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++) a[g][c] = _mm256_setzero_ps();
        for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
            const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
            const int64_t next = dc == 0 ? next_block_base(table, t0, t_end, bs) : -1;  /* later dims: from L2 */
            prefetch_scales(vs, next, bs, Hkv);
            const float *sc = scores + (t0 - t_begin);
            for (int64_t j = 0; j < n; j++) {
                const uint8_t *row = vc + ((base + j) * Hkv + h) * d * es;
                prefetch_row(vc, next, j, Hkv, h, d * es);
                const float sv = vs ? vs[(base + j) * Hkv + h] : 1.f;
                __m256 w[4];
                for (int g = 0; g < G; g++) w[g] = _mm256_set1_ps(sc[g * L + j] * sv);
                for (int c = 0; c < NV; c++) {
                    const __m256 v = load8_avx2(row, dc + 8 * c, code);
                    for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(w[g], v, a[g][c]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++) _mm256_storeu_ps(acc + g * d + dc + 8 * c, a[g][c]);
    }
}

/* v_pass_avx2_g with G and the dims per pass as constants: 32 for G <= 3, 16 for G = 4. d % 32 == 0. */
static inline __attribute__((always_inline)) void v_pass_avx2(
        const uint8_t *vc, const float *vs, const int64_t *table, int64_t t_begin, int64_t t_end, const float *scores,
        int64_t L, float *acc, const int G, int Hkv, int h, const int d, int bs, const int code) {
    switch (G) {
        case 1: v_pass_avx2_g(vc, vs, table, t_begin, t_end, scores, L, acc, 1, 4, Hkv, h, d, bs, code); break;
        case 2: v_pass_avx2_g(vc, vs, table, t_begin, t_end, scores, L, acc, 2, 4, Hkv, h, d, bs, code); break;
        case 3: v_pass_avx2_g(vc, vs, table, t_begin, t_end, scores, L, acc, 3, 4, Hkv, h, d, bs, code); break;
        default: v_pass_avx2_g(vc, vs, table, t_begin, t_end, scores, L, acc, 4, 2, Hkv, h, d, bs, code);
    }
}
#endif

/* The V pass (d % 16 == 0, d <= 256), all rows at once where that fits; vs: the V scales of a 1-byte
 * cache (each softmax weight times its token's scale), NULL for float caches. */
static inline __attribute__((always_inline)) void v_pass(
        const uint8_t *vc, const float *vs, const int64_t *table, int64_t t_begin, int64_t t_end, const float *scores,
        int64_t L, float *acc, int G, int Hkv, int h, const int d, int bs, const int code) {
#define V_ROWS(GG, DD) \
    if (G == GG && d == DD) { \
        v_pass_float_rows(vc, vs, table, t_begin, t_end, scores, L, acc, GG, Hkv, h, DD, bs, code); return; }
    V_ROWS(1, 64) V_ROWS(2, 64) V_ROWS(3, 64) V_ROWS(4, 64) V_ROWS(1, 128) V_ROWS(2, 128) V_ROWS(1, 256)
#undef V_ROWS
    v_pass_float(vc, vs, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, code);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_K_PASS_CODES 1

/* lane t of the result = the sum of the 16 lanes of v[t] (kernel_math.h) */
static inline __m512 transpose_sum16(const __m512 *v) { return transpose_reduce16(v, 0); }

/* The scores against a 1-byte key cache (int8 / fp8 codes, one scale per token and KV head) for float32
 * queries: a block's 16-row group of one head is converted once into an L1 scratch, then each query row
 * takes its 16 dot products there (fused multiply-adds, 16 lanes of partial sums per token, reduced by
 * one transpose_sum16), score = dot · (k_scale · softmax scale), as the generic loop computes it. The
 * next block's codes and scales are asked for spread over the block's products, as in k_pass_bf16.
 * qf: [Hkv·G, d] float32; ks: [num_slots, Hkv]; scores: [Hkv·G, L]; mx: [Hkv·G] running maxima.
 * d % 16 == 0, d <= 256. */
static inline __attribute__((always_inline)) void k_pass_codes(
        const float *qf, const uint8_t *kc, const float *ks, const int64_t *table, int64_t t_begin, int64_t t_end,
        float *scores, int64_t L, float *mx, int G, int Hkv, const int d, int bs, float scale, const int code) {
    const int D = d / 16;
    const int64_t stride = (int64_t)Hkv * d;  /* bytes from one token's row to the next */
    float rows[16 * 256] __attribute__((aligned(64)));
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        const int64_t next = next_block_base(table, t0, t_end, bs);
        paced_prefetch pf = pace_next_block(kc, next, bs, stride, Hkv * G * ((n + 15) / 16));
        prefetch_scales(ks, next, bs, Hkv);
        for (int h = 0; h < Hkv; h++)
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                const int nj = n - j0 < 16 ? (int)(n - j0) : 16;
                const __mmask16 live = (__mmask16)((1u << nj) - 1u);
                float sk[16] = {0};
                for (int j = 0; j < nj; j++) {
                    const int64_t slot = base + j0 + j;
                    const uint8_t *row = kc + (slot * Hkv + h) * d;
                    for (int c = 0; c < D; c++) {
                        const v16f v = load16(row + 16 * c, code);
                        memcpy(rows + j * d + 16 * c, &v, sizeof v);
                    }
                    sk[j] = ks[slot * Hkv + h] * scale;
                }
                const __m512 skv = _mm512_loadu_ps(sk);
                for (int g = h * G; g < (h + 1) * G; g++) {
                    pace_step(&pf);
                    __m512 q[16];
                    for (int c = 0; c < D; c++) q[c] = _mm512_loadu_ps(qf + g * d + 16 * c);
                    __m512 v[16];
                    for (int j = 0; j < 16; j++) {
                        v[j] = _mm512_setzero_ps();
                        if (j >= nj) continue;
                        for (int c = 0; c < D; c++)
                            v[j] = _mm512_fmadd_ps(_mm512_load_ps(rows + j * d + 16 * c), q[c], v[j]);
                    }
                    const __m512 sc = _mm512_mul_ps(transpose_sum16(v), skv);
                    _mm512_mask_storeu_ps(scores + g * L + (t0 - t_begin) + j0, live, sc);
                    const float m = _mm512_mask_reduce_max_ps(live, sc);
                    if (m > mx[g]) mx[g] = m;
                }
            }
    }
}

#if defined(__AVX512BF16__)
#define HAVE_K_PASS_BF16 1
/* The scores against a bfloat16 key cache when the queries are bfloat16 values (a bfloat16 model's):
 * q·k by AVX512-BF16 pair dot products straight from the cache (products of two bfloat16 are exact in
 * float32; vdpbf16ps accumulates in float32 and treats denormals as zero), 16 tokens at a time reduced
 * by one transpose_sum16. All KV heads of the chunk, block by block: each block serves every head right
 * after it arrives while the next one streams in (head by head, memory would idle while heads 2.. run
 * from L2). d % 32 == 0, d <= 256. qh: [Hkv·G, d] the queries as bfloat16 bits; scores: [Hkv·G, L];
 * mx: [Hkv·G] running maxima (start at -inf). */
static inline __attribute__((always_inline)) void k_pass_bf16(
        const uint16_t *qh, const uint8_t *kc, const int64_t *table, int64_t t_begin,
        int64_t t_end, float *scores, int64_t L, float *mx, int G, int Hkv, const int d, int bs, float scale) {
    const int D = d / 32;
    const int64_t stride = (int64_t)Hkv * d;  /* elements from one token's row to the next */
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        /* the next block's K lines in address order, an even share with each 16 × 1 head-row product */
        paced_prefetch pf = pace_next_block(kc, next_block_base(table, t0, t_end, bs), bs, stride * 2,
                                            Hkv * G * ((n + 15) / 16));
        for (int h = 0; h < Hkv; h++)
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                const int nj = n - j0 < 16 ? (int)(n - j0) : 16;
                const __mmask16 live = (__mmask16)((1u << nj) - 1u);
                for (int g = h * G; g < (h + 1) * G; g++) {
                    pace_step(&pf);
                    __m512bh q[8];
                    for (int c = 0; c < D; c++) q[c] = (__m512bh)_mm512_loadu_si512(qh + g * d + 32 * c);
                    __m512 v[16];
                    for (int j = 0; j < 16; j++) {
                        v[j] = _mm512_setzero_ps();
                        if (j >= nj) continue;
                        const uint16_t *row = (const uint16_t *)kc + ((base + j0 + j) * Hkv + h) * d;
                        for (int c = 0; c < D; c++)
                            v[j] = _mm512_dpbf16_ps(v[j], (__m512bh)_mm512_loadu_si512(row + 32 * c), q[c]);
                    }
                    const __m512 sc = _mm512_mul_ps(transpose_sum16(v), _mm512_set1_ps(scale));
                    _mm512_mask_storeu_ps(scores + g * L + (t0 - t_begin) + j0, live, sc);
                    const float m = _mm512_mask_reduce_max_ps(live, sc);
                    if (m > mx[g]) mx[g] = m;
                }
            }
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)  /* the passes round with vcvtne2ps2bf16 */
#define HAVE_K_PASS_AMX 1
int kvs_amx_granted(void); /* int4_gemm.c: this process was granted the AMX tile state */

/* Tiles of k_pass_amx: 0 = C, the scores [16 key rows × G queries] float32; 1 and 3 = A, 16 key rows ×
 * 32 dims bfloat16; 2 and 4 = B, the G queries' same 32 dims as 16 dim pairs × G (the VNNI pair layout). */
static void k_amx_configure(int G) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = 16;
    cfg.colsb[0] = cfg.colsb[2] = cfg.colsb[4] = (uint16_t)(4 * G);
    cfg.colsb[1] = cfg.colsb[3] = 64;
    _tile_loadconfig(&cfg);
}

/* Every KV head's B tiles: qt[(h·(d/32) + c)·512 + 32p + 2g + i] = qh[(h·G + g)·d + 32c + 2p + i], 16 rows
 * of 64 bytes per 32 dims, of which the tiles read the first 4G (columns past G are left as they are).
 * qh: [Hkv·G, d] bfloat16 bits; qt: [Hkv · d/32 · 512]. One 16-lane scatter per query row and 32 dims;
 * the scalar loop and a memset of the buffer it replaced cost, with 16 sequences of 320 bfloat16 tokens
 * (a layout per sequence and layer), 5 % of SmolLM2's 30-layer attention: 7.29 → 6.93 ms. */
static void k_amx_queries(const uint16_t *qh, uint16_t *qt, int G, int Hkv, int d) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));  /* pair p: dword 16p of the tile */
    for (int h = 0; h < Hkv; h++)
        for (int c = 0; c < d / 32; c++)
            for (int g = 0; g < G; g++)
                _mm512_i32scatter_epi32(qt + (h * (d / 32) + c) * 512 + 2 * g, rows,
                                        _mm512_loadu_si512(qh + (h * G + g) * d + 32 * c), 4);
}

/* C (tile 0) = 16 key rows (A: rows a_stride bytes apart, d bfloat16 each) times one KV head's query
 * tiles b (k_amx_queries), one tile product per 32 dims, in tile pairs (1, 2) and (3, 4). */
static inline __attribute__((always_inline)) void amx_score_tile(const void *a, int64_t a_stride, const uint16_t *b,
                                                                const int d) {
    _tile_zero(0);
    for (int c = 0; c < d / 32; c += 2) {
        _tile_loadd(1, (const uint8_t *)a + 64 * c, a_stride);
        _tile_loadd(2, b + 512 * c, 64);
        _tile_dpbf16ps(0, 1, 2);
        if (c + 1 < d / 32) {
            _tile_loadd(3, (const uint8_t *)a + 64 * (c + 1), a_stride);
            _tile_loadd(4, b + 512 * (c + 1), 64);
            _tile_dpbf16ps(0, 3, 4);
        }
    }
}

/* The scores of 16 tokens × G <= 4 queries in the compact C layout (token j's score of query g in lane
 * j·G + g of c0 | c1 | c2 | c3), times mul (per token lane), to out[g·L + j] for the live tokens j, and
 * into the queries' running maxima mv[g] (16 lanes each, reduced by the caller). Each query's column is
 * picked out with two-source permutes. Against a 16-load gather per query from a
 * tile stored 64 bytes a row (which also waits on that store) and a horizontal max per 16 tokens: the
 * bfloat16 key pass over SmolLM2's 30 layers (2 threads, cache from DRAM, interleaved medians), 4096
 * tokens 3.8-6.0 → 3.4-5.7 ms, 1024 1.29 → 1.19 ms, 16 × 384 10.4 → 10.0 ms; the same scores and maxima. */
static inline __attribute__((always_inline)) void amx_emit_columns(__m512 c0, __m512 c1, __m512 c2, __m512 c3,
                                                                  int G, __m512 mul, float *out, int64_t L,
                                                                  __mmask16 live, __m512 *mv) {
    const __m512i token = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(G));  /* token j's score of query 0 */
    for (int g = 0; g < G; g++) {
        const __m512i at = _mm512_add_epi32(token, _mm512_set1_epi32(g));
        const __m512 c = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(32)),
                                              _mm512_permutex2var_ps(c0, at, c1), _mm512_permutex2var_ps(c2, at, c3));
        const __m512 sc = _mm512_mul_ps(c, mul);
        _mm512_mask_storeu_ps(out + g * L, live, sc);
        mv[g] = _mm512_mask_max_ps(mv[g], live, mv[g], sc);
    }
}

/* amx_emit_columns of tile 0 (float32 C), stored compact in cbuf [64] (lanes past 16·G unused) */
static inline __attribute__((always_inline)) void amx_emit_scores(float *cbuf, int G, __m512 mul, float *out,
                                                                 int64_t L, __mmask16 live, __m512 *mv) {
    _tile_stored(0, cbuf, 4 * G);
    amx_emit_columns(_mm512_load_ps(cbuf), _mm512_load_ps(cbuf + 16), _mm512_load_ps(cbuf + 32),
                     _mm512_load_ps(cbuf + 48), G, mul, out, L, live, mv);
}

/* k_pass_bf16 on AMX, same arguments (qt from k_amx_queries): per 16 key rows of one head, one tile
 * product per 32 dims gives their 16 × G scores. tdpbf16ps rounds as vdpbf16ps does (products of two
 * bfloat16 exact in float32, float32 sums, denormal inputs read as zero) in another summation order.
 * Why: k_pass_bf16 spends a 46-instruction transpose_sum16 per query row and 16 tokens; here the A tile
 * is loaded straight from the cache (rows Hkv·d elements apart) and C comes out token by query. SmolLM2's
 * 30 layers × 4096 bfloat16 tokens (2 threads, cache from DRAM): 5.4-7.6 → 4.3-6.7 ms, ~15 % less,
 * medians of interleaved runs; 16 × 384 tokens: 10.5-12.2 → 9.3-11.2 ms. Needs bs % 16 == 0: the rows past a
 * partial block's last token are read (they are inside the block) and their scores dropped, so their
 * contents (stale, NaN) never reach a score. The tiles must be k_amx_configure(G). */
static inline __attribute__((always_inline)) void k_pass_amx(
        const uint16_t *qt, const uint8_t *kc, const int64_t *table, int64_t t_begin, int64_t t_end, float *scores,
        int64_t L, float *mx, int G, int Hkv, const int d, int bs, float scale) {
    const int64_t stride = (int64_t)Hkv * d * 2;  /* bytes from one token's row to the next */
    float cbuf[16 * 16] __attribute__((aligned(64)));
    const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    /* up to 4 queries per KV head, amx_emit_scores (C stored compact, running maxima in 16 lanes) */
    const int compact = G <= 4;
    __m512 mv[compact ? Hkv * G : 1];
    for (int i = 0; compact && i < Hkv * G; i++) mv[i] = _mm512_set1_ps(-INFINITY);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        /* the next block's K lines in address order, an even share with each 16-row tile product */
        paced_prefetch pf = pace_next_block(kc, next_block_base(table, t0, t_end, bs), bs, stride, Hkv * ((n + 15) / 16));
        for (int h = 0; h < Hkv; h++)
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                pace_step(&pf);
                const int nj = n - j0 < 16 ? (int)(n - j0) : 16;
                const __mmask16 live = (__mmask16)((1u << nj) - 1u);
                float *out = scores + (int64_t)h * G * L + (t0 - t_begin) + j0;
                amx_score_tile(kc + ((base + j0) * Hkv + h) * d * 2, stride, qt + (int64_t)h * (d / 32) * 512, d);
                if (compact) {
                    amx_emit_scores(cbuf, G, _mm512_set1_ps(scale), out, L, live, mv + h * G);
                    continue;
                }
                _tile_stored(0, cbuf, 64);
                for (int g = 0; g < G; g++) {  /* column g of C: query row g's scores of the 16 tokens */
                    const __m512 sc = _mm512_mul_ps(_mm512_i32gather_ps(col, cbuf + g, 4), _mm512_set1_ps(scale));
                    _mm512_mask_storeu_ps(out + g * L, live, sc);
                    const float m = _mm512_mask_reduce_max_ps(live, sc);
                    if (m > mx[h * G + g]) mx[h * G + g] = m;
                }
            }
    }
    for (int i = 0; compact && i < Hkv * G; i++) {
        const float m = _mm512_reduce_max_ps(mv[i]);
        if (m > mx[i]) mx[i] = m;
    }
}

/* Tiles of the integer key pass (k_pass_amx_codes over int8): 0, 5, 6 = C, the integer dot products
 * [16 key rows × G queries] int32 with the queries' high, middle and low digits; 1 = A, 16 key rows × 64
 * int8 codes; 2, 3, 4 = B, the G queries' same 64 dims' digits as 16 dim quads × G (the VNNI quad
 * layout). */
static void k_amx_configure_int8(int G) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = (uint16_t)(4 * G);
    }
    cfg.colsb[1] = 64;
    _tile_loadconfig(&cfg);
}

/* The queries as integers in three signed base-256 digits, for tdpbssd against int8 key codes.
 * Query row r (= h·G + g): with max|q_r| = f·2^e (f in [0.5, 1)) and E = max(e - 22, -126),
 * i = round(q · 2^-E) (the scaling is exact; |i| <= 2^22) = 65536 a + 256 b + c, b and c in [-128, 127],
 * |a| <= 65: q = i · 2^E to within 2^(E - 1) = 2^(e - 23) <= max|q_r| · 2^-22, twice float32's rounding
 * step at worst (max|q_r| a power of two; an adversarial review found the 2^-23 once claimed here
 * exceeded there), queries below 2^-104 to within 2^-127.
 * qt: per KV head h and 64 dims c, three 1024-byte B tiles (digits a, b, c), rows 64 bytes apart: byte
 * 4n + i of row p = the digit of q[(h·G + n)·d + 64c + 4p + i], n < G (the tiles are 4G bytes wide).
 * pat: per KV head 4 vectors, lane l of vector k = 2^E of query (16k + l) mod G, the lanes of the compact
 * C store (amx_emit_columns); NaN for a query row with a NaN or an infinite value, so all its scores are
 * NaN (a float dot product gives NaN or ±inf there, and the softmax NaN either way). q: [Hkv·G, d]
 * float32; d % 64 == 0. Vectorized: the scalar version of this, run once per work item, took as long as
 * the key pass it saved. */
static void k_amx_queries_int8(const float *q, int8_t *qt, float *pat, int G, int Hkv, int d) {
    float pw[16];
    for (int h = 0; h < Hkv; h++) {
        for (int g = 0; g < G; g++) {
            const float *qr = q + (int64_t)(h * G + g) * d;
            __m512 mv = _mm512_setzero_ps();
            __mmask16 bad = 0;  /* NaN or ±inf */
            for (int i = 0; i < d; i += 16) {
                const __m512 x = _mm512_abs_ps(_mm512_loadu_ps(qr + i));
                bad |= _mm512_cmp_ps_mask(x, _mm512_set1_ps(3.4028234663852886e38f), _CMP_NLE_UQ);
                mv = _mm512_max_ps(mv, x);
            }
            const float m = _mm512_reduce_max_ps(mv);
            int e = 0;
            frexpf(m, &e);
            const int E = m == 0.f ? -126 : e - 22 < -126 ? -126 : e - 22;
            pw[g] = bad ? NAN : bits_to_float((uint32_t)(127 + E) << 23);
            if (bad) continue;  /* the row's scores are NaN whatever its digits */
            const __m512 up = _mm512_set1_ps(bits_to_float((uint32_t)(127 - E) << 23));  /* 2^-E, E in [-126, 106] */
            const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
            for (int i = 0; i < d; i += 16) {  /* dims i .. i + 15: rows (i % 64) / 4 .. + 3 of tile i / 64 */
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qr + i), up));  /* nearest even */
                const __m512i c = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, k128), k255), k128);
                const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(v, c), 8);
                const __m512i bb = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, k128), k255), k128);
                const __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(r, bb), 8);
                int8_t *t = qt + ((int64_t)h * (d / 64) + i / 64) * 3 * 1024 + (i % 64 / 4) * 64 + 4 * g;
                int32_t da[4], db[4], dc[4];
                _mm_storeu_si128((__m128i *)da, _mm512_cvtepi32_epi8(a));
                _mm_storeu_si128((__m128i *)db, _mm512_cvtepi32_epi8(bb));
                _mm_storeu_si128((__m128i *)dc, _mm512_cvtepi32_epi8(c));
                for (int k = 0; k < 4; k++) {
                    memcpy(t + 64 * k, da + k, 4);
                    memcpy(t + 1024 + 64 * k, db + k, 4);
                    memcpy(t + 2048 + 64 * k, dc + k, 4);
                }
            }
        }
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 16; l++) pat[(h * 4 + k) * 16 + l] = pw[(16 * k + l) % G];
    }
}

/* The scores of 16 key rows of codes (src, rows stride bytes apart) for one KV head's queries, unscaled,
 * in amx_emit_columns' lanes. Integer (int8 codes, k_amx_configure_int8's tiles): the codes are the A tile
 * of tdpbssd as they are; three tile products per 64 dims with the query digits b (k_amx_queries_int8)
 * give exact int32 sums, and C = (65536 C_a + 256 C_b + C_c) · 2^E (pat), each C exact in float32 (|C| <=
 * 256 · 128 · 128 = 2^22), two float32 roundings in the combination. Otherwise (k_amx_configure's
 * tiles): the codes are decoded (load16) and stored as bfloat16 in the L1 buffer a, exactly (|int8| <=
 * 127 and every fp8 value fit bfloat16's 8 significant bits and exponent range, none of them denormal),
 * and multiplied by the bfloat16 query tiles b (k_amx_queries) from there. */
static inline __attribute__((always_inline)) void amx_code_scores(const uint8_t *src, int64_t stride,
                                                                 const void *b, const float *pat, int G, const int d,
                                                                 const int code, const int integer, uint16_t *a,
                                                                 void *cbuf, __m512 *cv) {
    if (integer) {
        const int8_t *q8 = b;
        int32_t *c32 = cbuf;  /* [3][64] */
        _tile_zero(0);
        _tile_zero(5);
        _tile_zero(6);
        for (int c = 0; c < d / 64; c++, q8 += 3 * 1024) {
            _tile_loadd(1, src + 64 * c, stride);
            _tile_loadd(2, q8, 64);
            _tile_loadd(3, q8 + 1024, 64);
            _tile_loadd(4, q8 + 2048, 64);
            _tile_dpbssd(0, 1, 2);
            _tile_dpbssd(5, 1, 3);
            _tile_dpbssd(6, 1, 4);
        }
        _tile_stored(0, c32, 4 * G);
        _tile_stored(5, c32 + 64, 4 * G);
        _tile_stored(6, c32 + 128, 4 * G);
        for (int k = 0; k < 4; k++) {
            const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c32 + 64 + 16 * k)),
                                              _mm512_set1_ps(256.f),
                                              _mm512_cvtepi32_ps(_mm512_load_si512(c32 + 128 + 16 * k)));
            cv[k] = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c32 + 16 * k)),
                                                  _mm512_set1_ps(65536.f), lo),
                                  _mm512_load_ps(pat + 16 * k));
        }
        return;
    }
    for (int j = 0; j < 16; j++)
        for (int c = 0; c < d; c += 32)
            _mm512_store_si512(a + j * d + c, (__m512i)_mm512_cvtne2ps_pbh(
                (__m512)load16(src + j * stride + c + 16, code), (__m512)load16(src + j * stride + c, code)));
    amx_score_tile(a, 2 * d, b, d);
    float *c = cbuf;
    _tile_stored(0, c, 4 * G);
    for (int k = 0; k < 4; k++) cv[k] = _mm512_load_ps(c + 16 * k);  /* past 16·G: unused lanes */
}

/* k_pass_amx over a 1-byte cache (int8, fp8 e4m3, fp8 e5m2 codes): per 16 key rows of one head,
 * amx_code_scores, then score = C · (k_scale · softmax scale) as k_pass_codes computes it.
 * - integer = 1 (int8 codes, any queries, float32 or bfloat16; d % 64 == 0; qt, pat from
 *   k_amx_queries_int8; tiles as k_amx_configure_int8(G)): the scores differ from k_pass_codes' (float32
 *   products and sums) by the query's rounding to 23 bits: |Δscore| <= 2^-22 · max|q| · Σ|code| ·
 *   k_scale · scale. Why: no code is decoded. SmolLM2's 30 layers, int8 (2 threads,
 *   interleaved medians, both with the queries laid out once per sequence): 4096 tokens 3.17 → 2.78 ms,
 *   1024 1.30 → 1.21 ms.
 * - integer = 0 (bfloat16 queries; qt from k_amx_queries; tiles as k_amx_configure(G)): the same products
 *   as k_pass_codes, float32 sums in another order. Like k_pass_amx, tdpbf16ps reads a denormal query
 *   value (|q| < 2^-126) as zero, where k_pass_codes multiplies it: that only shows when key scales near
 *   float32's maximum make such a product count. Two decode buffers in turn, so one group's stores need
 *   not wait for the tile loads of the group before. Against k_pass_codes (same runs as above, before the
 *   integer pass): int8 4096 tokens 4.47 → 3.82 ms, 1024 1.28 → 1.18 ms, 16 × 384 6.10 → 5.31 ms; fp8
 *   e4m3 4096 tokens 6.81 → 6.34 ms. (With a 16-load gather per query to read C it ran 4 % slower than
 *   k_pass_codes.)
 * G <= 4 (amx_emit_columns); bs % 16 == 0: the rows past a partial block's end are read from inside the
 * block and their scores dropped (a stale code is a finite integer, or a NaN fp8 code that never reaches a
 * score; stale scales are never gathered). */
static inline __attribute__((always_inline)) void k_pass_amx_codes(
        const void *qt, const float *pat, const uint8_t *kc, const float *ks, const int64_t *table, int64_t t_begin,
        int64_t t_end, float *scores, int64_t L, float *mx, int G, int Hkv, const int d, int bs, float scale,
        const int code, const int integer) {
    const int64_t stride = (int64_t)Hkv * d;  /* bytes from one token's row to the next */
    uint16_t abuf[2][16 * 256] __attribute__((aligned(64)));  /* integer: unused */
    int32_t cbuf[3 * 64] __attribute__((aligned(64))) = {0};
    const __m512i kv_row = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(Hkv));  /* token j's scale: j·Hkv on */
    __m512 mv[Hkv * G];
    for (int i = 0; i < Hkv * G; i++) mv[i] = _mm512_set1_ps(-INFINITY);
    int buf = 0;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        const int64_t next = next_block_base(table, t0, t_end, bs);
        paced_prefetch pf = pace_next_block(kc, next, bs, stride, Hkv * ((n + 15) / 16));
        prefetch_scales(ks, next, bs, Hkv);
        for (int h = 0; h < Hkv; h++)
            for (int64_t j0 = 0; j0 < n; j0 += 16, buf ^= 1) {
                pace_step(&pf);
                const int nj = n - j0 < 16 ? (int)(n - j0) : 16;
                const __mmask16 live = (__mmask16)((1u << nj) - 1u);
                __m512 cv[4];
                amx_code_scores(kc + ((base + j0) * Hkv + h) * d, stride,
                                integer ? (const void *)((const int8_t *)qt + (int64_t)h * (d / 64) * 3 * 1024)
                                        : (const void *)((const uint16_t *)qt + (int64_t)h * (d / 32) * 512),
                                integer ? pat + h * 64 : NULL, G, d, code, integer, abuf[buf], cbuf, cv);
                const __m512 sk = _mm512_mul_ps(  /* the live tokens' K scales (stale slots' may be NaN) */
                    _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, kv_row, ks + (base + j0) * Hkv + h, 4),
                    _mm512_set1_ps(scale));
                amx_emit_columns(cv[0], cv[1], cv[2], cv[3], G, sk, scores + (int64_t)h * G * L + (t0 - t_begin) + j0,
                                 L, live, mv + h * G);
            }
    }
    for (int i = 0; i < Hkv * G; i++) {
        const float m = _mm512_reduce_max_ps(mv[i]);
        if (m > mx[i]) mx[i] = m;
    }
}

#endif
#endif

/* Which key pass kvq_decode_attention_team runs: 5 = AMX integer tile products over int8 codes, any
 * queries (k_pass_amx_codes, integer), 4 = AMX tile products over 1-byte codes decoded to
 * bfloat16 (k_pass_amx_codes), 3 = AMX tile products (k_pass_amx), 2 = bfloat16 pair dot products
 * (k_pass_bf16), 1 = 1-byte codes (k_pass_codes), 6 = 8-lane vectors over int8, float32 or bfloat16
 * (k_pass_avx2, CPUs with AVX2 but no AVX-512; up to 64 query heads), 0 = the generic loop in
 * attend_chunk. */
int kvq_key_pass(int q_bf16, int code, int d, int G, int bs) {
#ifdef HAVE_K_PASS_AMX
    if (code == 0 && d % 64 == 0 && d <= 256 && G <= 4 && bs % 16 == 0 && kvs_amx_granted()) return 5;
    if (q_bf16 && code == 4 && d % 32 == 0 && d <= 256 && G <= 16 && bs % 16 == 0 && kvs_amx_granted()) return 3;
    if (q_bf16 && code <= 2 && d % 32 == 0 && d <= 256 && G <= 4 && bs % 16 == 0 && kvs_amx_granted()) return 4;
#endif
#ifdef HAVE_K_PASS_BF16
    if (q_bf16 && code == 4 && d % 32 == 0 && d <= 256) return 2;
#endif
#ifdef HAVE_K_PASS_CODES
    if (code <= 2 && d % 16 == 0 && d <= 256) return 1;
#endif
#ifdef HAVE_AVX2_PASSES
    if ((code == 0 || code == 3 || code == 4) && d % 32 == 0 && d <= 256 && G <= 4) return 6;
#endif
    return 0;
}

/* One (sequence, kv head, chunk of tokens [t_begin, t_end)): G query rows. Writes the chunk's partial
 * softmax state (flash-decoding, Dao et al. 2023): running max mx[G], sum of exp sum[G] and the
 * unnormalized output acc[G, d]. Inlined with d a literal (64/128/256) so the row loops unroll and
 * vectorize; t_begin is a multiple of bs, so blocks are walked whole (no per-token division).
 * pre: this head's scores [G, L] and maxima pre_mx [G] already computed (k_pass_bf16), or NULL. */
static inline __attribute__((always_inline)) void attend_chunk(
        const float *qb, const uint8_t *kc, const uint8_t *vc, const float *ks, const float *vs,
        const int64_t *table, int64_t t_begin, int64_t t_end, float *acc, float *mx, float *sum,
        int G, int Hkv, int h, const int d, int bs, float scale, int code, float *pre, const float *pre_mx) {
    const int64_t L = t_end - t_begin;
    float *scores = pre ? pre : malloc(sizeof(float) * (size_t)(G * L + d));
    float *row = scores + G * L;
    const int64_t es = elem_size(code);
    for (int g = 0; g < G; g++) { mx[g] = pre ? pre_mx[g] : -INFINITY; sum[g] = 0.f; }
    if (!pre)
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        const int64_t next = next_block_base(table, t0, t_end, bs);
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = base + j, t = t0 + j - t_begin;
            prefetch_row(kc, next, j, Hkv, h, d * es);
            decode_row(kc + (slot * Hkv + h) * d * es, row, d, code);
            const float sk = (ks ? ks[slot * Hkv + h] : 1.f) * scale;
            for (int g = 0; g < G; g++) {
                const float *qg = qb + g * d;
                float dot = 0.f;
                for (int i = 0; i < d; i++) dot += qg[i] * row[i];
                const float sc = dot * sk;
                scores[g * L + t] = sc;
                if (sc > mx[g]) mx[g] = sc;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float z = 0.f;
        float *sg = scores + g * L;
        const float m = mx[g];
        int64_t t = 0;
#ifdef __AVX512F__  /* 16 lanes of partial sums: a single running sum is a chain of dependent adds */
        __m512 zv = _mm512_setzero_ps();
        for (; t + 16 <= L; t += 16) {
            const __m512 e = exp_nonpos_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + t), _mm512_set1_ps(m)));
            _mm512_storeu_ps(sg + t, e);
            zv = _mm512_add_ps(zv, e);
        }
        z = _mm512_reduce_add_ps(zv);
#endif
        for (; t < L; t++) { const float e = exp_nonpos(sg[t] - m); sg[t] = e; z += e; }
        sum[g] = z;
    }
#ifdef HAVE_AVX2_PASSES
    if ((code == 0 || code == 3 || code == 4) && d % 32 == 0 && d <= 256 && G <= 4) {
        const float *vsh = code == 0 ? vs : NULL;
#define V_AVX2(CODE) \
        if (d == 64) v_pass_avx2(vc, vsh, table, t_begin, t_end, scores, L, acc, G, Hkv, h, 64, bs, CODE); \
        else v_pass_avx2(vc, vsh, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, CODE);
        if (code == 0) { V_AVX2(0) } else if (code == 3) { V_AVX2(3) } else { V_AVX2(4) }
#undef V_AVX2
        if (!pre) free(scores);
        return;
    }
#endif
    if (d % 16 == 0 && d <= 256) {  /* accumulators in registers; the code a constant in each copy */
        const float *vsh = code <= 2 ? vs : NULL;
        switch (code) {
            case 0: v_pass(vc, vsh, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, 0); break;
            case 1: v_pass(vc, vsh, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, 1); break;
            case 2: v_pass(vc, vsh, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, 2); break;
            case 3: v_pass(vc, NULL, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, 3); break;
            default: v_pass(vc, NULL, table, t_begin, t_end, scores, L, acc, G, Hkv, h, d, bs, 4);
        }
        if (!pre) free(scores);
        return;
    }
    memset(acc, 0, sizeof(float) * G * d);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, n = t_end - t0 < bs ? t_end - t0 : bs;
        const int64_t next = next_block_base(table, t0, t_end, bs);
        for (int64_t j = 0; j < n; j++) {
            const int64_t slot = base + j, t = t0 + j - t_begin;
            prefetch_row(vc, next, j, Hkv, h, d * es);
            decode_row(vc + (slot * Hkv + h) * d * es, row, d, code);
            const float sv = vs ? vs[slot * Hkv + h] : 1.f;
            for (int g = 0; g < G; g++) {
                const float w = scores[g * L + t] * sv;
                float *a = acc + g * d;
                for (int i = 0; i < d; i++) a[i] += w * row[i];
            }
        }
    }
    if (!pre) free(scores);
}

/* Tokens per work item (whole blocks, at most 512 rounded up to blocks): the step's tokens split into
 * num_threads × r equal items, r the fewest rounds that keeps items within 512. One sequence's items
 * then give every thread the same number of tokens, give or take a block; a batch's sequences are items
 * of their own, spread by the dynamic schedule. The split this replaced halved 512 while the step had
 * fewer than 2 items per thread, down to 4 blocks: a 192-token sequence made 3 items of 64 tokens on 2
 * threads, one thread taking two of them, and 4,100 tokens 9 items, one thread taking five. An item also
 * costs a few µs on top of its tokens (the key pass's set-up, each KV head's partial softmax state, the
 * merge), which fewer items save. SmolLM2 bf16 attention per layer on an AMD EPYC Zen 3, 2 threads,
 * medians of 5-10 alternating runs: 9.1 -> 7.9 µs at ~80 tokens, 13.4 -> 12.6 at ~190, 46 -> 44 at
 * ~1,100 and 243 -> 215 at ~4,060 (the runs spread ±20 % on this host). */
int64_t kvq_attention_chunk(const int64_t *seq_lens, int B, int bs, int num_threads) {
    int64_t total = 0;
    for (int b = 0; b < B; b++) total += seq_lens[b];
    const int64_t cap = ((512 + bs - 1) / bs) * bs, nt = num_threads > 1 ? num_threads : 1;
    const int64_t rounds = (total + cap * nt - 1) / (cap * nt);
    if (rounds == 0) return bs;  /* no tokens: no items */
    const int64_t chunk = (total + rounds * nt - 1) / (rounds * nt);
    return ((chunk + bs - 1) / bs) * bs;
}

/* first[b] = index of sequence b's first work item, first[B] = the number of items. first: [B + 1]. */
int64_t kvq_attention_items(const int64_t *seq_lens, int B, int64_t chunk, int64_t *first) {
    first[0] = 0;
    for (int b = 0; b < B; b++) first[b + 1] = first[b] + (seq_lens[b] + chunk - 1) / chunk;
    return first[B];
}

/* kvq_decode_attention's work, run by every thread of an enclosing parallel region (outside one: by the
 * caller alone); chunk and first from the two functions above, part: [first[B] * H * (d + 2)] float32
 * scratch. out_bf16: NULL, or [B, H, d] that also receives out rounded to bfloat16 (nearest even).
 * Ends with a barrier. */
void kvq_decode_attention_team(const float *q, const uint8_t *kc, const uint8_t *vc, const float *ks,
                               const float *vs, const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *seq_lens, float *out, int B, int H, int Hkv, int d, int bs,
                               float scale, int code, int64_t chunk, const int64_t *first, float *part,
                               int q_bf16, uint16_t *out_bf16) {
    const int G = H / Hkv;
    const int64_t num_items = first[B];
    int key_pass = kvq_key_pass(q_bf16, code, d, G, bs);
    if (key_pass == 6 && H > 64) key_pass = 0;  /* k_pass_avx2 keeps lane sums of at most 64 query heads */
#ifdef HAVE_K_PASS_AMX
    uint16_t *qt = NULL;  /* this thread's B tiles */
    int8_t *qt8 = NULL;
    float *pat = NULL;
    if (key_pass == 5) {
        qt8 = aligned_alloc(64, (size_t)Hkv * (d / 64) * 3 * 1024);
        pat = aligned_alloc(64, sizeof(float) * (size_t)Hkv * 64);
        k_amx_configure_int8(G);
    } else if (key_pass >= 3) {
        qt = aligned_alloc(64, sizeof(uint16_t) * (size_t)Hkv * (d / 32) * 512);
        k_amx_configure(G);
    }
#endif
    /* The sequence whose queries this thread's B tiles hold: a thread takes items in increasing order, so
     * a sequence's items come to it in a row and its queries are laid out once, not once per item (SmolLM2
     * at 4096 tokens: 8 items per layer). */
    int prepared = -1;
    /* partial state of (sequence b, kv head h, chunk c) at index first[b] * Hkv + h * nchunks_b + c */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
        int b = 0;
        while (first[b + 1] <= item) b++;
        const int64_t nchunks = first[b + 1] - first[b], c = item - first[b], t_begin = c * chunk;
        const int64_t t_end = t_begin + chunk < seq_lens[b] ? t_begin + chunk : seq_lens[b];
        const int64_t *table = block_tables + b * bt_stride, L = t_end - t_begin;
        float *pre = NULL, *pre_mx = NULL;  /* every head's scores, from k_pass_bf16 / k_pass_codes */
#ifdef HAVE_K_PASS_CODES
        if (key_pass == 1) {
            pre = malloc(sizeof(float) * (size_t)(H * L + H));
            pre_mx = pre + H * L;
            for (int i = 0; i < H; i++) pre_mx[i] = -INFINITY;
            const float *qs = q + (int64_t)b * H * d;
#define K_CODES(CODE) \
            if (d == 64) k_pass_codes(qs, kc, ks, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 64, bs, scale, CODE); \
            else k_pass_codes(qs, kc, ks, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, d, bs, scale, CODE);
            if (code == 0) { K_CODES(0) } else if (code == 1) { K_CODES(1) } else { K_CODES(2) }
#undef K_CODES
        }
#endif
#ifdef HAVE_K_PASS_AMX
        if (key_pass == 5) {
            pre = malloc(sizeof(float) * (size_t)(H * L + H));
            pre_mx = pre + H * L;
            for (int i = 0; i < H; i++) pre_mx[i] = -INFINITY;
            if (b != prepared) k_amx_queries_int8(q + (int64_t)b * H * d, qt8, pat, G, Hkv, d);
            prepared = b;
            if (d == 64)
                k_pass_amx_codes(qt8, pat, kc, ks, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 64, bs, scale, 0, 1);
            else
                k_pass_amx_codes(qt8, pat, kc, ks, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, d, bs, scale, 0, 1);
        }
#endif
#ifdef HAVE_AVX2_PASSES
        if (key_pass == 6) {
            pre = malloc(sizeof(float) * (size_t)(H * L + H));
            pre_mx = pre + H * L;
            for (int i = 0; i < H; i++) pre_mx[i] = -INFINITY;
            const float *qs = q + (int64_t)b * H * d;
            const float *kss = code == 0 ? ks : NULL;
#define K_AVX2(CODE) \
            if (d == 64) k_pass_avx2(qs, kc, vc, kss, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 64, bs, scale, CODE); \
            else if (d == 128) k_pass_avx2(qs, kc, vc, kss, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 128, bs, scale, CODE); \
            else k_pass_avx2(qs, kc, vc, kss, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, d, bs, scale, CODE);
            if (code == 0) { K_AVX2(0) } else if (code == 3) { K_AVX2(3) } else { K_AVX2(4) }
#undef K_AVX2
        }
#endif
#ifdef HAVE_K_PASS_BF16
        if (key_pass >= 2 && key_pass <= 4) {
            pre = malloc(sizeof(float) * (size_t)(H * L + H) + sizeof(uint16_t) * (size_t)(H * d));
            pre_mx = pre + H * L;
            uint16_t *qh = (uint16_t *)(pre_mx + H);
            /* exact: the queries are bfloat16 values; the AMX passes need them once per sequence */
            for (int64_t i = 0; (key_pass == 2 || b != prepared) && i < (int64_t)H * d; i++) {
                uint32_t bits;
                memcpy(&bits, q + (int64_t)b * H * d + i, 4);
                qh[i] = (uint16_t)(bits >> 16);
            }
            for (int i = 0; i < H; i++) pre_mx[i] = -INFINITY;
#ifdef HAVE_K_PASS_AMX
            if (key_pass == 4) {
                if (b != prepared) k_amx_queries(qh, qt, G, Hkv, d);
                prepared = b;
#define K_AMX_CODES(CODE) \
                if (d == 64) \
                    k_pass_amx_codes(qt, NULL, kc, ks, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 64, bs, scale, \
                                     CODE, 0); \
                else \
                    k_pass_amx_codes(qt, NULL, kc, ks, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, d, bs, scale, \
                                     CODE, 0);
                if (code == 0) { K_AMX_CODES(0) } else if (code == 1) { K_AMX_CODES(1) } else { K_AMX_CODES(2) }
#undef K_AMX_CODES
            } else if (key_pass == 3) {
                if (b != prepared) k_amx_queries(qh, qt, G, Hkv, d);
                prepared = b;
                if (d == 64) k_pass_amx(qt, kc, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 64, bs, scale);
                else k_pass_amx(qt, kc, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, d, bs, scale);
            } else
#endif
            switch (d) {
                case 64: k_pass_bf16(qh, kc, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 64, bs, scale); break;
                case 128: k_pass_bf16(qh, kc, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, 128, bs, scale); break;
                default: k_pass_bf16(qh, kc, table, t_begin, t_end, pre, L, pre_mx, G, Hkv, d, bs, scale);
            }
        }
#endif
        for (int h = 0; h < Hkv; h++) {
            const float *qb = q + ((int64_t)b * H + (int64_t)h * G) * d;
            float *acc = part + (first[b] * Hkv + h * nchunks + c) * G * (d + 2), *mx = acc + G * d, *sum = mx + G;
            float *ph = pre ? pre + (int64_t)h * G * L : NULL, *pm = pre ? pre_mx + h * G : NULL;
            switch (d) {
                case 64: attend_chunk(qb, kc, vc, ks, vs, table, t_begin, t_end, acc, mx, sum, G, Hkv, h, 64, bs, scale, code, ph, pm); break;
                case 128: attend_chunk(qb, kc, vc, ks, vs, table, t_begin, t_end, acc, mx, sum, G, Hkv, h, 128, bs, scale, code, ph, pm); break;
                case 256: attend_chunk(qb, kc, vc, ks, vs, table, t_begin, t_end, acc, mx, sum, G, Hkv, h, 256, bs, scale, code, ph, pm); break;
                default: attend_chunk(qb, kc, vc, ks, vs, table, t_begin, t_end, acc, mx, sum, G, Hkv, h, d, bs, scale, code, ph, pm);
            }
        }
        free(pre);
    }
#ifdef HAVE_K_PASS_AMX
    if (key_pass >= 3) {
        _tile_release();
        free(qt);
        free(qt8);
        free(pat);
    }
#endif
#pragma omp for schedule(static)
    for (int64_t row = 0; row < (int64_t)B * H; row++) {
        const int b = (int)(row / H), h = (int)(row % H) / G, g = (int)(row % H) % G;
        const int64_t nchunks = first[b + 1] - first[b];
        const float *p0 = part + (first[b] * Hkv + (int64_t)h * nchunks) * G * (d + 2);
        float M = -INFINITY, Z = 0.f;
        for (int64_t c = 0; c < nchunks; c++) {
            const float m = p0[c * G * (d + 2) + G * d + g];
            if (m > M) M = m;
        }
        float *o = out + row * d;
        for (int i = 0; i < d; i++) o[i] = 0.f;
        for (int64_t c = 0; c < nchunks; c++) {
            const float *pc = p0 + c * G * (d + 2);
            const float w = expf(pc[G * d + g] - M);
            Z += w * pc[G * d + G + g];
            for (int i = 0; i < d; i++) o[i] += w * pc[g * d + i];
        }
        for (int i = 0; i < d; i++) o[i] /= Z;
        if (out_bf16)
            for (int i = 0; i < d; i++) out_bf16[row * d + i] = float_to_bf16(o[i]);
    }
}

/* q: [B, H, d]; caches: [num_blocks, bs, Hkv, d] codes (or floats); scales: [num_blocks, bs, Hkv] or NULL;
 * block_tables: [B, bt_stride]; seq_lens: [B]; out: [B, H, d]. Query heads h*G .. h*G+G-1 share kv head h.
 * Work items are (sequence, chunk of tokens) so one long sequence keeps every thread busy; an item runs
 * its KV heads one after another over the same blocks, so each block comes from memory once (the other
 * heads find it in L2; items per head would stream every block from DRAM once per head). The chunks'
 * partial softmax states are then merged: out = Σ_c e^(m_c - M) acc_c / Σ_c e^(m_c - M) z_c.
 * q_bf16: every q value is a bfloat16 value (a bfloat16 model's), which lets a bfloat16 key cache be
 * read with bf16 dot products (k_pass_bf16). */
void kvq_decode_attention(const float *q, const uint8_t *kc, const uint8_t *vc, const float *ks,
                          const float *vs, const int64_t *block_tables, int64_t bt_stride,
                          const int64_t *seq_lens, float *out, int B, int H, int Hkv, int d, int bs,
                          float scale, int code, int num_threads, int q_bf16) {
    const int64_t chunk = kvq_attention_chunk(seq_lens, B, bs, num_threads);
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));
    const int64_t num_items = kvq_attention_items(seq_lens, B, chunk, first);
    float *part = malloc(sizeof(float) * (size_t)(num_items * H * (d + 2)));
#pragma omp parallel num_threads(num_threads)
    kvq_decode_attention_team(q, kc, vc, ks, vs, block_tables, bt_stride, seq_lens, out, B, H, Hkv, d, bs, scale,
                              code, chunk, first, part, q_bf16, NULL);
    free(part);
    free(first);
}

/* Quantize and store T tokens' K or V rows: x [T, Hkv, d] in code in_code (3 float32, 4 bfloat16; token
 * rows row_stride elements apart, heads d apart) → codes [num_slots, Hkv, d] and scales [num_slots, Hkv]
 * at slot_mapping[t], by quantize_row (= kv_quant.quantize, bit for bit). code: 0/1/2. */
void kvq_write_quantized(const void *x, int in_code, int64_t row_stride, int64_t T, int Hkv, int d,
                         const int64_t *slot_mapping, uint8_t *codes, float *scales, int code, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (T >= 16)
    {
        float *row = malloc(sizeof(float) * (size_t)d);  /* one row, any head_dim */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int h = 0; h < Hkv; h++) {
                const int64_t src = t * row_stride + (int64_t)h * d, dst = slot_mapping[t] * Hkv + h;
                for (int i = 0; i < d; i++)
                    row[i] = in_code == 3 ? ((const float *)x)[src + i] : bf16_to_float(((const uint16_t *)x)[src + i]);
                scales[dst] = quantize_row(row, d, code, codes + dst * d);
            }
        free(row);
    }
}

/* Dequantize n rows of d codes: dst[r, :] = code_to_float(src[r, :]) * scales[r]. src: [n, d]; dst: [n, d]. */
void kvq_dequantize(const uint8_t *src, const float *scales, float *dst, int64_t n, int d, int code,
                    int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < n; r++) {
        float *o = dst + r * d;
        decode_row(src + r * d, o, d, code);
        const float s = scales[r];
        for (int i = 0; i < d; i++) o[i] *= s;
    }
}
