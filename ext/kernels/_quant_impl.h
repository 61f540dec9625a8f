/* Block-quantised weight formats for ext/kernels/_kernels.pyx: exact dequantisation and
 * row dot products with the reduction order of the dense kernels.
 *
 * Design:
 * - One descriptor, `moed_weight`, describes any weight the kernels take: dense
 *   (f32/f16/bf16) or block-quantised (fp8 e4m3 with 2-D block scales, MXFP4, int8,
 *   int4). The value of weight (r, j) is decode(code) * scale, with the scale at
 *   scales[(r / scale_rows) * scale_ld + j / scale_cols] (plus the group's minimum
 *   for int4 with mins). The Python wrapper validates the arrays once and fills it.
 * - Dequantisation is exact: a kernel multiplies x by precisely the f32 value numpy
 *   gets from `decode(code).astype(f32) * scale.astype(f32) (+ min)`, one rounding of
 *   the product (fp8 x f32 scale) or of the sum (int4 with mins), none otherwise.
 * - Reduction order: a quantised row is reduced exactly like the dense row of its
 *   dequantised values (see moed_dot_rows_* in _kernels_impl.h), so the order is
 *   fixed by the number of columns alone and the result is bit-equal to the dense
 *   kernel's on `dequantize(w)`:
 *     "natural" (fp8, int8, like f32/f16): each 32-column step adds columns
 *       j..j+15 into the 16 lanes of a0 and j+16..j+31 into a1; then the fixed
 *       pairwise tree hsum(a0 + a1); then the n mod 32 tail, one column at a time.
 *     "paired" (mxfp4, int4, like bf16): a0 takes the even columns j+2l and a1 the
 *       odd columns j+2l+1 of each 32-column step (one byte holds columns 2i, 2i+1);
 *       hsum(a0 + a1); there is no tail (the column count is a multiple of 32).
 *   A product is a plain f32 multiply and the sums plain f32 adds (the build uses
 *   -ffp-contract=off), so every path below gives the same bits.
 * - Paths: moed_qdot_rows_generic is the reference, written for clarity (dequantise
 *   32 columns into a buffer, then the dense lane arithmetic). It is what the
 *   portable build runs.
 * - Values are not checked per call: NaN/inf/negative scales and E8M0 255 are the
 *   loader's business; the kernels compute with whatever the bytes say (an e4m3
 *   NaN code or an E8M0 255 scale gives NaN, exactly as the format defines).
 */
#ifndef MOED_QUANT_IMPL_H
#define MOED_QUANT_IMPL_H

#include "_kernels_impl.h"

enum { MOED_FP8_E4M3 = 3, MOED_MXFP4 = 4, MOED_INT8 = 5, MOED_INT4 = 6 };
enum { MOED_SCALE_F32 = 0, MOED_SCALE_BF16 = 1, MOED_SCALE_F16 = 2, MOED_SCALE_E8M0 = 3 };

typedef struct {
    int fmt;                 /* MOED_F32 .. MOED_INT4 */
    int scale_dtype;         /* MOED_SCALE_* (quantised formats) */
    ptrdiff_t rows, cols;    /* logical shape [R, C] = [out_features, in_features] */
    const uint8_t *codes;    /* row r starts at codes + r * row_bytes */
    size_t row_bytes;
    const void *scales;      /* NULL for dense formats */
    const uint16_t *mins;    /* int4 with mins: f16, indexed like scales; else NULL */
    ptrdiff_t scale_rows;    /* rows sharing one scale (fp8: block rows; else 1) */
    ptrdiff_t scale_cols;    /* columns sharing one scale (block cols / group size) */
    ptrdiff_t scale_ld;      /* scales per scale row */
} moed_weight;

/* ------------------------------------------------------------ scalar decoders */

