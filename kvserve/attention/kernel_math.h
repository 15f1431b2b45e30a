/* Float helpers and a compiler barrier shared by the C kernels (kv_quant_kernel.c, layer_kernel.c, int4_gemm.c). */
#ifndef KVSERVE_KERNEL_MATH_H
#define KVSERVE_KERNEL_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* An empty asm that takes v and hands it back: GCC cannot see through it, so it cannot reassociate a
 * sum across it. Why: from a chain acc += f(a); acc += f(b); ... of integer adds, GCC's tree
 * reassociation computes every f first and sums them afterwards; with AVX2's 16 ymm registers the
 * products of int4_tile_q8's chains (8 per accumulator, 32 a group at two rows of x) went to the stack
 * and back. Zen 3, one thread, SmolLM2's
 * four layer matmuls at 2,048 rows: 117-123 -> 90-93 ms; one row, weights in the L3: 0.032 -> 0.028 ms. */
#define KVS_KEEP(v) __asm__("" : "+x"(v))

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }

static inline float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

/* round to nearest even, as c10::BFloat16; NaN → 0x7fc0. A select, not a branch, so loops vectorize. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    const uint16_t rounded = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    return (b & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded;
}

/* e^x for x <= 0 (softmax after subtracting the max), vectorizable: x = n ln2 + r with |r| <= ln2/2,
 * e^r by the Cephes expf polynomial (relative error ~2e-7, like expf), 2^n through the exponent bits.
 * Flushes to 0 below -87 (e^-87 ~ 1.6e-38, the float32 normal limit). */
static inline float exp_nonpos(float x) {
    const float xc = x < -87.f ? -87.f : x;
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.f ? 0.f : p * bits_to_float(bits);
}

#ifdef __AVX2__
#include <immintrin.h>

/* 8 bfloat16 values as float32 (exact) */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* exp_nonpos on 8 lanes (the same polynomial; its products may round differently, FMA or not) */
static inline __m256 exp_nonpos_avx2(__m256 x) {
    const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  /* maxps returns its 2nd operand for NaN: kept */
    const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_NLT_UQ));  /* NaN: kept */
}
#endif

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 bfloat16 values as float32 (exact) */
static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* float_to_bf16 on 16 lanes, as 32-bit lanes (the bfloat16 bits in the low half) */
static inline __m512i ps_to_bf16_epi32(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

/* v rounded to bfloat16 (round_to(v, 4) on 16 lanes), as float32 */
static inline __m512 ps_round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(ps_to_bf16_epi32(v), 16)); }

/* v rounded to bfloat16 and stored: 16 values at p */
static inline void ps_store_bf16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(ps_to_bf16_epi32(v)));
}

/* exp_nonpos on 16 lanes: the same operations in the same order */
static inline __m512 exp_nonpos_ps(__m512 x) {
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-87.f), x);  /* maxps returns its 2nd operand for NaN: kept */
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ), y);  /* NaN: kept */
}

/* lane t of the result = the sum (is_max 0) or the maximum (1) of the 16 lanes of v[t]: a transpose-and-
 * reduce tree, 46 shuffles and adds/maxes where 16 separate horizontal reductions take ~130 */
