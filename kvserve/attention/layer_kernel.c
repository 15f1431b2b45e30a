/* The per-layer glue of a step, one call each instead of a dozen eager PyTorch ops (see
 * kvserve/models/fused_ops.py): RoPE + KV-cache write, residual add + RMSNorm, SiLU(gate) * up, and
 * decode attention on activations of the model's dtype.
 *
 * Activation codes as in kv_quant_kernel.c: 3 = float32, 4 = bfloat16. Every result that PyTorch
 * would round to the activation dtype after an op is rounded here after the same op (round to nearest
 * even, as c10::BFloat16), so a bfloat16 model sees the values its eager ops would give; float32
 * products are not contracted into FMAs where eager PyTorch rounds each product (RoPE).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

void kvq_decode_attention(const float *q, const uint8_t *kc, const uint8_t *vc, const float *ks,
                          const float *vs, const int64_t *block_tables, int64_t bt_stride,
                          const int64_t *seq_lens, float *out, int B, int H, int Hkv, int d, int bs,
                          float scale, int code, int num_threads, int q_bf16);
int64_t kvq_attention_chunk(const int64_t *seq_lens, int B, int bs, int num_threads);
int64_t kvq_attention_items(const int64_t *seq_lens, int B, int64_t chunk, int64_t *first);
void kvq_decode_attention_team(const float *q, const uint8_t *kc, const uint8_t *vc, const float *ks,
                               const float *vs, const int64_t *block_tables, int64_t bt_stride,
                               const int64_t *seq_lens, float *out, int B, int H, int Hkv, int d, int bs,
                               float scale, int code, int64_t chunk, const int64_t *first, float *part,
                               int q_bf16, uint16_t *out_bf16);
void kvs_int4_linear_team(const uint16_t *x, int64_t M, int K, const uint16_t *w, int N, void *y, int out_code,
                          float *xsum);
int64_t kvs_int4_scratch_floats(int64_t M, int K);
void kvs_dense_linear_team(const void *x, int64_t M, int K, const void *w, int w_code, const uint16_t *scales, int N,
                           void *y);

static inline float load(const void *p, int64_t i, int code) {
    return code == 3 ? ((const float *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}

static inline void store(void *p, int64_t i, float v, int code) {
    if (code == 3) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = float_to_bf16(v);
}

/* v as the activation dtype would hold it */
static inline float round_to(float v, int code) { return code == 3 ? v : bf16_to_float(float_to_bf16(v)); }

/* p[off .. off + n) = v[0 .. n) stored in code (3 float32, 4 bfloat16 rounded to nearest even): store() on
 * 16 lanes */
static inline __attribute__((always_inline)) void store_row(void *p, int64_t off, const float *v, int n,
                                                            const int code) {
    int i = 0;
    if (code == 3) { memcpy((float *)p + off, v, sizeof(float) * (size_t)n); return; }
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) ps_store_bf16((uint16_t *)p + off + i, _mm512_loadu_ps(v + i));
#endif
    for (; i < n; i++) store(p, off + i, v[i], code);
}

static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rope_row(
        const void *qkv, int64_t row, const float *c, const float *s, void *q_out, void *k_out, void *key_cache,
        void *value_cache, float *k_scale, float *v_scale, int64_t t, int64_t slot, int H, int Hkv, int d,
        const int in, const int act, const int cache_code, int q_code) {
    const int half = d / 2;
    float rot[512];  /* one rotated head (d <= 512) */
#ifdef __AVX512F__
    /* this row's cos and sin as the activation dtype holds them */
    float cr[256] __attribute__((aligned(64))), sr[256] __attribute__((aligned(64)));
    const int vec = in == 4 && act == 4 ? half / 16 * 16 : 0;  /* a bfloat16 model: 16 lanes, same ops and roundings */
    for (int i = 0; i < vec; i += 16) {
        _mm512_store_ps(cr + i, ps_round_bf16(_mm512_loadu_ps(c + i)));
        _mm512_store_ps(sr + i, ps_round_bf16(_mm512_loadu_ps(s + i)));
    }
#else
    const int vec = 0;
#endif
    for (int h = 0; h < H + Hkv; h++) {
        const int64_t src = row + (int64_t)h * d;
#ifdef __AVX512F__
        for (int i = 0; i < vec; i += 16) {
            const uint16_t *x = (const uint16_t *)qkv + src;
            const __m512 x1 = bf16x16_to_ps(x + i), x2 = bf16x16_to_ps(x + half + i);
            const __m512 ci = _mm512_load_ps(cr + i), si = _mm512_load_ps(sr + i);
            _mm512_storeu_ps(rot + i, ps_round_bf16(_mm512_sub_ps(ps_round_bf16(_mm512_mul_ps(x1, ci)),
                                                                  ps_round_bf16(_mm512_mul_ps(x2, si)))));
            _mm512_storeu_ps(rot + half + i, ps_round_bf16(_mm512_add_ps(ps_round_bf16(_mm512_mul_ps(x2, ci)),
                                                                         ps_round_bf16(_mm512_mul_ps(x1, si)))));
        }
#endif
        for (int i = vec; i < half; i++) {
            const float ci = round_to(c[i], act), si = round_to(s[i], act);
            const float x1 = load(qkv, src + i, in), x2 = load(qkv, src + half + i, in);
            rot[i] = round_to(round_to(x1 * ci, act) - round_to(x2 * si, act), act);
            rot[half + i] = round_to(round_to(x2 * ci, act) + round_to(x1 * si, act), act);
        }
        if (h < H) {
            store_row(q_out, (t * H + h) * (int64_t)d, rot, d, q_code);
            continue;
        }
        if (k_out)
            store_row(k_out, (t * Hkv + h - H) * (int64_t)d, rot, d, act);
        if (key_cache && cache_code <= 2)
            k_scale[slot * Hkv + h - H] = quantize_row(rot, d, cache_code,
                                                       (uint8_t *)key_cache + (slot * Hkv + h - H) * (int64_t)d);
        else if (key_cache)
            store_row(key_cache, (slot * Hkv + h - H) * (int64_t)d, rot, d, cache_code);
    }
    for (int h = 0; value_cache && h < Hkv; h++) {
        const int64_t src = row + (int64_t)(H + Hkv + h) * d;
        if (in == 4 && cache_code == 4) {  /* bfloat16 in, bfloat16 cache (act either way: exact) */
            memcpy((uint16_t *)value_cache + (slot * Hkv + h) * d, (const uint16_t *)qkv + src,
                   sizeof(uint16_t) * (size_t)d);
            continue;
        }
#ifdef __AVX512F__
        int i = 0;
        if (in == 4)  /* bfloat16 values are exact in either activation dtype */
            for (; i + 16 <= d; i += 16) _mm512_storeu_ps(rot + i, bf16x16_to_ps((const uint16_t *)qkv + src + i));
        for (; i < d; i++) rot[i] = round_to(load(qkv, src + i, in), act);
#else
        for (int i = 0; i < d; i++) rot[i] = round_to(load(qkv, src + i, in), act);
#endif
        if (cache_code <= 2)
            v_scale[slot * Hkv + h] = quantize_row(rot, d, cache_code, (uint8_t *)value_cache + (slot * Hkv + h) * d);
        else
            store_row(value_cache, (slot * Hkv + h) * d, rot, d, cache_code);
    }
}

/* Rotate-half RoPE of the first H + Hkv heads of each qkv row: queries to q_out [T, H, d], keys to
 * k_out [T, Hkv, d] (activation dtype `act`; NULL: not returned) and to key_cache at slot_mapping[t];
 * the V heads (qkv[:, (H + Hkv) d:]) to value_cache ([num_slots, Hkv, d] in cache_code 3 or 4; NULL
 * caches: not stored). cache_code 0/1/2 (int8, fp8 e4m3, fp8 e5m2): the caches hold 1-byte codes and
 * each row's scale goes to k_scale / v_scale [num_slots, Hkv] (quantize_row: kv_quant.quantize of the
 * row as the activation dtype holds it); float caches: scales unused (NULL). qkv: [T, row_stride] elements in code `in` (read as the activation dtype would
 * hold them); cos/sin: [max_positions, d/2] float32 tables. q_code: q_out's code, act, or 3 for float32
 * holding the activation dtype's values (what the one-call step's attention reads).
 * o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, each product rounded to the activation dtype. d <= 512. */
