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
#include <time.h>
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
/* KERNEL() and the LW_* weight order: generated from kernel_abi.py by the build (kernels.py).
 * Every function Python calls is defined through KERNEL(), whose signature is checked at load. */
#include "kernel_abi.h"

#define LANES 16
#define LORA_RB 4      /* rows of one adapter per LoRA item (model/lora.py makes the items;
                          kernels_body.h's lora_item has one case per item size) */

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

/* AVX-512 SiLU-and-mul for bf16: the scalar loop's exact arithmetic (same fexp steps, same
 * round-to-nearest-even), 16 lanes at a time. Returns how many elements it did. */
#ifdef __AVX512F__
static inline __m512 v_bf2f(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void v_f2bf(uint16_t *p, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
static inline __m512 v_fexp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(2.187751643e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.238783149e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.684577477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.548042915e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402305009e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469289e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000003f));
    __m512i e = _mm512_slli_epi32(_mm512_cvttps_epi32(fi), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}
static inline int64_t vsilu_bf16(const uint16_t *gp, const uint16_t *up, uint16_t *op, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 g = v_bf2f(gp + i);
        __m512 e = v_fexp(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        v_f2bf(op + i, _mm512_mul_ps(s, v_bf2f(up + i)));
    }
    return i;
}
/* row quantisation, vectorised (the same division and round-half-even as the scalar loop) */
static inline float vabsmax_bf16(const uint16_t *x, int64_t n, int64_t *done) {
    __m512 m = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(v_bf2f(x + i)));
    *done = i;
    return _mm512_reduce_max_ps(m);
}
static inline int64_t vquant_bf16(const uint16_t *x, int8_t *q, float sc, int64_t n) {
    const __m512 s = _mm512_set1_ps(sc), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(v_bf2f(x + i), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    return i;
}
#else
static inline float vabsmax_bf16(const uint16_t *x, int64_t n, int64_t *done) { *done = 0; return 0.f; }
static inline int64_t vquant_bf16(const uint16_t *x, int8_t *q, float sc, int64_t n) { return 0; }
static inline int64_t vsilu_bf16(const uint16_t *gp, const uint16_t *up, uint16_t *op, int64_t n) { return 0; }
#endif
static inline int64_t vsilu_f32(const float *gp, const float *up, float *op, int64_t n) { return 0; }
static inline float vabsmax_f32(const float *x, int64_t n, int64_t *done) { *done = 0; return 0.f; }
static inline int64_t vquant_f32(const float *x, int8_t *q, float sc, int64_t n) { return 0; }

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

#define SUF bf16
#define T uint16_t
#define LD bf2f
#define ST f2bf
#define VSILU vsilu_bf16
#define VABSMAX vabsmax_bf16
#define VQUANT vquant_bf16
#define VLD16 v_bf2f      /* 16 elements of T <-> float32 lanes (AVX-512 only) */
#define VST16 v_f2bf
#include "kernels_body.h"
#undef SUF
#undef T
#undef LD
#undef ST
#undef VSILU
#undef VABSMAX
#undef VQUANT
#undef VLD16
#undef VST16

#define SUF f32
#define T float
#define LD idf
#define ST f2f
#define VSILU vsilu_f32
#define VABSMAX vabsmax_f32
#define VQUANT vquant_f32
#define VLD16 _mm512_loadu_ps
#define VST16 _mm512_storeu_ps
#include "kernels_body.h"

/* ---------------------------------------------------------------- attention entry points
 * bf16 with head_dim a multiple of 32 on an AVX-512 CPU: q.k as sixteen float32 partial sums a
 * key, by vdpbf16ps (bf16 pairs) on an AVX512-BF16 CPU, elsewhere by float32 FMAs on q and the K
 * row widened in registers (the even and odd bf16 of each dword, as bf16_block_fma: exact
 * products, one rounding per FMA); sixteen keys' dot products reduced together by one fixed
 * shuffle tree, P.V in float32. Same structure as attention_ref (per row and kv head, keys in
 * order), so a row's bits still depend only on its own q and keys. Elsewhere: attention_ref.
 * The q.k form is fixed by the build (ATT_DP), not by the row count or the thread count. */
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
#define ATT_DP 1
#else
#define ATT_DP 0    /* AVX-512F without bf16 dot products (e.g. the Intel Xeon model 207 we run on) */
#endif
/* sums of the 16 lanes of each of v[0..16), returned as lanes 0..15 */
static inline __m512 hsum16(const __m512 *v) {
    __m512 q4[4];
    for (int b = 0; b < 4; b++) {
        const __m512 *w = v + 4 * b;
        __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        q4[b] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    }
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(q4[0], q4[1], 0x44), _mm512_shuffle_f32x4(q4[0], q4[1], 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(q4[2], q4[3], 0x44), _mm512_shuffle_f32x4(q4[2], q4[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
}

#define AMAXG 16            /* query heads per kv head handled here (GQA group) */
#define PF 32          /* keys fetched ahead in the attention loops */
#define AMAXC 8             /* head_dim / 32 */
/* One (row, kv head) item. G and C are literals at the call sites below, so the per-key loops
 * over query heads and 32-wide chunks unroll and `part` / `qv` / `acc` stay in registers.
 * DP (ATT_DP, a literal): 1 q.k by vdpbf16ps, 0 by float32 FMAs. */
static inline __attribute__((always_inline)) void attention_item_bf16(
        int64_t item, const int DP, const int64_t G, const int64_t C, float *sc, int64_t npad,
        const uint16_t *q, int64_t q_stride, const uint16_t *pool, int64_t cap1, uint16_t *out,
        int64_t rows, int64_t H, int64_t KVH, int64_t hd, const int64_t *slot_tab, const int64_t *off,
        const int64_t *ctx, float scale) {
    int64_t r = item / KVH, kh = item % KVH, n = ctx[r];
    const int64_t *sl = slot_tab + off[r];
    const uint16_t *Kb = pool + kh * cap1 * hd, *Vb = pool + (KVH + kh) * cap1 * hd;
#if defined(__AVX512BF16__)
    __m512bh qv[AMAXG][AMAXC];
    if (DP)
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < C; c++)
                qv[g][c] = (__m512bh)_mm512_loadu_si512(q + r * q_stride + (kh * G + g) * hd + 32 * c);
#endif
    /* the FMA form's q: each 32-wide chunk as its even and odd elements in float32 (exact) */
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    __m512 qe[AMAXG][AMAXC], qo[AMAXG][AMAXC];
    if (!DP)
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < C; c++) {
                __m512i v = _mm512_loadu_si512(q + r * q_stride + (kh * G + g) * hd + 32 * c);
                qe[g][c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                qo[g][c] = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
            }
    for (int64_t a = 0; a < PF && a < n; a++) {     /* this item's first V rows */
        const char *nv = (const char *)(Vb + sl[a] * hd);
        for (int64_t b = 0; b < hd * 2; b += 64) _mm_prefetch(nv + b, _MM_HINT_T1);
    }
    __m512 mxv[AMAXG];
    for (int64_t g = 0; g < G; g++) mxv[g] = _mm512_set1_ps(-INFINITY);
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        int64_t m = n - j0 < 16 ? n - j0 : 16;
        __m512 part[AMAXG][16];
        for (int64_t t = 0; t < 16; t++) {
            if (t < m) {
                const uint16_t *k = Kb + sl[j0 + t] * hd;
                if (j0 + t + PF < n) {      /* the pool is read once per step: fetch ahead */
                    const char *nk = (const char *)(Kb + sl[j0 + t + PF] * hd);
                    for (int64_t b = 0; b < hd * 2; b += 64) _mm_prefetch(nk + b, _MM_HINT_T0);
                    /* the V row too, into L2: P.V then finds it there instead of starting a
                     * second DRAM stream after this one */
                    const char *nv = (const char *)(Vb + sl[j0 + t + PF] * hd);
                    for (int64_t b = 0; b < hd * 2; b += 64) _mm_prefetch(nv + b, _MM_HINT_T1);
                }
#if defined(__AVX512BF16__)
                if (DP) {
                    for (int64_t g = 0; g < G; g++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int64_t c = 0; c < C; c++)
                            a = _mm512_dpbf16_ps(a, qv[g][c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
                        part[g][t] = a;
                    }
                } else
#endif
                {   /* the K row widened once, shared by the G query heads; per lane one FMA chain
                     * over the chunks in order: even element, then odd */
                    __m512 ke[AMAXC], ko[AMAXC];
                    for (int64_t c = 0; c < C; c++) {
                        __m512i v = _mm512_loadu_si512(k + 32 * c);
                        ke[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                        ko[c] = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
                    }
                    for (int64_t g = 0; g < G; g++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int64_t c = 0; c < C; c++) {
                            a = _mm512_fmadd_ps(qe[g][c], ke[c], a);
                            a = _mm512_fmadd_ps(qo[g][c], ko[c], a);
                        }
                        part[g][t] = a;
                    }
                }
            } else {
                for (int64_t g = 0; g < G; g++) part[g][t] = _mm512_setzero_ps();
            }
        }
        __mmask16 live = (__mmask16)((1u << m) - 1);
        for (int64_t g = 0; g < G; g++) {
            __m512 s = _mm512_mul_ps(hsum16(part[g]), vs);
            s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), s);
            _mm512_store_ps(sc + g * npad + j0, s);
            mxv[g] = _mm512_max_ps(mxv[g], s);
        }
    }
    float l[AMAXG];
    for (int64_t g = 0; g < G; g++) {
        float *sg = sc + g * npad;
        __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mxv[g])), lv = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            __m512 e = v_fexp(_mm512_sub_ps(_mm512_load_ps(sg + j), mv));
            e = _mm512_mask_blend_ps((__mmask16)(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1), _mm512_setzero_ps(), e);
            _mm512_store_ps(sg + j, e);
            lv = _mm512_add_ps(lv, e);
        }
        l[g] = _mm512_reduce_add_ps(lv);
    }
    const int64_t *sl1 = NULL; const uint16_t *K1 = NULL; int64_t n1 = 0;
    if (item + 1 < rows * KVH) {     /* the next item's K rows, fetched while this item's P.V runs
                                      * (a hint: OpenMP may give that item to the other thread) */
        int64_t r1 = (item + 1) / KVH, k1 = (item + 1) % KVH;
        K1 = pool + k1 * cap1 * hd; sl1 = slot_tab + off[r1]; n1 = ctx[r1];
    }
    /* P.V in float32 (P kept in float32: rounding it to bf16 moved greedy tokens away
     * from transformers' on the parity prompts, for no gain once the loop waits on memory) */
    __m512 acc[AMAXG][2 * AMAXC];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < 2 * C; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *v = Vb + sl[j] * hd;
        if (j + PF < n) {
            const char *nv = (const char *)(Vb + sl[j + PF] * hd);
            for (int64_t b = 0; b < hd * 2; b += 64) _mm_prefetch(nv + b, _MM_HINT_T0);
        }
        if (j < n1) {
            const char *nk = (const char *)(K1 + sl1[j] * hd);
            for (int64_t b = 0; b < hd * 2; b += 64) _mm_prefetch(nk + b, _MM_HINT_T1);
        }
        __m512 vf[2 * AMAXC];
        for (int64_t c = 0; c < 2 * C; c++) vf[c] = v_bf2f(v + 16 * c);
        for (int64_t g = 0; g < G; g++) {
            __m512 p = _mm512_set1_ps(sc[g * npad + j]);
            for (int64_t c = 0; c < 2 * C; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        uint16_t *o = out + r * H * hd + (kh * G + g) * hd;
        __m512 il = _mm512_set1_ps(1.0f / l[g]);
        for (int64_t c = 0; c < 2 * C; c++) v_f2bf(o + 16 * c, _mm512_mul_ps(acc[g][c], il));
    }
}

