/* Leaf kernels for ext/kernels/_kernels.pyx: dequantising dot products with a fixed
 * reduction order.
 *
 * Design:
 * - Every dot product of length n sums in the same order for the same n, whatever
 *   the thread count, the alignment of either operand, or how many other rows or
 *   tokens are computed in the same call: lanes of 16-wide vector accumulators,
 *   then a fixed pairwise tree over the lanes, then a sequential scalar tail (the
 *   exact orders are given above each function). Nothing depends on the address
 *   of the data: loads are unaligned (memcpy into GCC vector values), so there is
 *   no alignment peeling.
 * - GCC vector extensions give the lane semantics explicitly; the compiler maps
 *   them to AVX-512, AVX2 or SSE as the target allows. The build uses
 *   -ffp-contract=off so a multiply and an add are never fused differently in two
 *   code paths (mat-vec and mat-mat rows are bit-equal).
 * - Weights are dequantised on the fly to f32 and accumulated in f32. Formats:
 *   f32, f16 (IEEE binary16), bf16 (upper half of an f32). The block-quantised
 *   formats (fp8 e4m3, MXFP4, int8, int4) live in _quant_impl.h and reuse the
 *   reduction orders defined here.
 */
#ifndef MOED_KERNELS_IMPL_H
#define MOED_KERNELS_IMPL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { MOED_F32 = 0, MOED_F16 = 1, MOED_BF16 = 2 };

typedef float moed_vf __attribute__((vector_size(64)));        /* 16 x f32 */
typedef uint32_t moed_vu32 __attribute__((vector_size(64)));   /* 16 x u32 */
typedef uint16_t moed_vu16 __attribute__((vector_size(32)));   /* 16 x u16 */
typedef _Float16 moed_vh __attribute__((vector_size(32)));     /* 16 x f16 */

static inline size_t moed_dtype_size(int dtype) {
    return dtype == MOED_F32 ? 4 : 2;
}

