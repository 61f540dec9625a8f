/* Softmax attention in blocks for ext/kernels/_kernels.pyx (`attention`,
 * `latent_attention`).
 *
 * One call of moed_attend_rows computes up to MOED_AQ query rows that read the same
 * keys and values (the query heads of one key/value head, for a few consecutive tokens;
 * or, for MLA's shared latent cache, several heads and tokens): the keys are read once
 * per block of rows instead of once per row, and the values once per 4 rows.
 *
 * The arithmetic of a row is fixed by its query, its key range [lo, hi) and the
 * cache alone, so a row's output does not depend on which rows share its call, on
 * the thread count or on the prompt's chunking (the placement rule):
 *   1. score_s = moed_dot(q, k_s, Dk) * scale for lo <= s < hi (moed_dot's order:
 *      two 16-lane accumulators over 32-column steps, a 16-column step, the fixed
 *      tree of moed_hsum16, then a sequential scalar tail). The SIMD paths compute 16
 *      keys' accumulators and reduce them together with shuffles that pair the lanes
 *      exactly as moed_hsum16 does (l with l + 8, then + 4, + 2, + 1), so each score
 *      has moed_dot's bits.
 *   2. m = the largest score (and the sink logit, when there is one).
 *   3. e_s = moed_exp(score_s - m), moed_exp below (every path, same bits).
 *   4. total: lane j of a 16-lane accumulator adds e_{lo + 16 i + j} for i = 0, 1, ..
 *      in order, from 0; then moed_hsum16's tree; then the last (hi - lo) mod 16 terms
 *      one by one in key order; then moed_exp(sink - m) when there is a sink.
 *   5. acc_d = sum over s in key order of e_s * v_s[d], one fma per term, from 0;
 *      out_d = acc_d / total.
 * moed_exp(x), for x <= 0 (every score minus the maximum), after Cephes' expf
 * (S. L. Moshier, cephes/single/expf.c): 0 when x < -87 (e^-87 = 1.6e-38, below any
 * total, which is >= 1 as the maximum contributes e^0); else n = rint(x * log2(e))
 * (one fma against 1.5 * 2^23), r = x - n * ln2 in two fma steps (Cody-Waite, ln2 =
 * 0.693359375 - 2.12194440e-4), p = Cephes' degree-5 polynomial in r (Horner, fma),
 * y = (p * r^2 + r) + 1, and e^x = y * 2^n. Error below 2 ulp on [-87, 0].
 */
#ifndef MOED_ATTN_IMPL_H
#define MOED_ATTN_IMPL_H

#include "_kernels_impl.h"

#define MOED_AQ 8   /* query rows per call at most */

/* ---------------------------------------------------------------- exp */

static const float moed_exp_c[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                                    4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

/* 2^n for the integral n held (exactly) in t - 1.5 * 2^23, -126 <= n <= 127. */
#if defined(MOED_V16_AVX512)
static inline moed_v16 moed_v16_pow2(moed_v16 t) {
    __m512i n = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4b400000));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
/* a where x >= lim, else 0 */
static inline moed_v16 moed_v16_zero_below(moed_v16 a, moed_v16 x, float lim) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_NLT_UQ), a);
}
#elif defined(MOED_V16_AVX2)
static inline __m256 moed_v8_pow2(__m256 t) {
    __m256i n = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4b400000));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
static inline moed_v16 moed_v16_pow2(moed_v16 t) {
    return (moed_v16){moed_v8_pow2(t.lo), moed_v8_pow2(t.hi)};
}
static inline moed_v16 moed_v16_zero_below(moed_v16 a, moed_v16 x, float lim) {
    __m256 l = _mm256_set1_ps(lim);
    return (moed_v16){_mm256_and_ps(a.lo, _mm256_cmp_ps(x.lo, l, _CMP_NLT_UQ)),
                      _mm256_and_ps(a.hi, _mm256_cmp_ps(x.hi, l, _CMP_NLT_UQ))};
}
#else
static inline moed_v16 moed_v16_pow2(moed_v16 t) {
    moed_vu32 u;
    moed_v16 r;
    memcpy(&u, &t, sizeof u);
    u = ((u - 0x4b400000u) + 127u) << 23;
    memcpy(&r, &u, sizeof r);
    return r;
}
static inline moed_v16 moed_v16_zero_below(moed_v16 a, moed_v16 x, float lim) {
    for (int l = 0; l < 16; l++)
        if (x[l] < lim) a[l] = 0.0f;
    return a;
}
#endif