/* the items of one attention call, shared out by an orphaned `omp for` (so it runs inside the
 * caller's parallel region: attention_vec_bf16's own, or forward_bf16's); sc: this thread's
 * scratch of G * npad floats */
static void attention_items_bf16(float *sc, int64_t npad, const uint16_t *q, int64_t q_stride,
                                 const uint16_t *pool, int64_t cap1, uint16_t *out, int64_t rows, int64_t H,
                                 int64_t KVH, int64_t hd, const int64_t *slot_tab, const int64_t *off,
                                 const int64_t *ctx, float scale) {
    const int64_t G = H / KVH, C = hd / 32;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < rows * KVH; item++) {
#define ATT_ITEM(g, c) attention_item_bf16(item, ATT_DP, g, c, sc, npad, q, q_stride, pool, cap1, out, rows, H, KVH, \
                                           hd, slot_tab, off, ctx, scale)
        /* the shapes of the models we serve (SmolLM2-135M: 3 x 64; Llama-3: 4 x 128), then any */
        if (G == 3 && C == 2) ATT_ITEM(3, 2);
        else if (G == 4 && C == 4) ATT_ITEM(4, 4);
        else if (G == 4 && C == 2) ATT_ITEM(4, 2);
        else if (G == 1 && C == 2) ATT_ITEM(1, 2);
        else ATT_ITEM(G, C);
