/* Fast numerics of bf16 weights ("bf16-dp") for ext/kernels/_kernels.pyx: activations
 * rounded to bf16 and pairs of bf16 products accumulated as AVX-512 BF16's VDPBF16PS
 * does, on every path (the rule is in the module docstring of _kernels.pyx).
 *
 * - Activations: moed_bf16_round (round to nearest even, NaN kept quiet, subnormals to
 *   signed zero), into the xb plane of a moed_qact (rows padded with zeros to a
 *   multiple of 32 columns).
 * - A row's dot: 16 f32 lanes from +0; step i (columns 32i .. 32i + 31, the last step
 *   padded with zero weights and activations) does, in lane l,
 *       acc = flush(fma(w[32i + 2l + 1], x[32i + 2l + 1], acc))
 *       acc = flush(fma(w[32i + 2l], x[32i + 2l], acc))
 *   with the weights flushed too (flush: a subnormal becomes a zero of its sign), which
 *   is VDPBF16PS's definition ("FP32 FMA with DAZ in, FTZ out, RNE", Intel SDM); then
 *   moed_hsum16's tree (plain f32 adds). One accumulator per row: the mat-vec's and every
 *   mat-mat tile's arithmetic is the same, so rows are bit-equal whatever T is.
 * - Paths: "avx512-bf16" (VDPBF16PS, 32 products an instruction); every other build
 *   computes the same operations with f32 fma and explicit flushes ("emulated", no
 *   faster than exact mode); simd = 0 runs the plain scalar reference.
 */
#ifndef MOED_BDOT_IMPL_H
#define MOED_BDOT_IMPL_H

#include "_kernels_impl.h"

/* x rounded to bf16: nearest, ties to even; NaN stays NaN (quiet); a result below the
 * smallest normal bf16 (exponent bits 0) becomes a zero of its sign. */
static inline uint16_t moed_bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    if ((r & 0x7f80u) == 0) r &= 0x8000u;
    return r;
}

/* A subnormal f32 becomes a zero of its sign; everything else is kept. */
static inline float moed_flush1(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&v, &u, 4);
    return v;
}

#if defined(__AVX512BF16__) && defined(MOED_V16_AVX512)
#define MOED_B_AVX512 1
#endif

static inline const char *moed_bf16_fast_path(void) {
#if defined(MOED_B_AVX512)
    return "avx512-bf16";
#else
    return "emulated";
#endif
}

#if defined(MOED_V16_AVX512)
static inline moed_v16 moed_v16_flush(moed_v16 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 sub = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(_mm512_mask_and_epi32(u, sub, u, _mm512_set1_epi32((int)0x80000000u)));
}
#elif defined(MOED_V16_AVX2)
static inline __m256 moed_v8_flush(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f800000)),
                                           _mm256_setzero_si256());
    const __m256i keep = _mm256_or_si256(_mm256_andnot_si256(sub, _mm256_set1_epi32(-1)),
                                         _mm256_set1_epi32((int)0x80000000u));
    return _mm256_castsi256_ps(_mm256_and_si256(u, keep));
}
static inline moed_v16 moed_v16_flush(moed_v16 v) {
    return (moed_v16){moed_v8_flush(v.lo), moed_v8_flush(v.hi)};
}
#else
static inline moed_v16 moed_v16_flush(moed_v16 v) {
    for (int l = 0; l < 16; l++) v[l] = moed_flush1(v[l]);
    return v;
}
#endif

/* The row's 16 lanes for one step of 32 columns: w and x are 32 bf16 values each. */
static inline __attribute__((always_inline)) moed_v16
moed_bstep_emulated(moed_v16 acc, moed_v16 we, moed_v16 wo, moed_v16 xe, moed_v16 xo) {
    acc = moed_v16_flush(moed_v16_fma(wo, xo, acc));
    return moed_v16_flush(moed_v16_fma(we, xe, acc));
}

/* Rows NR (constant) of weight rows w[k] (bf16, n columns) against tokens NT (constant)
 * of bf16 activations x[j] (padded to a multiple of 32 with zeros): out[j * ldo + k]. */