#define ROPE_CASE(IN, ACT, CC) \
    if (in == IN && act == ACT && cache_code == CC) { \
        rope_row(qkv, row, c, s, q_out, k_out, key_cache, value_cache, k_scale, v_scale, t, slot, H, Hkv, d, IN, ACT, \
                 CC, q_code); continue; }
__attribute__((optimize("fp-contract=off")))
static void rope_team(const void *qkv, int in, int64_t row_stride, const int64_t *positions, const float *cos_t,
                      const float *sin_t, void *q_out, void *k_out, void *key_cache, void *value_cache,
                      float *k_scale, float *v_scale, const int64_t *slot_mapping, int64_t T, int H, int Hkv, int d,
                      int act, int cache_code, int q_code) {
    const int half = d / 2;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        const int64_t row = t * row_stride, slot = slot_mapping[t];
        ROPE_CASE(4, 4, 4) ROPE_CASE(4, 4, 3) ROPE_CASE(3, 3, 3) ROPE_CASE(3, 3, 4)
        ROPE_CASE(4, 3, 3) ROPE_CASE(4, 3, 4) ROPE_CASE(3, 4, 4) ROPE_CASE(3, 4, 3)
        ROPE_CASE(4, 4, 0) ROPE_CASE(3, 3, 0) ROPE_CASE(4, 3, 0)
        rope_row(qkv, row, c, s, q_out, k_out, key_cache, value_cache, k_scale, v_scale, t, slot, H, Hkv, d, in, act,
                 cache_code, q_code);
    }
}

void kvs_rope_write_kv(const void *qkv, int in, int64_t row_stride, const int64_t *positions, const float *cos_t,
                       const float *sin_t, void *q_out, void *k_out, void *key_cache, void *value_cache,
                       float *k_scale, float *v_scale, const int64_t *slot_mapping, int64_t T, int H, int Hkv, int d,
                       int act, int cache_code, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (T >= 16)
    rope_team(qkv, in, row_stride, positions, cos_t, sin_t, q_out, k_out, key_cache, value_cache, k_scale, v_scale,
              slot_mapping, T, H, Hkv, d, act, cache_code, act);
}

static inline __attribute__((always_inline)) void rms_norm_row(
        void *x, const void *residual, int res_code, const void *w, int w_code, float eps, void *out, int out_code,
        int64_t r, int n, const int act) {
    float ss = 0.f;
    if (residual)
        for (int i = 0; i < n; i++)
            store(x, r + i, round_to(load(x, r + i, act) + load(residual, r + i, res_code), act), act);
    for (int i = 0; i < n; i++) { const float v = load(x, r + i, act); ss += v * v; }
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++)
        store(out, r + i, round_to(load(x, r + i, act) * inv * load(w, i, w_code), act), out_code);
}

#ifdef __AVX512F__
/* rms_norm_row for a bfloat16 model (x, residual and out bfloat16; w bfloat16 or float32) on 16 lanes: the
 * same roundings; the sum of squares in 16 partial sums (another float32 summation order). */
static inline void rms_norm_row_bf16(uint16_t *x, const uint16_t *residual, const void *w, int w_code, float eps,
                                     uint16_t *out, int n) {
    __m512 ss = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = bf16x16_to_ps(x + i);
        if (residual) {
            v = ps_round_bf16(_mm512_add_ps(v, bf16x16_to_ps(residual + i)));
            ps_store_bf16(x + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float tail = 0.f;
    for (int j = i; j < n; j++) {
        float v = bf16_to_float(x[j]);
        if (residual) { v = round_to(v + bf16_to_float(residual[j]), 4); x[j] = float_to_bf16(v); }
        tail += v * v;
    }
    const float inv = 1.f / sqrtf((_mm512_reduce_add_ps(ss) + tail) / (float)n + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 wv = w_code == 3 ? _mm512_loadu_ps((const float *)w + i) : bf16x16_to_ps((const uint16_t *)w + i);
        ps_store_bf16(out + i, _mm512_mul_ps(_mm512_mul_ps(bf16x16_to_ps(x + i), vinv), wv));
    }
    for (int j = i; j < n; j++) out[j] = float_to_bf16(bf16_to_float(x[j]) * inv * load(w, j, w_code));
}
#endif

/* RMSNorm (Zhang & Sennrich 2019) of each row of x [T, n] (activation dtype `act`), optionally after
 * x += residual (residual in res_code; x is updated in place, rounded to the activation dtype, as eager
 * `x + residual` would be): out = x / sqrt(mean(x^2) + eps) * w, in float32, rounded to the activation
 * dtype and stored in out_code (bfloat16 out of a float32 model = the eager result cast to bf16).
 * w: [n] in w_code (3 or 4). Never inlined: every caller (kvs_add_rms_norm, the module path's; the
 * one-call step's norms, one-row or not) runs this one compiled copy. -fassociative-math lets the compiler
 * vectorize the sum of squares differently in each inlined copy, and the one-row step's copy summed in
 * another order than kvs_add_rms_norm's: its logprobs differed from the module path's (adversarial
 * review). */
static __attribute__((noinline)) void rms_norm_rows(void *x, const void *residual, int res_code, const void *w,
                                                    int w_code, float eps, void *out, int out_code, int64_t t0,
                                                    int64_t t1, int n, int act) {
    for (int64_t t = t0; t < t1; t++) {
#ifdef __AVX512F__
        if (act == 4 && out_code == 4 && (!residual || res_code == 4)) {
            rms_norm_row_bf16((uint16_t *)x + t * n, residual ? (const uint16_t *)residual + t * n : NULL, w, w_code,
                              eps, (uint16_t *)out + t * n, n);
            continue;
        }
#endif
        if (act == 4) rms_norm_row(x, residual, res_code, w, w_code, eps, out, out_code, t * n, n, 4);
        else rms_norm_row(x, residual, res_code, w, w_code, eps, out, out_code, t * n, n, 3);
    }
}

static void rms_norm_team(void *x, const void *residual, int res_code, const void *w, int w_code, float eps,
                          void *out, int out_code, int64_t T, int n, int act) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) rms_norm_rows(x, residual, res_code, w, w_code, eps, out, out_code, t, t + 1, n, act);
}

void kvs_add_rms_norm(void *x, const void *residual, int res_code, const void *w, int w_code, float eps, void *out,
                      int out_code, int64_t T, int n, int act, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (T >= 16)
    rms_norm_team(x, residual, res_code, w, w_code, eps, out, out_code, T, n, act);
}

/* Elements [i0, i1) of row t. */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gu, const int in, void *out,
                                                               const int out_code, int64_t t, int I, int i0, int i1,
                                                               const int act) {
    const int64_t r = t * 2 * (int64_t)I;
    for (int i = i0; i < i1; i++) {
        float g = load(gu, r + i, in), u = load(gu, r + I + i, in);
        if (in != act) { g = round_to(g, act); u = round_to(u, act); }  /* in == act: already exact */
        const float e = exp_nonpos(-fabsf(g));  /* e^-|g|: sigmoid without overflow */
        const float sig = (g >= 0.f ? 1.f : e) / (1.f + e);
        store(out, t * (int64_t)I + i, round_to(round_to(g * sig, act) * u, act), out_code);
    }
}