#undef ATT_ITEM
    }
}

static void attention_vec_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *pool, int64_t cap1,
                               uint16_t *out, int64_t rows, int64_t H, int64_t KVH, int64_t hd,
                               const int64_t *slot_tab, const int64_t *off, const int64_t *ctx,
                               int64_t max_ctx, float scale) {
    const int64_t G = H / KVH, npad = (max_ctx + 15) / 16 * 16;
    #pragma omp parallel
    {
        float *sc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(G * npad + 16));
        attention_items_bf16(sc, npad, q, q_stride, pool, cap1, out, rows, H, KVH, hd, slot_tab, off, ctx, scale);
        free(sc);
    }
}
#endif

KERNEL(void, attention_bf16, const uint16_t *q, int64_t q_stride, const uint16_t *pool, int64_t cap1, uint16_t *out,
                             int64_t rows, int64_t H, int64_t KVH, int64_t hd, const int64_t *slot_tab,
                             const int64_t *off, const int64_t *ctx, int64_t max_ctx, float scale) {
#if defined(__AVX512F__)
    if (hd % 32 == 0 && hd / 32 <= AMAXC && H / KVH <= AMAXG && max_ctx > 0) {
        attention_vec_bf16(q, q_stride, pool, cap1, out, rows, H, KVH, hd, slot_tab, off, ctx, max_ctx, scale);
        return;
    }
#endif
    attention_ref_bf16(q, q_stride, pool, cap1, out, rows, H, KVH, hd, slot_tab, off, ctx, max_ctx, scale);
}

KERNEL(void, attention_f32, const float *q, int64_t q_stride, const float *pool, int64_t cap1, float *out,
                            int64_t rows, int64_t H, int64_t KVH, int64_t hd, const int64_t *slot_tab,
                            const int64_t *off, const int64_t *ctx, int64_t max_ctx, float scale) {
    attention_ref_f32(q, q_stride, pool, cap1, out, rows, H, KVH, hd, slot_tab, off, ctx, max_ctx, scale);
}

/* Token bitmasks (structured outputs, model/grammar.py): int32 words, bit b of word w set = token
 * 32 w + b allowed (xgrammar's layout), W = ceil(V / 32) words a row. A clear bit reads as -inf. */
static inline uint32_t mask16(const int32_t *m, int64_t i) {   /* the bits of tokens i..i+15, i % 16 == 0 */
    return ((uint32_t)m[i >> 5] >> (i & 16)) & 0xFFFFu;
}

/* index of the largest value of one row (the first one on ties, as torch.argmax); a NaN row falls
 * back to the scalar rule NaN > everything, first NaN wins. With a bitmask row m, the row read is
 * the masked one (a disallowed token reads -inf): the same index as masking the row, then this. */
static int64_t argmax_row(const float *xr, int64_t V, const int32_t *m) {
    int64_t best = 0, i = 0;
    float bv = (m && !(m[0] & 1)) ? -INFINITY : xr[0];
#ifdef __AVX512F__
    if (V >= 16) {
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 mv = _mm512_loadu_ps(xr);
        if (m) mv = _mm512_mask_mov_ps(ninf, (__mmask16)mask16(m, 0), mv);
        __m512i mi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), cur = mi;
        __mmask16 nan = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= V && i < (1LL << 31) - 16; i += 16) {
            cur = _mm512_add_epi32(cur, _mm512_set1_epi32(16));
            __m512 v = _mm512_loadu_ps(xr + i);
            if (m) v = _mm512_mask_mov_ps(ninf, (__mmask16)mask16(m, i), v);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);   /* strictly greater: earlier index kept */
            mv = _mm512_mask_blend_ps(gt, mv, v);
            mi = _mm512_mask_blend_epi32(gt, mi, cur);
        }
        if (!nan) {
            float lane_v[16]; int32_t lane_i[16];
            _mm512_storeu_ps(lane_v, mv); _mm512_storeu_si512(lane_i, mi);
            bv = lane_v[0]; best = lane_i[0];
            for (int l = 1; l < 16; l++)
                if (lane_v[l] > bv || (lane_v[l] == bv && lane_i[l] < best)) { bv = lane_v[l]; best = lane_i[l]; }
        } else {
            i = 0; best = 0; bv = (m && !(m[0] & 1)) ? -INFINITY : xr[0];
        }
    }
#endif
    for (; i < V; i++) {
        float v = (m && !((m[i >> 5] >> (i & 31)) & 1)) ? -INFINITY : xr[i];
        if (v != v) { if (bv == bv) { bv = v; best = i; } }
        else if (bv == bv && v > bv) { bv = v; best = i; }
    }
    return best;
}

KERNEL(void, argmax_rows, const float *x, int64_t rows, int64_t V, int64_t *out) {
    #pragma omp parallel for schedule(static) if(rows >= 8)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * V, V, NULL);
}

/* argmax_rows with a grammar's bitmask applied in the kernel: row r reads bitmask row mrow[r]
 * (none where mrow[r] < 0). The logits are not written: no masked copy to make. */
KERNEL(void, argmax_masked_rows, const float *x, int64_t rows, int64_t V, const int32_t *mask, int64_t W,
                                 const int64_t *mrow, int64_t *out) {
    #pragma omp parallel for schedule(static) if(rows >= 8)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * V, V, mrow[r] < 0 ? NULL : mask + mrow[r] * W);
}

