/* The kernels for one element type; kernels.c includes this once per type with
 * T (storage type), LD (T -> float), ST (float -> T) and FN(name) (name_suffix) defined. */
/* fixed-order dot product: LANES partial sums, then the lanes in order */

/* sum of x[0..n) in LANES partial sums and a fixed tree */
static inline float FN(vsum)(const float *x, int64_t n) {
    float a[LANES] = {0};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) a[l] += x[j + l];
    float s = 0.f;
    for (; j < n; j++) s += x[j];
    return hsum(a) + s;
}

/* x_out = x + delta (if delta), rounded to T; h = w * T(x_out * rsqrt(mean(x_out^2) + eps)) */
static inline void FN(rmsnorm_row)(int64_t r, const T *x, const T *delta, T *x_out, const T *w, T *h,
                                   int64_t D, float eps) {
    const T *xr = x + r * D;
    T *xo = x_out + r * D;
    float a[LANES] = {0};
    float buf[D];
    for (int64_t i = 0; i < D; i++) {
        float v = LD(xr[i]);
        if (delta) { T t = ST(v + LD(delta[r * D + i])); xo[i] = t; v = LD(t); }
        buf[i] = v;
    }
    int64_t i = 0;
    for (; i + LANES <= D; i += LANES)
        for (int l = 0; l < LANES; l++) a[l] += buf[i + l] * buf[i + l];
    float ss = 0.f;
    for (; i < D; i++) ss += buf[i] * buf[i];
    ss += hsum(a);
    float inv = 1.0f / sqrtf(ss / (float)D + eps);
    if (h) for (i = 0; i < D; i++) h[r * D + i] = ST(LD(w[i]) * LD(ST(buf[i] * inv)));
}

KERNEL(void, FN(rmsnorm), const T *x, const T *delta, T *x_out, const T *w, T *h,
       int64_t rows, int64_t D, float eps) {
    #pragma omp parallel for schedule(static) if(rows >= 16)
    for (int64_t r = 0; r < rows; r++) FN(rmsnorm_row)(r, x, delta, x_out, w, h, D, eps);
}

/* RoPE (rotate-half) on the q and k heads of qkv [rows, (H + 2*KVH) * hd], in place; then the
 * row's k and v heads are written to pool[kvh][slot] and pool[KVH + kvh][slot]. */
static inline void FN(rope_kv_row)(int64_t r, T *qkv, int64_t H, int64_t KVH, int64_t hd,
                                   const int64_t *pos, const float *cos_t, const float *sin_t,
                                   T *pool, int64_t cap1, const int64_t *slots) {
    const int64_t half = hd / 2, W = (H + 2 * KVH) * hd;
    T *row = qkv + r * W;
    const float *c = cos_t + pos[r] * half, *s = sin_t + pos[r] * half;
    for (int64_t h = 0; h < H + KVH; h++) {
        T *x = row + h * hd;
        for (int64_t i = 0; i < half; i++) {
            float x1 = LD(x[i]), x2 = LD(x[i + half]);
            x[i] = ST(x1 * c[i] - x2 * s[i]);
            x[i + half] = ST(x2 * c[i] + x1 * s[i]);
        }
    }
    for (int64_t j = 0; j < 2 * KVH; j++)
        memcpy(pool + (j * cap1 + slots[r]) * hd, row + (H + j) * hd, hd * sizeof(T));
}

KERNEL(void, FN(rope_kv), T *qkv, int64_t rows, int64_t H, int64_t KVH, int64_t hd,
       const int64_t *pos, const float *cos_t, const float *sin_t,
       T *pool, int64_t cap1, const int64_t *slots) {
    for (int64_t r = 0; r < rows; r++) FN(rope_kv_row)(r, qkv, H, KVH, hd, pos, cos_t, sin_t, pool, cap1, slots);
}

static inline void FN(silu_mul_row)(int64_t r, const T *gu, T *out, int64_t I) {
    const T *restrict gp = gu + r * 2 * I, *restrict up = gp + I;
    T *restrict op = out + r * I;
    int64_t i = VSILU(gp, up, op, I);
    for (; i < I; i++) {
        float g = LD(gp[i]);
        op[i] = ST(g / (1.0f + fexp(-g)) * LD(up[i]));
    }
}

KERNEL(void, FN(silu_mul), const T *gu, T *out, int64_t rows, int64_t I) {
    #pragma omp parallel for schedule(static) if(rows >= 16)
    for (int64_t r = 0; r < rows; r++) FN(silu_mul_row)(r, gu, out, I);
}