#ifdef __AVX512F__
/* silu_mul_row of a bfloat16 model (bfloat16 in and out) on 16 lanes: the same operations and roundings */
static inline void silu_mul_row_bf16(const uint16_t *gu, uint16_t *out, int64_t t, int I, int i0, int i1) {
    const uint16_t *g_row = gu + t * 2 * (int64_t)I, *u_row = g_row + I;
    uint16_t *o = out + t * (int64_t)I;
    const __m512 one = _mm512_set1_ps(1.f);
    int i = i0;
    for (; i + 16 <= i1; i += 16) {
        const __m512 g = bf16x16_to_ps(g_row + i), u = bf16x16_to_ps(u_row + i);
        const __m512 e = exp_nonpos_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
        const __m512 silu = ps_round_bf16(_mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e))));
        ps_store_bf16(o + i, _mm512_mul_ps(silu, u));
    }
    if (i < i1) {  /* the rest one by one, as silu_mul_row */
        for (int j = i; j < i1; j++) {
            const float g = bf16_to_float(g_row[j]), u = bf16_to_float(u_row[j]);
            const float e = exp_nonpos(-fabsf(g));
            const float sig = (g >= 0.f ? 1.f : e) / (1.f + e);
            o[j] = float_to_bf16(round_to(g * sig, 4) * u);
        }
    }
}
#endif

/* SwiGLU's elementwise part: out[t, i] = silu(gu[t, i]) * gu[t, I + i], silu(g) = g * sigmoid(g) rounded
 * to the activation dtype before the product (as eager F.silu(gate) * up). gu: [T, 2I] in code `in`;
 * out: [T, I] in out_code (the activation dtype's result, cast). */
static void silu_mul_team(const void *gu, int in, void *out, int out_code, int64_t T, int I, int act) {
    /* fewer rows than threads (a decode step of one sequence): each row in as many pieces of whole
     * 16-element vectors, so no thread waits at the next barrier for one that did a whole row */
    const int nt = omp_get_num_threads(), P = T < nt ? nt : 1, piece = ((I + P - 1) / P + 15) / 16 * 16;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < T * P; item++) {  /* the dtypes as constants, so the row loop vectorizes */
        const int64_t t = item / P;
        const int i0 = (int)(item % P) * piece, i1 = i0 + piece < I ? i0 + piece : I;
        if (i0 >= i1) continue;
#ifdef __AVX512F__
        if (in == 4 && out_code == 4 && act == 4) { silu_mul_row_bf16(gu, out, t, I, i0, i1); continue; }
#endif
        if (in == 4 && out_code == 4 && act == 4) silu_mul_row(gu, 4, out, 4, t, I, i0, i1, 4);
        else if (in == 3 && out_code == 3 && act == 3) silu_mul_row(gu, 3, out, 3, t, I, i0, i1, 3);
        else if (act == 4) silu_mul_row(gu, in, out, out_code, t, I, i0, i1, 4);
        else silu_mul_row(gu, in, out, out_code, t, I, i0, i1, 3);
    }
}

void kvs_silu_mul(const void *gu, int in, void *out, int out_code, int64_t T, int I, int act, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (T >= 16)
    silu_mul_team(gu, in, out, out_code, T, I, act);
}

/* kvq_decode_attention on q [B, H, d] in `act` (3 or 4), out [B, H, d] stored in out_code: the
 * float32 kernel with exact casts around it (out = the float32 result rounded to act, then cast).
 * ks, vs: a 1-byte cache's scales [num_slots, Hkv] (NULL for float caches). */
void kvs_decode_attention(const void *q, const uint8_t *kc, const uint8_t *vc, const float *ks, const float *vs,
                          const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, void *out,
                          int out_code, int B, int H, int Hkv, int d, int bs, float scale, int cache_code, int act,
                          int num_threads) {
    const int64_t n = (int64_t)B * H * d;
    float *qf = act == 3 ? (float *)q : malloc(sizeof(float) * (size_t)n);
    float *of = out_code == 3 ? (float *)out : malloc(sizeof(float) * (size_t)n);
    if (act != 3)
        for (int64_t i = 0; i < n; i++) qf[i] = load(q, i, act);
    kvq_decode_attention(qf, kc, vc, ks, vs, block_tables, bt_stride, seq_lens, of, B, H, Hkv, d, bs, scale,
                         cache_code, num_threads, act == 4);
    if (out_code != 3)
        for (int64_t i = 0; i < n; i++) store(out, i, round_to(of[i], act), out_code);
    else if (act != 3)
        for (int64_t i = 0; i < n; i++) of[i] = round_to(of[i], act);
    if (act != 3) free(qf);
    if (out_code != 3) free(of);
}

/* The matmul of the one-call step: kind 0 = int4 tiles (int4_gemm.c; x and y bfloat16), 1 = dense float32
 * weights (dense_gemv.c; x and y float32), 2 = int8 rows with bfloat16 scales (dense_gemv.c; x and y
 * bfloat16). */
static void linear_team(int kind, const void *x, int64_t M, int K, const void *w, const void *scales, int N, void *y,
                        float *xsum) {
    if (kind == 0) kvs_int4_linear_team((const uint16_t *)x, M, K, (const uint16_t *)w, N, y, 4, xsum);
    else if (kind == 1) kvs_dense_linear_team(x, M, K, w, 3, NULL, N, y);
    else kvs_dense_linear_team(x, M, K, w, 0, (const uint16_t *)scales, N, y);
}

/* One decode step of a Llama model whose four matrices per layer are int4 tiles (int4_gemm.c, kind 0),
 * dense float32 matrices of a float32 model (dense_gemv.c, kind 1) or int8 rows with a scale each
 * (dense_gemv.c, kind 2), inside a single parallel region: the
 * same calls, in the same order and with the same roundings, as
 * kvserve.models.llama_decode.LlamaDecodePlan's loop (norm, QKV, RoPE + KV write, attention, O, norm,
 * gate/up, SiLU, down), with barriers between them instead of a Python call, a fork and a join each.
 *
 * x: [B, n] residual stream (act 3 or 4), updated in place (one row: left as it is, each thread updating a
 * copy of its own); NULL: the rows input_ids [B] of embed [vocab, n]
 * (act), gathered here into a buffer of its own (returns -1, running nothing, if an id is outside
 * [0, vocab)). out: NULL for a step with lm_head given, which needs only the logits or token ids.
 *
 * layers: [L, 14] pointers per layer: QKV, O, gate/up, down matrices; input and post-attention norm
 * weights (norm_code 3 or 4); key and value caches ([num_slots, Hkv, d] in cache_code 0-4); for 1-byte
 * caches (codes 0-2) their K and V scales [num_slots, Hkv] (else 0); for int8 matrices their row scales
 * (bfloat16 [N]; else 0), in the matrices' order. out: [B, n] final-norm hidden states (act). Matmul
 * inputs and outputs are bfloat16 for int4 and int8, as Int4Linear and Int8Linear take and return them,
 * and float32 for dense ones (act 3).
 *
 * lm_head (NULL: none): the LM head, a [V, n] matrix of kind lm_kind (as kind above; lm_scales: its row
 * scales for int8, else NULL), multiplied with out in the same parallel region (no fork and join, no
 * return to Python between the last layer and the logits) into logits_out [B, V] (bfloat16, float32 for
 * a dense head; NULL: a buffer of its own), then, unless token_ids is NULL (the caller samples from the
 * logits), token_ids[b] = kvs_argmax_rows of row b of the logits, or where temperature (NULL: none) has
 * temperature[b] > 0 the draw of kvs_sample_rows with temperature[b], top_k[b], top_p[b], min_p[b] and
 * u[b] (-1: the row holds a NaN or only -inf): the same kernels, with the same inputs, as the LM head
 * module and the sampler run. A packed head (int4, int8) of a float32 model (act 3) takes out rounded to
 * bfloat16, as Int4Linear and Int8Linear cast their input; a dense head needs act 3. out may be NULL
 * only with lm_head given. */
