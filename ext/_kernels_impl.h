/* Leaf kernels for ext/_kernels.pyx: dequantising dot products with a fixed
 * reduction order.
 *
 * Design:
 * - Every dot product of length n sums in the same order for the same n, whatever
 *   the thread count, the alignment of either operand, or how many other rows or
 *   tokens are computed in the same call. The order is: 32 lanes (two 16-wide
 *   vectors, lane l takes elements j with j mod 32 == l, for j below
 *   n - n mod 16... see below), then a fixed pairwise tree over the lanes, then a
 *   sequential scalar tail. Nothing depends on the address of the data: loads are
 *   unaligned (memcpy into GCC vector values), so there is no alignment peeling.
 * - GCC vector extensions give the lane semantics explicitly; the compiler maps
 *   them to AVX-512, AVX2 or SSE as the target allows. The build uses
 *   -ffp-contract=off so a multiply and an add are never fused differently in two
 *   code paths (mat-vec and mat-mat rows are bit-equal).
 * - Weights are dequantised on the fly to f32 and accumulated in f32. Formats:
 *   f32, f16 (IEEE binary16), bf16 (upper half of an f32). fp8-e4m3 with block
 *   scales and MXFP4 will be new MOED_DTYPE codes with their own load functions;
 *   the row-dot dispatch below is the one place they plug in.
 */
#ifndef MOED_KERNELS_IMPL_H
#define MOED_KERNELS_IMPL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

static inline moed_vf moed_load_f16(const uint16_t *p) {
    moed_vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, moed_vf);
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

/* Four dot products sharing one weight row: out[t] = w . x[t] for t < 4, x[t] at
 * x + t * ldx. Each out[t] is computed with exactly the order of the single dot,
 * so it is bit-equal to moed_dot_*(w, x + t*ldx, n). */
#define MOED_DEFINE_DOT4(NAME, DT)                                               \
    static inline void NAME(const void *w, const float *x, ptrdiff_t ldx,       \
                            ptrdiff_t n, float *out) {                           \
        moed_vf a0[4] = {{0}}, a1[4] = {{0}};                                    \
        ptrdiff_t j = 0;                                                         \
        for (; j + 32 <= n; j += 32) {                                           \
            moed_vf w0 = MOED_LOADW(DT, w, j), w1 = MOED_LOADW(DT, w, j + 16);   \
            for (int t = 0; t < 4; t++) {                                        \
                a0[t] = a0[t] + w0 * moed_load_f32(x + t * ldx + j);             \
                a1[t] = a1[t] + w1 * moed_load_f32(x + t * ldx + j + 16);        \
            }                                                                    \
        }                                                                        \
        ptrdiff_t j16 = j;                                                       \
        if (j + 16 <= n) {                                                       \
            moed_vf w0 = MOED_LOADW(DT, w, j);                                   \
            for (int t = 0; t < 4; t++)                                          \
                a0[t] = a0[t] + w0 * moed_load_f32(x + t * ldx + j);             \
            j16 = j + 16;                                                        \
        }                                                                        \
        for (int t = 0; t < 4; t++) {                                            \
            float s = moed_hsum(a0[t] + a1[t]);                                  \
            const float *xt = x + t * ldx;                                       \
            for (ptrdiff_t k = j16; k < n; k++)                                  \
                s = s + moed_scalarw(DT, w, k) * xt[k];                          \
            out[t] = s;                                                          \
        }                                                                        \
    }

MOED_DEFINE_DOT4(moed_dot4_f32, MOED_F32)
MOED_DEFINE_DOT4(moed_dot4_f16, MOED_F16)
MOED_DEFINE_DOT4(moed_dot4_bf16, MOED_BF16)

/* Dispatch on the weight format. */
static inline float moed_dot(int dtype, const void *w, const float *x, ptrdiff_t n) {
    if (dtype == MOED_BF16) return moed_dot_bf16(w, x, n);
    if (dtype == MOED_F16) return moed_dot_f16(w, x, n);
    return moed_dot_f32(w, x, n);
}

static inline void moed_dot4(int dtype, const void *w, const float *x, ptrdiff_t ldx,
                             ptrdiff_t n, float *out) {
    if (dtype == MOED_BF16) moed_dot4_bf16(w, x, ldx, n, out);
    else if (dtype == MOED_F16) moed_dot4_f16(w, x, ldx, n, out);
    else moed_dot4_f32(w, x, ldx, n, out);
}

/* out[j] = dequantised w[j] for j < n. */
static inline void moed_dequant_row(int dtype, const void *w, float *out, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) out[j] = moed_scalarw(dtype, w, j);
}

/* y[j] += a * x[j], elementwise (no reduction: order is irrelevant). */
static inline void moed_axpy(float a, const float *x, float *y, ptrdiff_t n) {
    for (ptrdiff_t j = 0; j < n; j++) y[j] = y[j] + a * x[j];
}

static inline float moed_silu(float g) {
    return g / (1.0f + expf(-g));
}

#endif