/* W8A8: each row of x -> int8 q with one scale s = max|x| / 127 (q = round-half-even(x / s)).
 * Row-local, so the integer GEMM that follows (exact) keeps a row's result batch-invariant. */
KERNEL(void, FN(quant_rows), const T *x, int8_t *q, float *s, int64_t rows, int64_t K) {
    #pragma omp parallel for schedule(static) if(rows >= 32)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * K;
        int64_t i;
        float m = VABSMAX(xr, K, &i);
        for (; i < K; i++) m = fmaxf(m, fabsf(LD(xr[i])));
        float sc = fmaxf(m, 1e-10f) / 127.0f;
        s[r] = sc;
        for (i = VQUANT(xr, q + r * K, sc, K); i < K; i++) {
            float v = nearbyintf(LD(xr[i]) / sc);
            q[r * K + i] = (int8_t)(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));
        }
    }
}

/* y = T(acc * sx[row] * sw[col]) (+ bias, rounded again: the same two roundings as torch's
 * `(acc * sx * sw).to(T) + b`). No FMA contraction: for T = float it would fuse the scale and
 * the bias add, which torch does not. */
KERNEL(__attribute__((optimize("fp-contract=off"))) void, FN(dequant),
       const int32_t *acc, const float *sx, const float *sw, const T *bias, T *y, int64_t rows, int64_t N) {
    #pragma omp parallel for schedule(static) if(rows >= 32)
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *a = acc + r * N;
        T *yr = y + r * N;
        float s = sx[r];
        for (int64_t j = 0; j < N; j++) {
            T t = ST((float)a[j] * s * sw[j]);
            yr[j] = bias ? ST(LD(t) + LD(bias[j])) : t;
        }
    }
}

/* q: row r, head h at q[r * q_stride + h * hd]. Row r attends over the keys in slots
 * slot_tab[off[r] .. off[r] + ctx[r]). One work item = (row, kv head): its G query heads
 * share each K/V read. Two passes (scores + max, then exp and P.V), in key order. */
void FN(attention_ref)(const T *q, int64_t q_stride, const T *pool, int64_t cap1, T *out,
                     int64_t rows, int64_t H, int64_t KVH, int64_t hd,
                     const int64_t *slot_tab, const int64_t *off, const int64_t *ctx,
                     int64_t max_ctx, float scale) {
    const int64_t G = H / KVH;
    #pragma omp parallel
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(G * max_ctx + G * hd * 2 + 16));
        float *qf = sc + G * max_ctx, *acc = qf + G * hd, row[hd];
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * KVH; item++) {
            int64_t r = item / KVH, kh = item % KVH, n = ctx[r];
            const int64_t *sl = slot_tab + off[r];
            const T *Kb = pool + kh * cap1 * hd, *Vb = pool + (KVH + kh) * cap1 * hd;
            for (int64_t g = 0; g < G; g++)
                for (int64_t i = 0; i < hd; i++)
                    qf[g * hd + i] = LD(q[r * q_stride + (kh * G + g) * hd + i]);
            float mx[G];
            for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const T *k = Kb + sl[j] * hd;
                for (int64_t i = 0; i < hd; i++) row[i] = LD(k[i]);
                for (int64_t g = 0; g < G; g++) {
                    float s = fdot(qf + g * hd, row, hd) * scale;
                    sc[g * max_ctx + j] = s;
                    if (s > mx[g]) mx[g] = s;
                }
            }
            float l[G];
            for (int64_t g = 0; g < G; g++) {
                float *sg = sc + g * max_ctx, m = mx[g];
                for (int64_t j = 0; j < n; j++) sg[j] = fexp(sg[j] - m);
                l[g] = FN(vsum)(sg, n);
            }
            memset(acc, 0, sizeof(float) * G * hd);
            for (int64_t j = 0; j < n; j++) {
                const T *v = Vb + sl[j] * hd;
                for (int64_t i = 0; i < hd; i++) row[i] = LD(v[i]);
                for (int64_t g = 0; g < G; g++) {
                    float p = sc[g * max_ctx + j], *a = acc + g * hd;
                    for (int64_t i = 0; i < hd; i++) a[i] += p * row[i];
                }
            }
            for (int64_t g = 0; g < G; g++) {
                T *o = out + r * H * hd + (kh * G + g) * hd;
                float il = 1.0f / l[g];
                for (int64_t i = 0; i < hd; i++) o[i] = ST(acc[g * hd + i] * il);
            }
        }
        free(sc);
    }
}