/* E8M0 (OCP MX scale, DeepSeek's UE8M0): 2^(s - 127); 255 is NaN. */
static inline float moed_e8m0_to_f32(uint8_t s) {
    uint32_t u = s == 255 ? 0x7fc00000u : s == 0 ? 0x00400000u : (uint32_t)s << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float8_e4m3fn (OCP FP8): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
 * infinities; S.1111.111 is NaN; exponent 0 is subnormal (m * 2^-9). */
static inline float moed_e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80) << 24, mag = b & 0x7f, u;
    if (mag == 0x7f) {
        u = sign | 0x7fc00000u;
    } else if (mag < 8) {
        float f = (float)mag * 0x1p-9f;
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | (mag + (120u << 3)) << 20;   /* exponent e - 7 + 127, mantissa m */
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* E2M1 (OCP MXFP4 element): bit 3 sign, 2 exponent bits, 1 mantissa bit. */
static const float moed_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Element j of a nibble-packed row: 2i in the low nibble of byte i, 2i+1 in the high. */
static inline unsigned moed_nibble(const uint8_t *row, ptrdiff_t j) {
    return (row[j >> 1] >> ((j & 1) * 4)) & 15u;
}

/* Scale i of a weight (arrays may sit at any address: loads go through memcpy). */
static inline float moed_scale_at(const moed_weight *w, ptrdiff_t i) {
    uint16_t h;
    float f;
    switch (w->scale_dtype) {
    case MOED_SCALE_E8M0: return moed_e8m0_to_f32(((const uint8_t *)w->scales)[i]);
    case MOED_SCALE_BF16:
        memcpy(&h, (const uint16_t *)w->scales + i, 2);
        return moed_bf16_to_f32(h);
    case MOED_SCALE_F16:
        memcpy(&h, (const uint16_t *)w->scales + i, 2);
        return moed_f16_to_f32(h);
    default:
        memcpy(&f, (const float *)w->scales + i, 4);
        return f;
    }
}

static inline float moed_min_at(const moed_weight *w, ptrdiff_t i) {
    uint16_t h;
    memcpy(&h, w->mins + i, 2);
    return moed_f16_to_f32(h);
}

static inline ptrdiff_t moed_scale_index(const moed_weight *w, ptrdiff_t r, ptrdiff_t j) {
    return (r / w->scale_rows) * w->scale_ld + j / w->scale_cols;
}

/* out[k] = the value of weight (r, j0 + k) for k < n, exactly. */
static void moed_w_dequant(const moed_weight *w, ptrdiff_t r, ptrdiff_t j0, ptrdiff_t n,
                           float *out) {
    const uint8_t *row = w->codes + r * w->row_bytes;
    if (w->fmt <= MOED_BF16) {
        moed_dequant_row(w->fmt, row + j0 * moed_dtype_size(w->fmt), out, n);
        return;
    }
    ptrdiff_t j = j0, end = j0 + n;
    while (j < end) {   /* one scale group at a time */
        ptrdiff_t stop = (j / w->scale_cols + 1) * w->scale_cols;
        if (stop > end) stop = end;
        ptrdiff_t si = moed_scale_index(w, r, j);
        float s = moed_scale_at(w, si);
        switch (w->fmt) {
        case MOED_FP8_E4M3:
            for (; j < stop; j++) *out++ = moed_e4m3_to_f32(row[j]) * s;
            break;
        case MOED_MXFP4:
            for (; j < stop; j++) *out++ = moed_e2m1[moed_nibble(row, j)] * s;
            break;
        case MOED_INT8:
            for (; j < stop; j++) *out++ = (float)(int8_t)row[j] * s;
            break;
        default: /* MOED_INT4 */
            if (w->mins) {
                float m = moed_min_at(w, si);
                for (; j < stop; j++) *out++ = (float)moed_nibble(row, j) * s + m;
            } else {
                for (; j < stop; j++) *out++ = (float)((int)moed_nibble(row, j) - 8) * s;
            }
        }
    }
}

static inline int moed_is_paired(int fmt) {
    return fmt == MOED_BF16 || fmt == MOED_MXFP4 || fmt == MOED_INT4;
}

/* --------------------------------------------------------- the reference path */

/* out[q] = w_(r0+q) . x for q < nrows, in the order given at the top of this file. */
static void moed_qdot_rows_generic(const moed_weight *w, ptrdiff_t r0, int nrows,
                                   const float *x, float *out) {
    ptrdiff_t n = w->cols;
    int paired = moed_is_paired(w->fmt);
    for (int q = 0; q < nrows; q++) {
        moed_vf a0 = {0}, a1 = {0};
        float v[32];
        ptrdiff_t j = 0;
        for (; j + 32 <= n; j += 32) {
            moed_w_dequant(w, r0 + q, j, 32, v);
            moed_vf v0 = moed_load_f32(v), v1 = moed_load_f32(v + 16);
            moed_vf x0 = moed_load_f32(x + j), x1 = moed_load_f32(x + j + 16);
            if (paired) {
                moed_vf ve = __builtin_shufflevector(v0, v1, 0, 2, 4, 6, 8, 10, 12, 14,
                                                     16, 18, 20, 22, 24, 26, 28, 30);
                moed_vf vo = __builtin_shufflevector(v0, v1, 1, 3, 5, 7, 9, 11, 13, 15,
                                                     17, 19, 21, 23, 25, 27, 29, 31);
                moed_vf xe = __builtin_shufflevector(x0, x1, 0, 2, 4, 6, 8, 10, 12, 14,
                                                     16, 18, 20, 22, 24, 26, 28, 30);
                moed_vf xo = __builtin_shufflevector(x0, x1, 1, 3, 5, 7, 9, 11, 13, 15,
                                                     17, 19, 21, 23, 25, 27, 29, 31);
                a0 = a0 + ve * xe;
                a1 = a1 + vo * xo;
            } else {
                a0 = a0 + v0 * x0;
                a1 = a1 + v1 * x1;
            }
        }
        float s = moed_hsum(a0 + a1);
        if (j < n) {
            moed_w_dequant(w, r0 + q, j, n - j, v);
            for (ptrdiff_t k = j; k < n; k++) s = s + v[k - j] * x[k];
        }
        out[q] = s;
    }
}

/* ------------------------------------------------------------- the SIMD paths */
/* Chosen at compile time (the build is -march=native unless MOED_PORTABLE=1):
 *   "avx512": AVX-512 F/BW/VL/DQ/VBMI (Zen 4+, Ice Lake+): fp8 decoded by two 128-entry
 *             byte tables (vpermt2b), nibbles by one 16-entry vpermps.
 *   "avx2":   AVX2 + F16C (Zen 3, Haswell+, Skylake-X without VBMI): fp8 decoded through
 *             binary16 bit placement, nibbles by two 8-entry vpermps and a blend.
 *   "portable": moed_qdot_rows_generic.
 * Every path computes each lane with the same f32 multiplies and adds in the same
 * order, so all three give the same bits (tests compare them). Several rows per pass
 * and a software prefetch per row, as the bf16 kernel does. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VBMI__)
#define MOED_Q_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__)
#define MOED_Q_AVX2 1
#endif

#if defined(MOED_Q_AVX512) || defined(MOED_Q_AVX2)
#include <immintrin.h>

typedef float moed_vf8 __attribute__((vector_size(32)));       /* 8 x f32 (__m256) */

#define MOED_EVENS 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define MOED_ODDS 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define MOED_LO8 0, 1, 2, 3, 4, 5, 6, 7
#define MOED_HI8 8, 9, 10, 11, 12, 13, 14, 15
#define MOED_CAT16 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
/* Bytes of a row prefetched ahead: a bf16 row's 1024 bytes are 512 columns; a 4-bit
 * row streams a quarter as many bytes per column. */
#define MOED_Q_PREFETCH 512

/* 16 bytes at p zero-extended to 32-bit lanes (GCC's __builtin_convertvector does this
 * one element at a time). */
static inline moed_vu32 moed_widen_u8(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
#ifdef MOED_Q_AVX512
    return (moed_vu32)_mm512_cvtepu8_epi32(b);
#else
    typedef uint32_t vu32x8 __attribute__((vector_size(32)));
    vu32x8 lo = (vu32x8)_mm256_cvtepu8_epi32(b), hi = (vu32x8)_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    return __builtin_shufflevector(lo, hi, MOED_CAT16);
#endif
}

/* 16 signed bytes at p as f32 (exact). */
static inline moed_vf moed_i8_to_f32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
#ifdef MOED_Q_AVX512
    return (moed_vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#else
    moed_vf8 lo = (moed_vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    moed_vf8 hi = (moed_vf8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    return __builtin_shufflevector(lo, hi, MOED_CAT16);
#endif
}

/* x[j .. j+31] split into its even and odd columns (the "paired" order). */
static inline void moed_split_x(const float *x, moed_vf *xe, moed_vf *xo) {
    moed_vf x0 = moed_load_f32(x), x1 = moed_load_f32(x + 16);
    *xe = __builtin_shufflevector(x0, x1, MOED_EVENS);
    *xo = __builtin_shufflevector(x0, x1, MOED_ODDS);
}

/* table[idx & 15] in each of the 16 lanes (bits above 3 of idx are ignored). */
static inline moed_vf moed_lookup16(moed_vf table, moed_vu32 idx) {
#ifdef MOED_Q_AVX512
    return (moed_vf)_mm512_permutexvar_ps((__m512i)idx, (__m512)table);
#else
    __m256 lo = (__m256)__builtin_shufflevector(table, table, MOED_LO8);
    __m256 hi = (__m256)__builtin_shufflevector(table, table, MOED_HI8);
    moed_vf8 half[2];
    for (int h = 0; h < 2; h++) {
        __m256i i = h ? (__m256i)__builtin_shufflevector(idx, idx, MOED_HI8)
                      : (__m256i)__builtin_shufflevector(idx, idx, MOED_LO8);
        __m256 a = _mm256_permutevar8x32_ps(lo, i), b = _mm256_permutevar8x32_ps(hi, i);
        half[h] = (moed_vf8)_mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
    }
    return __builtin_shufflevector(half[0], half[1], MOED_CAT16);
#endif
}

/* int4 / mxfp4: nibble-packed rows, one 16-entry table of exact values per group of
 * g columns and row (base[c] * scale (+ min): the generic path's arithmetic).
 * `kind` (a constant in each instantiation): MOED_MXFP4, MOED_INT4 (mins) or
 * MOED_INT4 + 16 (symmetric). */
static inline __attribute__((always_inline)) void
moed_qrows_nibbles(const moed_weight *w, ptrdiff_t r0, const int nrows, const float *x,
                   float *out, const int kind) {
    static const moed_vf e2m1 = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    static const moed_vf codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static const moed_vf centred = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
    const moed_vf base = kind == MOED_MXFP4 ? e2m1 : kind == MOED_INT4 ? codes : centred;
    const ptrdiff_t C = w->cols, g = w->scale_cols;
    const uint8_t *row[MOED_ROWS];
    moed_vf a0[MOED_ROWS], a1[MOED_ROWS], tab[MOED_ROWS];
    for (int q = 0; q < nrows; q++) {
        row[q] = w->codes + (r0 + q) * w->row_bytes;
        a0[q] = a1[q] = (moed_vf){0};
    }
    for (ptrdiff_t j = 0, si = 0; j < C; j += g, si++) {
        for (int q = 0; q < nrows; q++) {
            ptrdiff_t i = (r0 + q) * w->scale_ld + si;
            if (kind == MOED_MXFP4) {
                tab[q] = base * moed_e8m0_to_f32(((const uint8_t *)w->scales)[i]);
            } else {
                uint16_t h;
                memcpy(&h, (const uint16_t *)w->scales + i, 2);
                tab[q] = base * moed_f16_to_f32(h);
                if (kind == MOED_INT4) tab[q] = tab[q] + moed_min_at(w, i);
            }
        }
        for (ptrdiff_t k = j; k < j + g; k += 32) {
            moed_vf xe, xo;
            moed_split_x(x + k, &xe, &xo);
            for (int q = 0; q < nrows; q++) {
                __builtin_prefetch(row[q] + k / 2 + MOED_Q_PREFETCH);
                moed_vu32 i = moed_widen_u8(row[q] + k / 2);
                a0[q] = a0[q] + moed_lookup16(tab[q], i) * xe;
                a1[q] = a1[q] + moed_lookup16(tab[q], i >> 4) * xo;
            }
        }
    }
    for (int q = 0; q < nrows; q++) out[q] = moed_hsum(a0[q] + a1[q]);
}
#define moed_qrows_mxfp4(w, r0, n, x, out) moed_qrows_nibbles(w, r0, n, x, out, MOED_MXFP4)
#define moed_qrows_int4m(w, r0, n, x, out) moed_qrows_nibbles(w, r0, n, x, out, MOED_INT4)
#define moed_qrows_int4s(w, r0, n, x, out) moed_qrows_nibbles(w, r0, n, x, out, MOED_INT4 + 16)

/* int8: natural order, value = code * scale of its group. */
static inline __attribute__((always_inline)) void
moed_qrows_int8(const moed_weight *w, ptrdiff_t r0, const int nrows, const float *x,
                float *out) {
    const ptrdiff_t C = w->cols, g = w->scale_cols;
    const uint8_t *row[MOED_ROWS];
    moed_vf a0[MOED_ROWS], a1[MOED_ROWS];
    float s[MOED_ROWS];
    for (int q = 0; q < nrows; q++) {
        row[q] = w->codes + (r0 + q) * w->row_bytes;
        a0[q] = a1[q] = (moed_vf){0};
    }
    for (ptrdiff_t j = 0, si = 0; j < C; j += g, si++) {
        for (int q = 0; q < nrows; q++) {
            uint16_t h;
            memcpy(&h, (const uint16_t *)w->scales + (r0 + q) * w->scale_ld + si, 2);
            s[q] = moed_f16_to_f32(h);
        }
        for (ptrdiff_t k = j; k < j + g; k += 32) {
            moed_vf x0 = moed_load_f32(x + k), x1 = moed_load_f32(x + k + 16);
            for (int q = 0; q < nrows; q++) {
                __builtin_prefetch(row[q] + k + 2 * MOED_Q_PREFETCH);
                a0[q] = a0[q] + moed_i8_to_f32(row[q] + k) * s[q] * x0;
                a1[q] = a1[q] + moed_i8_to_f32(row[q] + k + 16) * s[q] * x1;
            }
        }
    }
    for (int q = 0; q < nrows; q++) out[q] = moed_hsum(a0[q] + a1[q]);
}

/* fp8 e4m3: natural order, value = fp8 * scale of its (br, bc) block; needs bc % 32
 * == 0 so that 32-column steps never straddle two blocks (the caller checks). */
#ifdef MOED_Q_AVX512
/* Byte tables of the f32 value of each 7-bit e4m3 magnitude (its bits 16..23 and
 * 24..31; the low 16 bits are zero for every e4m3 value), and the byte placement of
 * four 16-value groups into f32 lanes. Filled by moed_quant_init. */
static uint8_t moed_e4m3_lut[2][128] __attribute__((aligned(64)));
static uint8_t moed_e4m3_place[4][64] __attribute__((aligned(64)));

static inline void moed_quant_init(void) {
    for (int m = 0; m < 128; m++) {
        float f = moed_e4m3_to_f32((uint8_t)m);
        uint32_t u;
        memcpy(&u, &f, 4);
        moed_e4m3_lut[0][m] = (uint8_t)(u >> 16);
        moed_e4m3_lut[1][m] = (uint8_t)(u >> 24);
    }
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 16; i++) {
            moed_e4m3_place[k][4 * i + 2] = (uint8_t)(16 * k + i);        /* from lo */
            moed_e4m3_place[k][4 * i + 3] = (uint8_t)(64 + 16 * k + i);   /* from hi */
        }
}

typedef struct { __m512i lo0, lo1, hi0, hi1, sign, place[4]; } moed_e4m3_tables;

static inline void moed_e4m3_tables_load(moed_e4m3_tables *t) {
    t->lo0 = _mm512_load_si512(moed_e4m3_lut[0]);
    t->lo1 = _mm512_load_si512(moed_e4m3_lut[0] + 64);
    t->hi0 = _mm512_load_si512(moed_e4m3_lut[1]);
    t->hi1 = _mm512_load_si512(moed_e4m3_lut[1] + 64);
    t->sign = _mm512_set1_epi8((char)0x80);
    for (int k = 0; k < 4; k++) t->place[k] = _mm512_load_si512(moed_e4m3_place[k]);
}

/* The exact f32 values of n (32 or 64) e4m3 codes at p, 16 per vector. */
static inline __attribute__((always_inline)) void
moed_e4m3_decode(const moed_e4m3_tables *t, const uint8_t *p, int n, moed_vf *f) {
    __m512i b = n == 64 ? _mm512_loadu_si512(p)
                        : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    __m512i lo = _mm512_permutex2var_epi8(t->lo0, b, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, b, t->hi1);
    hi = _mm512_ternarylogic_epi32(hi, b, t->sign, 0xF8);   /* hi | (b & 0x80) */
    for (int k = 0; k < n / 16; k++)
        f[k] = (moed_vf)_mm512_castsi512_ps(
            _mm512_maskz_permutex2var_epi8(0xCCCCCCCCCCCCCCCCull, lo, t->place[k], hi));
}
#define MOED_E4M3_STEP 64
#else
static inline void moed_quant_init(void) {}

typedef int moed_e4m3_tables;
static inline void moed_e4m3_tables_load(moed_e4m3_tables *t) { *t = 0; }

/* 16 e4m3 codes -> their values * 2^-8, exactly: the code's bits placed in a binary16
 * (sign to bit 15, exponent and mantissa to bits 7..13) read as f16; NaN codes NaN. */
static inline moed_vf moed_e4m3_x2m8(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i t = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    t = _mm256_and_si256(t, _mm256_set1_epi16((short)0xBFFF));
    __m256 f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(t));
    __m256 f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(t, 1));
    __m128i nan = _mm_cmpeq_epi8(_mm_or_si128(b, _mm_set1_epi8((char)0x80)), _mm_set1_epi8(-1));
    if (__builtin_expect(_mm_movemask_epi8(nan) != 0, 0)) {
        __m256 q = _mm256_set1_ps(__builtin_nanf(""));
        f0 = _mm256_blendv_ps(f0, q, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan)));
        f1 = _mm256_blendv_ps(f1, q, _mm256_castsi256_ps(
                                         _mm256_cvtepi8_epi32(_mm_srli_si128(nan, 8))));
    }
    return __builtin_shufflevector((moed_vf8)f0, (moed_vf8)f1, MOED_CAT16);
}

