/* Fast numerics ("q8x2-32") for ext/kernels/_kernels.pyx: activations quantised per
 * block of 32 columns into two int8 planes (the codes q1 at scale d and the residual q2
 * at scale e = d / 254), exact integer block dots of each plane with the weight codes, and
 * a fixed f32 combination of the blocks (the rules are in the module docstring of
 * _kernels.pyx; one plane, "q8-32", cost 5e-4 nats of KL on the default model).
 *
 * Design:
 * - An activation row is quantised once per call (moed_qact_row) into caller-owned
 *   scratch (moed_qact): the planes q1, q2 (int8), d, e (f32 scales), s1, s2 (int32 sums
 *   of q1, q2) and ds = d * (float)s1 + e * (float)s2 (the f32 factor the int4-with-mins
 *   term uses) per block. Rows are padded with zero blocks to a multiple of MOED_ICHUNK
 *   blocks, so every kernel step reads whole chunks.
 *   For the nibble formats (int4, mxfp4) both planes are stored permuted within each run
 *   of 4 blocks (128 columns): bytes 16i..16i+15 hold the even columns of block i, bytes
 *   64+16i.. its odd columns, which is where the low and high nibbles of the weight bytes
 *   land after a mask and a shift. int8 weights meet the planes in column order. Integer
 *   sums do not depend on the order of their terms, so the layout changes no bit.
 * - Per weight row r and block b the kernels compute the exact int32 S1_rb and S2_rb (any
 *   order, any width; each weight vector is loaded and decoded once and meets both
 *   planes), then t = (float)S1 * (sw * d), t = t + (float)S2 * (sw * e) (+ m * ds with
 *   int4 mins) per block, and add the blocks' t left to right in f32, from 0.0f. The
 *   SIMD paths compute S1 and S2 for 16 blocks of one row at a time (a chunk), then the
 *   16 t's with 16-lane f32 operations (each lane one (row, block), the same f32
 *   operations as the reference, in its order), then add them to the row's sum one by
 *   one, in block order. So every path gives the bits of the portable reference
 *   (moed_idot_rows_portable), for any rows per pass, thread count or alignment.
 * - Integer codes: int8 as stored; int4 with mins the nibble; int4 symmetric nibble - 8,
 *   summed as sum(nibble * q) - 8 * s; mxfp4 2 x E2M1 (-12..12), summed by the SIMD paths
 *   as sum((code + 12) * q) - 12 * s, so that the weight operand is unsigned (vpmaddubsw
 *   and vpdpbusd take unsigned x signed bytes). int8 with vpdpbusd: sum((c ^ 0x80) * q)
 *   - 128 * s; with vpmaddubsw (no VNNI): |c| * sign(q, c), whose pair sums stay below
 *   2^15 (|c| <= 128, |q| <= 127). Each plane's bias is taken off with its own sum
 *   (S1 = biased1 - bias * s1, S2 = biased2 - bias * s2).
 * - Paths, chosen at compile time (moed_fast_path()):
 *     "avx512-vnni": AVX-512 with VNNI; 64 weight bytes per vpdpbusd, two per weight
 *       vector (one per plane).
 *     "avx2-vnni" / "avx2": 256-bit vectors, AVX-VNNI's vpdpbusd when compiled in, else
 *       vpmaddubsw + vpmaddwd. Also what an AVX-512 build without VNNI runs.
 *     "portable": moed_idot_rows_portable, plain loops.
 * - Mat-mat: the SIMD kernels take MOED_ITOKENS = 4 tokens a pass: each chunk of a row
 *   is loaded (and its nibbles split) once for them, and each token's sums, t's and
 *   block-by-block sum are computed with its mat-vec's arithmetic, so every token row is
 *   bit-equal to its mat-vec.
 */
#ifndef MOED_IDOT_IMPL_H
#define MOED_IDOT_IMPL_H

#include "_quant_impl.h"
#include "_bdot_impl.h"

#define MOED_ICHUNK 16   /* blocks of 32 columns per kernel step */

typedef struct {
    int8_t *q1, *q2;     /* the two planes: row t at q1 + t * ldq (ldq bytes, padded with zeros) */
    float *d, *e;        /* row t at d + t * ldb: the planes' block scales (e = d / 254) */
    float *ds;           /* d * (float)s1 + e * (float)s2 per block */
    int32_t *s1, *s2;    /* the block sums of q1, q2 */
    ptrdiff_t rows, cols, nb;   /* T, C, C / 32 */
    ptrdiff_t ldq, ldb;  /* per-row strides (elements) */
    int paired;          /* 0: q in column order; 1: q in the nibble formats' permuted
                          * order; 2: bf16 weights, only xb is filled */
    uint16_t *xb;        /* paired 2: row t at xb + t * ldx, bf16, zero-padded */
    ptrdiff_t ldx;       /* C rounded up to a multiple of 32 */
} moed_qact;

static inline ptrdiff_t moed_qact_padded_blocks(ptrdiff_t C) {
    ptrdiff_t nb = C / 32;
    return (nb + MOED_ICHUNK - 1) / MOED_ICHUNK * MOED_ICHUNK;
}

/* Bytes of scratch moed_qact_init needs for T rows of C columns (C % 32 == 0 for the
 * integer planes; any C for bf16). */
static inline size_t moed_qact_bytes(ptrdiff_t T, ptrdiff_t C) {
    ptrdiff_t nbp = moed_qact_padded_blocks(C);
    return (size_t)T * (size_t)nbp * (2 * 32 + 5 * 4) + (size_t)T * (size_t)((C + 31) & ~(ptrdiff_t)31) * 2 + 64;
}