/* ---------------------------------------------------------------- LoRA (model/lora.py)
 * One item = up to LORA_RB rows of one adapter slot (lrows[litems[i] .. litems[i+1])); its record
 * `rec` (kernel_abi.LORA_RECORD) holds the slot's float32 A rows and B^T parts for one linear layer.
 * y[row][off + c] = T(y + sum_j s_j B^T[j][c]) with s = x[row] . A^T: the shrink sums K in LANES
 * partial sums and a fixed tree, the expand sums the rank in order, all in float32 and per row, so
 * a row's bits do not depend on the rows beside it (its item, its step): the batch-invariant rule.
 * PEFT's order of roundings: the base output is rounded already, the update is added in float32
 * and the sum rounded once. */
#ifdef __AVX512F__
/* The same sums in AVX-512, a whole item at a time (n <= LORA_RB rows, a literal n through
 * lora_item's switch, so the accumulators stay in registers): each A row and each B^T vector is
 * loaded once for the item's rows, where the scalar form reloaded it per row, and the output
 * rows are converted 16 lanes at a time. Per row the arithmetic is the scalar form's: the
 * shrink's 16 lane partial sums (an FMA each, k in order), _mm512_reduce_add_ps (hsum) plus the
 * tail; the expand's sum over j in order from 0 by FMAs; one rounding of y + update. */
/* s[i][j .. j + J) for the item's n rows: J A rows at once, so that each x vector loaded serves
 * J FMAs (the load ports, not the FMAs, bound the one-row-of-A form) */
static inline __attribute__((always_inline)) void FN(lora_shrink_rows)(const float *xf, int64_t K, const float *A,
                                                                      int64_t R, int64_t j, float *s, int n, int J) {
    __m512 acc[4][LORA_RB];
    for (int q = 0; q < J; q++)
        for (int i = 0; i < n; i++) acc[q][i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 av[4];
        for (int q = 0; q < J; q++) av[q] = _mm512_loadu_ps(A + (j + q) * K + k);
        for (int i = 0; i < n; i++) {
            const __m512 xv = _mm512_loadu_ps(xf + i * K + k);
            for (int q = 0; q < J; q++) acc[q][i] = _mm512_fmadd_ps(xv, av[q], acc[q][i]);
        }
    }
    for (int q = 0; q < J; q++)
        for (int i = 0; i < n; i++) {
            const float *a = A + (j + q) * K;
            float t = 0.f;
            for (int64_t kk = k; kk < K; kk++) t += xf[i * K + kk] * a[kk];
            s[i * R + j + q] = _mm512_reduce_add_ps(acc[q][i]) + t;
        }
}

static inline __attribute__((always_inline)) void FN(lora_shrink_v)(const float *xf, int64_t K, const float *A,
                                                                   int64_t R, float *s, int n) {
    int64_t j = 0;
    for (; j + 4 <= R; j += 4) FN(lora_shrink_rows)(xf, K, A, R, j, s, n, 4);
    for (; j < R; j++) FN(lora_shrink_rows)(xf, K, A, R, j, s, n, 1);
}

/* y[rows[i]][off + c ..] += s[i][roff ..] . B^T[.., c ..] for 16 * C columns from c */
static inline __attribute__((always_inline)) void FN(lora_expand_v)(const float *s, int64_t R, const float *Bt,
        int64_t N, int64_t r, int64_t c, T *y, int64_t ldy, const int64_t *rows, int n, int C) {
    __m512 acc[LORA_RB][4];
    for (int i = 0; i < n; i++)
        for (int q = 0; q < C; q++) acc[i][q] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; j++) {
        const float *b = Bt + j * N + c;
        __m512 bv[4];
        for (int q = 0; q < C; q++) bv[q] = _mm512_loadu_ps(b + 16 * q);
        for (int i = 0; i < n; i++) {
            const __m512 sv = _mm512_set1_ps(s[i * R + j]);
            for (int q = 0; q < C; q++) acc[i][q] = _mm512_fmadd_ps(sv, bv[q], acc[i][q]);
        }
    }
    for (int i = 0; i < n; i++) {
        T *yr = y + rows[i] * ldy + c;
        for (int q = 0; q < C; q++) VST16(yr + 16 * q, _mm512_add_ps(VLD16(yr + 16 * q), acc[i][q]));
    }
}