/* logits[rows[k], t] = -inf for every token t whose bit is clear in bitmask row rows[k], in
 * place; a word of all-allowed bits costs one compare (most of a JSON string's vocabulary). */
KERNEL(void, bitmask_apply_rows, float *x, int64_t ld, int64_t V, const int32_t *mask, int64_t W,
                                 const int64_t *rows, int64_t n) {
    #pragma omp parallel for schedule(static) if(n >= 8)
    for (int64_t k = 0; k < n; k++) {
        float *xr = x + rows[k] * ld;
        const int32_t *m = mask + rows[k] * W;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        for (; i + 32 <= V; i += 32) {
            uint32_t w = (uint32_t)m[i >> 5];
            if (w == 0xFFFFFFFFu) continue;
            _mm512_mask_storeu_ps(xr + i, (__mmask16)~w, ninf);
            _mm512_mask_storeu_ps(xr + i + 16, (__mmask16)~(w >> 16), ninf);
        }
#endif
        for (; i < V; i++)
            if (!((m[i >> 5] >> (i & 31)) & 1)) xr[i] = -INFINITY;
    }
}

/* ---------------------------------------------------------------- int4 weights x int8 activations
 * (w4a8, the int4 mode's kernel where AVX512-VNNI exists). Weights: groups of 32 along K,
 * w = q d + m (q 0..15; Q4_1's form, Q4_0 is m = -8d). Activations: each row's groups of 32
 * to int8 with their own scale dx, and sx = dx * sum(q_x) (llama.cpp's Q8_1 idea). Per group,
 *   sum_k w_k x_k = d (dx sum_k q_k q_xk) + m sx
 * with the integer sum exact (vpdpbusd: u8 nibbles x s8 activations). Groups are added in
 * order in float32, per row, whatever the number of rows: batch-invariant by construction.
 *
 * Packed weights, 16 output rows (a tile) x one group per 320-byte block, tile-major:
 *   bytes [0, 256): byte 64c + 4l + j = q[16t + l][32g + 4c + j] | q[16t + l][32g + 16 + 4c + j] << 4
 *   bytes [256, 288): d of the 16 rows (fp16); [288, 320): m (fp16). */
KERNEL(int, has_w4a8, void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__F16C__)
KERNEL(void, quant_groups_bf16, const uint16_t *x, int8_t *q, float *dx, float *sx, int64_t rows, int64_t K) {
    const int64_t NG = K / 32;
    #pragma omp parallel for schedule(static) if(rows >= 32)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < NG; g++) {      /* quant_rows' steps, on a group of 32 */
            const uint16_t *xg = x + r * K + 32 * g;
            int8_t *qg = q + r * K + 32 * g;
            int64_t done;
            float d = fmaxf(vabsmax_bf16(xg, 32, &done), 1e-10f) / 127.0f;
            vquant_bf16(xg, qg, d, 32);
            int32_t sq = 0;
            for (int i = 0; i < 32; i++) sq += qg[i];
            dx[r * NG + g] = d;
            sx[r * NG + g] = d * (float)sq;
        }
}

#define W4BLK 320
KERNEL(void, w4a8_mm_bf16, const int8_t *xq, const float *dx, const float *sx, int64_t rows, int64_t K,
                           const uint8_t *w, int64_t N, uint16_t *y) {
    const int64_t NG = K / 32, NT = N / 16;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t R = rows - r0 < 4 ? rows - r0 : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t g = 0; g < NG; g++) {
                const uint8_t *blk = w + (t * NG + g) * W4BLK;
                if ((t * NG + g + 8) < NT * NG) {   /* the next blocks, across tiles too */
                    const char *nb = (const char *)(blk + 8 * W4BLK);
                    for (int b = 0; b < W4BLK; b += 64) _mm_prefetch(nb + b, _MM_HINT_T0);
                }
                __m512i wq[8];
                for (int c = 0; c < 4; c++) {
                    __m512i v = _mm512_loadu_si512(blk + 64 * c);
                    wq[c] = _mm512_and_si512(v, low4);
                    wq[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
                __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
                for (int64_t rr = 0; rr < R; rr++) {
                    const int8_t *xr = xq + (r0 + rr) * K + 32 * g;
                    __m512i ia = _mm512_setzero_si512();
                    for (int s8 = 0; s8 < 8; s8++) {
                        int32_t xw; memcpy(&xw, xr + 4 * s8, 4);
                        ia = _mm512_dpbusd_epi32(ia, wq[s8], _mm512_set1_epi32(xw));
                    }
                    const int64_t gi = (r0 + rr) * NG + g;
                    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(dx[gi]));
                    acc[rr] = _mm512_fmadd_ps(dv, f, acc[rr]);
                    acc[rr] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[gi]), acc[rr]);
                }
            }
            for (int64_t rr = 0; rr < R; rr++) v_f2bf(y + (r0 + rr) * N + 16 * t, acc[rr]);
        }
    }
}
#endif

/* ---------------------------------------------------------------- bf16 GEMM (bf16_mm)
 * y = x W^T (+ b) for bf16 x [rows, K] and W [N, K], written for the decode step's small M,
 * where oneDNN's per-call cost and its M-dependent paths dominate. Two forms of the inner block,
 * chosen once per process by bf16_dp_pays() (kernels.py), because the better one depends on the
 * core: at 64 rows the GEMM is compute-bound, and vdpbf16ps (32 MACs an instruction) issues at
 * the FMA rate on AMD Zen 5 but at about a quarter of it on the Intel Xeon we measured, where two
 * float32 FMAs on weights widened in registers do twice its MACs per cycle. At one row both are
 * memory-bound. Either form gives each output one float32 accumulator folded over k (FMA form:
 * k = 0, 1, .., K-1; dp form: k-pairs 0, 1, .., K/2-1) in order, whatever the number of rows or
 * how rows and columns are blocked: batch-invariant for any M, so no padding rows are needed.
 *
 * Packed weights, tile t = output rows 16t..16t+15, k-pair major: element (kp, lane, j) at
 * w[t * 16K + 32 kp + 2 lane + j] = W[16t + lane][2 kp + j]. A tile is one contiguous stream. */
