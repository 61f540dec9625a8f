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
 * - The 16-lane vectors of _simd.h give the lane semantics explicitly (one zmm,
 *   two ymm, or a GCC vector extension value, as the target allows; every path
 *   gives the same bits).
 * - Every product is accumulated with a fused multiply-add, acc = fma(w, x, acc): one
 *   rounding per term (more accurate than a multiply then an add, and one instruction
 *   instead of two). It is written out explicitly (moed_v16_fma, fmaf in the scalar
 *   tails) and the build uses -ffp-contract=off, so the compiler never fuses or splits
 *   anything on its own and every path (vector lanes, tails, mat-vec, mat-mat tiles,
 *   the portable build) rounds at the same places: mat-vec and mat-mat rows are
 *   bit-equal. Other arithmetic (hsum's tree, scales, norms) stays plain f32.
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

#include "_simd.h"

enum { MOED_F32 = 0, MOED_F16 = 1, MOED_BF16 = 2 };

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

/* 16 weights of format `dtype` (f32 or f16) starting at element j of row w. */
static inline moed_v16 moed_loadw(int dtype, const void *w, ptrdiff_t j) {
    return dtype == MOED_F16 ? moed_v16_load_f16((const uint16_t *)w + j)
                             : moed_v16_load((const float *)w + j);
}

static inline float moed_scalarw(int dtype, const void *w, ptrdiff_t j) {
    uint16_t h;
    float f;
    if (dtype == MOED_F32) {
        memcpy(&f, (const float *)w + j, 4);
        return f;
    }
    memcpy(&h, (const uint16_t *)w + j, 2);
    return dtype == MOED_BF16 ? moed_bf16_to_f32(h) : moed_f16_to_f32(h);
}

/* The reduction order of moed_dot (rmsnorm, attention):
 *   a0 takes 16-element blocks 0, 2, 4, ...; a1 blocks 1, 3, 5, ... (whole
 *   32-element steps), then one more 16-block into a0 if it fits; then
 *   hsum(a0 + a1); then the remaining n mod 16 elements added one by one.
 * `dtype` is f32 or f16. */
static inline float moed_dot(int dtype, const void *w, const float *x, ptrdiff_t n) {
    moed_v16 a0 = moed_v16_zero(), a1 = moed_v16_zero();
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        a0 = moed_v16_fma(moed_loadw(dtype, w, j), moed_v16_load(x + j), a0);
        a1 = moed_v16_fma(moed_loadw(dtype, w, j + 16), moed_v16_load(x + j + 16), a1);
    }
    if (j + 16 <= n) {
        a0 = moed_v16_fma(moed_loadw(dtype, w, j), moed_v16_load(x + j), a0);
        j += 16;
    }
    float s = moed_v16_hsum(moed_v16_add(a0, a1));
    for (; j < n; j++) s = fmaf(moed_scalarw(dtype, w, j), x[j], s);
    return s;
}

/* Up to MOED_ROWS weight rows against one f32 vector: out[r] = w_r . x.
 *
 * Several rows per pass give the core independent load streams, which is what
 * keeps a memory-bound mat-vec near the DRAM bandwidth. Each row is reduced
 * alone, in an order fixed by n: 32 elements per step into two 16-lane
 * accumulators a0/a1, then hsum(a0 + a1), then the n mod 32 tail one by one.
 * For f32/f16, a0 takes elements j..j+15 and a1 j+16..j+31 of each step. For
 * bf16, one 64-byte load holds 32 values as 16 pairs; the even-indexed values
 * go to a0 against x's even elements and the odd ones to a1 against x's odd
 * elements. So a row's result does not depend on nrows, on the row's neighbours,
 * on alignment, or on the thread that computes it. */
/* Rows of one unit of parallel work; a pass streams up to this many at once
 * (measured on Zen 5, one thread, 2048 x 7168 from DRAM: 8 rows a pass rather than
 * 4 moved bf16 27 -> 31 GB/s and f16 28 -> 31 on AVX-512, bf16 25 -> 31 on AVX2). */