void kvs_argmax_rows(const void *x, int code, int64_t rows, int64_t n, int64_t *out);
static int64_t sample_one(const void *x, int code, int64_t n, float t, int64_t top_k, float top_p, float min_p,
                          double u);

int kvs_llama_decode(const int64_t *layers, int L, int kind, int norm_code, void *x, const void *embed,
                     int64_t vocab, const int64_t *input_ids, const int64_t *positions,
                     const float *cos_t, const float *sin_t, const int64_t *slot_mapping,
                     const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                     const void *final_norm, void *out, int B, int n, int H, int Hkv, int d, int I, float eps,
                     float scale, int bs, int act, int cache_code, int num_threads, const void *lm_head,
                     int lm_kind, const void *lm_scales, int V, int64_t *token_ids, void *logits_out,
                     const float *temperature, const int32_t *top_k, const float *top_p, const float *min_p,
                     const double *u) {
    const int W = (H + 2 * Hkv) * d, Kmax = n > I ? (n > H * d ? n : H * d) : (I > H * d ? I : H * d);
    const int mc = kind == 1 ? 3 : 4;  /* the matmuls' input and output dtype */
    const size_t es = mc == 3 ? sizeof(float) : sizeof(uint16_t);
    const size_t xs = (act == 3 ? sizeof(float) : sizeof(uint16_t)) * (size_t)n;  /* bytes of a row of x */
    void *x_own = NULL, *out_own = NULL;
    if (!x) {
        for (int b = 0; b < B; b++)
            if (input_ids[b] < 0 || input_ids[b] >= vocab) return -1;
        x = x_own = malloc(xs * (size_t)B);
        for (int b = 0; b < B; b++) memcpy((char *)x + xs * b, (const char *)embed + xs * input_ids[b], xs);
    }
    if (!out) out = out_own = malloc(xs * (size_t)B);
    const int64_t chunk = kvq_attention_chunk(seq_lens, B, bs, num_threads);
    int64_t *first = malloc(sizeof(int64_t) * (B + 1));
    const int64_t items = kvq_attention_items(seq_lens, B, chunk, first);
    const int64_t hd = (int64_t)B * H * d;
    float *part = malloc(sizeof(float) * (size_t)(items * H * (d + 2)));
    float *qf = malloc(sizeof(float) * (size_t)(2 * hd)), *of = qf + hd;
    float *xsum = malloc(sizeof(float) * (size_t)kvs_int4_scratch_floats(B, Kmax));
    char *h = malloc(es * (size_t)B * (size_t)(n + W + H * d + n + 2 * I + I + n));
    char *qkv = h + es * B * n, *o = qkv + es * B * W, *a = o + es * hd, *gu = a + es * B * n;
    char *g = gu + es * B * 2 * I, *delta = g + es * B * I;
    void *o_in = mc == 3 ? (void *)of : (void *)o;  /* float32 attention output: the O matmul's input as is */
    const int lm_code = lm_kind == 1 ? 3 : 4;  /* the head's output dtype */
    const size_t les = lm_code == 3 ? sizeof(float) : sizeof(uint16_t);
    void *logits = lm_head ? (logits_out ? logits_out : malloc(les * (size_t)B * (size_t)V)) : NULL;
    /* a packed head of a float32 model: its bfloat16 input */
    uint16_t *lm_in = lm_head && lm_code == 4 && act == 3 ? malloc(sizeof(uint16_t) * (size_t)B * n) : NULL;
    /* a one-row step: each thread's residual row and matmul input, 64-byte aligned (below) */
    const size_t own_bytes = (xs + es * (size_t)n + 63) / 64 * 64;
    char *rows_own = B == 1 ? aligned_alloc(64, own_bytes * (size_t)(num_threads > 0 ? num_threads : 1)) : NULL;
#pragma omp parallel num_threads(num_threads)
    {
        /* A one-row step: every thread keeps its own copy of the residual stream and computes a layer's two
         * RMSNorms itself, into its own matmul input (the same values as one shared copy: the same
         * arithmetic on the same inputs), instead of one thread computing them while the others wait at
         * two barriers a layer. */
        void *xr = x, *hr = h, *own = NULL;
        if (rows_own) {
            own = rows_own + own_bytes * (size_t)omp_get_thread_num();
            memcpy(own, x, xs);
            xr = own;
            hr = (char *)own + xs;
        }
        for (int l = 0; l < L; l++) {
            const int64_t *p = layers + 14 * l;
            const void *w_qkv = (const void *)p[0], *w_o = (const void *)p[1];
            const void *w_gu = (const void *)p[2], *w_down = (const void *)p[3];
            void *kc = (void *)p[6], *vc = (void *)p[7];
            float *ks = (float *)p[8], *vs = (float *)p[9];
            if (own) rms_norm_rows(xr, l ? delta : NULL, mc, (const void *)p[4], norm_code, eps, hr, mc, 0, 1, n, act);
            else rms_norm_team(x, l ? delta : NULL, mc, (const void *)p[4], norm_code, eps, h, mc, B, n, act);
            linear_team(kind, hr, B, n, w_qkv, (const void *)p[10], W, qkv, xsum);
            /* the queries as float32 holding the activation dtype's values, straight from RoPE */
            rope_team(qkv, mc, W, positions, cos_t, sin_t, qf, NULL, kc, vc, ks, vs, slot_mapping, B, H, Hkv, d, act,
                      cache_code, 3);
            /* bfloat16 matmuls: the merge also stores each output row as bfloat16 (= the float32 result rounded
             * to act, then to bfloat16: one rounding either way), saving a pass and a barrier */
            kvq_decode_attention_team(qf, kc, vc, ks, vs, block_tables, bt_stride, seq_lens, of, B, H, Hkv, d, bs,
                                      scale, cache_code, chunk, first, part, act == 4, mc == 4 ? (uint16_t *)o : NULL);
            linear_team(kind, o_in, B, H * d, w_o, (const void *)p[11], n, a, xsum);
            if (own) rms_norm_rows(xr, a, mc, (const void *)p[5], norm_code, eps, hr, mc, 0, 1, n, act);
            else rms_norm_team(x, a, mc, (const void *)p[5], norm_code, eps, h, mc, B, n, act);
            linear_team(kind, hr, B, n, w_gu, (const void *)p[12], 2 * I, gu, xsum);
            silu_mul_team(gu, mc, g, mc, B, I, act);
            linear_team(kind, g, B, I, w_down, (const void *)p[13], n, delta, xsum);
        }
        rms_norm_team(xr, delta, mc, final_norm, norm_code, eps, out, act, B, n, act);  /* ends with a barrier */
        if (lm_head) {
            if (lm_in) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < (int64_t)B * n; i++) lm_in[i] = float_to_bf16(((const float *)out)[i]);
            }
            linear_team(lm_kind, lm_in ? (const void *)lm_in : out, B, n, lm_head, lm_scales, V, logits,
                        xsum);  /* ends with a barrier */
            if (token_ids) {
#pragma omp for schedule(static)
                for (int b = 0; b < B; b++) {
                    const char *row = (const char *)logits + les * (size_t)b * V;
                    if (temperature && temperature[b] > 0.f)
                        token_ids[b] = sample_one(row, lm_code, V, temperature[b], top_k[b], top_p[b], min_p[b],
                                                  u[b]);
                    else
                        kvs_argmax_rows(row, lm_code, 1, V, token_ids + b);
                }
            }
        }
    }
    if (logits != logits_out) free(logits);
    free(rows_own);
    free(lm_in);
    free(x_own);
    free(out_own);
    free(h);
    free(xsum);
    free(qf);
    free(part);
    free(first);
    return 0;
}