static inline void moed_qact_init(moed_qact *a, void *buf, ptrdiff_t T, ptrdiff_t C, int paired) {
    ptrdiff_t nbp = moed_qact_padded_blocks(C);
    uintptr_t p = ((uintptr_t)buf + 63) & ~(uintptr_t)63;
    a->rows = T;
    a->cols = C;
    a->nb = C / 32;
    a->ldq = nbp * 32;
    a->ldb = nbp;
    a->paired = paired;
    a->q1 = (int8_t *)p;
    a->q2 = a->q1 + (size_t)T * nbp * 32;   /* 64-byte aligned: nbp is a multiple of 16 */
    a->d = (float *)(a->q2 + (size_t)T * nbp * 32);
    a->e = a->d + T * nbp;
    a->ds = a->e + T * nbp;
    a->s1 = (int32_t *)(a->ds + T * nbp);
    a->s2 = a->s1 + T * nbp;
    a->ldx = (C + 31) & ~(ptrdiff_t)31;
    a->xb = (uint16_t *)(a->s2 + T * nbp);
}

/* Where column j of a row is stored in q. */
static inline ptrdiff_t moed_qact_index(int paired, ptrdiff_t j) {
    if (!paired) return j;
    return (j & ~(ptrdiff_t)127) + ((j & 1) ? 64 : 0) + ((j & 127) >> 5) * 16 + ((j & 31) >> 1);
}

/* Block b's plane at q (column order or the nibble formats' order). */
static inline void moed_qact_put(const moed_qact *a, int8_t *q, ptrdiff_t b, const int8_t *qb) {
    if (a->paired) {
        const ptrdiff_t e = moed_qact_index(1, 32 * b), o = moed_qact_index(1, 32 * b + 1);
        for (int i = 0; i < 16; i++) {
            q[e + i] = qb[2 * i];
            q[o + i] = qb[2 * i + 1];
        }
    } else {
        memcpy(q + 32 * b, qb, 32);
    }
}

/* clamp(rint(v / scale), -127, 127) for a block (scale != 0): f32 division, rint half to
 * even (the default rounding mode); v is finite or +-inf, never NaN, for finite x. */
static inline void moed_qact_plane(const float *v, float scale, float *f, int8_t *qb) {
    for (int i = 0; i < 32; i++) {
        float r = rintf(v[i] / scale);
        r = r < -127.0f ? -127.0f : r;
        f[i] = r > 127.0f ? 127.0f : r;
    }
    for (int i = 0; i < 32; i++) qb[i] = (int8_t)(int)f[i];
}

/* Quantise activation row t from x[0 .. C-1] (spec section 1; bf16: moed_bf16_round). */
static void moed_qact_row(const moed_qact *a, ptrdiff_t t, const float *x) {
    if (a->paired == 2) {
        uint16_t *xb = a->xb + t * a->ldx;
        for (ptrdiff_t j = 0; j < a->cols; j++) xb[j] = moed_bf16_round(x[j]);
        for (ptrdiff_t j = a->cols; j < a->ldx; j++) xb[j] = 0;
        return;
    }
    int8_t *q1 = a->q1 + t * a->ldq, *q2 = a->q2 + t * a->ldq;
    float *d = a->d + t * a->ldb, *e = a->e + t * a->ldb, *ds = a->ds + t * a->ldb;
    int32_t *s1 = a->s1 + t * a->ldb, *s2 = a->s2 + t * a->ldb;
    /* the padding: from the last run of 4 blocks on (the nibble order interleaves it) */
    const ptrdiff_t pad = (32 * a->nb) & ~(ptrdiff_t)127;
    memset(q1 + pad, 0, (size_t)(a->ldq - pad));
    memset(q2 + pad, 0, (size_t)(a->ldq - pad));
    for (ptrdiff_t b = 0; b < a->nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float v = fabsf(xb[i]);
            amax = v > amax ? v : amax;
        }
        const float db = amax / 127.0f, eb = db / 254.0f;
        int8_t qb1[32], qb2[32];
        float f1[32], f2[32], r[32];
        int32_t sum1 = 0, sum2 = 0;
        if (db == 0.0f) {
            memset(qb1, 0, sizeof qb1);
        } else {
            moed_qact_plane(xb, db, f1, qb1);
            for (int i = 0; i < 32; i++) sum1 += qb1[i];
        }
        if (eb == 0.0f) {
            memset(qb2, 0, sizeof qb2);
        } else {
            for (int i = 0; i < 32; i++) {
                const float p = f1[i] * db;   /* the product rounded, then the difference */
                r[i] = xb[i] - p;
            }
            moed_qact_plane(r, eb, f2, qb2);
            for (int i = 0; i < 32; i++) sum2 += qb2[i];
        }
        moed_qact_put(a, q1, b, qb1);
        moed_qact_put(a, q2, b, qb2);
        d[b] = db;
        e[b] = eb;
        s1[b] = sum1;
        s2[b] = sum2;
        const float u = db * (float)sum1, v = eb * (float)sum2;
        ds[b] = u + v;
    }
    for (ptrdiff_t b = a->nb; b < a->ldb; b++) {
        d[b] = e[b] = ds[b] = 0.0f;
        s1[b] = s2[b] = 0;
    }
}

/* Does fast mode apply to this weight (int8, int4, mxfp4, bf16)? */
static inline int moed_fast_applies(const moed_weight *w) {
    return w->fmt == MOED_INT8 || w->fmt == MOED_INT4 || w->fmt == MOED_MXFP4 || w->fmt == MOED_BF16;
}

/* The activations' layout for this format (moed_qact.paired). */
static inline int moed_fast_paired(int fmt) {
    return fmt == MOED_BF16 ? 2 : fmt == MOED_INT4 || fmt == MOED_MXFP4;
}

/* 2 x E2M1 of each nibble. */
static const int8_t moed_e2m1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* The f32 weight scale sw of group si (spec section 3): the f16 scale, or mxfp4's
 * 2^(e - 128) = 0.5 * 2^(e - 127) (exact, subnormal included; 255 gives NaN). */
static inline float moed_iscale_at(const moed_weight *w, ptrdiff_t si) {
    float s = moed_scale_at(w, si);
    return w->fmt == MOED_MXFP4 ? s * 0.5f : s;
}

/* ------------------------------------------------------- the reference path */

static inline int moed_icode(const moed_weight *w, const uint8_t *row, ptrdiff_t j) {
    switch (w->fmt) {
    case MOED_INT8: return (int8_t)row[j];
    case MOED_MXFP4: return moed_e2m1x2[moed_nibble(row, j)];
    default: return (int)moed_nibble(row, j) - (w->mins ? 0 : 8);
    }
}