static inline __attribute__((always_inline)) __m512 transpose_reduce16(const __m512 *v, const int is_max) {
#define KVS_R(a, b) (is_max ? _mm512_max_ps((a), (b)) : _mm512_add_ps((a), (b)))
    __m512 w[8], x[4];
    for (int k = 0; k < 8; k++)  /* w[k]: 128-bit lanes 0-1 partial results of v[2k], lanes 2-3 of v[2k+1] */
        w[k] = KVS_R(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                     _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)  /* x[k]: 128-bit lane L holds 4 partial results of v[4k + L] */
        x[k] = KVS_R(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                     _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
    const __m512 y0 = KVS_R(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 y1 = KVS_R(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d a = _mm512_castps_pd(y0), b = _mm512_castps_pd(y1);
    /* z lane 4L + m = the result of v[4m + L] */
    const __m512 z = KVS_R(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
#undef KVS_R
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}
#endif

/* One float (already divided by its scale and clamped to the format's range, finite) as a float8 code,
 * round to nearest even as torch's .to(float8_e4m3fn / float8_e5m2): mbits mantissa bits, exponent
 * bias `bias`. Subnormals (below 2^(1 - bias)) are multiples of 2^(1 - bias - mbits); a subnormal that
 * rounds up to 2^mbits of those is the smallest normal, whose code is the same integer. */
static inline uint8_t float_to_fp8(float y, const int mbits, const int bias) {
    uint32_t b;
    memcpy(&b, &y, 4);
    const uint32_t sign = (b >> 24) & 0x80u, mag = b & 0x7fffffffu;
    const float a = bits_to_float(mag);
    if (a < bits_to_float((uint32_t)(128 - bias) << 23))  /* 2^(1 - bias) */
        return (uint8_t)(sign | (uint32_t)nearbyintf(a * bits_to_float((uint32_t)(126 + bias + mbits) << 23)));
    const int drop = 23 - mbits;
    const uint32_t rounded = (mag + (1u << (drop - 1)) - 1u + ((mag >> drop) & 1u)) >> drop;
    return (uint8_t)(sign | (rounded - ((uint32_t)(127 - bias) << mbits)));
}

/* A cache row's codes and scale, as kvserve.attention.kv_quant.quantize computes them (bit for bit):
 * scale = max(max|x| / QMAX, 1e-12), code = x / scale rounded (int8: to nearest even integer, clamped
 * to ±127; fp8: clamped to ±QMAX, then float_to_fp8). A NaN in x makes the scale NaN (an inf makes it
 * inf) and every code 0, so the whole row reads back NaN: a NaN key or value reaches the attention
 * output as in a float cache, instead of vanishing into a finite max. code: 0 int8, 1 fp8 e4m3
 * (QMAX 448), 2 fp8 e5m2 (QMAX 57344). x: [d] float32; out: [d] codes. */
static inline float quantize_row(const float *x, int d, int code, uint8_t *out) {
    const float qmax = code == 0 ? 127.f : code == 1 ? 448.f : 57344.f;
    float amax = 0.f;
    for (int i = 0; i < d; i++) { const float a = fabsf(x[i]); amax = a > amax || a != a ? a : amax; }
    float s = amax / qmax;
    s = s < (float)1e-12 ? (float)1e-12 : s;
    if (!(s <= 3.4028234663852886e38f)) {  /* NaN or inf */
        memset(out, 0, (size_t)d);
        return s;
    }
    /* qmax · s must stay finite: fl(max|x| / qmax) can round up, and for max|x| within rounding of FLT_MAX
     * the code ±qmax then read back as ±inf. One step down makes qmax · s < max|x| (s shrinks by more than
     * its rounding error, 2^-24 relative); the value at max|x| clamps to ±qmax. The product is exact in
     * double (qmax has at most 7 significant bits), and no float reassociation can fold it into max|x|. */
    if ((double)s * qmax > 3.4028234663852886e38) s = nextafterf(s, 0.f);
    for (int i = 0; i < d; i++) {
        float y = x[i] / s;
        if (code == 0) {
            y = nearbyintf(y);
            y = y > 127.f ? 127.f : y < -127.f ? -127.f : y;
            out[i] = (uint8_t)(int8_t)y;
        } else {
            y = y > qmax ? qmax : y < -qmax ? -qmax : y;
            out[i] = code == 1 ? float_to_fp8(y, 3, 7) : float_to_fp8(y, 2, 15);
        }
    }
    return s;
}

/* LDTILECFG's 64-byte operand (Intel SDM vol. 2, LDTILECFG: palette 1): per tile its bytes per row and
 * rows. Used by the AMX paths of int4_gemm.c, kv_quant_kernel.c and prefill_attention.c. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_tile_config;

#if defined(__AMX_TILE__)
#include <immintrin.h>
/* All 8 tiles at their largest: 16 rows of 64 bytes */
static inline void amx_configure_full(void) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

#endif
