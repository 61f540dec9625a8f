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

/* ------------------------------------------------------------------ dispatch */

static inline const char *moed_simd_path(void) {
    return "portable";
}

/* out[q] = w_(r0+q) . x for q < nrows <= MOED_ROWS. `simd` = 0 forces the
 * reference path for the quantised formats (the same bits; tests compare them). */
static inline void moed_w_dot_rows(const moed_weight *w, ptrdiff_t r0, int nrows,
                                   const float *x, float *out, int simd) {
    (void)simd;
    if (w->fmt <= MOED_BF16) {
        moed_dot_rows(w->fmt, (const char *)w->codes + r0 * w->row_bytes, w->row_bytes,
                      nrows, x, w->cols, out);
        return;
    }
    moed_qdot_rows_generic(w, r0, nrows, x, out);
}

#endif