/* out[k] = y of row r0 + k for token t of a, k < nrows: spec sections 2-4, plainly. */
static void moed_idot_rows_portable(const moed_weight *w, ptrdiff_t r0, int nrows,
                                    const moed_qact *a, ptrdiff_t t, float *out) {
    const int8_t *q1 = a->q1 + t * a->ldq, *q2 = a->q2 + t * a->ldq;
    const float *d = a->d + t * a->ldb, *e = a->e + t * a->ldb, *ds = a->ds + t * a->ldb;
    for (int k = 0; k < nrows; k++) {
        const ptrdiff_t r = r0 + k;
        const uint8_t *row = w->codes + r * w->row_bytes;
        float y = 0.0f;
        for (ptrdiff_t b = 0; b < a->nb; b++) {
            int32_t S1 = 0, S2 = 0;
            for (ptrdiff_t j = 32 * b; j < 32 * b + 32; j++) {
                const int c = moed_icode(w, row, j);
                const ptrdiff_t i = moed_qact_index(a->paired, j);
                S1 += c * q1[i];
                S2 += c * q2[i];
            }
            const ptrdiff_t si = r * w->scale_ld + (32 * b) / w->scale_cols;
            const float sw = moed_iscale_at(w, si);
            float tb = (float)S1 * (sw * d[b]);
            const float t2 = (float)S2 * (sw * e[b]);
            tb = tb + t2;
            if (w->mins) tb = tb + moed_min_at(w, si) * ds[b];
            y = y + tb;
        }
        out[k] = y;
    }
}

/* ------------------------------------------------------------ the SIMD paths */
#if defined(__AVX512VNNI__) && defined(MOED_V16_AVX512)
#define MOED_I_AVX512 1
#elif defined(__AVX2__) && (defined(MOED_V16_AVX512) || defined(MOED_V16_AVX2))
#define MOED_I_AVX2 1
#endif

enum { MOED_IK_INT8 = 0, MOED_IK_INT4M = 1, MOED_IK_INT4S = 2, MOED_IK_MXFP4 = 3 };

#if defined(MOED_I_AVX512) || defined(MOED_I_AVX2)
#define MOED_I_SIMD 1

/* Rows a pass streams together: a multiple of 4 (the f32 sums go 4 rows to a vector). */
#ifndef MOED_IPASS
#define MOED_IPASS 8
#endif
_Static_assert(MOED_IPASS % 4 == 0 && MOED_IPASS <= MOED_ROWS, "rows of a pass");
/* Bytes of a row prefetched ahead (int8 rows stream twice the bytes per block). */
#ifndef MOED_I_PREFETCH
#define MOED_I_PREFETCH 512
#endif
#ifndef MOED_I_PREFETCH_INT8
#define MOED_I_PREFETCH_INT8 1024
#endif
/* Scales (and mins) prefetched this many groups ahead along each row: without it the
 * scale streams, not the codes, bounded a cold int4 mat-vec (see moed_idot_chunk). */
#ifndef MOED_I_SCALES_AHEAD
#define MOED_I_SCALES_AHEAD 64
#endif

/* mxfp4: nibble -> 2 x E2M1 + 12 (0..24), for vpshufb. */
#define MOED_E2M1X2_BIASED 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

/* The integer sums of a chunk: 16 x int32, block order. */
#ifdef MOED_I_AVX512
typedef __m512i moed_is16;
#else
typedef struct { __m256i lo, hi; } moed_is16;
#endif

/* The 16 sums as f32 (exact: |S| < 2^24). */
static inline __attribute__((always_inline)) moed_v16 moed_is16_f32(moed_is16 S) {
#if defined(MOED_I_AVX512)
    return _mm512_cvtepi32_ps(S);
#elif defined(MOED_V16_AVX512)
    return _mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(S.lo), S.hi, 1));
#else
    return (moed_v16){_mm256_cvtepi32_ps(S.lo), _mm256_cvtepi32_ps(S.hi)};
#endif
}

/* c * s[0..15]: the correction of a biased code (shared by every row of a chunk). */
static inline __attribute__((always_inline)) moed_is16 moed_is16_times(int32_t c, const int32_t *s) {
#ifdef MOED_I_AVX512
    return _mm512_mullo_epi32(_mm512_set1_epi32(c), _mm512_loadu_si512(s));
#else
    const __m256i cv = _mm256_set1_epi32(c);
    return (moed_is16){_mm256_mullo_epi32(cv, _mm256_loadu_si256((const __m256i *)s)),
                       _mm256_mullo_epi32(cv, _mm256_loadu_si256((const __m256i *)(s + 8)))};
#endif
}

/* The code bias each kind's SIMD sums carry (S = biased sum - c * s). */
static inline int32_t moed_ikind_bias(const int kind) {
#if defined(MOED_I_AVX512) || defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
    const int32_t int8_bias = 128;   /* vpdpbusd of c ^ 0x80 */
#else
    const int32_t int8_bias = 0;     /* vpmaddubsw of |c| and sign(q, c) */
#endif
    return kind == MOED_IK_INT8 ? int8_bias : kind == MOED_IK_MXFP4 ? 12 : kind == MOED_IK_INT4S ? 8 : 0;
}

/* Bytes [0, valid) of the 64 (32) at p, zeros past them; no access past them. */
#ifdef MOED_I_AVX512
static inline __attribute__((always_inline)) __m512i moed_load64(const uint8_t *p, const int full, ptrdiff_t valid) {
    if (full || valid >= 64) return _mm512_loadu_si512(p);
    __mmask64 m = valid <= 0 ? 0 : (((__mmask64)1 << valid) - 1);
    return _mm512_maskz_loadu_epi8(m, p);
}
#endif
static inline __attribute__((always_inline)) __m256i moed_load32(const uint8_t *p, const int full, ptrdiff_t valid) {
    if (full || valid >= 32) return _mm256_loadu_si256((const __m256i *)p);
    /* valid is a multiple of 16 here (whole blocks of 16 or 32 bytes) */
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid > 0 ? valid / 4 : 0)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_epi32((const int *)p, m);
}