/* e^x per lane for x <= 0 (the rule in the header comment). */
static inline moed_v16 moed_v16_exp(moed_v16 x) {
    const moed_v16 magic = moed_v16_set1(12582912.0f);          /* 1.5 * 2^23 */
    moed_v16 xc = moed_v16_zero_below(x, x, -87.0f);             /* keeps n >= -126 */
    moed_v16 t = moed_v16_fma(xc, moed_v16_set1(1.44269504088896341f), magic);
    moed_v16 n = moed_v16_add(t, moed_v16_set1(-12582912.0f));
    moed_v16 r = moed_v16_fma(n, moed_v16_set1(-0.693359375f), xc);
    r = moed_v16_fma(n, moed_v16_set1(2.12194440e-4f), r);
    moed_v16 p = moed_v16_set1(moed_exp_c[0]);
    for (int i = 1; i < 6; i++) p = moed_v16_fma(p, r, moed_v16_set1(moed_exp_c[i]));
    moed_v16 y = moed_v16_fma(p, moed_v16_mul(r, r), r);
    y = moed_v16_add(y, moed_v16_set1(1.0f));
    return moed_v16_zero_below(moed_v16_mul(y, moed_v16_pow2(t)), x, -87.0f);
}

/* The largest of n values (NaN ignored; -inf when there is none): a lane maximum
 * that keeps the running value on ties and NaN, as `if (x > m) m = x` does. */
#if defined(MOED_V16_AVX512)
static inline moed_v16 moed_v16_max_keep(moed_v16 x, moed_v16 m) { return _mm512_max_ps(x, m); }
#elif defined(MOED_V16_AVX2)
static inline moed_v16 moed_v16_max_keep(moed_v16 x, moed_v16 m) {
    return (moed_v16){_mm256_max_ps(x.lo, m.lo), _mm256_max_ps(x.hi, m.hi)};
}
#else
static inline moed_v16 moed_v16_max_keep(moed_v16 x, moed_v16 m) {
    for (int l = 0; l < 16; l++)
        if (x[l] > m[l]) m[l] = x[l];
    return m;
}
#endif
static inline float moed_max(const float *x, ptrdiff_t n) {
    moed_v16 mv = moed_v16_set1(-INFINITY);
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) mv = moed_v16_max_keep(moed_v16_load(x + j), mv);
    float l[16], m = -INFINITY;
    moed_v16_store(l, mv);
    for (int i = 0; i < 16; i++)
        if (l[i] > m) m = l[i];
    for (; j < n; j++)
        if (x[j] > m) m = x[j];
    return m;
}

/* e_s = moed_exp(x_s - m) in place for n values, and their total in step 4's order. */
static inline float moed_exp_sum(float *x, ptrdiff_t n, float m) {
    moed_v16 nm = moed_v16_set1(-m), acc = moed_v16_zero();   /* x + (-m) == x - m */
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) {
        moed_v16 e = moed_v16_exp(moed_v16_add(moed_v16_load(x + j), nm));
        moed_v16_store(x + j, e);
        acc = moed_v16_add(acc, e);
    }
    float total = moed_v16_hsum(acc);
    if (j < n) {
        float buf[16];
        const int rest = (int)(n - j);
        for (int i = 0; i < 16; i++) buf[i] = i < rest ? x[j + i] : 0.0f;
        moed_v16 e = moed_v16_exp(moed_v16_add(moed_v16_load(buf), nm));
        moed_v16_store(buf, e);
        for (int i = 0; i < rest; i++) {
            x[j + i] = buf[i];
            total = total + buf[i];
        }
    }
    return total;
}

/* moed_exp(x) of one value (the lanes' arithmetic). */
static inline float moed_exp1(float x) {
    float buf[16];
    moed_v16_store(buf, moed_v16_exp(moed_v16_set1(x)));
    return buf[0];
}

/* ---------------------------------------------------------------- scores */