#ifndef MOED_ROWS
#define MOED_ROWS 8
#endif
_Static_assert(MOED_ROWS >= 1 && MOED_ROWS <= 8, "_kernels.pyx's buffers hold 8 rows");
/* Software prefetch distance along each weight row (prefetches never fault). 1024
 * bytes were measured +10 % on a DRAM-bound 14336 x 4096 bf16 mat-vec on Zen 5. On Zen 4
 * (one thread, bench/matvec.py --stream-mib 96, two rounds of 7-9 each) 512 moved more
 * bf16 and f16 bytes/s than 1024 on every shape tried: bf16 14.9-15.3 -> 17.2-17.3 GB/s
 * at 14336 x 4096, 14.0-15.2 -> 16.2-16.4 at 4096 x 4096, 11.2-11.4 -> 12.0-12.8 at
 * 768 x 2048, f16 +5-17 %; f32 within its noise (-14 to +18 % by run); 2048 bytes were
 * no better than 1024. Eight rows a pass at 512 bytes each keep 64 lines in flight;
 * 1024 asks for 128. */
#ifndef MOED_PREFETCH_BYTES
#define MOED_PREFETCH_BYTES 512
#endif

/* Where to prefetch along a row, `at` elements (of a row `len` long) from its start: at
 * itself, or past the row's end the same place in the row of the next pass, nrows rows
 * on. Rows of a pass lie `len` apart, so the end of row q runs into row q + 1, which is
 * already streaming; the next pass's rows would otherwise start cold. */
static inline ptrdiff_t moed_prefetch_at(ptrdiff_t at, ptrdiff_t len, int nrows) {
    return at < len ? at : at + (nrows - 1) * len;
}

/* A second prefetch, into L2 (prefetcht1), MOED_L2_PASSES passes ahead: the rows of a
 * pass lie `ld` bytes apart, so the same place of row q of that pass is
 * MOED_L2_PASSES * nrows rows on. The L1 prefetch above runs at most one pass ahead,
 * which on short rows (a routed expert's 512-2048 columns) left the next passes to the
 * hardware prefetchers, and a mat-vec of cold weights ran at half its in-cache speed.
 * Measured on Zen 4 by bench/kernel_ab.py (2 threads, 10 rounds, median [quartiles] of
 * the paired ratios against the build without it), same bits: bf16 1024 x 512 1.84x
 * [1.81-1.87], 512 x 1024 1.39x, 1024 x 1024 1.67x, 4096 x 4096 1.15x; f16 1.45x and
 * 1.15x, f32 1.16x and 1.07x (1024^2, 4096^2); an AVX2 build (-mno-avx512f) bf16
 * 1.32-2.46x. 3 and 4 passes were no better than 2. Past the weight's end it only wastes
 * a request (prefetches never fault). */
#ifndef MOED_L2_PASSES
#define MOED_L2_PASSES 2
#endif
static inline __attribute__((always_inline)) void
moed_prefetch_l2(const void *row, ptrdiff_t at, ptrdiff_t ld, int nrows) {
    __builtin_prefetch((const char *)row + at + (ptrdiff_t)MOED_L2_PASSES * nrows * ld, 0, 2);
}

static inline __attribute__((always_inline)) void
moed_dot_rows_bf16(const char *w, size_t ldw, const int nrows, const float *x, ptrdiff_t n,
                   float *out) {
    moed_v16 a0[MOED_ROWS], a1[MOED_ROWS];
    for (int r = 0; r < nrows; r++) a0[r] = a1[r] = moed_v16_zero();
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        moed_v16 xe, xo;
        moed_v16_deinterleave(moed_v16_load(x + j), moed_v16_load(x + j + 16), &xe, &xo);
        for (int r = 0; r < nrows; r++) {
            moed_v16 e, o;
            __builtin_prefetch(w + r * ldw + 2 * j + MOED_PREFETCH_BYTES);
            moed_prefetch_l2(w + r * ldw, 2 * j, ldw, nrows);
            moed_v16_load_bf16_pairs((const uint16_t *)(w + r * ldw) + j, &e, &o);
            a0[r] = moed_v16_fma(e, xe, a0[r]);
            a1[r] = moed_v16_fma(o, xo, a1[r]);
        }
    }
    for (int r = 0; r < nrows; r++) {
        const void *wr = w + r * ldw;
        float s = moed_v16_hsum(moed_v16_add(a0[r], a1[r]));
        for (ptrdiff_t k = j; k < n; k++) s = fmaf(moed_scalarw(MOED_BF16, wr, k), x[k], s);
        out[r] = s;
    }
}