/* out[r] = the index torch.max(x[r], dim=-1) returns, for each row of x [rows, n] (code 3 float32, 4
 * bfloat16; rows n elements apart): the first NaN if the row holds one, else the first maximum (the
 * lowest index on ties; 0 for a row of -inf). The greedy sampler's argmax: torch's max(dim=-1) took
 * ~90 µs for one 49,152-entry row here (float32 or bfloat16, 1 or 2 threads), 2-3 % of a decode step.
 * Each lane keeps the first index of its own maximum (a strictly greater value replaces it); across
 * lanes the lowest index of the largest value wins; the tail and any NaN are scanned one by one. */
void kvs_argmax_rows(const void *x, int code, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xf = (const float *)x + r * n;
        const uint16_t *xh = (const uint16_t *)x + r * n;
        int64_t i = 0, best = 0;
        float bv = -INFINITY;
        int nan = 0;
#ifdef __AVX512F__
        if (n >= 16) {
            __m512 mv = _mm512_set1_ps(-INFINITY);
            __m512i mi = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                         13, 14, 15);
            for (; i + 16 <= n; i += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
                const __m512 v = code == 3 ? _mm512_loadu_ps(xf + i) : bf16x16_to_ps(xh + i);
                if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) { nan = 1; break; }
                const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);
                mv = _mm512_mask_mov_ps(mv, gt, v);
                mi = _mm512_mask_mov_epi32(mi, gt, idx);
            }
            bv = _mm512_reduce_max_ps(mv);
            best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(mv, _mm512_set1_ps(bv), _CMP_EQ_OQ), mi);
        }
#elif defined(__AVX2__)  /* the same on 8 lanes: one 49,152-entry bfloat16 row 64 -> 14 µs on Zen 2 */
        if (n >= 8) {
            __m256 mv = _mm256_set1_ps(-INFINITY);
            __m256i mi = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (; i + 8 <= n; i += 8, idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8))) {
                const __m256 v = code == 3 ? _mm256_loadu_ps(xf + i) : _mm256_castsi256_ps(_mm256_slli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xh + i))), 16));
                if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) { nan = 1; break; }
                const __m256 gt = _mm256_cmp_ps(v, mv, _CMP_GT_OQ);
                mv = _mm256_blendv_ps(mv, v, gt);
                mi = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(mi), _mm256_castsi256_ps(idx), gt));
            }
            float m8[8];
            int32_t i8[8];
            _mm256_storeu_ps(m8, mv);
            _mm256_storeu_si256((__m256i *)i8, mi);
            bv = m8[0];
            for (int l = 1; l < 8; l++) bv = m8[l] > bv ? m8[l] : bv;
            best = INT64_MAX;
            for (int l = 0; l < 8; l++)
                if (m8[l] == bv && i8[l] < best) best = i8[l];
        }
#endif
        if (nan) i = 0;  /* rescan for the first NaN */
        for (; i < n; i++) {
            const float v = code == 3 ? xf[i] : bf16_to_float(xh[i]);
            if (v != v) { best = i; break; }
            if (!nan && v > bv) { bv = v; best = i; }
        }
        out[r] = best;
    }
}

/* Softmax sampling by inverse CDF for count rows of logits x (code 3 float32, 4 bfloat16; n entries a row;
 * row i of the call is row row_ids[i] of x): the sampler's temperature / top-k / top-p / min-p path
 * (kvserve/engine/sampler.py: sampling_probs, then sample_from_probs) without its PyTorch ops on
 * [rows, vocab] tensors (temperature alone: ~0.5 ms cold for one 49,152-token row, a tenth of a SmolLM2
 * decode step; top-k 40 on bfloat16 logits, whose ties at the k-th value sent it to a full sort: ~6.5 ms).
 *
 * Row i: z = x / temperature[i] (an IEEE division, as torch's), clamped to FLT_MAX (torch's clamp_);
 * w = e^(z - max z) (exp_nonpos). In the order (z descending, id ascending), top_k[i] > 0 keeps the first
 * top_k[i] tokens and top_p[i] < 1 the first of those whose mass before them (w over the sum of w of the
 * top-k set, or of the whole row without top-k) is below top_p[i] (the first token always) — as
 * sampling_probs orders and cuts them, with its float32 masses (sample_cut). Kept tokens of w < min_p[i]
 * get w = 0 (w / sum w < min_p × the largest kept probability, 1 / sum w; min_p 0: off). out[i] = the first token whose float64 running sum of w (in id
 * order) exceeds u[i] × sum w, found as sample_from_probs finds it: the first block of KVS_CDF_BLOCK
 * tokens whose cumulative float64 block sums exceed the target, then the running sum inside it, the
 * result clamped to the block's first and last token of w > 0 (so a token of probability 0 is never
 * drawn). The probabilities are not divided by their sum and its exp is not torch's: the same draw up
 * to rounding. out[i] = -1 for a row that holds a NaN or only -inf, or where memory ran out (the
 * caller's PyTorch path decides those). Rows run in parallel. */
#define KVS_CDF_BLOCK 256

static inline float sample_value(const void *x, int code, int64_t i) {
    return code == 3 ? ((const float *)x)[i] : bf16_to_float(((const uint16_t *)x)[i]);
}

static inline float sample_z(const void *x, int code, int64_t i, float t) {
    const float z = sample_value(x, code, i) / t;
    return z > FLT_MAX ? FLT_MAX : z;
}

#ifdef __AVX2__
/* sample_weights's 8 lanes from the values v of tokens i .. i + 7 */
static inline __m256 sample_weights8(__m256 v, int64_t i, float t, float m, float min_p, float vcut, int64_t icut,
                                     __m256 *zout) {
    const __m256 z = _mm256_min_ps(t == 1.f ? v : _mm256_div_ps(v, _mm256_set1_ps(t)), _mm256_set1_ps(FLT_MAX));
    const __m256 we = exp_nonpos_avx2(_mm256_sub_ps(z, _mm256_set1_ps(m)));
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int32_t)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i ic = _mm256_set1_epi32(icut > INT32_MAX ? INT32_MAX : (int32_t)icut);
    const __m256 vc = _mm256_set1_ps(vcut);
    const __m256 in_id = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, ic));  /* id > icut */
    const __m256 kept = _mm256_or_ps(_mm256_cmp_ps(z, vc, _CMP_GT_OQ),
                                     _mm256_andnot_ps(in_id, _mm256_cmp_ps(z, vc, _CMP_EQ_OQ)));
    *zout = z;
    return _mm256_and_ps(_mm256_and_ps(we, kept), _mm256_cmp_ps(we, _mm256_set1_ps(min_p), _CMP_NLT_UQ));
}
#endif

/* w[j] for tokens b0 + j < e: e^(z - m), 0 below min_p and outside the kept set (z > vcut, or z == vcut and
 * id <= icut); z[j] = z where z is not NULL. Every token takes the same arithmetic (on AVX2 the last
 * partial group of 8 too, padded), so a token's w is the same in every pass and w never decreases as z
 * grows between two tokens of one row. */
static inline void sample_weights(const void *x, int code, int64_t b0, int64_t e, float t, float m, float min_p,
                                  float vcut, int64_t icut, float *w, float *z) {
    int64_t i = b0;
#ifdef __AVX2__
    __m256 z8;
    for (; i + 8 <= e; i += 8) {
        const __m256 v = code == 3 ? _mm256_loadu_ps((const float *)x + i) : bf16x8((const uint16_t *)x + i);
        _mm256_storeu_ps(w + (i - b0), sample_weights8(v, i, t, m, min_p, vcut, icut, &z8));
        if (z) _mm256_storeu_ps(z + (i - b0), z8);
    }
    if (i < e) {
        float v8[8], w8[8], zz[8];
        for (int l = 0; l < 8; l++) v8[l] = i + l < e ? sample_value(x, code, i + l) : -INFINITY;
        _mm256_storeu_ps(w8, sample_weights8(_mm256_loadu_ps(v8), i, t, m, min_p, vcut, icut, &z8));
        _mm256_storeu_ps(zz, z8);
        for (int l = 0; i + l < e; l++) {
            w[i + l - b0] = w8[l];
            if (z) z[i + l - b0] = zz[l];
        }
        i = e;
    }
#endif
    for (; i < e; i++) {
        const float zi = sample_z(x, code, i, t);
        const float we = exp_nonpos(zi - m);
        w[i - b0] = we < min_p || !(zi > vcut || (zi == vcut && i <= icut)) ? 0.f : we;
        if (z) z[i - b0] = zi;
    }
}