static inline __attribute__((always_inline)) void FN(lora_item_v)(const float *xf, int64_t K, T *y, int64_t ldy,
        const int64_t *rec, const int64_t *rows, float *s, int n) {
    const float *A = (const float *)(intptr_t)rec[LR_A];
    const int64_t R = rec[LR_RANK], np = rec[LR_PARTS];
    FN(lora_shrink_v)(xf, K, A, R, s, n);
    for (int64_t p = 0; p < np; p++) {
        const int64_t *f = rec + LR_B0 + p * LR_PART;
        const float *Bt = (const float *)(intptr_t)f[0];
        const int64_t off = f[1], N = f[2], roff = f[3], r = f[4];
        T *yo = y + off;
        int64_t c = 0;
        for (; c + 64 <= N; c += 64) FN(lora_expand_v)(s + roff, R, Bt, N, r, c, yo, ldy, rows, n, 4);
        for (; c + 16 <= N; c += 16) FN(lora_expand_v)(s + roff, R, Bt, N, r, c, yo, ldy, rows, n, 1);
        for (; c < N; c++)
            for (int i = 0; i < n; i++) {
                float acc = 0.f;
                for (int64_t j = 0; j < r; j++) acc += s[i * R + roff + j] * Bt[j * N + c];
                T *yr = yo + rows[i] * ldy + c;
                *yr = ST(LD(*yr) + acc);
            }
    }
}
#endif

static void FN(lora_item)(const T *x, int64_t K, T *y, int64_t ldy, const int64_t *rec,
                          const int64_t *rows, int64_t n) {
    const float *A = (const float *)(intptr_t)rec[LR_A];
    const int64_t R = rec[LR_RANK], np = rec[LR_PARTS];
    float xf[LORA_RB][K], s[LORA_RB][R];
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < K; k++) xf[i][k] = LD(x[rows[i] * K + k]);
#ifdef __AVX512F__
    _Static_assert(LORA_RB == 4, "one case per item size below");
    switch (n) {   /* a literal n per case: straight-line register code */
    case 4: FN(lora_item_v)(&xf[0][0], K, y, ldy, rec, rows, &s[0][0], 4); return;
    case 3: FN(lora_item_v)(&xf[0][0], K, y, ldy, rec, rows, &s[0][0], 3); return;
    case 2: FN(lora_item_v)(&xf[0][0], K, y, ldy, rec, rows, &s[0][0], 2); return;
    default: FN(lora_item_v)(&xf[0][0], K, y, ldy, rec, rows, &s[0][0], 1); return;
    }
#endif
    for (int64_t j = 0; j < R; j++) {   /* each A row is read once for the item's rows */
        const float *a = A + j * K;
        for (int64_t i = 0; i < n; i++) {
            float acc[LANES] = {0}, t = 0.f;
            int64_t k = 0;
            for (; k + LANES <= K; k += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += xf[i][k + l] * a[k + l];
            for (; k < K; k++) t += xf[i][k] * a[k];
            s[i][j] = hsum(acc) + t;
        }
    }
    for (int64_t p = 0; p < np; p++) {
        const int64_t *f = rec + LR_B0 + p * LR_PART;
        const float *Bt = (const float *)(intptr_t)f[0];
        const int64_t off = f[1], N = f[2], roff = f[3], r = f[4];
        int64_t c = 0;
        for (; c + LANES <= N; c += LANES)
            for (int64_t i = 0; i < n; i++) {
                float acc[LANES] = {0};
                for (int64_t j = 0; j < r; j++) {
                    const float sj = s[i][roff + j], *b = Bt + j * N + c;
                    for (int l = 0; l < LANES; l++) acc[l] += sj * b[l];
                }
                T *yr = y + rows[i] * ldy + off + c;
                for (int l = 0; l < LANES; l++) yr[l] = ST(LD(yr[l]) + acc[l]);
            }
        for (; c < N; c++)
            for (int64_t i = 0; i < n; i++) {
                float acc = 0.f;
                for (int64_t j = 0; j < r; j++) acc += s[i][roff + j] * Bt[j * N + c];
                T *yr = y + rows[i] * ldy + off + c;
                *yr = ST(LD(*yr) + acc);
            }
    }
}

/* the items of one linear layer's LoRA, shared out by an orphaned `omp for` (lora's own region,
 * or forward_bf16's); rec: the layer-linear's records, one per adapter slot */
static void FN(lora_items)(const T *x, int64_t K, T *y, int64_t ldy, const int64_t *rec, const int64_t *lrows,
                           const int64_t *litems, const int64_t *lslot, int64_t nitems) {
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < nitems; it++) {
        const int64_t *rc = rec + lslot[it] * LR_N;
        if (rc[LR_A]) FN(lora_item)(x, K, y, ldy, rc, lrows + litems[it], litems[it + 1] - litems[it]);
    }
}

KERNEL(void, FN(lora), const T *x, int64_t K, T *y, int64_t ldy, const int64_t *rec, const int64_t *lrows,
       const int64_t *litems, const int64_t *lslot, int64_t nitems) {
    #pragma omp parallel if(nitems > 1)
    FN(lora_items)(x, K, y, ldy, rec, lrows, litems, lslot, nitems);
}