/* a0 + a1 of moed_dot(q, k, n) (f32) before its tree, over the first n & ~15 columns. */
static inline moed_v16 moed_dot_lanes(const float *q, const float *k, ptrdiff_t n) {
    moed_v16 a0 = moed_v16_zero(), a1 = moed_v16_zero();
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        a0 = moed_v16_fma(moed_v16_load(q + j), moed_v16_load(k + j), a0);
        a1 = moed_v16_fma(moed_v16_load(q + j + 16), moed_v16_load(k + j + 16), a1);
    }
    if (j + 16 <= n) a0 = moed_v16_fma(moed_v16_load(q + j), moed_v16_load(k + j), a0);
    return moed_v16_add(a0, a1);
}

/* Lane j = moed_hsum16 of v[j]'s lanes, for 16 vectors, in moed_hsum16's pairing. */
#if defined(MOED_V16_AVX512)
static inline moed_v16 moed_tree16(const moed_v16 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)      /* lanes l + (l + 8): [key 2i | key 2i+1] */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)      /* + 4: 128-bit chunk c holds key 4i + c */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)      /* + 2 */
        c[i] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]))));
    /* + 1: lane 4c + p holds key 4p + c */
    __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(idx, d);
}
#elif defined(MOED_V16_AVX2)
static inline moed_v16 moed_tree16(const moed_v16 v[16]) {
    __m256 a[16], b[8], c[4], d[2];
    for (int i = 0; i < 16; i++) a[i] = _mm256_add_ps(v[i].lo, v[i].hi);   /* l + (l + 8) */
    for (int i = 0; i < 8; i++)      /* + 4: 128-bit half h holds key 2i + h */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 4; i++)      /* + 2 */
        c[i] = _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]))),
            _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]))));
    /* + 1: in d[i], lane 4h + p holds key 8i + 2p + h */
    const __m256i idx = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < 2; i++)
        d[i] = _mm256_permutevar8x32_ps(_mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0x88),
                                                      _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0xDD)), idx);
    return (moed_v16){d[0], d[1]};
}
#else
static inline moed_v16 moed_tree16(const moed_v16 v[16]) {
    moed_v16 r;
    for (int i = 0; i < 16; i++) r[i] = moed_v16_hsum(v[i]);
    return r;
}
#endif

/* moed_dot_lanes with the query's 16-column vectors already loaded: qv[c] holds
 * columns 16c.. of q, nv = D / 16 of them (moed_dot's order: a0 takes the even
 * vectors, a1 the odd ones, a last odd-numbered vector goes to a0). */
static inline moed_v16 moed_dot_lanes_qv(const moed_v16 *qv, int nv, const float *k) {
    moed_v16 a0 = moed_v16_zero(), a1 = moed_v16_zero();
    int c = 0;
    for (; c + 2 <= nv; c += 2) {
        a0 = moed_v16_fma(qv[c], moed_v16_load(k + 16 * c), a0);
        a1 = moed_v16_fma(qv[c + 1], moed_v16_load(k + 16 * c + 16), a1);
    }
    if (c < nv) a0 = moed_v16_fma(qv[c], moed_v16_load(k + 16 * c), a0);
    return moed_v16_add(a0, a1);
}

/* 16 keys from s: their scores into score[s..s+15]; qv/nv as above (nv <= 8) or
 * NULL (the query read from q). */
static inline void moed_scores16(const float *q, const moed_v16 *qv, int nv, const float *k,
                                 ptrdiff_t ks, ptrdiff_t D, ptrdiff_t s, float scale, float *score) {
    const ptrdiff_t D16 = D & ~(ptrdiff_t)15;
    moed_v16 v[16];
    float t[16];
    for (int i = 0; i < 16; i++)
        v[i] = qv != NULL ? moed_dot_lanes_qv(qv, nv, k + (s + i) * ks)
                          : moed_dot_lanes(q, k + (s + i) * ks, D);
    if (D16 == D) {
        moed_v16_store(score + s, moed_v16_mul(moed_tree16(v), moed_v16_set1(scale)));
        return;
    }
    moed_v16_store(t, moed_tree16(v));
    for (int i = 0; i < 16; i++) {
        float d = t[i];
        for (ptrdiff_t j = D16; j < D; j++) d = fmaf(q[j], k[(s + i) * ks + j], d);
        score[s + i] = d * scale;
    }
}