KERNEL(int, has_bf16_mm, void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
/* rows per block: the dp form keeps 6 x 4 tiles = 24 accumulators beside 4 weights and a broadcast
 * (64 rows, ctx 40: a step 1.4-1.8% faster than 5 rows, by fewer L2 re-reads of each unit); the
 * FMA form stays at 5 x 4 = 20, beside 8 widened weights and 2 broadcasts (6 rows spill there) */
#define BF_ROWS 6
#define BF_ROWS_FMA 5
static inline int64_t bf_rows(int dp) { return dp ? BF_ROWS : BF_ROWS_FMA; }
/* R rows x C tiles of accumulators over all k (R, C compile-time after inlining). A packed dword
 * holds (W[n][2kp], W[n][2kp+1]): the even weight is the dword shifted up, the odd one its high
 * half, both exact float32, so each product is exact and the chain rounds once per k. */
static inline __attribute__((always_inline)) void bf16_block_fma(const float *x, int64_t K, int R,
                                                                 const uint16_t *w, int C, __m512 acc[BF_ROWS][4],
                                                                 const uint16_t *pf, int pfn) {
    const int64_t KP = K / 2;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < KP; kp++) {
        for (int j = 0; j < pfn; j++) _mm_prefetch((const char *)(pf + j * 16 * K + 32 * kp), _MM_HINT_T1);
        __m512 we[4], wo[4];
        for (int c = 0; c < C; c++) {
            const uint16_t *p = w + c * 16 * K + 32 * kp;
            _mm_prefetch((const char *)(p + 32 * 16), _MM_HINT_T0);
            __m512i v = _mm512_loadu_si512(p);
            we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            wo[c] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
        for (int r = 0; r < R; r++) {
            const __m512 xe = _mm512_set1_ps(x[r * K + 2 * kp]), xo = _mm512_set1_ps(x[r * K + 2 * kp + 1]);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_fmadd_ps(xo, wo[c], _mm512_fmadd_ps(xe, we[c], acc[r][c]));
        }
    }
}

#if defined(__AVX512BF16__)
/* The same block on vdpbf16ps: x stays bf16, one instruction per k-pair and tile. */
static inline __attribute__((always_inline)) void bf16_block_dp(const uint16_t *x, int64_t K, int R,
                                                                const uint16_t *w, int C, __m512 acc[BF_ROWS][4],
                                                                const uint16_t *pf, int pfn) {
    const int64_t KP = K / 2;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < KP; kp++) {
        for (int j = 0; j < pfn; j++) _mm_prefetch((const char *)(pf + j * 16 * K + 32 * kp), _MM_HINT_T1);
        __m512bh wv[4];
        for (int c = 0; c < C; c++) {
            const uint16_t *p = w + c * 16 * K + 32 * kp;
            _mm_prefetch((const char *)(p + 32 * 16), _MM_HINT_T0);
            wv[c] = (__m512bh)_mm512_loadu_si512(p);
        }
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * K + 2 * kp, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
}
#endif

static double bf_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* the calling thread's CPU time, s (a system call, ~0.3 us here; forward_bf16's looks) */
static double thread_cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define LOOK_THREADS 256   /* forward_bf16 looks at the first 256 threads of a larger team */

KERNEL(int, has_bf16_dp, void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* 1 when vdpbf16ps does at least as many MACs per second as float32 FMAs on this core (best of
 * three runs of 12 independent chains, ~1 ms in all): the dp form's condition. */
KERNEL(int, bf16_dp_pays, void) {
#if defined(__AVX512BF16__)
    double tf = 1e9, td = 1e9;
    const long n = 100000;
    for (int rep = 0; rep < 3; rep++) {
        __m512 a[12];
        for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(1e-9f * i);
        const __m512 u = _mm512_set1_ps(0.999f), v = _mm512_set1_ps(1.001f);
        double t = bf_now();
        for (long j = 0; j < n; j++) {
            for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(u, v, a[i]);
            __asm__ volatile("" : "+v"(a[0]), "+v"(a[6]));
        }
        t = bf_now() - t;
        if (t < tf) tf = t;
        const __m512bh ub = (__m512bh)_mm512_set1_epi32(0x3f803f80), vb = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
        t = bf_now();
        for (long j = 0; j < n; j++) {
            for (int i = 0; i < 12; i++) a[i] = _mm512_dpbf16_ps(a[i], ub, vb);
            __asm__ volatile("" : "+v"(a[0]), "+v"(a[6]));
        }
        t = bf_now() - t;
        if (t < td) td = t;
        float sink = 0;
        for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(a[i]);
        __asm__ volatile("" : : "x"(sink));
    }
    return 32.0 / td >= 16.0 / tf;
#else
    return 0;
#endif
}

static inline void bf16_store(__m512 v, const uint16_t *bias, void *y, int64_t off, int out_f32) {
    if (bias) v = _mm512_add_ps(v, v_bf2f(bias));
    if (out_f32) _mm512_storeu_ps((float *)y + off, v);
    else v_f2bf((uint16_t *)y + off, v);
}

/* literal R and C so each full block compiles to straight-line register code; the last tiles of
 * an N that is not a multiple of 64 take the generic loop (same sums) */
#define BF_BLOCK(block, xb)                                         \
    if (C < 4 && R == 1 && C == 2) block(xb, K, 1, wt, 2, acc, pf, pfn); \
    else if (C < 4) block(xb, K, R, wt, C, acc, pf, pfn);           \
    else switch (R) {                                               \
        case 5: block(xb, K, 5, wt, 4, acc, pf, pfn); break;        \
        case 4: block(xb, K, 4, wt, 4, acc, pf, pfn); break;        \
        case 3: block(xb, K, 3, wt, 4, acc, pf, pfn); break;        \
        case 2: block(xb, K, 2, wt, 4, acc, pf, pfn); break;        \
        default: block(xb, K, 1, wt, 4, acc, pf, pfn); break;       \
    }

/* x as float32 for the FMA form (converted once, not once per tile), by the calling team */
static void bf16_to_f32_for(const uint16_t *x, float *xf, int64_t n) {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i += 16) {
        if (i + 16 <= n) _mm512_storeu_ps(xf + i, v_bf2f(x + i));
        else for (int64_t j = i; j < n; j++) xf[j] = bf2f(x[j]);
    }
}

/* The items of one bf16 GEMM, shared out by an orphaned `omp for` (bf16_mm's region, or
 * forward_bf16's). xf: x as float32 for the FMA form (dp == 0), unused by the dp form. */