#ifdef MOED_I_AVX512
/* v[i] holds 4 int32 partial sums of block 4i + L in 128-bit lane L; the 16 block sums
 * in block order. */
static inline __attribute__((always_inline)) __m512i moed_ireduce4(const __m512i *v) {
    __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
    __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
    __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    /* lane 4L + i = block 4i + L */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(idx, r);
}

/* S1 and S2 of the first n blocks of a chunk (n = 16 when full; the rest 0): weight bytes
 * at wp, the planes at qp1 and qp2, cs1 and cs2 their bias corrections. Each weight
 * vector is loaded and decoded once and meets both planes. half (n <= 8): blocks 8 .. 15
 * are not computed (their sums are -cs, and their t's are never added). */
static inline __attribute__((always_inline)) void
moed_ichunk_S(const int kind, const uint8_t *wp, const int8_t *qp1, const int8_t *qp2, moed_is16 cs1,
              moed_is16 cs2, const int full, int n, const int half, moed_is16 *S1, moed_is16 *S2) {
    __m512i v1[4], v2[4];
    const __m512i zero = _mm512_setzero_si512();
    if (kind == MOED_IK_INT8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int i = 0; i < 4; i++) {
            if (half && i >= 2) {   /* blocks 8 .. 15 */
                v1[i] = v2[i] = zero;
                continue;
            }
            __m512i p1[2], p2[2];
            for (int h = 0; h < 2; h++) {
                const int j = 2 * i + h;
                const __m512i wv = _mm512_xor_si512(moed_load64(wp + 64 * j, full, 32 * n - 64 * j), flip);
                p1[h] = _mm512_dpbusd_epi32(zero, wv, _mm512_load_si512(qp1 + 64 * j));
                p2[h] = _mm512_dpbusd_epi32(zero, wv, _mm512_load_si512(qp2 + 64 * j));
            }
            /* [A | B], [C | D] (8 partials each) -> [A B C D] */
            v1[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(p1[0], p1[1], 0x88),
                                     _mm512_shuffle_i64x2(p1[0], p1[1], 0xDD));
            v2[i] = _mm512_add_epi32(_mm512_shuffle_i64x2(p2[0], p2[1], 0x88),
                                     _mm512_shuffle_i64x2(p2[0], p2[1], 0xDD));
        }
    } else {
        const __m512i m = _mm512_set1_epi8(15);
        const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(MOED_E2M1X2_BIASED));
        for (int i = 0; i < 4; i++) {
            if (half && i >= 2) {   /* blocks 8 .. 15 */
                v1[i] = v2[i] = zero;
                continue;
            }
            __m512i b = moed_load64(wp + 64 * i, full, 16 * n - 64 * i);
            __m512i lo = _mm512_and_si512(b, m), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
            if (kind == MOED_IK_MXFP4) {
                lo = _mm512_shuffle_epi8(tab, lo);
                hi = _mm512_shuffle_epi8(tab, hi);
            }
            v1[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, _mm512_load_si512(qp1 + 128 * i)),
                                        hi, _mm512_load_si512(qp1 + 128 * i + 64));
            v2[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, _mm512_load_si512(qp2 + 128 * i)),
                                        hi, _mm512_load_si512(qp2 + 128 * i + 64));
        }
    }
    __m512i r1 = moed_ireduce4(v1), r2 = moed_ireduce4(v2);
    if (kind != MOED_IK_INT4M) {
        r1 = _mm512_sub_epi32(r1, cs1);
        r2 = _mm512_sub_epi32(r2, cs2);
    }
    *S1 = r1;
    *S2 = r2;
}
#else
/* AVX2: v[i] holds 4 int32 partials of block 2i + L in 128-bit lane L (i < 4); the 8
 * block sums in block order. */
static inline __attribute__((always_inline)) __m256i moed_ireduce4(const __m256i *v) {
    __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
    __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
    __m256i r = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
    /* lane 4L + i = block 2i + L */
    return _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define MOED_I_VNNI256 1
#ifdef __AVXVNNI__
#define moed_dpbusd256 _mm256_dpbusd_avx_epi32
#else
#define moed_dpbusd256 _mm256_dpbusd_epi32
#endif
#endif

/* The 8 block sums (blocks 8 * half .. 8 * half + 7) of each plane; see the AVX-512
 * moed_ichunk_S. */
static inline __attribute__((always_inline)) void
moed_ichunk_S8(const int kind, const uint8_t *wp, const int8_t *qp1, const int8_t *qp2, const int full,
               int n, const int half, __m256i *r1, __m256i *r2) {
    __m256i v1[4], v2[4];
    if (kind == MOED_IK_INT8) {
        for (int k = 0; k < 4; k++) {   /* blocks 2i, 2i + 1 */
            const int i = 4 * half + k;
            __m256i p1[2], p2[2];
            for (int h = 0; h < 2; h++) {
                const int o = 64 * i + 32 * h;
                __m256i w = moed_load32(wp + o, full, 32 * n - o);
                __m256i x1 = _mm256_load_si256((const __m256i *)(qp1 + o));
                __m256i x2 = _mm256_load_si256((const __m256i *)(qp2 + o));
#ifdef MOED_I_VNNI256
                w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
                p1[h] = moed_dpbusd256(_mm256_setzero_si256(), w, x1);
                p2[h] = moed_dpbusd256(_mm256_setzero_si256(), w, x2);
#else
                /* |c| * sign(q, c): pair sums <= 2 * 128 * 127 < 2^15 */
                const __m256i aw = _mm256_abs_epi8(w), one = _mm256_set1_epi16(1);
                p1[h] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x1, w)), one);
                p2[h] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x2, w)), one);