/* score[s] = moed_dot(q, k + s * ks, D) * scale for s in [lo, hi). */
static inline void moed_scores(const float *q, const float *k, ptrdiff_t ks, ptrdiff_t D,
                               ptrdiff_t lo, ptrdiff_t hi, float scale, float *score) {
    const ptrdiff_t D16 = D & ~(ptrdiff_t)15;
    const int nv = (int)(D16 / 16);
    ptrdiff_t s = lo;
    if (nv <= 8) {                     /* the query stays in registers (D <= 143) */
        moed_v16 qv[8];
        for (int c = 0; c < nv; c++) qv[c] = moed_v16_load(q + 16 * c);
        switch (nv) {                  /* constant trip counts: the loops unroll */
#define MOED_SCORES_NV(N) case N: {                                          \
            for (; s + 16 <= hi; s += 16) moed_scores16(q, qv, N, k, ks, D, s, scale, score); \
            break; }
        MOED_SCORES_NV(1) MOED_SCORES_NV(2) MOED_SCORES_NV(3) MOED_SCORES_NV(4)
        MOED_SCORES_NV(5) MOED_SCORES_NV(6) MOED_SCORES_NV(7) MOED_SCORES_NV(8)
#undef MOED_SCORES_NV
        default: break;
        }
    } else {
        for (; s + 16 <= hi; s += 16) moed_scores16(q, NULL, 0, k, ks, D, s, scale, score);
    }
    for (; s < hi; s++) {
        moed_v16 v = moed_dot_lanes(q, k + s * ks, D);
        float d = moed_v16_hsum(v);
        for (ptrdiff_t j = D16; j < D; j++) d = fmaf(q[j], k[s * ks + j], d);
        score[s] = d * scale;
    }
}

/* ---------------------------------------------------------------- values */

/* acc[r][c] = fma(e[r][s], v_s[d0 + 16c ..], acc[r][c]) for r < NR, c < NC and the keys
 * s in [a, b) in order. Called with constant NR and NC, the accumulators live in
 * registers for the span. */