/* Tiles per unit at one row block: 4, or 2 where 4-tile units split unevenly over the team.
 * There each unit is read once from memory, so a thread's share of the units is its share of the
 * op's time; the 36-tile O and down projections of SmolLM2 are 9 units, 5 + 4 over two threads
 * (the op takes 5/4.5 of an even split), and 2-tile units make it 9 + 9. Same bits: each tile's
 * accumulators are its own whatever the unit (the 4-tile unit pays off across row blocks, where
 * a unit is re-read from cache, so more rows keep it). */
static inline int64_t bf_unit_tiles(int64_t NT, int64_t RB) {
    if (RB > 1) return 4;
    const int64_t team = omp_get_num_threads();
    const int64_t n4 = (NT + 3) / 4, n2 = (NT + 1) / 2;
    const int64_t max4 = (n4 + team - 1) / team * 4, max2 = (n2 + team - 1) / team * 2;
    return max2 < max4 ? 2 : 4;
}

static void bf16_mm_items(const uint16_t *x, const float *xf, int64_t rows, int64_t K, const uint16_t *w,
                          int64_t N, const uint16_t *bias, void *y, int out_f32, int dp) {
    const int64_t BR = bf_rows(dp);
    const int64_t NT = N / 16, RB = (rows + BR - 1) / BR, U = bf_unit_tiles(NT, RB), NU = (NT + U - 1) / U;
    /* one item per (unit of U tiles, row block), unit-major: a thread's contiguous share re-reads
     * a unit's weights from its own cache across row blocks, and 9 units still split evenly */
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < NU * RB; it++) {
        const int64_t t0 = U * (it / RB), r0 = BR * (it % RB);
        const int C = NT - t0 < U ? (int)(NT - t0) : (int)U;
        const int R = rows - r0 < BR ? (int)(rows - r0) : (int)BR;
        const uint16_t *wt = w + t0 * 16 * K;
        /* the next unit's weights come from DRAM: its tiles are fetched into L2 while this unit's
         * row blocks run from L2 (the tiles shared out over the row blocks), so its first row
         * block does not wait on memory. With one row block there is no L2 phase to hide it in:
         * the extra stream only competed with the current one (1 row: 6.5 -> 8 ms a step). */
        const int64_t nt = RB < 2 || NT - t0 - 4 < 0 ? 0 : (NT - t0 - 4 < 4 ? NT - t0 - 4 : 4);
        const int64_t per = (nt + RB - 1) / RB, first = (it % RB) * per;
        const int pfn = (int)(nt - first < 0 ? 0 : (nt - first < per ? nt - first : per));
        const uint16_t *pf = w + (t0 + 4 + first) * 16 * K;
        __m512 acc[BF_ROWS][4];
#if defined(__AVX512BF16__)
        if (dp) {   /* 6-row blocks only here (bf_rows) */
            if (R == 6 && C == 4) bf16_block_dp(x + r0 * K, K, 6, wt, 4, acc, pf, pfn);
            else BF_BLOCK(bf16_block_dp, x + r0 * K)
        }
        else
#endif
        { BF_BLOCK(bf16_block_fma, xf + r0 * K) }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                bf16_store(acc[r][c], bias ? bias + 16 * (t0 + c) : NULL, y, (r0 + r) * N + 16 * (t0 + c), out_f32);
    }
}

/* dp: 1 for the vdpbf16ps form (only where the CPU has it), 0 for the FMA form */
KERNEL(void, bf16_mm, const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N,
                      const uint16_t *bias, void *y, int out_f32, int dp) {
#if !defined(__AVX512BF16__)
    dp = 0;
#endif
    const int64_t NT = N / 16, NU = (NT + 3) / 4, RB = (rows + bf_rows(dp) - 1) / bf_rows(dp);
    float *xf = dp ? NULL : malloc(sizeof(float) * rows * K);
    if (xf) bf16_to_f32_for(x, xf, rows * K);
    #pragma omp parallel if(NU * RB > 1)
    bf16_mm_items(x, xf, rows, K, w, N, bias, y, out_f32, dp);
    free(xf);
}
#endif

/* ---------------------------------------------------------------- the layer stack in one parallel region
 * forward_bf16 runs every layer of a bf16 model whose linear layers are bf16_mm tiles with the
 * per-op path's kernels and per-row arithmetic (llama.py's _forward_fused), so its output is
 * bit-identical to it. What it saves is the ~9 calls a layer makes from Python, each with its
 * ctypes call, output allocation and OpenMP fork/join: here the ops are separated by the
 * barriers that end each `omp for`, and the threads stay in one region for the whole stack.
 * lw: LW_N pointers per layer (kernel_abi.LAYER_WEIGHTS, the generated LW_* enum); 0 for no qkv
 * bias, and for the last layer's next norm.
 * It runs the ops s0..S-1 of the stack, op s being op s % FWD_STAGES (kernel_abi.FORWARD_STAGES,
 * the generated FS_* enum: qkv, rope, attention, o, ln2, gu, silu, down, ln1) of layer
 * s / FWD_STAGES (lw, pool and lora are the whole model's), or stops early at a look (below), and
 * returns the op it stopped before (S: all done). Every op reads and writes only the scratch
 * below, x and the pool, all of which outlive the call, so a call can start at any op boundary
 * (on entry at s0 = l * FWD_STAGES, h = rmsnorm(x) * ln1 of layer l; after the last layer's ln1
 * op, x is the residual stream after it), and calls over [0, a), [a, b), ... give the one call's
 * bits (kernels.py layer_stack; the thread governor's looks, engine/threads.py). Every op shares
 * its items out with an `omp for` and each item is computed whole by one thread, so a call may
 * run with another team size than the last one: same bits.
 * (h, qkv, att, gu, act, tmp: scratch of M rows; xf: M * max(K) floats, FMA form only).
 * Looks (the thread governor's mid-step rule, engine/threads.py), probe >= 0: at the first op
 * boundary after one that came `probe` s or more after the last look (or the call's start), every
 * thread's CPU time since then is set against the wall time since then; seen[0] = the least share
 * a thread got, seen[1] = the team's CPUs (their sum), seen[2] = the wall s. The call returns there
 * when `stop` or when a thread got less than `least` of the wall: it was descheduled, another
 * process is on our cores. A quiet step so runs as one call; under contention, where one layer
 * took 30-92 ms (harden.md), the return comes within an op of the look, not at the layer's end.
 * stretch > 0 (the governor sets it at a few rows, where an op takes 0.02-0.4 ms): an op whose
 * wall time, boundary to boundary, was `stretch` s or more (a thread of the team was off its CPU
 * inside it: the others waited for it at the op's closing barrier) makes the next boundary a look
 * at once, and the call returns there whatever the look finds; seen[3] = the longest op since the
 * last look, s (0 when stretch <= 0). Under the stall attacks the first such op of a step took
 * 3.2-12.1 ms, where the 10 ms looks' two-look rule left the team at two threads for 42-73 ms of
 * such a step (docs/SERVING.md "Where the gap goes", "Stretch looks").
 * probe < 0: no looks. */