typedef struct { float z; int32_t id; } sample_cand;

static int sample_cand_order(const void *a, const void *b) {  /* z descending, id ascending */
    const sample_cand *p = a, *q = b;
    if (p->z != q->z) return p->z > q->z ? -1 : 1;
    return (p->id > q->id) - (p->id < q->id);
}

/* A key whose ascending order is z descending (z not NaN; -0 and +0 the same key, as they compare equal) */
static inline uint32_t sample_cand_key(float z) {
    uint32_t b;
    memcpy(&b, &z, sizeof b);
    b &= 0u - (uint32_t)((b & 0x7fffffffu) != 0);  /* -0 to +0 in bits: -fno-signed-zeros may fold a float test */
    return ~(b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u));  /* no branch: signs mix in a broad row */
}

/* Sort c[0 .. nc) into (z descending, id ascending) order, given it holds ids ascending: a stable LSD radix
 * sort on sample_cand_key, three passes of 11 bits (a pass whose digit is the same in every key is
 * skipped), through tmp (nc entries). qsort's comparator calls took ~4-5 ms for a broad nucleus (top-p 0.9
 * of 49,152 random normal logits, ~30,000 candidates); the passes are linear in nc. Short lists go to
 * qsort, whose cost there is below the histograms'. */
static void sample_cand_sort(sample_cand *c, sample_cand *tmp, int64_t nc) {
    if (nc < 512) {
        qsort(c, (size_t)nc, sizeof *c, sample_cand_order);
        return;
    }
    enum { BITS = 11, BUCKETS = 1 << BITS, PASSES = 3 };
    uint32_t hist[PASSES][BUCKETS];
    memset(hist, 0, sizeof hist);
    for (int64_t j = 0; j < nc; j++) {
        const uint32_t key = sample_cand_key(c[j].z);
        for (int d = 0; d < PASSES; d++) hist[d][(key >> (BITS * d)) & (BUCKETS - 1)]++;
    }
    sample_cand *src = c, *dst = tmp;
    for (int d = 0; d < PASSES; d++) {
        uint32_t *h = hist[d], sum = 0;
        if (h[(sample_cand_key(c[0].z) >> (BITS * d)) & (BUCKETS - 1)] == (uint32_t)nc) continue;
        for (int b = 0; b < BUCKETS; b++) {  /* counts -> first positions */
            const uint32_t cnt = h[b];
            h[b] = sum;
            sum += cnt;
        }
        for (int64_t j = 0; j < nc; j++) dst[h[(sample_cand_key(src[j].z) >> (BITS * d)) & (BUCKETS - 1)]++] = src[j];
        sample_cand *t = src;
        src = dst;
        dst = t;
    }
    if (src != c) memcpy(c, src, sizeof *c * (size_t)nc);
}

/* The kept set of top-k (k > 0) and top-p (top_p < 1): its last token in (z descending, id ascending)
 * order as (*vcut, *icut). Candidates are the tokens of z >= max z - 1.5, then - 3, ... - 17, - 88 and
 * then all, until they settle it: the top-k set lies among them, or the top-p walk stops inside them (a
 * threshold on z takes every token of a tie or none). The top-p masses follow sampling_probs's float32
 * arithmetic: p = w / total in float32, the running sum accumulated in float64 and rounded to float32 (as
 * torch's CPU cumsum), the mass before a token that sum minus its p in float32; so a tie that sits
 * exactly on the top-p edge is cut where the PyTorch path cuts it. Returns 0, or -1 where memory ran out. */
static int sample_cut(const void *x, int code, int64_t n, float t, float m, int64_t k, float top_p, float *vcut,
                      int64_t *icut) {
    if (k <= 0 || k > n) k = n;
    float *w = malloc(sizeof(float) * (size_t)n), *z = malloc(sizeof(float) * (size_t)n);
    sample_cand *c = malloc(sizeof(sample_cand) * (size_t)n), *tmp = malloc(sizeof(sample_cand) * (size_t)n);
    if (!w || !z || !c || !tmp) {
        free(w);
        free(z);
        free(c);
        free(tmp);
        return -1;
    }
    double total_all = 0.0;  /* top-p's normaliser without top-k: every token's w */
    for (int64_t b0 = 0; b0 < n; b0 += KVS_CDF_BLOCK) {
        const int64_t e = b0 + KVS_CDF_BLOCK < n ? b0 + KVS_CDF_BLOCK : n;
        sample_weights(x, code, b0, e, t, m, 0.f, -INFINITY, INT64_MAX, w + b0, z + b0);
        for (int64_t j = b0; j < e; j++) total_all += (double)w[j];
    }
    static const float drops[] = {1.5f, 3.f, 4.5f, 6.f, 8.f, 10.f, 13.f, 17.f, 88.f, INFINITY};
    enum { ROUNDS = sizeof drops / sizeof drops[0] };
    /* After round 0 (a peaked row or a small top-k settles there, in one scan), the rounds worth sorting
     * follow from each round's count and (float32) mass, taken in one pass: top-k needs its k tokens among
     * the candidates, top-p alone a candidate mass above top_p (with a margin far above rounding), and a
     * round of no more tokens than the last one gathered walks the same way. Skipping any round is correct,
     * as each round's sorted set begins with the one before it, so a later round cuts where an earlier one
     * would; the skips save scans of the row (~25-30 us each; a peaked row's nucleus took ~5) and sorts. */
    float cnt[ROUNDS - 1] = {0}, mass[ROUNDS - 1] = {0}, scanned = -1.f;  /* scanned: the last round's count */
    int bands = 0;
    for (int round = 0; round < ROUNDS; round++) {
        const int final = round == ROUNDS - 1;
        if (round > 0 && !final) {
            if (!bands) {
                for (int64_t i = 0; i < n; i++) {
                    const float d = m - z[i];
                    for (int r = 0; r < ROUNDS - 1; r++) {
                        const int in = d <= drops[r];
                        cnt[r] += (float)in;
                        mass[r] += in ? w[i] : 0.f;
                    }
                }
                bands = 1;
            }
            if (cnt[round] == scanned) continue;
            if (k < n ? cnt[round] < (float)k : (double)mass[round] < (double)top_p * total_all * (1.0 - 1e-3))
                continue;
        }
        int64_t nc = 0;
        const float lo = final ? -INFINITY : -drops[round];
        for (int64_t i = 0; i < n; i++) {  /* branchless: a broad row's candidates are a coin toss */
            c[nc] = (sample_cand){z[i], (int32_t)i};
            nc += z[i] - m >= lo;
        }
        scanned = (float)nc;
        if (!final && k < n && nc < k) continue;  /* top-k needs its k tokens (and their mass) among them */
        sample_cand_sort(c, tmp, nc);
        const int64_t kk = k < nc ? k : nc;
        int64_t last = kk - 1;
        int settled = kk == k || final;
        if (top_p < 1.f) {
            double total = total_all;
            if (k < n) {  /* with top-k, top-p's normaliser is the top-k set's mass */
                total = 0.0;
                for (int64_t j = 0; j < kk; j++) total += (double)w[c[j].id];
            }
            const float total_f = (float)total;
            double run = 0.0;
            for (int64_t j = 0; j < kk; j++) {
                const float pj = w[c[j].id] / total_f;
                run += (double)pj;
                if (j > 0 && (float)run - pj >= top_p) {
                    last = j - 1;
                    settled = 1;
                    break;
                }
            }
        }
        if (!settled) continue;
        *vcut = c[last].z;
        *icut = c[last].id;
        break;
    }
    free(w);
    free(z);
    free(c);
    free(tmp);
    return 0;
}