#endif
            }
            v1[k] = _mm256_add_epi32(_mm256_permute2x128_si256(p1[0], p1[1], 0x20),
                                     _mm256_permute2x128_si256(p1[0], p1[1], 0x31));
            v2[k] = _mm256_add_epi32(_mm256_permute2x128_si256(p2[0], p2[1], 0x20),
                                     _mm256_permute2x128_si256(p2[0], p2[1], 0x31));
        }
    } else {
        const __m256i m = _mm256_set1_epi8(15);
        const __m256i tab = _mm256_broadcastsi128_si256(_mm_setr_epi8(MOED_E2M1X2_BIASED));
        for (int k = 0; k < 4; k++) {   /* blocks 2i, 2i + 1 */
            const int i = 4 * half + k, G = i >> 1, p = i & 1;
            __m256i b = moed_load32(wp + 32 * i, full, 16 * n - 32 * i);
            __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
            if (kind == MOED_IK_MXFP4) {
                lo = _mm256_shuffle_epi8(tab, lo);
                hi = _mm256_shuffle_epi8(tab, hi);
            }
            const ptrdiff_t oe = 128 * G + 32 * p, oo = 128 * G + 64 + 32 * p;
            const __m256i qe1 = _mm256_load_si256((const __m256i *)(qp1 + oe));
            const __m256i qo1 = _mm256_load_si256((const __m256i *)(qp1 + oo));
            const __m256i qe2 = _mm256_load_si256((const __m256i *)(qp2 + oe));
            const __m256i qo2 = _mm256_load_si256((const __m256i *)(qp2 + oo));
#ifdef MOED_I_VNNI256
            v1[k] = moed_dpbusd256(moed_dpbusd256(_mm256_setzero_si256(), lo, qe1), hi, qo1);
            v2[k] = moed_dpbusd256(moed_dpbusd256(_mm256_setzero_si256(), lo, qe2), hi, qo2);
#else
            /* pair sums <= 2 * 24 * 127 each; the two products' sum stays below 2^15 */
            const __m256i one = _mm256_set1_epi16(1);
            v1[k] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, qe1), _mm256_maddubs_epi16(hi, qo1)),
                                      one);
            v2[k] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, qe2), _mm256_maddubs_epi16(hi, qo2)),
                                      one);
#endif
        }
    }
    *r1 = moed_ireduce4(v1);
    *r2 = moed_ireduce4(v2);
}

/* S1 and S2 of the first n blocks of a chunk (n = 16 when full; the rest 0), in two
 * halves of 8 blocks (the accumulators of both planes fit the 16 registers); half
 * (n <= 8): the second is not computed (as on AVX-512). */
static inline __attribute__((always_inline)) void
moed_ichunk_S(const int kind, const uint8_t *wp, const int8_t *qp1, const int8_t *qp2, moed_is16 cs1,
              moed_is16 cs2, const int full, int n, const int half, moed_is16 *S1, moed_is16 *S2) {
    moed_is16 r1, r2;
    moed_ichunk_S8(kind, wp, qp1, qp2, full, n, 0, &r1.lo, &r2.lo);
    if (half) r1.hi = r2.hi = _mm256_setzero_si256();
    else moed_ichunk_S8(kind, wp, qp1, qp2, full, n, 1, &r1.hi, &r2.hi);
    if (moed_ikind_bias(kind)) {
        r1.lo = _mm256_sub_epi32(r1.lo, cs1.lo);
        r1.hi = _mm256_sub_epi32(r1.hi, cs1.hi);
        r2.lo = _mm256_sub_epi32(r2.lo, cs2.lo);
        r2.hi = _mm256_sub_epi32(r2.hi, cs2.hi);
    }
    *S1 = r1;
    *S2 = r2;
}
#endif

/* t[0..3] (16 blocks each) -> tmp[m][4j + k] = t[k] of block 4j + m: block b's 4 values
 * at tmp[b % 4] + 4 * (b / 4). */
static inline __attribute__((always_inline)) void moed_itranspose4(const moed_v16 *t, float (*tmp)[16]) {
#ifdef MOED_V16_AVX512
    __m512d a = _mm512_castps_pd(_mm512_unpacklo_ps(t[0], t[1])), b = _mm512_castps_pd(_mm512_unpackhi_ps(t[0], t[1]));
    __m512d c = _mm512_castps_pd(_mm512_unpacklo_ps(t[2], t[3])), d = _mm512_castps_pd(_mm512_unpackhi_ps(t[2], t[3]));
    _mm512_store_pd((double *)tmp[0], _mm512_unpacklo_pd(a, c));
    _mm512_store_pd((double *)tmp[1], _mm512_unpackhi_pd(a, c));
    _mm512_store_pd((double *)tmp[2], _mm512_unpacklo_pd(b, d));
    _mm512_store_pd((double *)tmp[3], _mm512_unpackhi_pd(b, d));
#else
    for (int h = 0; h < 2; h++) {
        __m256 t0 = h ? t[0].hi : t[0].lo, t1 = h ? t[1].hi : t[1].lo;
        __m256 t2 = h ? t[2].hi : t[2].lo, t3 = h ? t[3].hi : t[3].lo;
        __m256d a = _mm256_castps_pd(_mm256_unpacklo_ps(t0, t1)), b = _mm256_castps_pd(_mm256_unpackhi_ps(t0, t1));
        __m256d c = _mm256_castps_pd(_mm256_unpacklo_ps(t2, t3)), d = _mm256_castps_pd(_mm256_unpackhi_ps(t2, t3));
        _mm256_store_pd((double *)(tmp[0] + 8 * h), _mm256_unpacklo_pd(a, c));
        _mm256_store_pd((double *)(tmp[1] + 8 * h), _mm256_unpackhi_pd(a, c));
        _mm256_store_pd((double *)(tmp[2] + 8 * h), _mm256_unpacklo_pd(b, d));
        _mm256_store_pd((double *)(tmp[3] + 8 * h), _mm256_unpackhi_pd(b, d));
    }
#endif
}