static inline float moed_bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float moed_f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline moed_vf moed_load_f32(const float *p) {
    moed_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline moed_vf moed_load_bf16(const uint16_t *p) {
    moed_vu16 h;
    memcpy(&h, p, sizeof h);
    moed_vu32 u = __builtin_convertvector(h, moed_vu32) << 16;
    moed_vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 binary16 values to f32 (exact). GCC 12 converts a vector of _Float16 one element
 * at a time, so the F16C / AVX-512 instruction is used where the target has it. */
static inline moed_vf moed_load_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (moed_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && defined(__AVX__)
    typedef float vf8 __attribute__((vector_size(32)));
    vf8 lo = (vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    vf8 hi = (vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    moed_vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, moed_vf);
#endif
}

/* Fixed pairwise tree over 16 lanes: (0+8, 1+9, ...), then 4, 2, 1. */
static inline float moed_hsum(moed_vf a) {
    float l[16];
    memcpy(l, &a, sizeof l);
    for (int s = 8; s > 0; s >>= 1)
        for (int i = 0; i < s; i++)
            l[i] = l[i] + l[i + s];
    return l[0];
}

/* Load 16 weights of format `dtype` starting at element j of row w. */
#define MOED_LOADW(dtype, w, j)                                                  \
    ((dtype) == MOED_BF16  ? moed_load_bf16((const uint16_t *)(w) + (j))         \
     : (dtype) == MOED_F16 ? moed_load_f16((const uint16_t *)(w) + (j))          \
                           : moed_load_f32((const float *)(w) + (j)))

static inline float moed_scalarw(int dtype, const void *w, ptrdiff_t j) {
    if (dtype == MOED_BF16) return moed_bf16_to_f32(((const uint16_t *)w)[j]);
    if (dtype == MOED_F16) return moed_f16_to_f32(((const uint16_t *)w)[j]);
    return ((const float *)w)[j];
}

/* The reduction order, shared by every dot below:
 *   a0 takes 16-element blocks 0, 2, 4, ...; a1 blocks 1, 3, 5, ... (whole
 *   32-element steps), then one more 16-block into a0 if it fits; then
 *   hsum(a0 + a1); then the remaining n mod 16 elements added one by one. */
#define MOED_DEFINE_DOT(NAME, DT)                                                \
    static inline float NAME(const void *w, const float *x, ptrdiff_t n) {      \
        moed_vf a0 = {0}, a1 = {0};                                              \
        ptrdiff_t j = 0;                                                         \
        for (; j + 32 <= n; j += 32) {                                           \
            a0 = a0 + MOED_LOADW(DT, w, j) * moed_load_f32(x + j);               \
            a1 = a1 + MOED_LOADW(DT, w, j + 16) * moed_load_f32(x + j + 16);     \
        }                                                                        \
        if (j + 16 <= n) {                                                       \
            a0 = a0 + MOED_LOADW(DT, w, j) * moed_load_f32(x + j);               \
            j += 16;                                                             \
        }                                                                        \
        float s = moed_hsum(a0 + a1);                                            \
        for (; j < n; j++) s = s + moed_scalarw(DT, w, j) * x[j];                \
        return s;                                                                \
    }

MOED_DEFINE_DOT(moed_dot_f32, MOED_F32)
MOED_DEFINE_DOT(moed_dot_f16, MOED_F16)
MOED_DEFINE_DOT(moed_dot_bf16, MOED_BF16)

/* Up to MOED_ROWS weight rows against one f32 vector: out[r] = w_r . x.
 *
 * Several rows per pass give the core independent load streams, which is what
 * keeps a memory-bound mat-vec near the DRAM bandwidth. Each row is reduced
 * alone, in an order fixed by n: 32 elements per step into two 16-lane
 * accumulators a0/a1, then hsum(a0 + a1), then the n mod 32 tail one by one.
 * For f32/f16, a0 takes elements j..j+15 and a1 j+16..j+31 of each step. For
 * bf16, one 64-byte load holds 32 values as 16 pairs; the even-indexed values
 * (v << 16) go to a0 against x's even elements and the odd ones (v & 0xffff0000)
 * to a1 against x's odd elements, x being de-interleaved by a fixed shuffle.
 * So a row's result does not depend on nrows, on the row's neighbours, on
 * alignment, or on the thread that computes it. */
#define MOED_ROWS 4
/* Software prefetch distance along each weight row (measured: +10 % on a
 * DRAM-bound 14336 x 4096 bf16 mat-vec; prefetches never fault). */
#define MOED_PREFETCH_BYTES 1024

typedef uint32_t moed_vpair __attribute__((vector_size(64)));   /* 16 x (2 x bf16) */

static inline void moed_split_bf16(const uint16_t *p, moed_vf *even, moed_vf *odd) {
    moed_vpair u;
    memcpy(&u, p, sizeof u);
    moed_vpair lo = u << 16, hi = u & 0xffff0000u;
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
}

static inline __attribute__((always_inline)) void moed_dot_rows_bf16(const char *w, size_t ldw, int nrows, const float *x,
                                      ptrdiff_t n, float *out) {
    moed_vf a0[MOED_ROWS] = {{0}}, a1[MOED_ROWS] = {{0}};
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        moed_vf x0 = moed_load_f32(x + j), x1 = moed_load_f32(x + j + 16);
        moed_vf xe = __builtin_shufflevector(x0, x1, 0, 2, 4, 6, 8, 10, 12, 14,
                                             16, 18, 20, 22, 24, 26, 28, 30);
        moed_vf xo = __builtin_shufflevector(x0, x1, 1, 3, 5, 7, 9, 11, 13, 15,
                                             17, 19, 21, 23, 25, 27, 29, 31);
        for (int r = 0; r < nrows; r++) {
            moed_vf e, o;
            __builtin_prefetch(w + r * ldw + 2 * j + MOED_PREFETCH_BYTES);
            moed_split_bf16((const uint16_t *)(w + r * ldw) + j, &e, &o);
            a0[r] = a0[r] + e * xe;
            a1[r] = a1[r] + o * xo;
        }
    }
    for (int r = 0; r < nrows; r++) {
        const uint16_t *wr = (const uint16_t *)(w + r * ldw);
        float s = moed_hsum(a0[r] + a1[r]);
        for (ptrdiff_t k = j; k < n; k++) s = s + moed_bf16_to_f32(wr[k]) * x[k];
        out[r] = s;
    }
}

#define MOED_DEFINE_DOT_ROWS(NAME, DT)                                           \
    static inline __attribute__((always_inline)) void NAME(const char *w, size_t ldw, int nrows, const float *x, \
                            ptrdiff_t n, float *out) {                           \
        moed_vf a0[MOED_ROWS] = {{0}}, a1[MOED_ROWS] = {{0}};                    \
        ptrdiff_t j = 0;                                                         \
        for (; j + 32 <= n; j += 32) {                                           \
            moed_vf x0 = moed_load_f32(x + j), x1 = moed_load_f32(x + j + 16);   \
            for (int r = 0; r < nrows; r++) {                                    \
                const void *wr = w + r * ldw;                                    \
                a0[r] = a0[r] + MOED_LOADW(DT, wr, j) * x0;                      \
                a1[r] = a1[r] + MOED_LOADW(DT, wr, j + 16) * x1;                 \
            }                                                                    \
        }                                                                        \
        for (int r = 0; r < nrows; r++) {                                        \
            const void *wr = w + r * ldw;                                        \
            float s = moed_hsum(a0[r] + a1[r]);                                  \
            for (ptrdiff_t k = j; k < n; k++) s = s + moed_scalarw(DT, wr, k) * x[k]; \
            out[r] = s;                                                          \
        }                                                                        \
    }

MOED_DEFINE_DOT_ROWS(moed_dot_rows_f32, MOED_F32)
MOED_DEFINE_DOT_ROWS(moed_dot_rows_f16, MOED_F16)

/* out[r] = w_r . x for nrows <= MOED_ROWS rows spaced ldw bytes apart. */
static void moed_dot_rows4(int dtype, const char *w, size_t ldw, const float *x,
                           ptrdiff_t n, float *out) {
    if (dtype == MOED_BF16) moed_dot_rows_bf16(w, ldw, MOED_ROWS, x, n, out);
    else if (dtype == MOED_F16) moed_dot_rows_f16(w, ldw, MOED_ROWS, x, n, out);
    else moed_dot_rows_f32(w, ldw, MOED_ROWS, x, n, out);
}

static void moed_dot_rows1(int dtype, const char *w, const float *x, ptrdiff_t n,
                           float *out) {
    if (dtype == MOED_BF16) moed_dot_rows_bf16(w, 0, 1, x, n, out);
    else if (dtype == MOED_F16) moed_dot_rows_f16(w, 0, 1, x, n, out);
    else moed_dot_rows_f32(w, 0, 1, x, n, out);
}

/* out[r] = w_r . x for nrows <= MOED_ROWS rows spaced ldw bytes apart: groups of
 * MOED_ROWS share a pass, leftovers go one by one (same per-row arithmetic). */
static inline void moed_dot_rows(int dtype, const char *w, size_t ldw, int nrows,
                                 const float *x, ptrdiff_t n, float *out) {
    if (nrows == MOED_ROWS) {
        moed_dot_rows4(dtype, w, ldw, x, n, out);
        return;
    }
    for (int r = 0; r < nrows; r++) moed_dot_rows1(dtype, w + r * ldw, x, n, out + r);
}

/* Dispatch on the weight format. */
static inline float moed_dot(int dtype, const void *w, const float *x, ptrdiff_t n) {
    if (dtype == MOED_BF16) return moed_dot_bf16(w, x, n);
    if (dtype == MOED_F16) return moed_dot_f16(w, x, n);
    return moed_dot_f32(w, x, n);
}

/* out[j] = dequantised w[j] for j < n. */
static inline void moed_dequant_row(int dtype, const void *w, float *out, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) out[j] = moed_scalarw(dtype, w, j);
}

/* y[j] += a * dequantised w[j], elementwise: 16 lanes at a time, then one by one (the
 * same multiply and add either way, so the result does not depend on which path an
 * element takes). One row of a weight stored [in, out] added into an f32 output; a
 * transposed mat-vec is a sequence of these, its reduction order the row order. */
static inline void moed_axpy_w(int dtype, float a, const void *w, float *y, ptrdiff_t n) {
    moed_vf av = {0};
    av = av + a;
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) {
        moed_vf yv = moed_load_f32(y + j);
        yv = yv + av * MOED_LOADW(dtype, w, j);
        memcpy(y + j, &yv, sizeof yv);
    }
    for (; j < n; j++) y[j] = y[j] + a * moed_scalarw(dtype, w, j);
}

/* y[j] += a * x[j], elementwise (no reduction: order is irrelevant). */
static inline void moed_axpy(float a, const float *x, float *y, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) y[j] = y[j] + a * x[j];
}

/* GPT-OSS's clamped SwiGLU: gate clamped from above, up both ways at `limit`, then
 * (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts._apply_gate). */
static inline float moed_clamped_swiglu(float g, float u, float alpha, float limit) {
    if (g > limit) g = limit;
    if (u > limit) u = limit;
    if (u < -limit) u = -limit;
    float sig = 1.0f / (1.0f + expf(-(g * alpha)));
    return (u + 1.0f) * (g * sig);
}

static inline float moed_silu(float g) {
    return g / (1.0f + expf(-g));
}

#endif