static inline __attribute__((always_inline)) void
moed_pv_span(const int NR, const int NC, moed_v16 (*acc)[4], float *const *e, ptrdiff_t a,
             ptrdiff_t b, const float *v, ptrdiff_t vs, ptrdiff_t d0) {
    moed_v16 loc[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) loc[r][c] = acc[r][c];
    for (ptrdiff_t s = a; s < b; s++) {
        moed_v16 vv[4];
        for (int c = 0; c < NC; c++) vv[c] = moed_v16_load(v + s * vs + d0 + 16 * c);
        for (int r = 0; r < NR; r++) {
            moed_v16 p = moed_v16_set1(e[r][s]);
            for (int c = 0; c < NC; c++) loc[r][c] = moed_v16_fma(p, vv[c], loc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = loc[r][c];
}

/* The spans of moed_pv4 with NC columns vectors: each row's keys before the rows'
 * common keys, the common keys for all rows at once, each row's keys after them. */
static inline __attribute__((always_inline)) void
moed_pv_rows(const int NC, int nr, moed_v16 (*acc)[4], float *const *e, const ptrdiff_t *lo,
             const ptrdiff_t *hi, ptrdiff_t L, ptrdiff_t H, const float *v, ptrdiff_t vs,
             ptrdiff_t d0) {
    for (int r = 0; r < nr; r++) moed_pv_span(1, NC, acc + r, e + r, lo[r], L, v, vs, d0);
    switch (nr) {
    case 4: moed_pv_span(4, NC, acc, e, L, H, v, vs, d0); break;
    case 3: moed_pv_span(3, NC, acc, e, L, H, v, vs, d0); break;
    case 2: moed_pv_span(2, NC, acc, e, L, H, v, vs, d0); break;
    default: moed_pv_span(1, NC, acc, e, L, H, v, vs, d0); break;
    }
    for (int r = 0; r < nr; r++)
        moed_pv_span(1, NC, acc + r, e + r, H > lo[r] ? H : lo[r], hi[r], v, vs, d0);
}

/* out_r[d] = (sum over s in [lo_r, hi_r), in order, of e_r[s] * v_s[d]) / total_r for
 * nr <= 4 rows, 16 * nc columns from d0 (nc <= 4). */
static inline void moed_pv4(int nr, float *const *e, const ptrdiff_t *lo, const ptrdiff_t *hi,
                            const float *total, const float *v, ptrdiff_t vs, ptrdiff_t d0,
                            int nc, float *const *out) {
    moed_v16 acc[4][4];
    ptrdiff_t L = lo[0], H = hi[0];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = moed_v16_zero();
    for (int r = 0; r < nr; r++) {
        if (lo[r] > L) L = lo[r];
        if (hi[r] < H) H = hi[r];
    }
    if (L > H) L = H;
    switch (nc) {
    case 4: moed_pv_rows(4, nr, acc, e, lo, hi, L, H, v, vs, d0); break;
    case 3: moed_pv_rows(3, nr, acc, e, lo, hi, L, H, v, vs, d0); break;
    case 2: moed_pv_rows(2, nr, acc, e, lo, hi, L, H, v, vs, d0); break;
    default: moed_pv_rows(1, nr, acc, e, lo, hi, L, H, v, vs, d0); break;
    }
    for (int r = 0; r < nr; r++) {
        for (int c = 0; c < nc; c++) {
            float buf[16];
            moed_v16_store(buf, acc[r][c]);
            for (int i = 0; i < 16; i++) out[r][d0 + 16 * c + i] = buf[i] / total[r];
        }
    }
}

/* ---------------------------------------------------------------- rows */

/* nq <= MOED_AQ query rows over one key/value cache: row r's query q[r] (Dk floats)
 * attends keys lo[r] <= s < hi[r] at k + s * ks (Dk floats) with values at
 * v + s * vs (Dv floats); out[r] gets Dv floats. sink: NULL or nq sink logits.
 * scores: nq * sstride floats of scratch, sstride >= max hi. The rule is in the
 * header comment. */
static void moed_attend_rows(int nq, const float *const *q, float *const *out,
                             const ptrdiff_t *lo, const ptrdiff_t *hi, const float *sink,
                             const float *k, ptrdiff_t ks, const float *v, ptrdiff_t vs,
                             ptrdiff_t Dk, ptrdiff_t Dv, float scale, float *scores,
                             ptrdiff_t sstride) {
    float *e[MOED_AQ];
    float total[MOED_AQ];
    ptrdiff_t klo = lo[0], khi = hi[0];
    for (int r = 0; r < nq; r++) {
        e[r] = scores + r * sstride;
        if (lo[r] < klo) klo = lo[r];
        if (hi[r] > khi) khi = hi[r];
    }
    /* 1. scores, 16 keys at a time; the block of keys is read by every row */
    for (ptrdiff_t s0 = klo; s0 < khi; s0 += 64) {
        ptrdiff_t s1 = s0 + 64 < khi ? s0 + 64 : khi;
        for (int r = 0; r < nq; r++) {
            ptrdiff_t a = lo[r] > s0 ? lo[r] : s0, b = hi[r] < s1 ? hi[r] : s1;
            if (a < b) moed_scores(q[r], k, ks, Dk, a, b, scale, e[r]);
        }
    }
    /* 2-4. maximum, exponentials, total */
    for (int r = 0; r < nq; r++) {
        float m = moed_max(e[r] + lo[r], hi[r] - lo[r]);   /* which of +-0 wins is immaterial */
        if (sink != NULL && sink[r] > m) m = sink[r];
        total[r] = moed_exp_sum(e[r] + lo[r], hi[r] - lo[r], m);
        if (sink != NULL) total[r] = total[r] + moed_exp1(sink[r] - m);
    }
    /* 5. values, 4 rows x 64 columns a pass */
    const ptrdiff_t Dv16 = Dv & ~(ptrdiff_t)15;
    for (int r0 = 0; r0 < nq; r0 += 4) {
        int nr = nq - r0 < 4 ? nq - r0 : 4;
        for (ptrdiff_t d0 = 0; d0 < Dv16; d0 += 64) {
            int nc = (int)((Dv16 - d0) / 16 < 4 ? (Dv16 - d0) / 16 : 4);
            moed_pv4(nr, e + r0, lo + r0, hi + r0, total + r0, v, vs, d0, nc, out + r0);
        }
        for (int r = r0; r < r0 + nr; r++)
            for (ptrdiff_t d = Dv16; d < Dv; d++) {
                float a = 0.0f;
                for (ptrdiff_t s = lo[r]; s < hi[r]; s++) a = fmaf(e[r][s], v[s * vs + d], a);
                out[r][d] = a / total[r];
            }
    }
}

#endif