static inline __attribute__((always_inline)) void
moed_btile(const int NR, const int NT, const uint16_t *const *w, ptrdiff_t n,
           const uint16_t *const *x, float *out, ptrdiff_t ldo, int prefetch) {
    moed_v16 acc[8][4];
    for (int k = 0; k < NR; k++)
        for (int j = 0; j < NT; j++) acc[k][j] = moed_v16_zero();
    const ptrdiff_t nfull = n & ~(ptrdiff_t)31;
    for (ptrdiff_t c = 0; c < n; c += 32) {
        const int tail = c >= nfull;
#if defined(MOED_B_AVX512)
        __m512bh xv[4];
        for (int j = 0; j < NT; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x[j] + c);
        for (int k = 0; k < NR; k++) {
            if (prefetch) {
                __builtin_prefetch((const char *)(w[k] + c) + MOED_PREFETCH_BYTES);
                moed_prefetch_l2(w[k], 2 * c, 2 * n, NR);
            }
            const __m512i wr = tail ? _mm512_maskz_loadu_epi16((__mmask32)((1ull << (n - c)) - 1), w[k] + c)
                                    : _mm512_loadu_si512(w[k] + c);
            for (int j = 0; j < NT; j++) acc[k][j] = _mm512_dpbf16_ps(acc[k][j], (__m512bh)wr, xv[j]);
        }
#else
        moed_v16 xe[4], xo[4];
        for (int j = 0; j < NT; j++) moed_v16_load_bf16_pairs(x[j] + c, &xe[j], &xo[j]);
        for (int k = 0; k < NR; k++) {
            moed_v16 we, wo;
            if (tail) {
                uint16_t buf[32] = {0};
                memcpy(buf, w[k] + c, (size_t)(n - c) * 2);
                moed_v16_load_bf16_pairs(buf, &we, &wo);
            } else {
                if (prefetch) {
                    __builtin_prefetch((const char *)(w[k] + c) + MOED_PREFETCH_BYTES);
                    moed_prefetch_l2(w[k], 2 * c, 2 * n, NR);
                }
                moed_v16_load_bf16_pairs(w[k] + c, &we, &wo);
            }
            we = moed_v16_flush(we);
            wo = moed_v16_flush(wo);
            for (int j = 0; j < NT; j++) acc[k][j] = moed_bstep_emulated(acc[k][j], we, wo, xe[j], xo[j]);
        }
#endif
    }
    for (int k = 0; k < NR; k++)
        for (int j = 0; j < NT; j++) out[j * ldo + k] = moed_v16_hsum(acc[k][j]);
}

/* The scalar reference of the rule (simd = 0): out = y of row w (n columns) for x. */
static inline float moed_bdot_portable(const uint16_t *w, ptrdiff_t n, const uint16_t *x) {
    float acc[16] = {0};
    for (ptrdiff_t c = 0; c < n; c += 32)
        for (int l = 0; l < 16; l++) {
            for (int h = 1; h >= 0; h--) {
                const ptrdiff_t i = c + 2 * l + h;
                const float wv = i < n ? moed_flush1(moed_bf16_to_f32(w[i])) : 0.0f;
                acc[l] = moed_flush1(fmaf(wv, moed_bf16_to_f32(x[i]), acc[l]));
            }
        }
    return moed_hsum16(acc);
}

/* out[j * ldo + k] = y of rows r0 + k (k < nrows <= 8, rows ldw elements apart, n
 * columns) for the T bf16 activation rows x + (t0 + j) * ldx. Tokens go 4 a pass over 4
 * rows at a time (two passes for 8 rows); one token streams all rows together. */
static inline void moed_bmatmul_rows(const uint16_t *w, ptrdiff_t ldw, ptrdiff_t r0, int nrows,
                                     ptrdiff_t n, const uint16_t *x, ptrdiff_t ldx, ptrdiff_t t0,
                                     ptrdiff_t T, float *out, ptrdiff_t ldo, int simd) {
    const uint16_t *rows[8];
    for (int k = 0; k < nrows; k++) rows[k] = w + (r0 + k) * ldw;
    if (!simd) {
        for (ptrdiff_t j = 0; j < T; j++)
            for (int k = 0; k < nrows; k++)
                out[j * ldo + k] = moed_bdot_portable(rows[k], n, x + (t0 + j) * ldx);
        return;
    }
    for (ptrdiff_t j = 0; j < T;) {
        const uint16_t *xs[4];
        const int nt = T - j >= 4 ? 4 : (int)(T - j);
        for (int i = 0; i < nt; i++) xs[i] = x + (t0 + j + i) * ldx;
        float *o = out + j * ldo;
        if (nt == 1) {
            switch (nrows) {
#define MOED_BT1(R) case R: moed_btile(R, 1, rows, n, xs, o, ldo, 1); break;
            MOED_BT1(8) MOED_BT1(7) MOED_BT1(6) MOED_BT1(5) MOED_BT1(4) MOED_BT1(3) MOED_BT1(2)
#undef MOED_BT1
            default: moed_btile(1, 1, rows, n, xs, o, ldo, 1); break;
            }
        } else {
            for (int k = 0; k < nrows; k += 4) {
                const int nr = nrows - k >= 4 ? 4 : nrows - k;
                switch (nr * 4 + nt) {
#define MOED_BT(R, N) case R * 4 + N: moed_btile(R, N, rows + k, n, xs, o + k, ldo, j == 0); break;
                MOED_BT(4, 4) MOED_BT(4, 3) MOED_BT(4, 2)
                MOED_BT(3, 4) MOED_BT(3, 3) MOED_BT(3, 2)
                MOED_BT(2, 4) MOED_BT(2, 3) MOED_BT(2, 2)
                MOED_BT(1, 4) MOED_BT(1, 3) MOED_BT(1, 2)
#undef MOED_BT
                default: break;
                }
            }
        }
        j += nt;
    }
}

#endif