/* The exact f32 values of n (32) codes at p * 2^-8, 16 per vector; the scale the
 * caller multiplies by is then 256 x the block's scale (exact below 2^120). */
static inline __attribute__((always_inline)) void
moed_e4m3_decode(const moed_e4m3_tables *t, const uint8_t *p, int n, moed_vf *f) {
    (void)t;
    for (int k = 0; k < n / 16; k++) f[k] = moed_e4m3_x2m8(p + 16 * k);
}
#define MOED_E4M3_STEP 32
#endif

static inline __attribute__((always_inline)) void
moed_qrows_fp8(const moed_weight *w, ptrdiff_t r0, const int nrows, const float *x,
               float *out) {
#ifdef MOED_Q_AVX512
    const float prescale = 1.0f;
#else
    const float prescale = 256.0f;   /* moed_e4m3_decode gives value * 2^-8 */
#endif
    const ptrdiff_t C = w->cols, bc = w->scale_cols;
    const uint8_t *row[MOED_ROWS];
    const float *xr;
    moed_vf a0[MOED_ROWS], a1[MOED_ROWS];
    float s[MOED_ROWS];
    moed_e4m3_tables t;
    moed_e4m3_tables_load(&t);
    for (int q = 0; q < nrows; q++) {
        row[q] = w->codes + (r0 + q) * w->row_bytes;
        a0[q] = a1[q] = (moed_vf){0};
    }
    ptrdiff_t j = 0;
    for (ptrdiff_t c0 = 0; c0 < C; c0 += bc) {
        ptrdiff_t c1 = c0 + bc < C ? c0 + bc : C;
        for (int q = 0; q < nrows; q++)
            s[q] = moed_scale_at(w, moed_scale_index(w, r0 + q, c0)) * prescale;
        for (j = c0; j + MOED_E4M3_STEP <= c1; j += MOED_E4M3_STEP) {
            moed_vf xv[MOED_E4M3_STEP / 16], f[MOED_E4M3_STEP / 16];
            xr = x + j;
            for (int k = 0; k < MOED_E4M3_STEP / 16; k++) xv[k] = moed_load_f32(xr + 16 * k);
            for (int q = 0; q < nrows; q++) {
                __builtin_prefetch(row[q] + j + 2 * MOED_Q_PREFETCH);
                moed_e4m3_decode(&t, row[q] + j, MOED_E4M3_STEP, f);
                for (int k = 0; k < MOED_E4M3_STEP / 16; k += 2) {
                    a0[q] = a0[q] + f[k] * s[q] * xv[k];
                    a1[q] = a1[q] + f[k + 1] * s[q] * xv[k + 1];
                }
            }
        }
        if (MOED_E4M3_STEP > 32 && j + 32 <= c1) {
            moed_vf f[2];
            moed_vf x0 = moed_load_f32(x + j), x1 = moed_load_f32(x + j + 16);
            for (int q = 0; q < nrows; q++) {
                moed_e4m3_decode(&t, row[q] + j, 32, f);
                a0[q] = a0[q] + f[0] * s[q] * x0;
                a1[q] = a1[q] + f[1] * s[q] * x1;
            }
            j += 32;
        }
    }
    for (int q = 0; q < nrows; q++) {   /* j: start of the n mod 32 tail */
        float v[32], sum = moed_hsum(a0[q] + a1[q]);
        if (j < C) {
            moed_w_dequant(w, r0 + q, j, C - j, v);
            for (ptrdiff_t k = j; k < C; k++) sum = sum + v[k - j] * x[k];
        }
        out[q] = sum;
    }
}