/* The weight scales (and mins) of a full chunk's 16 blocks, from block b0 of row r. */
static inline __attribute__((always_inline)) void
moed_ichunk_scales(const moed_weight *w, const int kind, ptrdiff_t r, ptrdiff_t b0, moed_v16 *sw,
                   moed_v16 *mv) {
    const ptrdiff_t g = w->scale_cols, si = r * w->scale_ld + (32 * b0) / g;
    if (kind == MOED_IK_MXFP4) {
        *sw = moed_v16_mul(moed_v16_load_e8m0((const uint8_t *)w->scales + si), moed_v16_set1(0.5f));
        return;
    }
    const uint16_t *sp = (const uint16_t *)w->scales + si, *mp = w->mins ? w->mins + si : NULL;
    if (g == 32) {
        *sw = moed_v16_load_f16(sp);
        if (kind == MOED_IK_INT4M) *mv = moed_v16_load_f16(mp);
        return;
    }
    float sf[16] __attribute__((aligned(64))), mf[16] __attribute__((aligned(64)));
    if (g == 64 || g == 128) {
        const int n = g == 64 ? 8 : 4, rep = g / 32;
        float t[8], u[8];
        __m128i h = n == 8 ? _mm_loadu_si128((const __m128i *)sp) : _mm_loadl_epi64((const __m128i *)sp);
        _mm256_storeu_ps(t, _mm256_cvtph_ps(h));
        if (kind == MOED_IK_INT4M) {
            h = n == 8 ? _mm_loadu_si128((const __m128i *)mp) : _mm_loadl_epi64((const __m128i *)mp);
            _mm256_storeu_ps(u, _mm256_cvtph_ps(h));
        }
        for (int k = 0; k < 16; k++) {
            sf[k] = t[k / rep];
            if (kind == MOED_IK_INT4M) mf[k] = u[k / rep];
        }
    } else {
        for (int k = 0; k < 16; k++) {
            const ptrdiff_t i = r * w->scale_ld + (32 * (b0 + k)) / g;
            sf[k] = moed_scale_at(w, i);
            if (kind == MOED_IK_INT4M) mf[k] = moed_min_at(w, i);
        }
    }
    *sw = moed_v16_load(sf);
    if (kind == MOED_IK_INT4M) *mv = moed_v16_load(mf);
}

/* The same for the first n < 16 blocks (the lanes past them are 0). */
static inline void moed_itail_scales(const moed_weight *w, ptrdiff_t r, ptrdiff_t b0, int n,
                                     moed_v16 *sw, moed_v16 *mv) {
    float sf[16] __attribute__((aligned(64))) = {0}, mf[16] __attribute__((aligned(64))) = {0};
    for (int k = 0; k < n; k++) {
        const ptrdiff_t i = r * w->scale_ld + (32 * (b0 + k)) / w->scale_cols;
        sf[k] = moed_iscale_at(w, i);
        if (w->mins) mf[k] = moed_min_at(w, i);
    }
    *sw = moed_v16_load(sf);
    *mv = moed_v16_load(mf);
}

/* Can the rows up to r read a whole chunk from block b0 (codes, scales and mins) without
 * passing the end of their arrays? The bytes past a row's last block belong to the next
 * row: they meet q's zero padding (and s = 0), and their t's are never added, so reading
 * them changes nothing. */
static inline int moed_itail_overread_ok(const moed_weight *w, const int kind, ptrdiff_t r, ptrdiff_t b0) {
    const ptrdiff_t bpb = kind == MOED_IK_INT8 ? 32 : 16, g = w->scale_cols;
    const ptrdiff_t first = (32 * b0) / g;
    const ptrdiff_t read = g == 32 ? 16 : g == 64 ? 8 : g == 128 ? 4
                                                     : (32 * (b0 + MOED_ICHUNK - 1)) / g - first + 1;
    return r * (ptrdiff_t)w->row_bytes + (b0 + MOED_ICHUNK) * bpb <= w->rows * (ptrdiff_t)w->row_bytes &&
           r * w->scale_ld + first + read <= w->rows * w->scale_ld;
}

/* Tokens a mat-mat pass takes at once: each chunk of a row is loaded (and its nibbles
 * split) once for them; each token's integer sums, t's and block-by-block sum are those
 * of its mat-vec. */
#ifndef MOED_ITOKENS
#define MOED_ITOKENS 4
#endif

/* The quantised activations of up to MOED_ITOKENS tokens (rows of a moed_qact). */
typedef struct {
    const int8_t *q1[MOED_ITOKENS], *q2[MOED_ITOKENS];
    const float *d[MOED_ITOKENS], *e[MOED_ITOKENS], *ds[MOED_ITOKENS];
    const int32_t *s1[MOED_ITOKENS], *s2[MOED_ITOKENS];
} moed_itoks;

/* One chunk (blocks b0 .. b0+n-1) of rows r0 .. r0+nrows-1 (nrows a multiple of 4, or
 * 1) for nt tokens, added to their sums (full: whole-chunk loads, else none past block
 * n; half: n <= 8, the integer work of half a chunk): y4[j][k] holds rows 4k .. 4k+3 of
 * token j, y1[j] the single row's.
 * Prefetch: each row's codes MOED_I_PREFETCH bytes ahead (MOED_I_PREFETCH_INT8 for
 * int8, whose blocks are twice as long) and into L2 two passes ahead, and its scales
 * (and mins) MOED_I_SCALES_AHEAD groups ahead. A chunk's scales are 16 bytes (mxfp4) or
 * 32 (f16, groups of 32), a line every 2-4 chunks; the prefetch is issued every chunk
 * (cheap, mostly a hit). */