KERNEL(int, forward_bf16_supports, int64_t H, int64_t KVH, int64_t hd) {
#if defined(__AVX512F__)
    return hd % 32 == 0 && hd / 32 <= AMAXC && H % KVH == 0 && H / KVH <= AMAXG;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)   /* dp form where the CPU has AVX512-BF16, else the FMA form (kernels.py) */
#define PTR(t, v) ((t)(intptr_t)(v))
/* Up to XP_ROWS rows, each thread widens x into its own buffer xp (a few KB, exact either way)
 * instead of the team sharing the work out: that `omp for` ended in a barrier, one per GEMM, 120
 * a one-row step, for 576-1,536 values a thread converts in well under a microsecond. */
#define XP_ROWS 4
static inline void mm_in_region(const uint16_t *x, float *xf, float *xp, int64_t M, int64_t K, int64_t w,
                                int64_t N, int64_t bias, uint16_t *y, int dp) {
    if (!dp && M <= XP_ROWS) {
        for (int64_t i = 0; i < M * K; i += 16) {
            if (i + 16 <= M * K) _mm512_storeu_ps(xp + i, v_bf2f(x + i));
            else for (int64_t j = i; j < M * K; j++) xp[j] = bf2f(x[j]);
        }
        xf = xp;
    }
    else if (!dp) bf16_to_f32_for(x, xf, M * K);
    bf16_mm_items(x, xf, M, K, PTR(const uint16_t *, w), N, PTR(const uint16_t *, bias), y, 0, dp);
}

KERNEL(int64_t, forward_bf16, int64_t s0, int64_t S, const int64_t *lw, uint16_t *x, uint16_t *h, uint16_t *qkv,
       uint16_t *att, uint16_t *gu, uint16_t *act, uint16_t *tmp, float *xf, int64_t M, int64_t D, int64_t H,
       int64_t KVH, int64_t hd, int64_t I, const int64_t *pos, const float *cos_t, const float *sin_t,
       uint16_t *pool, int64_t layer_elems, int64_t cap1, const int64_t *slots, const int64_t *slot_tab,
       const int64_t *off, const int64_t *ctx, int64_t max_ctx, float scale, float eps, int dp,
       const int64_t *lora, int64_t lora_slots, const int64_t *lrows, const int64_t *litems, const int64_t *lslot,
       int64_t nitems, float probe, float least, int stop, float stretch, float *seen) {
#if !defined(__AVX512BF16__)
    dp = 0;   /* as bf16_mm: there is no dp form in this build */
#endif
    const int64_t W = (H + 2 * KVH) * hd, npad = (max_ctx + 15) / 16 * 16;
    /* A look at op boundary b is agreed one boundary ahead: at b - 1 the master thread reads the
     * wall clock and, when `probe` s have passed since the last look, marks b (due[b & 1]; the
     * other buffer is the one being read at b - 1), which the op's closing barrier shows every
     * thread. At a marked boundary each thread reads its own CPU clock (exact: the kernel adds
     * the running slice; another thread's or the process's lags by up to a scheduler tick, 4 ms
     * at HZ=250, a third of a 10 ms look), a barrier publishes them, the master looks and
     * answers, and a second barrier publishes the answer: two barriers a look, none between.
     * An unmarked boundary costs nothing but the master's wall clock read (which also times the
     * op before it, for `stretch`). due: 1 a look after `probe` s, 2 a look after a stretched op. */
    double cpu_now[LOOK_THREADS], cpu_then[LOOK_THREADS];
    double wall_then = bf_now(), op_then = wall_then, op_max = 0.0;
    int due[2] = {0, 0}, ret = 0;
    int64_t next = S;
    /* lora (NULL: no row of the step has an adapter): the records, [L][LL_N][lora_slots][LR_N];
     * each linear's update is added to its output before the op that reads it */
#define LORA(ll, xin, K, yout, ldy) \
    if (lora) lora_items_bf16(xin, K, yout, ldy, lora + ((l * LL_N + (ll)) * lora_slots) * LR_N, lrows, litems, lslot, nitems)
    #pragma omp parallel
    {
        float *sc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(H / KVH * npad + 16));
        const int64_t kmax = (D > I ? D : I) > H * hd ? (D > I ? D : I) : H * hd;
        float *xp = (float *)aligned_alloc(64, sizeof(float) * (size_t)(XP_ROWS * kmax + 16));
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        const int look = probe >= 0 && me < LOOK_THREADS;
        if (look) cpu_then[me] = thread_cpu();
        for (int64_t b = s0; b < S; b++) {   /* b: the op boundary before op b % FWD_STAGES of layer b / FWD_STAGES */
            if (probe >= 0 && b > s0 && due[b & 1]) {
                if (look) cpu_now[me] = thread_cpu();
                #pragma omp barrier
                #pragma omp master
                {
                    const double now = bf_now(), wall = now - wall_then;
                    const int n = team < LOOK_THREADS ? team : LOOK_THREADS;
                    double low = 1.0, sum = 0.0;
                    for (int t = 0; t < n; t++) {
                        const double got = wall > 0 ? (cpu_now[t] - cpu_then[t]) / wall : 1.0;
                        low = got < low ? got : low;
                        sum += got;
                        cpu_then[t] = cpu_now[t];
                    }
                    wall_then = now;
                    if (seen) seen[0] = (float)low, seen[1] = (float)sum, seen[2] = (float)wall, seen[3] = (float)op_max;
                    op_max = 0.0;
                    ret = stop || low < least || due[b & 1] == 2;
                    if (ret) next = b;
                }
                #pragma omp barrier
                if (ret) break;
            }
            #pragma omp master
            if (probe >= 0) {
                const double now = bf_now(), took = now - op_then;   /* op b - 1, and a look at b if any */
                const int stretched = stretch > 0 && b > s0 && took >= stretch;
                if (stretch > 0 && b > s0 && took > op_max) op_max = took;
                op_then = now;
                due[(b + 1) & 1] = stretched ? 2 : now - wall_then >= probe;
            }
            const int64_t l = b / FWD_STAGES;
            const int64_t *p = lw + l * LW_N;
            uint16_t *pl = pool + l * layer_elems;
            switch (b % FWD_STAGES) {   /* each op ends with its `omp for`'s barrier */
            case FS_QKV:
                mm_in_region(h, xf, xp, M, D, p[LW_QKV], W, p[LW_QKV_B], qkv, dp);
                LORA(LL_QKV, h, D, qkv, W);
                break;
            case FS_ROPE:
                #pragma omp for schedule(static)
                for (int64_t r = 0; r < M; r++) rope_kv_row_bf16(r, qkv, H, KVH, hd, pos, cos_t, sin_t, pl, cap1, slots);
                break;
            case FS_ATTN:
                attention_items_bf16(sc, npad, qkv, W, pl, cap1, att, M, H, KVH, hd, slot_tab, off, ctx, scale);
                break;
            case FS_O:
                mm_in_region(att, xf, xp, M, H * hd, p[LW_O], D, 0, tmp, dp);
                LORA(LL_O, att, H * hd, tmp, D);
                break;
            case FS_LN2:
                #pragma omp for schedule(static)
                for (int64_t r = 0; r < M; r++)
                    rmsnorm_row_bf16(r, x, tmp, x, PTR(const uint16_t *, p[LW_LN2]), h, D, eps);
                break;
            case FS_GU:
                mm_in_region(h, xf, xp, M, D, p[LW_GU], 2 * I, 0, gu, dp);
                LORA(LL_GU, h, D, gu, 2 * I);
                break;
            case FS_SILU:
                #pragma omp for schedule(static)
                for (int64_t r = 0; r < M; r++) silu_mul_row_bf16(r, gu, act, I);
                break;
            case FS_DOWN:
                mm_in_region(act, xf, xp, M, I, p[LW_DOWN], D, 0, tmp, dp);
                LORA(LL_DOWN, act, I, tmp, D);
                break;
            default: {  /* FS_LN1: the residual add, and the next layer's input norm (none after the last) */
                const uint16_t *ln1 = PTR(const uint16_t *, p[LW_LN1_NEXT]);
                #pragma omp for schedule(static)
                for (int64_t r = 0; r < M; r++) rmsnorm_row_bf16(r, x, tmp, x, ln1, ln1 ? h : NULL, D, eps);
            }
            }
        }
        free(sc);
        free(xp);
    }