/* One row's draw (kvs_sample_rows); exclude >= 0: that token's w is zeroed after the cut and min-p (the
 * draw is from the rest of the kept set), and *pq (pq not NULL) = its probability before that, w over the
 * kept mass including it (NaN where the row returns -1 before its weights). */
static int64_t sample_row(const void *x, int code, int64_t n, float t, int64_t top_k, float top_p, float min_p,
                          double u, double *cdf, int64_t exclude, double *pq) {
    if (pq) *pq = NAN;
    /* max z = the clamped (max x) / t: a division by t > 0 and the clamp keep the order */
    float mx = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX2__
    const int64_t n8 = n & ~(int64_t)7;
    __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    for (; i < n8; i += 8) {
        const __m256 v = code == 3 ? _mm256_loadu_ps((const float *)x + i) : bf16x8((const uint16_t *)x + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(v, vmax);  /* a NaN v leaves vmax as it was; vnan has it */
    }
    float m8[8];
    _mm256_storeu_ps(m8, vmax);
    for (int l = 0; l < 8; l++) mx = m8[l] > mx ? m8[l] : mx;
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; i < n; i++) {
        const float v = sample_value(x, code, i);
        nan |= v != v;
        mx = v > mx ? v : mx;
    }
    if (nan || mx == -INFINITY) return -1;
    const float m = mx / t > FLT_MAX ? FLT_MAX : mx / t;
    float vcut = -INFINITY;
    int64_t icut = INT64_MAX;
    if (((top_k > 0 && top_k < n) || top_p < 1.f) && sample_cut(x, code, n, t, m, top_k, top_p, &vcut, &icut))
        return -1;
    const int64_t nb = (n + KVS_CDF_BLOCK - 1) / KVS_CDF_BLOCK;
    float w[KVS_CDF_BLOCK], wx = 0.f;  /* wx: the excluded token's w */
    double c = 0.0;
    for (int64_t k = 0; k < nb; k++) {
        const int64_t b0 = k * KVS_CDF_BLOCK, e = b0 + KVS_CDF_BLOCK < n ? b0 + KVS_CDF_BLOCK : n;
        sample_weights(x, code, b0, e, t, m, min_p, vcut, icut, w, NULL);
        if (exclude >= b0 && exclude < e) {
            wx = w[exclude - b0];
            w[exclude - b0] = 0.f;
        }
        double s = 0.0;
        for (int64_t j = 0; j < e - b0; j++) s += (double)w[j];  /* vectorized (-fassociative-math) */
        cdf[k] = c += s;
    }
    if (pq) *pq = (double)wx / (cdf[nb - 1] + (double)wx);  /* the largest kept w is 1: never 0 / 0 */
    if (!(cdf[nb - 1] > 0.0)) return -1;  /* only the excluded token was kept */
    const double target = u * cdf[nb - 1];
    int64_t k = 0;
    while (k < nb - 1 && !(cdf[k] > target)) k++;
    double run = k ? cdf[k - 1] : 0.0;
    const int64_t b0 = k * KVS_CDF_BLOCK, e = b0 + KVS_CDF_BLOCK < n ? b0 + KVS_CDF_BLOCK : n;
    sample_weights(x, code, b0, e, t, m, min_p, vcut, icut, w, NULL);
    if (exclude >= b0 && exclude < e) w[exclude - b0] = 0.f;
    int64_t pos = KVS_CDF_BLOCK, first = -1, last = -1;
    for (int64_t j = 0; j < e - b0; j++) {
        if (w[j] == 0.f) continue;
        if (first < 0) first = j;
        last = j;
        run += (double)w[j];
        if (pos == KVS_CDF_BLOCK && run > target) pos = j;
    }
    if (first >= 0) pos = pos > last ? last : pos < first ? first : pos;
    else pos = KVS_CDF_BLOCK - 1;
    return b0 + pos < n - 1 ? b0 + pos : n - 1;
}

static int64_t sample_one_ex(const void *x, int code, int64_t n, float t, int64_t top_k, float top_p, float min_p,
                             double u, int64_t exclude, double *pq) {
    double *cdf = malloc(sizeof(double) * (size_t)((n + KVS_CDF_BLOCK - 1) / KVS_CDF_BLOCK));
    if (!cdf && pq) *pq = NAN;
    const int64_t tok = cdf ? sample_row(x, code, n, t, top_k, top_p, min_p, u, cdf, exclude, pq) : -1;
    free(cdf);
    return tok;
}

static int64_t sample_one(const void *x, int code, int64_t n, float t, int64_t top_k, float top_p, float min_p,
                          double u) {
    return sample_one_ex(x, code, n, t, top_k, top_p, min_p, u, -1, NULL);
}

void kvs_sample_rows(const void *x, int code, int64_t n, const int64_t *row_ids, int64_t count,
                     const float *temperature, const int32_t *top_k, const float *top_p, const float *min_p,
                     const double *u, int64_t *out) {
    const size_t es = code == 3 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
    for (int64_t i = 0; i < count; i++)
        out[i] = sample_one((const char *)x + es * (size_t)row_ids[i] * (size_t)n, code, n, temperature[i], top_k[i],
                            top_p[i], min_p[i], u[i]);
}

/* kvs_sample_rows for speculative decoding's rejection sampling (kvserve/spec_decode/verify.py), each row
 * with a proposed token exclude[i] (-1: none; ids outside [0, n) are none): pq[i] = that token's
 * probability under the row's settings (w over the kept mass, float64; NaN where out[i] would be -1 for
 * the row itself), and out[i] the draw of the same row with it taken out of the kept set (the residual
 * max(0, p - onehot(exclude)) renormalised; -1, as kvs_sample_rows's, also where the kept set held only
 * that token). One pass over each row gives both. */
void kvs_sample_rows_excluding(const void *x, int code, int64_t n, const int64_t *row_ids, int64_t count,
                               const float *temperature, const int32_t *top_k, const float *top_p,
                               const float *min_p, const double *u, const int64_t *exclude, int64_t *out,
                               double *pq) {
    const size_t es = code == 3 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
    for (int64_t i = 0; i < count; i++) {
        const int64_t ex = exclude[i] >= 0 && exclude[i] < n ? exclude[i] : -1;
        out[i] = sample_one_ex((const char *)x + es * (size_t)row_ids[i] * (size_t)n, code, n, temperature[i],
                               top_k[i], top_p[i], min_p[i], u[i], ex, &pq[i]);
    }
}

/* Ask for the bytes_each bytes from each of the n addresses into the caches (prefetcht0; a prefetch never
 * faults, so a stale or freed address costs only the request). For the decode plan's pointer check: after
 * a step has streamed the weights, the ~180 weight tensors' Python objects, TensorImpls and StorageImpls
 * it reads are cold, and the check took 0.13-0.16 ms of dependent cache misses; prefetched right after
 * the step, while Python does the step's bookkeeping, 0.05 ms (SmolLM2 int4, 128 tokens, 5 alternations). */
void kvs_prefetch_lines(const int64_t *addrs, int64_t n, int64_t bytes_each) {
    for (int64_t i = 0; i < n; i++) {
        const char *p = (const char *)(uintptr_t)addrs[i];
        for (int64_t o = 0; o < bytes_each; o += 64) __builtin_prefetch(p + o, 0, 3);
    }
}