static inline __attribute__((always_inline)) void
moed_idot_chunk(const moed_weight *w, const int kind, ptrdiff_t r0, const int nrows,
                const uint8_t *const *row, const int nt, const moed_itoks *a, ptrdiff_t b0,
                const int full, int n, const int half, __m128 (*y4)[MOED_ROWS / 4], float *y1) {
    const ptrdiff_t bpb = kind == MOED_IK_INT8 ? 32 : 16;   /* weight bytes per block */
    const ptrdiff_t off = b0 * bpb;
    moed_v16 dv[MOED_ITOKENS], ev[MOED_ITOKENS], dsv[MOED_ITOKENS];
    moed_is16 cs1[MOED_ITOKENS], cs2[MOED_ITOKENS];
    for (int j = 0; j < nt; j++) {
        dv[j] = moed_v16_load(a->d[j] + b0);
        ev[j] = moed_v16_load(a->e[j] + b0);
        dsv[j] = kind == MOED_IK_INT4M ? moed_v16_load(a->ds[j] + b0) : moed_v16_zero();
        cs1[j] = moed_is16_times(moed_ikind_bias(kind), a->s1[j] + b0);
        cs2[j] = moed_is16_times(moed_ikind_bias(kind), a->s2[j] + b0);
    }
    float tmp[4][16] __attribute__((aligned(64)));
    moed_v16 tv[MOED_ITOKENS][4];
    for (int k = 0; k < nrows; k++) {
        if (full) {
            const ptrdiff_t ahead = kind == MOED_IK_INT8 ? MOED_I_PREFETCH_INT8 : MOED_I_PREFETCH;
            for (int l = 0; l < 16 * bpb; l += 64) {
                __builtin_prefetch(row[k] + moed_prefetch_at(off + l + ahead, w->row_bytes, nrows));
                moed_q_prefetch_l2(row[k], off + l, w->row_bytes, nrows);
            }
            const ptrdiff_t sa = (r0 + k) * w->scale_ld +
                                 moed_prefetch_at((32 * b0) / w->scale_cols + MOED_I_SCALES_AHEAD, w->scale_ld, nrows);
            if (kind == MOED_IK_MXFP4) {
                __builtin_prefetch((const uint8_t *)w->scales + sa);
            } else {
                __builtin_prefetch((const uint16_t *)w->scales + sa);
                if (kind == MOED_IK_INT4M) __builtin_prefetch(w->mins + sa);
            }
        }
        /* the tokens' sums of one chunk of a row: the weight loads and their decoding are
         * the same for every token (the compiler shares them) */
        moed_is16 S1[MOED_ITOKENS], S2[MOED_ITOKENS];
        for (int j = 0; j < nt; j++)
            moed_ichunk_S(kind, row[k] + off, a->q1[j] + 32 * b0, a->q2[j] + 32 * b0, cs1[j], cs2[j], full, n,
                          half, &S1[j], &S2[j]);
        moed_v16 sw, mv = moed_v16_zero();
        if (full) moed_ichunk_scales(w, kind, r0 + k, b0, &sw, &mv);
        else moed_itail_scales(w, r0 + k, b0, n, &sw, &mv);
        for (int j = 0; j < nt; j++) {
            moed_v16 t = moed_v16_mul(moed_is16_f32(S1[j]), moed_v16_mul(sw, dv[j]));
            const moed_v16 t2 = moed_v16_mul(moed_is16_f32(S2[j]), moed_v16_mul(sw, ev[j]));
            t = moed_v16_add(t, t2);
            if (kind == MOED_IK_INT4M) t = moed_v16_add(t, moed_v16_mul(mv, dsv[j]));
            if (nrows == 1) {
                moed_v16_store(tmp[0], t);
                for (int l = 0; l < n; l++) y1[j] = y1[j] + tmp[0][l];
            } else {
                tv[j][k & 3] = t;
            }
        }
        if (nrows > 1 && (k & 3) == 3)   /* four rows' sums in one vector, block by block */
            for (int j = 0; j < nt; j++) {
                moed_itranspose4(tv[j], tmp);
                __m128 y = y4[j][k >> 2];
                for (int l = 0; l < n; l++) y = _mm_add_ps(y, _mm_load_ps(tmp[l & 3] + 4 * (l >> 2)));
                y4[j][k >> 2] = y;
            }
    }
}

/* out[j * ldo + k] = y of row r0 + k for token t0 + j, k < nrows (a multiple of 4, or 1),
 * j < nt. */
static inline __attribute__((always_inline)) void
moed_idot_pass(const moed_weight *w, const int kind, ptrdiff_t r0, const int nrows, const int nt,
               const moed_qact *qa, ptrdiff_t t0, float *out, ptrdiff_t ldo) {
    moed_itoks a;
    for (int j = 0; j < nt; j++) {
        const ptrdiff_t t = t0 + j;
        a.q1[j] = qa->q1 + t * qa->ldq;
        a.q2[j] = qa->q2 + t * qa->ldq;
        a.d[j] = qa->d + t * qa->ldb;
        a.e[j] = qa->e + t * qa->ldb;
        a.ds[j] = qa->ds + t * qa->ldb;
        a.s1[j] = qa->s1 + t * qa->ldb;
        a.s2[j] = qa->s2 + t * qa->ldb;
    }
    const ptrdiff_t nb = qa->nb, nfull = nb / MOED_ICHUNK * MOED_ICHUNK;
    const uint8_t *row[MOED_ROWS];
    __m128 y4[MOED_ITOKENS][MOED_ROWS / 4];
    float y1[MOED_ITOKENS];
    for (int k = 0; k < nrows; k++) row[k] = w->codes + (r0 + k) * w->row_bytes;
    for (int j = 0; j < nt; j++) {
        y1[j] = 0.0f;
        for (int k = 0; k < MOED_ROWS / 4; k++) y4[j][k] = _mm_setzero_ps();
    }
    for (ptrdiff_t b0 = 0; b0 < nfull; b0 += MOED_ICHUNK)
        moed_idot_chunk(w, kind, r0, nrows, row, nt, &a, b0, 1, MOED_ICHUNK, 0, y4, y1);
    if (nfull < nb) {   /* the last n blocks: whole-chunk loads where they stay inside the arrays;
                         * at most 8 of them: the integer work of half a chunk */
        const int n = (int)(nb - nfull);
        if (moed_itail_overread_ok(w, kind, r0 + nrows - 1, nfull)) {
            if (n <= 8) moed_idot_chunk(w, kind, r0, nrows, row, nt, &a, nfull, 1, n, 1, y4, y1);
            else moed_idot_chunk(w, kind, r0, nrows, row, nt, &a, nfull, 1, n, 0, y4, y1);
        } else {
            if (n <= 8) moed_idot_chunk(w, kind, r0, nrows, row, nt, &a, nfull, 0, n, 1, y4, y1);
            else moed_idot_chunk(w, kind, r0, nrows, row, nt, &a, nfull, 0, n, 0, y4, y1);
        }
    }
    for (int j = 0; j < nt; j++) {
        if (nrows == 1) out[j * ldo] = y1[j];
        else
            for (int k = 0; k < nrows / 4; k++) _mm_storeu_ps(out + j * ldo + 4 * k, y4[j][k]);
    }
}