#undef LORA
    return next;
}
#undef PTR
#endif

/* ---------------------------------------------------------------- int8 weights x bf16 activations
 * (w8_mm: the LM head of int4/int8 models). y[r][n] = s[n] * sum_k x[r][k] q[n][k], the sum one
 * float32 FMA chain over k = 0..K-1 in order (batch-invariant for any M), the activations exact
 * (bf16 -> fp32). Each int8 weight is widened once per block of up to 6 rows.
 * Packed weights, 64 output rows (a unit) per k-major run: w[u * 64K + 64 k + lane] = q[64u + lane][k]. */
KERNEL(int, has_w8_mm, void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
#define W8_ROWS 6   /* 6 rows x 4 = 24 accumulators beside 4 widened weights and a broadcast */
static inline __attribute__((always_inline)) void w8_block(const float *x, int64_t K, int R,
                                                           const int8_t *w, __m512 acc[W8_ROWS][4]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const int8_t *p = w + 64 * k;
        _mm_prefetch((const char *)(p + 64 * 16), _MM_HINT_T0);
        __m512 wf[4];   /* widened straight from memory: no lane extracts on the shuffle port */
        for (int c = 0; c < 4; c++)
            wf[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * c))));
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_set1_ps(x[r * K + k]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(xv, wf[c], acc[r][c]);
        }
    }
}

KERNEL(void, w8_mm_bf16, const uint16_t *x, int64_t rows, int64_t K, const int8_t *w, const float *s, int64_t N,
                         void *y, int out_f32) {
    const int64_t NU = N / 64;
    float *xf = malloc(sizeof(float) * rows * K);
    for (int64_t i = 0; i < rows * K; i++) xf[i] = bf2f(x[i]);
    #pragma omp parallel for schedule(static)
    for (int64_t u = 0; u < NU; u++) {
        for (int64_t r0 = 0; r0 < rows; r0 += W8_ROWS) {
            const int R = rows - r0 < W8_ROWS ? (int)(rows - r0) : W8_ROWS;
            __m512 acc[W8_ROWS][4];
            switch (R) {   /* literal R: straight-line register code per case */
            case 6: w8_block(xf + r0 * K, K, 6, w + u * 64 * K, acc); break;
            case 5: w8_block(xf + r0 * K, K, 5, w + u * 64 * K, acc); break;
            case 4: w8_block(xf + r0 * K, K, 4, w + u * 64 * K, acc); break;
            case 3: w8_block(xf + r0 * K, K, 3, w + u * 64 * K, acc); break;
            case 2: w8_block(xf + r0 * K, K, 2, w + u * 64 * K, acc); break;
            default: w8_block(xf + r0 * K, K, 1, w + u * 64 * K, acc); break;
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 4; c++) {
                    const int64_t n = 64 * u + 16 * c;
                    __m512 v = _mm512_mul_ps(acc[r][c], _mm512_loadu_ps(s + n));
                    if (out_f32) _mm512_storeu_ps((float *)y + (r0 + r) * N + n, v);
                    else v_f2bf((uint16_t *)y + (r0 + r) * N + n, v);
                }
        }
    }
    free(xf);
}
#endif
