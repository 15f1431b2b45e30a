/* Float helpers shared by the C kernels (kv_quant_kernel.c, layer_kernel.c, int4_gemm.c). */
#ifndef KVSERVE_KERNEL_MATH_H
#define KVSERVE_KERNEL_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

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

#endif