static inline __attribute__((always_inline)) void
moed_dot_rows_natural(int dtype, const char *w, size_t ldw, const int nrows, const float *x,
                      ptrdiff_t n, float *out) {
    moed_v16 a0[MOED_ROWS], a1[MOED_ROWS];
    for (int r = 0; r < nrows; r++) a0[r] = a1[r] = moed_v16_zero();
    ptrdiff_t j = 0;
    for (; j + 32 <= n; j += 32) {
        moed_v16 x0 = moed_v16_load(x + j), x1 = moed_v16_load(x + j + 16);
        for (int r = 0; r < nrows; r++) {
            const char *wr = w + r * ldw;
            const size_t at = (size_t)j * moed_dtype_size(dtype) + MOED_PREFETCH_BYTES;
            __builtin_prefetch(wr + at);
            if (dtype == MOED_F32) __builtin_prefetch(wr + at + 64);   /* 128 bytes a step */
            moed_prefetch_l2(wr, (ptrdiff_t)j * moed_dtype_size(dtype), ldw, nrows);
            if (dtype == MOED_F32) moed_prefetch_l2(wr, (ptrdiff_t)j * 4 + 64, ldw, nrows);
            a0[r] = moed_v16_fma(moed_loadw(dtype, wr, j), x0, a0[r]);
            a1[r] = moed_v16_fma(moed_loadw(dtype, wr, j + 16), x1, a1[r]);
        }
    }
    for (int r = 0; r < nrows; r++) {
        const void *wr = w + r * ldw;
        float s = moed_v16_hsum(moed_v16_add(a0[r], a1[r]));
        for (ptrdiff_t k = j; k < n; k++) s = fmaf(moed_scalarw(dtype, wr, k), x[k], s);
        out[r] = s;
    }
}

/* out[r] = w_r . x for MOED_ROWS rows or one row spaced ldw bytes apart. */
static void moed_dot_rows_all(int dtype, const char *w, size_t ldw, const float *x,
                              ptrdiff_t n, float *out) {
    if (dtype == MOED_BF16) moed_dot_rows_bf16(w, ldw, MOED_ROWS, x, n, out);
    else if (dtype == MOED_F16) moed_dot_rows_natural(MOED_F16, w, ldw, MOED_ROWS, x, n, out);
    else moed_dot_rows_natural(MOED_F32, w, ldw, MOED_ROWS, x, n, out);
}

static void moed_dot_rows1(int dtype, const char *w, const float *x, ptrdiff_t n,
                           float *out) {
    if (dtype == MOED_BF16) moed_dot_rows_bf16(w, 0, 1, x, n, out);
    else if (dtype == MOED_F16) moed_dot_rows_natural(MOED_F16, w, 0, 1, x, n, out);
    else moed_dot_rows_natural(MOED_F32, w, 0, 1, x, n, out);
}

/* out[r] = w_r . x for nrows <= MOED_ROWS rows spaced ldw bytes apart: a full group
 * shares a pass, leftovers go one by one (same per-row arithmetic). */
static inline void moed_dot_rows(int dtype, const char *w, size_t ldw, int nrows,
                                 const float *x, ptrdiff_t n, float *out) {
    if (nrows == MOED_ROWS) {
        moed_dot_rows_all(dtype, w, ldw, x, n, out);
        return;
    }
    for (int r = 0; r < nrows; r++) moed_dot_rows1(dtype, w + r * ldw, x, n, out + r);
}

/* out[j] = dequantised w[j] for j < n. */
static inline void moed_dequant_row(int dtype, const void *w, float *out, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) out[j] = moed_scalarw(dtype, w, j);
}

/* y[j] = fma(a, dequantised w[j], y[j]), elementwise: 16 lanes at a time, then one by
 * one (the same fused multiply-add either way, so the result does not depend on which
 * path an element takes). One row of a weight stored [in, out] added into an f32 output; a
 * transposed mat-vec is a sequence of these, its reduction order the row order. */
static inline void moed_axpy_w(int dtype, float a, const void *w, float *y, ptrdiff_t n) {
    moed_v16 av = moed_v16_set1(a);
    ptrdiff_t j = 0;
    for (; j + 16 <= n; j += 16) {
        moed_v16 wv = dtype == MOED_BF16 ? moed_v16_load_bf16((const uint16_t *)w + j)
                                         : moed_loadw(dtype, w, j);   /* f32, f16 */
        moed_v16_store(y + j, moed_v16_fma(av, wv, moed_v16_load(y + j)));
    }
    for (; j < n; j++) y[j] = fmaf(a, moed_scalarw(dtype, w, j), y[j]);
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
