/* Fused CPU kernels for the Llama forward (built at first use by kernels.py).
 *
 * Every kernel works one row (one token) at a time with a fixed loop order, so a
 * row's bits never depend on the other rows of the batch: that is what keeps the
 * batch-invariant mode invariant. Arithmetic is float32; bf16 inputs/outputs are
 * converted with round-to-nearest-even, as torch does.
 *
 * The attention reads K/V straight from the pool by slot (no gather copy): a row
 * attends over slot_tab[off .. off+ctx), its own request's slots.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16

static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float f2f(float f) { return f; }

/* exp(x) as 2^(x log2 e): a degree-6 fit of 2^f on [0, 1) (relative error ~3e-9 before float
 * rounding) scaled by the exponent bits. Plain arithmetic, so loops over it vectorise (libm's
 * expf does not); deterministic like everything else here. */
static inline float fexp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.4426950408889634f;
    float fi = floorf(t), f = t - fi;
    float p = 2.187751643e-4f;
    p = p * f + 1.238783149e-3f;
    p = p * f + 9.684577477e-3f;
    p = p * f + 5.548042915e-2f;
    p = p * f + 2.402305009e-1f;
    p = p * f + 6.931469289e-1f;
    p = p * f + 1.000000003f;
    int32_t e = (int32_t)fi;
    uint32_t b; memcpy(&b, &p, 4); b += (uint32_t)e << 23; memcpy(&p, &b, 4);
    return p;
}
static inline float idf(float f) { return f; }

/* a fixed reduction tree over the LANES partial sums (vectorises; a serial chain does not) */
static inline float hsum(float *a) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps(_mm512_loadu_ps(a));   /* in registers: no store-forwarding stalls */
#else
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
#endif
}

/* q . k over n floats (the attention's hot loop) */
static inline float fdot(const float *q, const float *k, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
    for (; i < n; i++) s += q[i] * k[i];
    return _mm512_reduce_add_ps(acc) + s;
#else
    float a[LANES] = {0};
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) a[l] += q[i + l] * k[i + l];
    for (; i < n; i++) s += q[i] * k[i];
    return hsum(a) + s;
#endif
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

#define SUF bf16
#define T uint16_t
#define LD bf2f
#define ST f2bf
#include "kernels_body.h"
#undef SUF
#undef T
#undef LD
#undef ST

#define SUF f32
#define T float
#define LD idf
#define ST f2f
#include "kernels_body.h"