/* Logprobs of the raw logits for the sampler (kvserve/engine/sampler.py: token_logprobs) without its
 * PyTorch passes over [rows, vocab] tensors (log_softmax, a comparison and a sum for the rank, topk and two
 * sorts: ~0.3-0.4 ms for one 49,152-token row, a tenth of a SmolLM2 decode step). x: logits (code 3
 * float32, 4 bfloat16; n entries a row); row i of the call is row row_ids[i] of x, its token token_ids[i].
 * With m the row's largest value and lse = m + log(Σ_j e^(x_j - m)) (exp_nonpos, summed and logged in
 * float64): lp[i] = (x_t - m) - (lse - m), as log_softmax forms it;
 * rank[i] = 1 + the number of tokens whose logit is strictly greater than x_t (the logprobs' order is the
 * logits' order; comparing logits also keeps apart two logits whose logprobs round to one float); and
 * the k (<= 64) tokens of largest logit, ties to the lower id, in that order (logit descending, id
 * ascending): top_ids[i·k + j], top_lp[i·k + j] as lp. status[i] = 0, or 1 for a row that holds a NaN or
 * +inf, or only -inf (its outputs unset: the caller's PyTorch path decides those). Rows run in parallel. */
static int token_logprobs_row(const void *x, int code, int64_t n, int64_t t, int k, float *lp, int64_t *rank,
                              int64_t *top_ids, float *top_lp) {
    float tv[64];  /* the k best so far: (value descending, id ascending) */
    int64_t ti[64];
    int have = 0;
    float m = -INFINITY;
    const float xt = sample_value(x, code, t);
    int64_t greater = 0;
    for (int64_t i = 0; i < n; i++) {
        float v;
        int64_t i8 = 0;
#ifdef __AVX2__
        /* 8 at a time while none of them is a candidate for the top k, greater than x_t or not a number */
        if (have == k && i + 8 <= n) {
            const __m256 thr = _mm256_set1_ps(k ? tv[k - 1] : INFINITY), vt = _mm256_set1_ps(xt);
            __m256 mv = _mm256_set1_ps(m);
            int64_t cnt = 0;
            for (i8 = i; i8 + 8 <= n; i8 += 8) {
                const __m256 v8 = code == 3 ? _mm256_loadu_ps((const float *)x + i8) : bf16x8((const uint16_t *)x + i8);
                const __m256 bad = _mm256_or_ps(_mm256_cmp_ps(v8, thr, _CMP_GT_OQ), _mm256_cmp_ps(v8, v8, _CMP_UNORD_Q));
                if (_mm256_movemask_ps(bad)) break;
                cnt += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v8, vt, _CMP_GT_OQ)));
                mv = _mm256_max_ps(mv, v8);
            }
            float m8[8];
            _mm256_storeu_ps(m8, mv);
            for (int l = 0; l < 8; l++) m = m8[l] > m ? m8[l] : m;
            greater += cnt;
            i = i8;
            if (i >= n) break;
        }
#endif
        (void)i8;
        v = sample_value(x, code, i);
        if (v != v || v == INFINITY) return 1;
        if (v > m) m = v;
        if (v > xt) greater++;
        if (k && (have < k || v > tv[k - 1])) {  /* insert; an equal value keeps the lower id already there */
            int j = have < k ? have++ : k - 1;
            while (j > 0 && tv[j - 1] < v) {
                tv[j] = tv[j - 1];
                ti[j] = ti[j - 1];
                j--;
            }
            tv[j] = v;
            ti[j] = i;
        }
    }
    if (m == -INFINITY || m == INFINITY) return 1;  /* +inf found 8 at a time where k is 0 */
    double s = 0.0;
    int64_t i = 0;
#ifdef __AVX2__
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();  /* float64 sums: a float32 lane's sum of
                                                                   * ~6,000 terms drifted by ~7e-6 */
    const __m256 mm = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 v8 = code == 3 ? _mm256_loadu_ps((const float *)x + i) : bf16x8((const uint16_t *)x + i);
        const __m256 e = exp_nonpos_avx2(_mm256_sub_ps(v8, mm));
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double a4[4];
    _mm256_storeu_pd(a4, _mm256_add_pd(lo, hi));
    for (int l = 0; l < 4; l++) s += a4[l];
#endif
    for (; i < n; i++) s += exp_nonpos(sample_value(x, code, i) - m);
    const float lsm = (float)log(s);  /* lse - m, at least 0: the largest term is 1 */
    volatile float d = xt - m;  /* volatile: two roundings in this order (-fassociative-math may not fold them) */
    *lp = d - lsm;
    *rank = greater + 1;
    for (int j = 0; j < have; j++) {  /* have = k unless the row is shorter (the caller asks k <= n) */
        top_ids[j] = ti[j];
        d = tv[j] - m;
        top_lp[j] = d - lsm;
    }
    return 0;
}

void kvs_token_logprobs(const void *x, int code, int64_t n, const int64_t *row_ids, int64_t count,
                        const int64_t *token_ids, int k, float *lp, int64_t *rank, int64_t *top_ids, float *top_lp,
                        int32_t *status) {
    const size_t es = code == 3 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
    for (int64_t i = 0; i < count; i++)
        status[i] = token_logprobs_row((const char *)x + es * (size_t)row_ids[i] * (size_t)n, code, n, token_ids[i],
                                       k, lp + i, rank + i, top_ids + (int64_t)k * i, top_lp + (int64_t)k * i);
}

/* The sampler's penalties (kvserve/engine/sampler.py: apply_penalties) in place on logits [rows, n]
 * float32, touching only the tokens a row has seen instead of PyTorch's passes over [rows, n] count and
 * mask tensors (~0.2-0.4 ms for one 49,152-token row). Row r: its prompt ids prompt_ids[prompt_off[r] ..
 * prompt_off[r + 1]) and output ids out_ids[out_off[r] .. out_off[r + 1]), each in [0, n) (the caller
 * checks). Repetition penalty p = rep[r] (CTRL with the HF/vLLM sign rule) on every distinct id seen in
 * either: l > 0 → l / p, else l · p (a NaN stays NaN); then presence/frequency on every distinct output id
 * with c occurrences: l = (l − freq[r] · c) − pres[r], the two float32 roundings in PyTorch's order (for
 * c = 0 its l − 0 − 0 leaves the value as it was, so untouched tokens agree; PyTorch may turn a -0.0 into
 * +0.0 there). rep 1 and pres = freq = 0: nothing.
 * Returns 0, or -1 where the count scratch could not be allocated (nothing changed). */
int kvs_apply_penalties(float *logits, int64_t n, int64_t rows, const int64_t *prompt_ids,
                        const int64_t *prompt_off, const int64_t *out_ids, const int64_t *out_off,
                        const float *rep, const float *pres, const float *freq) {
    int32_t *count = calloc((size_t)n, sizeof(int32_t));  /* zero again after each row: only its ids are set */
    if (!count) return -1;
    for (int64_t r = 0; r < rows; r++) {
        float *l = logits + r * n;
        const int64_t *po = prompt_ids + prompt_off[r], *oo = out_ids + out_off[r];
        const int64_t np = prompt_off[r + 1] - prompt_off[r], no = out_off[r + 1] - out_off[r];
        if (rep[r] != 1.f) {  /* count[id] = 1: already penalised */
            const float p = rep[r];
            for (int pass = 0; pass < 2; pass++)
                for (int64_t j = 0, m = pass ? no : np; j < m; j++) {
                    const int64_t id = pass ? oo[j] : po[j];
                    if (count[id]) continue;
                    count[id] = 1;
                    volatile float v = l[id];  /* one rounding, never contracted */
                    l[id] = v > 0.f ? v / p : v * p;
                }
            for (int64_t j = 0; j < np; j++) count[po[j]] = 0;
            for (int64_t j = 0; j < no; j++) count[oo[j]] = 0;
        }
        if (pres[r] != 0.f || freq[r] != 0.f) {
            for (int64_t j = 0; j < no; j++) count[oo[j]]++;
            for (int64_t j = 0; j < no; j++) {
                const int64_t id = oo[j];
                if (!count[id]) continue;  /* done */
                volatile float fc = freq[r] * (float)count[id];
                volatile float v = l[id] - fc;
                l[id] = v - pres[r];
                count[id] = 0;
            }
        }
    }
    free(count);
    return 0;
}