/* Can moed_qrows_fp8 take these rows? Blocks must be whole 32-column steps, and (on
 * the binary16 path, which multiplies by 256 x scale) no finite scale may reach 2^120. */
static inline int moed_fp8_simd_ok(const moed_weight *w, ptrdiff_t r0, int nrows) {
    if (w->scale_cols % 32) return 0;
#ifndef MOED_Q_AVX512
    ptrdiff_t last = (r0 + nrows - 1) / w->scale_rows;
    for (ptrdiff_t sr = r0 / w->scale_rows; sr <= last; sr++)
        for (ptrdiff_t b = 0; b < w->scale_ld; b++) {
            float s = fabsf(moed_scale_at(w, sr * w->scale_ld + b));
            if (s >= 0x1p120f && s <= 3.4028235e38f) return 0;
        }
#endif
    return 1;
}

#define MOED_DEFINE_QROWS(FMT)                                                     \
    static void moed_qrows_##FMT##_4(const moed_weight *w, ptrdiff_t r0,           \
                                     const float *x, float *out) {                 \
        moed_qrows_##FMT(w, r0, MOED_ROWS, x, out);                                \
    }                                                                              \
    static void moed_qrows_##FMT##_1(const moed_weight *w, ptrdiff_t r0,           \
                                     const float *x, float *out) {                 \
        moed_qrows_##FMT(w, r0, 1, x, out);                                        \
    }