typedef void (*moed_ipass_fn)(const moed_weight *, ptrdiff_t, const moed_qact *, ptrdiff_t, float *,
                              ptrdiff_t);
#define MOED_DEFINE_IPASS1(NAME, KIND, NROWS, NT, SUFFIX)                                 \
    static void moed_idot_##NAME##_##SUFFIX(const moed_weight *w, ptrdiff_t r0, const moed_qact *a, \
                                            ptrdiff_t t0, float *out, ptrdiff_t ldo) {    \
        moed_idot_pass(w, KIND, r0, NROWS, NT, a, t0, out, ldo);                          \
    }
/* moed_ikernels_NAME[tokens: 1 or MOED_ITOKENS][rows: a pass, 4, 1] */
#define MOED_DEFINE_IPASS(NAME, KIND)                                                     \
    MOED_DEFINE_IPASS1(NAME, KIND, MOED_IPASS, 1, p1)                                     \
    MOED_DEFINE_IPASS1(NAME, KIND, 4, 1, r4t1)                                            \
    MOED_DEFINE_IPASS1(NAME, KIND, 1, 1, r1t1)                                            \
    MOED_DEFINE_IPASS1(NAME, KIND, MOED_IPASS, MOED_ITOKENS, pT)                          \
    MOED_DEFINE_IPASS1(NAME, KIND, 4, MOED_ITOKENS, r4tT)                                 \
    MOED_DEFINE_IPASS1(NAME, KIND, 1, MOED_ITOKENS, r1tT)                                 \
    static const moed_ipass_fn moed_ikernels_##NAME[2][3] = {                             \
        {moed_idot_##NAME##_p1, moed_idot_##NAME##_r4t1, moed_idot_##NAME##_r1t1},        \
        {moed_idot_##NAME##_pT, moed_idot_##NAME##_r4tT, moed_idot_##NAME##_r1tT}};
MOED_DEFINE_IPASS(int8, MOED_IK_INT8)
MOED_DEFINE_IPASS(int4m, MOED_IK_INT4M)
MOED_DEFINE_IPASS(int4s, MOED_IK_INT4S)
MOED_DEFINE_IPASS(mxfp4, MOED_IK_MXFP4)

/* The kernels of w's kind, for one token (tiled = 0) or MOED_ITOKENS (tiled = 1). */
static inline const moed_ipass_fn *moed_ikernels_for(const moed_weight *w, int tiled) {
    switch (w->fmt) {
    case MOED_INT8: return moed_ikernels_int8[tiled];
    case MOED_MXFP4: return moed_ikernels_mxfp4[tiled];
    default: return w->mins ? moed_ikernels_int4m[tiled] : moed_ikernels_int4s[tiled];
    }
}

/* out[j * ldo + k] = y of row r0 + k for tokens t0 + j, k < nrows <= MOED_ROWS, j < T:
 * MOED_ITOKENS tokens a pass while that many are left, then one by one. */
static inline void moed_imatmul_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                          const moed_qact *a, ptrdiff_t t0, ptrdiff_t T,
                                          float *out, ptrdiff_t ldo) {
    for (ptrdiff_t j = 0; j < T;) {
        const int tiled = T - j >= MOED_ITOKENS;
        const moed_ipass_fn *f = moed_ikernels_for(w, tiled);
        float *o = out + j * ldo;
        int k = 0;
        for (; k + MOED_IPASS <= nrows; k += MOED_IPASS) f[0](w, r0 + k, a, t0 + j, o + k, ldo);
        for (; k + 4 <= nrows; k += 4) f[1](w, r0 + k, a, t0 + j, o + k, ldo);
        for (; k < nrows; k++) f[2](w, r0 + k, a, t0 + j, o + k, ldo);
        j += tiled ? MOED_ITOKENS : 1;
    }
}
#endif

static inline const char *moed_fast_path(void) {
#if defined(MOED_I_AVX512)
    return "avx512-vnni";
#elif defined(MOED_I_AVX2) && defined(MOED_I_VNNI256)
    return "avx2-vnni";
#elif defined(MOED_I_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* out[j * ldo + k] = y of row r0 + k (k < nrows <= MOED_ROWS) for tokens t0 + j of a
 * (j < T), whose layout must be moed_fast_paired(w->fmt): each token's mat-vec, whatever
 * T is. simd = 0: the portable reference (same bits). */
static inline void moed_imatmul_rows(const moed_weight *w, ptrdiff_t r0, int nrows,
                                     const moed_qact *a, ptrdiff_t t0, ptrdiff_t T, float *out,
                                     ptrdiff_t ldo, int simd) {
    if (w->fmt == MOED_BF16) {
        moed_bmatmul_rows((const uint16_t *)w->codes, (ptrdiff_t)(w->row_bytes / 2), r0, nrows, w->cols,
                          a->xb, a->ldx, t0, T, out, ldo, simd);
        return;
    }
#ifdef MOED_I_SIMD
    if (simd) {
        moed_imatmul_rows_simd(w, r0, nrows, a, t0, T, out, ldo);
        return;
    }
#endif
    (void)simd;
    float o[MOED_ROWS];
    for (ptrdiff_t j = 0; j < T; j++) {
        moed_idot_rows_portable(w, r0, nrows, a, t0 + j, o);
        for (int k = 0; k < nrows; k++) out[j * ldo + k] = o[k];
    }
}

/* out[k] = y of row r0 + k (k < nrows <= MOED_ROWS) for token t of a. */
static inline void moed_idot_rows(const moed_weight *w, ptrdiff_t r0, int nrows,
                                  const moed_qact *a, ptrdiff_t t, float *out, int simd) {
    moed_imatmul_rows(w, r0, nrows, a, t, 1, out, 0, simd);
}

#endif