MOED_DEFINE_QROWS(mxfp4)
MOED_DEFINE_QROWS(int4m)
MOED_DEFINE_QROWS(int4s)
MOED_DEFINE_QROWS(int8)
MOED_DEFINE_QROWS(fp8)

/* The SIMD path for nrows <= MOED_ROWS rows; 0 if it does not apply. */
static inline int moed_qdot_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                      const float *x, float *out) {
    void (*four)(const moed_weight *, ptrdiff_t, const float *, float *);
    void (*one)(const moed_weight *, ptrdiff_t, const float *, float *);
    switch (w->fmt) {
    case MOED_MXFP4: four = moed_qrows_mxfp4_4; one = moed_qrows_mxfp4_1; break;
    case MOED_INT4:
        if (w->mins) { four = moed_qrows_int4m_4; one = moed_qrows_int4m_1; }
        else { four = moed_qrows_int4s_4; one = moed_qrows_int4s_1; }
        break;
    case MOED_INT8: four = moed_qrows_int8_4; one = moed_qrows_int8_1; break;
    case MOED_FP8_E4M3:
        if (!moed_fp8_simd_ok(w, r0, nrows)) return 0;
        four = moed_qrows_fp8_4; one = moed_qrows_fp8_1;
        break;
    default: return 0;
    }
    if (nrows == MOED_ROWS) four(w, r0, x, out);
    else for (int q = 0; q < nrows; q++) one(w, r0 + q, x, out + q);
    return 1;
}
#else
static inline void moed_quant_init(void) {}
static inline int moed_qdot_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                      const float *x, float *out) {
    (void)w; (void)r0; (void)nrows; (void)x; (void)out;
    return 0;
}
#endif

/* ------------------------------------------------------------------ dispatch */

static inline const char *moed_simd_path(void) {
#if defined(MOED_Q_AVX512)
    return "avx512";
#elif defined(MOED_Q_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* out[q] = w_(r0+q) . x for q < nrows <= MOED_ROWS. `simd` = 0 forces the
 * reference path for the quantised formats (the same bits; tests compare them). */
static inline void moed_w_dot_rows(const moed_weight *w, ptrdiff_t r0, int nrows,
                                   const float *x, float *out, int simd) {
    if (w->fmt <= MOED_BF16) {
        moed_dot_rows(w->fmt, (const char *)w->codes + r0 * w->row_bytes, w->row_bytes,
                      nrows, x, w->cols, out);
        return;
    }
    if (simd && moed_qdot_rows_simd(w, r0, nrows, x, out)) return;
    moed_qdot_rows_generic(w, r0, nrows, x, out);
}

#endif
