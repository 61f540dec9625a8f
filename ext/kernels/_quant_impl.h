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
 *   Each exact value v is accumulated as acc = fma(v, x, acc), one rounding, as the
 *   dense kernels do (the scale multiply and the min add that make v are separate,
 *   plain f32 operations; the build uses -ffp-contract=off so the compiler never
 *   fuses them), so every path below gives the same bits.
 * - Paths: moed_qdot_rows_generic is the reference, written for clarity (dequantise
 *   32 columns into a buffer, then the dense lane arithmetic). It is what the
 *   portable build runs; the SIMD paths below decode in registers, streaming the
 *   rows for one token (mat-vec) or into a small tile of exact values shared by up
 *   to 8 tokens (mat-mat). The per-(token, row) arithmetic is the same in all.
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

/* moed_e4m3_to_f32 of every byte, filled by moed_quant_init (the scalar decoder of
 * moed_w_dequant). */
static float moed_e4m3_table[256];

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
            for (; j < stop; j++) *out++ = moed_e4m3_table[row[j]] * s;
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
        moed_v16 a0 = moed_v16_zero(), a1 = moed_v16_zero();
        float v[32];
        ptrdiff_t j = 0;
        for (; j + 32 <= n; j += 32) {
            moed_w_dequant(w, r0 + q, j, 32, v);
            moed_v16 v0 = moed_v16_load(v), v1 = moed_v16_load(v + 16);
            moed_v16 x0 = moed_v16_load(x + j), x1 = moed_v16_load(x + j + 16);
            if (paired) {
                moed_v16_deinterleave(v0, v1, &v0, &v1);
                moed_v16_deinterleave(x0, x1, &x0, &x1);
            }
            a0 = moed_v16_fma(v0, x0, a0);
            a1 = moed_v16_fma(v1, x1, a1);
        }
        float s = moed_v16_hsum(moed_v16_add(a0, a1));
        if (j < n) {
            moed_w_dequant(w, r0 + q, j, n - j, v);
            for (ptrdiff_t k = j; k < n; k++) s = fmaf(v[k - j], x[k], s);
        }
        out[q] = s;
    }
}

/* ------------------------------------------------------------- the SIMD paths */
/* Chosen at compile time (the build is -march=native unless MOED_PORTABLE=1), by the
 * vectors of _simd.h:
 *   "avx512": fp8 decoded by two 128-entry byte tables (vpermt2b, with AVX-512 VBMI;
 *             else as on AVX2), nibbles by one 16-entry vpermps.
 *   "avx2":   fp8 decoded through binary16 bit placement (F16C); int4 codes
 *             converted to f32 and scaled (plus the min), mxfp4 magnitudes by one
 *             8-entry vpermps and the sign bit moved in (moed_nibble_values); the
 *             mat-vec of int4 and mxfp4 in column chunks, one row's accumulators
 *             in registers at a time (moed_qdot_nibc: a pass's accumulators alone
 *             fill the 16 ymm registers). int8 and fp8 chunked the same way were
 *             no faster on Zen 3 (int8 0.83-1.17x, fp8 about 0.96x), so they keep
 *             the span kernels.
 *   "portable": moed_qdot_rows_generic.
 * Each lane is computed with the reference path's f32 operations (the exact value, then
 * a fused multiply-add into the accumulator) in the same order, so all paths give the
 * same bits (tests compare them). Several rows per pass
 * and a software prefetch per row, as the bf16 kernel does. */
/* Per format: mat-vec of `pass` rows or of one row, and the tile decoder of `tpass`
 * rows or one row (columns [c0, c1) into buf, row q at buf + q * ldb). */
typedef struct {
    int pass;
    void (*dotp)(const moed_weight *, ptrdiff_t, const float *, float *);
    void (*dot1)(const moed_weight *, ptrdiff_t, const float *, float *);
    int tpass;
    void (*tilep)(const moed_weight *, ptrdiff_t, ptrdiff_t, ptrdiff_t, float *, ptrdiff_t);
    void (*tile1)(const moed_weight *, ptrdiff_t, ptrdiff_t, ptrdiff_t, float *, ptrdiff_t);
} moed_qkernel;

/* Tokens sharing one decoded tile, and the tile's width in columns. */
#define MOED_TILE_TOKENS 8
#define MOED_TILE_COLS 512

#if defined(MOED_V16_AVX512) || defined(MOED_V16_AVX2)
#define MOED_Q_SIMD 1
/* Rows a pass streams, by lane order (measured on Zen 5, one thread, 2048 x 7168 from
 * DRAM, 8 rows against 4: fp8 17 -> 23 GB/s and int8 18 -> 21 on AVX-512; every
 * quantised format slower on AVX2 (16 registers)); and the rows a mat-mat tile
 * accumulates at once. int4 and mxfp4 were -10 to -17 % at 8 rows while each group's
 * table was built from the stored scale; with the scales widened 16 groups at a time
 * (moed_qspan_nibbles) 8 rows are about 5 % faster than 4 (one thread, 768 x 2048 in
 * cache, a shared machine: within its noise). */
#ifdef MOED_V16_AVX512
#define MOED_QPASS_NATURAL 8
#define MOED_QPASS_PAIRED 8
#define MOED_TILE_ACC_ROWS 8
/* fp8's VBMI decode holds seven tables in registers; at 8 rows the accumulators spill and
 * 4 rows are faster (Xeon, 2 threads: 4096 x 4096 streamed 12.0 -> 13.6 Gw/s, 2048 x 7168
 * 12.3 -> 12.7-13.7). */
#ifndef MOED_QPASS_FP8
#define MOED_QPASS_FP8 4
#endif
#else
#ifndef MOED_QPASS_NATURAL
#define MOED_QPASS_NATURAL 4
#endif
#ifndef MOED_QPASS_PAIRED
#define MOED_QPASS_PAIRED 4
#endif
#define MOED_TILE_ACC_ROWS 4
#endif
/* Bytes of a row prefetched ahead: a bf16 row's 1024 bytes are 512 columns; a 4-bit
 * row streams a quarter as many bytes per column. */
#ifndef MOED_Q_PREFETCH
#define MOED_Q_PREFETCH 512
#endif
/* The quantised spans' second prefetch, into L2 two passes ahead (moed_prefetch_l2),
 * on AVX-512 only. Measured on Zen 4 as for the dense kernels (bench/kernel_ab.py, shapes
 * 1024 x 512, 512 x 1024, 1024 x 1024, 4096 x 4096): int8 1.29-1.51x, fp8 1.14-1.30x,
 * mxfp4 1.04-1.08x, int4 with mins 1.02-1.10x on AVX-512; in an AVX2 build (-mno-avx512f,
 * same machine), where these kernels are bound by their instructions rather than by
 * memory, 0.92-1.01x. */
#ifndef MOED_Q_L2
#ifdef MOED_V16_AVX512
#define MOED_Q_L2 1
#else
#define MOED_Q_L2 0
#endif
#endif
#define moed_q_prefetch_l2(row, at, ld, nrows) \
    do { if (MOED_Q_L2) moed_prefetch_l2(row, at, ld, nrows); } while (0)
/* Scales (and mins) prefetched ahead along each row, in groups. */
#ifndef MOED_Q_SCALES_AHEAD
#define MOED_Q_SCALES_AHEAD 32
#endif

/* The span kernels below decode columns [c0, c1) (multiples of 32) of rows r0 ..
 * r0+nrows-1, 32 columns per step, into two 16-lane vectors per row in the format's
 * lane order (natural: columns j..j+15, j+16..j+31; paired: the even, the odd ones),
 * exactly the reference path's values. With `store` 0 they add value * x into the
 * row's accumulators a0, a1 (mat-vec); with `store` 1 they write the values to
 * buf[q * ldb + (j - c0)] (a tile that several tokens then share). `store`, `nrows`
 * and `kind` are constants in each instantiation. */
static inline __attribute__((always_inline)) void
moed_sink(const int store, moed_v16 v0, moed_v16 v1, moed_v16 x0, moed_v16 x1,
          moed_v16 *a0, moed_v16 *a1, float *buf, ptrdiff_t at) {
    if (store) {
        moed_v16_store(buf + at, v0);
        moed_v16_store(buf + at + 16, v1);
    } else {
        *a0 = moed_v16_fma(v0, x0, *a0);
        *a1 = moed_v16_fma(v1, x1, *a1);
    }
}

/* x[j .. j+31] in the lane order of a format (paired: evens in *x0, odds in *x1). */
static inline __attribute__((always_inline)) void
moed_load_x32(const float *x, const int paired, moed_v16 *x0, moed_v16 *x1) {
    *x0 = moed_v16_load(x);
    *x1 = moed_v16_load(x + 16);
    if (paired) moed_v16_deinterleave(*x0, *x1, x0, x1);
}

/* The exact values of the nibbles in the low 4 bits (v0) and in bits 4..7 (v1) of
 * each lane of i (h = i >> 4), for the nibble kinds of moed_qspan_nibbles below.
 * AVX-512 looks each up in the group's 16-entry table (one vpermps). On AVX2 a
 * 16-entry lookup is two permutes and a blend, and the shuffle port bounded the
 * kernel, so there int4 computes (code & 15) as f32 times the scale plus m (the min;
 * -8 * scale when symmetric) in one fused multiply-add: code * scale is exact (4 bits
 * times a binary16 scale's 11), so the one rounding of the sum is the reference path's
 * (code * scale + min; (code - 8) * scale is exact either way); and mxfp4 permutes the
 * 8 magnitudes times the scale (exact: the scale is a power of two) and moves the sign
 * bit in. */
#ifdef MOED_V16_AVX2
#define MOED_NIB_ARITH 1
#else
#define MOED_NIB_ARITH 0
#endif
static inline __attribute__((always_inline)) void
moed_nibble_values(const int kind, moed_v16 tab, moed_v16 s, moed_v16 m, moed_v16i i,
                   moed_v16i h, moed_v16 *v0, moed_v16 *v1) {
#if MOED_NIB_ARITH
    if (kind == MOED_MXFP4) {
        *v0 = moed_v16_lookup_signed8(tab, i);
        *v1 = moed_v16_lookup_signed8(tab, h);
    } else {
        *v0 = moed_v16_fma(moed_v16i_nib_f32(i), s, m);
        *v1 = moed_v16_fma(moed_v16i_nib_f32(h), s, m);
    }
#else
    (void)kind; (void)s; (void)m;
    *v0 = moed_v16_lookup(tab, i);
    *v1 = moed_v16_lookup(tab, h);
#endif
}

/* The scales (and int4's mins) of groups si .. si+n-1 (n <= 16) of rows r0 ..
 * r0+nrows-1 as f32, into sf[q][off + k] (and mf[q][off + k]) for k < n; returns off.
 * kind: MOED_MXFP4 (E8M0 scales), MOED_INT4 (binary16 scales and mins), else binary16
 * scales. 16 scales are read at once, starting at si or earlier so as not to pass the
 * row's end (then group si is entry `off`); a row of fewer than 16 groups goes one by
 * one. Each row's scales are a stream of their own, prefetched MOED_Q_SCALES_AHEAD
 * groups ahead. Widening 16 at a time (one vector conversion per row) leaves a
 * group's scale one broadcast load: with 32-column groups a group is 16 bytes of an
 * int4 row, and converting each group's scale on its own took about a quarter of the
 * int4 kernel's time. */
static inline __attribute__((always_inline)) int
moed_widen_groups(const moed_weight *w, ptrdiff_t r0, const int nrows, ptrdiff_t si, int n,
                  float (*sf)[16], float (*mf)[16], const int kind) {
    const ptrdiff_t ws = si + 16 <= w->scale_ld ? si : w->scale_ld - 16;
    const int off = ws < 0 ? 0 : (int)(si - ws);
    const ptrdiff_t sa = moed_prefetch_at(si + MOED_Q_SCALES_AHEAD, w->scale_ld, nrows);
    for (int q = 0; q < nrows; q++) {
        const ptrdiff_t i = (r0 + q) * w->scale_ld + (ws < 0 ? si : ws), ia = (r0 + q) * w->scale_ld + sa;
        if (kind == MOED_MXFP4) {
            __builtin_prefetch((const uint8_t *)w->scales + ia);
        } else {
            __builtin_prefetch((const uint16_t *)w->scales + ia);
            if (kind == MOED_INT4) __builtin_prefetch(w->mins + ia);
        }
        if (ws < 0) {
            for (int k = 0; k < n; k++) {
                sf[q][k] = moed_scale_at(w, i + k);
                if (kind == MOED_INT4) mf[q][k] = moed_min_at(w, i + k);
            }
        } else if (kind == MOED_MXFP4) {
            moed_v16_store(sf[q], moed_v16_load_e8m0((const uint8_t *)w->scales + i));
        } else {
            moed_v16_store(sf[q], moed_v16_load_f16((const uint16_t *)w->scales + i));
            if (kind == MOED_INT4) moed_v16_store(mf[q], moed_v16_load_f16(w->mins + i));
        }
    }
    return off;
}

/* int4 / mxfp4: nibble-packed rows, one 16-entry table of exact values per group of
 * g columns and row (base[c] * scale (+ min): the reference path's arithmetic).
 * kind: MOED_MXFP4, MOED_INT4 (mins) or MOED_INT4 + 16 (symmetric).
 * The scales (and mins) go 16 groups at a time (moed_widen_groups), so a group's
 * table costs one multiply (or fused multiply-add) by a broadcast load. */
static inline __attribute__((always_inline)) void
moed_qspan_nibbles(const moed_weight *w, ptrdiff_t r0, const int nrows, ptrdiff_t c0,
                   ptrdiff_t c1, const float *x, moed_v16 *a0, moed_v16 *a1, float *buf,
                   ptrdiff_t ldb, const int store, const int kind) {
    static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    static const float codes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static const float centred[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
    const moed_v16 base = moed_v16_load(kind == MOED_MXFP4 ? e2m1 : kind == MOED_INT4 ? codes : centred);
    const ptrdiff_t g = w->scale_cols;
    const uint8_t *row[MOED_ROWS];
    float sf[MOED_ROWS][16] __attribute__((aligned(64))), mf[MOED_ROWS][16] __attribute__((aligned(64)));
    moed_v16 tab[MOED_ROWS], sv[MOED_ROWS], mv[MOED_ROWS], xe = moed_v16_zero(), xo = moed_v16_zero();
    for (int q = 0; q < nrows; q++) row[q] = w->codes + (r0 + q) * w->row_bytes;
    const ptrdiff_t last = (c1 - 1) / g;   /* the span's last group */
    for (ptrdiff_t j = c0, si = c0 / g; j < c1;) {
        const int n = last - si + 1 < 16 ? (int)(last - si + 1) : 16;   /* groups this chunk */
        const int off = moed_widen_groups(w, r0, nrows, si, n, sf, mf, kind);
        for (int k = 0; k < n; k++, si++) {   /* one group (or its part in the span) */
            ptrdiff_t end = (si + 1) * g < c1 ? (si + 1) * g : c1;
            for (int q = 0; q < nrows; q++) {
                if (MOED_NIB_ARITH && kind != MOED_MXFP4) {
                    sv[q] = moed_v16_set1(sf[q][off + k]);
                    mv[q] = moed_v16_set1(kind == MOED_INT4 ? mf[q][off + k] : -8.0f * sf[q][off + k]);
                    continue;
                }
                /* base * scale is exact, so one fused add of the min rounds as the reference does */
                tab[q] = kind == MOED_INT4 ? moed_v16_fma(base, moed_v16_set1(sf[q][off + k]),
                                                          moed_v16_set1(mf[q][off + k]))
                                           : moed_v16_mul(base, moed_v16_set1(sf[q][off + k]));
            }
            for (; j < end; j += 32) {
                const ptrdiff_t pf = moed_prefetch_at((j >> 1) + MOED_Q_PREFETCH, w->row_bytes, nrows);
                if (!store) moed_load_x32(x + j, 1, &xe, &xo);
                for (int q = 0; q < nrows; q++) {
                    __builtin_prefetch(row[q] + pf);
                    moed_q_prefetch_l2(row[q], j >> 1, w->row_bytes, nrows);
                    moed_v16i i = moed_v16i_load_u8(row[q] + (j >> 1)), h = moed_v16i_srl4(i);
                    moed_v16 v0, v1;
                    moed_nibble_values(kind, tab[q], sv[q], mv[q], i, h, &v0, &v1);
                    moed_sink(store, v0, v1, xe, xo, a0 + q, a1 + q, buf, q * ldb + (j - c0));
                }
            }
        }
    }
}
#define moed_qspan_mxfp4(...) moed_qspan_nibbles(__VA_ARGS__, MOED_MXFP4)
#define moed_qspan_int4m(...) moed_qspan_nibbles(__VA_ARGS__, MOED_INT4)
#define moed_qspan_int4s(...) moed_qspan_nibbles(__VA_ARGS__, MOED_INT4 + 16)

/* int8: natural order, value = code * scale of its group; the scales go 16 groups at
 * a time as for int4 (converting each group's scale on its own, two vector operations
 * per group and row, held the kernel back as much). */
static inline __attribute__((always_inline)) void
moed_qspan_int8(const moed_weight *w, ptrdiff_t r0, const int nrows, ptrdiff_t c0,
                ptrdiff_t c1, const float *x, moed_v16 *a0, moed_v16 *a1, float *buf,
                ptrdiff_t ldb, const int store) {
    const ptrdiff_t g = w->scale_cols;
    const uint8_t *row[MOED_ROWS];
    float sf[MOED_ROWS][16] __attribute__((aligned(64)));
    moed_v16 s[MOED_ROWS], x0 = moed_v16_zero(), x1 = moed_v16_zero();
    for (int q = 0; q < nrows; q++) row[q] = w->codes + (r0 + q) * w->row_bytes;
    const ptrdiff_t last = (c1 - 1) / g;
    for (ptrdiff_t j = c0, si = c0 / g; j < c1;) {
        const int n = last - si + 1 < 16 ? (int)(last - si + 1) : 16;
        const int off = moed_widen_groups(w, r0, nrows, si, n, sf, NULL, MOED_INT8);
        for (int k = 0; k < n; k++, si++) {
            ptrdiff_t end = (si + 1) * g < c1 ? (si + 1) * g : c1;
            for (int q = 0; q < nrows; q++) s[q] = moed_v16_set1(sf[q][off + k]);
            for (; j < end; j += 32) {
                const ptrdiff_t pf = moed_prefetch_at(j + 2 * MOED_Q_PREFETCH, w->row_bytes, nrows);
                if (!store) moed_load_x32(x + j, 0, &x0, &x1);
                for (int q = 0; q < nrows; q++) {
                    __builtin_prefetch(row[q] + pf);
                    moed_q_prefetch_l2(row[q], j, w->row_bytes, nrows);
                    moed_sink(store, moed_v16_mul(moed_v16_load_i8(row[q] + j), s[q]),
                              moed_v16_mul(moed_v16_load_i8(row[q] + j + 16), s[q]),
                              x0, x1, a0 + q, a1 + q, buf, q * ldb + (j - c0));
                }
            }
        }
    }
}

/* fp8 e4m3 decoders: moed_e4m3_decode(t, p, n, f) writes the values of n codes at p
 * (n = 32, or MOED_E4M3_STEP), 16 per vector, times MOED_E4M3_UNIT (exact). */
#if defined(MOED_V16_AVX512) && defined(__AVX512VBMI__)
/* Byte tables of the f32 value of each 7-bit e4m3 magnitude (its bits 16..23 and
 * 24..31; the low 16 bits are zero for every e4m3 value: each is a bfloat16), and the
 * order the 64 codes of a step are put in first (see moed_e4m3_decode). Filled by
 * moed_quant_init_simd. */
static uint8_t moed_e4m3_lut[2][128] __attribute__((aligned(64)));
static uint8_t moed_e4m3_order[64] __attribute__((aligned(64)));

static inline void moed_quant_init_simd(void) {
    for (int m = 0; m < 128; m++) {
        float f = moed_e4m3_to_f32((uint8_t)m);
        uint32_t u;
        memcpy(&u, &f, 4);
        moed_e4m3_lut[0][m] = (uint8_t)(u >> 16);
        moed_e4m3_lut[1][m] = (uint8_t)(u >> 24);
    }
    /* byte 16L + 2d (+1, +8, +9) feeds lane 4L + d of value vector 0 (1, 2, 3) */
    for (int L = 0; L < 4; L++)
        for (int d = 0; d < 4; d++) {
            moed_e4m3_order[16 * L + 2 * d] = (uint8_t)(4 * L + d);
            moed_e4m3_order[16 * L + 2 * d + 1] = (uint8_t)(16 + 4 * L + d);
            moed_e4m3_order[16 * L + 8 + 2 * d] = (uint8_t)(32 + 4 * L + d);
            moed_e4m3_order[16 * L + 9 + 2 * d] = (uint8_t)(48 + 4 * L + d);
        }
}

typedef struct { __m512i lo0, lo1, hi0, hi1, sign, order, top; } moed_e4m3_tables;

static inline void moed_e4m3_tables_load(moed_e4m3_tables *t) {
    t->lo0 = _mm512_load_si512(moed_e4m3_lut[0]);
    t->lo1 = _mm512_load_si512(moed_e4m3_lut[0] + 64);
    t->hi0 = _mm512_load_si512(moed_e4m3_lut[1]);
    t->hi1 = _mm512_load_si512(moed_e4m3_lut[1] + 64);
    t->sign = _mm512_set1_epi8((char)0x80);
    t->order = _mm512_load_si512(moed_e4m3_order);
    t->top = _mm512_set1_epi32((int)0xFFFF0000u);
}

/* The codes are put in moed_e4m3_order (one byte permute); the two byte tables give
 * each value's bits 16..23 and 24..31 (the sign bit or-ed in); interleaving the two
 * (in-lane byte unpacks) makes 16-bit halves that one shift or one mask puts into f32
 * lanes, in column order thanks to the first permute. 7 shuffle-port operations per 64
 * codes, where placing the bytes by four two-table byte permutes took 12 (a two-table
 * byte permute is two of them). */
static inline __attribute__((always_inline)) void
moed_e4m3_decode(const moed_e4m3_tables *t, const uint8_t *p, const int n, moed_v16 *f) {
    __m512i b = n == 64 ? _mm512_loadu_si512(p)
                        : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    b = _mm512_permutexvar_epi8(t->order, b);
    __m512i lo = _mm512_permutex2var_epi8(t->lo0, b, t->lo1);
    __m512i hi = _mm512_permutex2var_epi8(t->hi0, b, t->hi1);
    hi = _mm512_ternarylogic_epi32(hi, b, t->sign, 0xF8);   /* hi | (b & 0x80) */
    __m512i u = _mm512_unpacklo_epi8(lo, hi);
    f[0] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    f[1] = _mm512_castsi512_ps(_mm512_and_si512(u, t->top));
    if (n == 64) {
        u = _mm512_unpackhi_epi8(lo, hi);
        f[2] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
        f[3] = _mm512_castsi512_ps(_mm512_and_si512(u, t->top));
    }
}
#define MOED_E4M3_STEP 64
#define MOED_E4M3_UNIT 1.0f
#else
static inline void moed_quant_init_simd(void) {}

typedef int moed_e4m3_tables;
static inline void moed_e4m3_tables_load(moed_e4m3_tables *t) { *t = 0; }

/* 16 e4m3 codes -> their values * 2^-8, exactly: the code's bits placed in a binary16
 * (sign to bit 15, exponent and mantissa to bits 7..13) read as f16; NaN codes NaN. */
static inline moed_v16 moed_e4m3_x2m8(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i t = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    t = _mm256_and_si256(t, _mm256_set1_epi16((short)0xBFFF));
    __m128i nan = _mm_cmpeq_epi8(_mm_or_si128(b, _mm_set1_epi8((char)0x80)), _mm_set1_epi8(-1));
    int any_nan = _mm_movemask_epi8(nan) != 0;
#ifdef MOED_V16_AVX512
    moed_v16 f = _mm512_cvtph_ps(t);
    if (__builtin_expect(any_nan, 0))
        f = _mm512_mask_mov_ps(f, (__mmask16)_mm_movemask_epi8(nan), _mm512_set1_ps(__builtin_nanf("")));
    return f;
#else
    __m256 f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(t));
    __m256 f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(t, 1));
    if (__builtin_expect(any_nan, 0)) {
        __m256 q = _mm256_set1_ps(__builtin_nanf(""));
        f0 = _mm256_blendv_ps(f0, q, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan)));
        f1 = _mm256_blendv_ps(f1, q, _mm256_castsi256_ps(
                                         _mm256_cvtepi8_epi32(_mm_srli_si128(nan, 8))));
    }
    return (moed_v16){f0, f1};
#endif
}

static inline __attribute__((always_inline)) void
moed_e4m3_decode(const moed_e4m3_tables *t, const uint8_t *p, const int n, moed_v16 *f) {
    (void)t;
    for (int k = 0; k < n / 16; k++) f[k] = moed_e4m3_x2m8(p + 16 * k);
}
#define MOED_E4M3_STEP 32
#define MOED_E4M3_UNIT 0x1p-8f
#endif

/* fp8 e4m3: natural order, value = fp8 * scale of its (br, bc) block. Needs bc % 32
 * == 0, so that 32-column steps never straddle two blocks, and (when the decoder's
 * unit is 2^-8, folded into the scale) no finite scale at or above 2^120: see
 * moed_fp8_simd_ok. The decoded value times (scale / unit) is then exactly
 * fl(fp8 * scale). */
static inline __attribute__((always_inline)) void
moed_qspan_fp8(const moed_weight *w, ptrdiff_t r0, const int nrows, ptrdiff_t c0,
               ptrdiff_t c1, const float *x, moed_v16 *a0, moed_v16 *a1, float *buf,
               ptrdiff_t ldb, const int store) {
    enum { STEP = MOED_E4M3_STEP, NV = MOED_E4M3_STEP / 16 };
    const ptrdiff_t bc = w->scale_cols;
    const uint8_t *row[MOED_ROWS];
    moed_v16 s[MOED_ROWS], xv[NV], f[NV];
    moed_e4m3_tables t;
    moed_e4m3_tables_load(&t);
    for (int k = 0; k < NV; k++) xv[k] = moed_v16_zero();
    ptrdiff_t srow[MOED_ROWS];   /* first scale of each row's block row */
    for (int q = 0; q < nrows; q++) {
        row[q] = w->codes + (r0 + q) * w->row_bytes;
        srow[q] = (r0 + q) / w->scale_rows * w->scale_ld;
    }
    for (ptrdiff_t j = c0, b = c0 / bc; j < c1; b++) {   /* one block (or its part in the span) */
        ptrdiff_t end = (b + 1) * bc < c1 ? (b + 1) * bc : c1;
        for (int q = 0; q < nrows; q++)
            s[q] = moed_v16_set1(moed_scale_at(w, srow[q] + b) / MOED_E4M3_UNIT);
        for (; j + STEP <= end; j += STEP) {
            const ptrdiff_t pf = moed_prefetch_at(j + 2 * MOED_Q_PREFETCH, w->row_bytes, nrows);
            if (!store)
                for (int k = 0; k < NV; k++) xv[k] = moed_v16_load(x + j + 16 * k);
            for (int q = 0; q < nrows; q++) {
                __builtin_prefetch(row[q] + pf);
                moed_q_prefetch_l2(row[q], j, w->row_bytes, nrows);
                moed_e4m3_decode(&t, row[q] + j, STEP, f);
                for (int k = 0; k < NV; k += 2)
                    moed_sink(store, moed_v16_mul(f[k], s[q]), moed_v16_mul(f[k + 1], s[q]),
                              xv[k], xv[k + 1], a0 + q, a1 + q, buf, q * ldb + (j - c0) + 16 * k);
            }
        }
        if (STEP > 32 && j + 32 <= end) {
            if (!store) moed_load_x32(x + j, 0, xv, xv + 1);
            for (int q = 0; q < nrows; q++) {
                moed_e4m3_decode(&t, row[q] + j, 32, f);
                moed_sink(store, moed_v16_mul(f[0], s[q]), moed_v16_mul(f[1], s[q]),
                          xv[0], xv[1], a0 + q, a1 + q, buf, q * ldb + (j - c0));
            }
            j += 32;
        }
    }
}

/* Is every finite scale of rows r0 .. r0+nrows-1 below `limit` in magnitude? */
static inline int moed_fp8_scales_below(const moed_weight *w, ptrdiff_t r0, int nrows, float limit) {
    ptrdiff_t last = (r0 + nrows - 1) / w->scale_rows;
    for (ptrdiff_t sr = r0 / w->scale_rows; sr <= last; sr++)
        for (ptrdiff_t b = 0; b < w->scale_ld; b++) {
            float s = fabsf(moed_scale_at(w, sr * w->scale_ld + b));
            if (s >= limit && s <= 3.4028235e38f) return 0;
        }
    return 1;
}

/* Can moed_qspan_fp8 take these rows (see there)? */
static inline int moed_fp8_simd_ok(const moed_weight *w, ptrdiff_t r0, int nrows) {
    if (w->scale_cols % 32) return 0;
    return MOED_E4M3_UNIT == 1.0f || moed_fp8_scales_below(w, r0, nrows, 0x1p120f);
}

/* The n mod 32 tail of row r (columns from C - C % 32), one column at a time. */
static inline float moed_qtail(const moed_weight *w, ptrdiff_t r, const float *x, float s) {
    ptrdiff_t C = w->cols, j = C - C % 32;
    float v[32];
    if (j < C) {
        moed_w_dequant(w, r, j, C - j, v);
        for (ptrdiff_t k = j; k < C; k++) s = fmaf(v[k - j], x[k], s);
    }
    return s;
}

#define MOED_DEFINE_QDOT_N(FMT, N, NAME)                                              \
    static void moed_qdot_##FMT##_##NAME(const moed_weight *w, ptrdiff_t r0,          \
                                         const float *x, float *out) {                \
        moed_v16 a0[MOED_ROWS], a1[MOED_ROWS];                                        \
        for (int q = 0; q < N; q++) a0[q] = a1[q] = moed_v16_zero();                  \
        moed_qspan_##FMT(w, r0, N, 0, w->cols - w->cols % 32, x, a0, a1, NULL, 0, 0); \
        for (int q = 0; q < N; q++)                                                   \
            out[q] = moed_qtail(w, r0 + q, x, moed_v16_hsum(moed_v16_add(a0[q], a1[q]))); \
    }
#define MOED_DEFINE_QTILE_N(FMT, N, NAME)                                             \
    static void moed_qtile_##FMT##_##NAME(const moed_weight *w, ptrdiff_t r0,         \
                                          ptrdiff_t c0, ptrdiff_t c1, float *buf,     \
                                          ptrdiff_t ldb) {                            \
        moed_v16 unused[MOED_ROWS];                                                   \
        moed_qspan_##FMT(w, r0, N, c0, c1, NULL, unused, unused, buf, ldb, 1);        \
    }
#define MOED_DEFINE_QKERNEL(FMT, PASS)                                                \
    MOED_DEFINE_QDOT_N(FMT, PASS, p)                                                  \
    MOED_DEFINE_QDOT_N(FMT, 1, 1)                                                     \
    MOED_DEFINE_QTILE_N(FMT, PASS, p)                                                 \
    MOED_DEFINE_QTILE_N(FMT, 1, 1)                                                    \
    static const moed_qkernel moed_qkernel_##FMT = {                                  \
        PASS, moed_qdot_##FMT##_p, moed_qdot_##FMT##_1, PASS, moed_qtile_##FMT##_p,   \
        moed_qtile_##FMT##_1};
/* The same with the mat-vec of a chunked kernel FN(w, r0, nrows, x, out, KIND) (below),
 * PASS rows at a time, and the span kernel's tiles, TPASS rows at a time. */
#define MOED_DEFINE_QKERNEL_CHUNKED(FMT, PASS, TPASS, FN, KIND)                       \
    MOED_DEFINE_QTILE_N(FMT, TPASS, p)                                                \
    MOED_DEFINE_QTILE_N(FMT, 1, 1)                                                    \
    static void moed_qdotc_##FMT##_p(const moed_weight *w, ptrdiff_t r0, const float *x, \
                                     float *out) {                                    \
        FN(w, r0, PASS, x, out, KIND);                                                \
    }                                                                                 \
    static void moed_qdotc_##FMT##_1(const moed_weight *w, ptrdiff_t r0, const float *x, \
                                     float *out) {                                    \
        FN(w, r0, 1, x, out, KIND);                                                   \
    }                                                                                 \
    static const moed_qkernel moed_qkernel_##FMT = {                                  \
        PASS, moed_qdotc_##FMT##_p, moed_qdotc_##FMT##_1, TPASS, moed_qtile_##FMT##_p, \
        moed_qtile_##FMT##_1};

#ifdef MOED_V16_AVX2
/* AVX2 mat-vec of nibble rows. Sixteen ymm registers cannot hold a pass's
 * accumulators (two 16-lane vectors per row are four ymm), its x and its scales, so
 * the span kernel above spilled every accumulator to the stack on each step. Here the
 * columns go in chunks of MOED_NIB_CHUNK: the chunk's x is put in paired lane order once,
 * into an L1 buffer the fused multiply-adds read as memory operands, and then the rows
 * of the pass go one after another over the chunk, each with its four accumulators in
 * registers (kept in memory between chunks). Each lane of each row sees the same
 * values in the same order as in the span kernel, so the bits are the same. */
#define MOED_NIB_CHUNK 512
typedef struct {
    __m256i n15, spread0, spread1;
    __m256 e2m1;
} moed_nibc_consts;

/* One 32-column step of one row: the 16 bytes at p against x in paired order at xp
 * (16 even columns, then 16 odd), into the row's accumulators acc[0..3] (even columns
 * 0-7 and 8-15 of the step, odd 0-7 and 8-15). s, m: the group's scale and min
 * (-8 * scale when symmetric) in every lane; tab: mxfp4's 8 magnitudes times the scale. */
static inline __attribute__((always_inline)) void
moed_nibc_step(const int kind, const moed_nibc_consts *c, const uint8_t *p, const float *xp,
               __m256 s, __m256 m, __m256 tab, __m256 *acc) {
    /* the 16 bytes in both halves; low and high nibbles as bytes; byte l to lane l */
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    __m256i bl = _mm256_and_si256(b, c->n15), bh = _mm256_and_si256(_mm256_srli_epi16(b, 4), c->n15);
    __m256i i[4] = {_mm256_shuffle_epi8(bl, c->spread0), _mm256_shuffle_epi8(bl, c->spread1),
                    _mm256_shuffle_epi8(bh, c->spread0), _mm256_shuffle_epi8(bh, c->spread1)};
    for (int k = 0; k < 4; k++) {
        __m256 v;
        if (kind == MOED_MXFP4) {
            v = moed_v8_lookup_signed8(tab, i[k]);
        } else {
            v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[k]), s, m);   /* as moed_nibble_values */
        }
        acc[k] = _mm256_fmadd_ps(v, _mm256_load_ps(xp + 8 * k), acc[k]);
    }
}

static inline __attribute__((always_inline)) void
moed_qdot_nibc(const moed_weight *w, ptrdiff_t r0, const int nrows, const float *x,
               float *out, const int kind) {
    static const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    moed_nibc_consts c;
    c.n15 = _mm256_set1_epi8(15);
    c.e2m1 = _mm256_loadu_ps(e2m1);
    /* byte l of 0-7 (spread0) or of 8-15 (spread1) to 32-bit lane l, zero-extended:
     * the low 128-bit half takes bytes 0-3 (8-11), the high half 4-7 (12-15) */
    c.spread0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    c.spread1 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                 12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    const ptrdiff_t C = w->cols, g = w->scale_cols;
    float xd[MOED_NIB_CHUNK] __attribute__((aligned(32)));
    float sf[MOED_NIB_CHUNK / 32 + 1] __attribute__((aligned(32)));
    float mf[MOED_NIB_CHUNK / 32 + 1] __attribute__((aligned(32)));
    __m256 acc[MOED_ROWS][4];
    for (int q = 0; q < nrows; q++)
        for (int k = 0; k < 4; k++) acc[q][k] = _mm256_setzero_ps();
    for (ptrdiff_t c0 = 0; c0 < C; c0 += MOED_NIB_CHUNK) {
        const ptrdiff_t c1 = c0 + MOED_NIB_CHUNK < C ? c0 + MOED_NIB_CHUNK : C;
        for (ptrdiff_t j = c0; j < c1; j += 32) {
            moed_v16 xe, xo;
            moed_load_x32(x + j, 1, &xe, &xo);
            moed_v16_store(xd + (j - c0), xe);
            moed_v16_store(xd + (j - c0) + 16, xo);
        }
        const ptrdiff_t g0 = c0 / g, ng = (c1 - 1) / g - g0 + 1;
        for (int q = 0; q < nrows; q++) {
            const ptrdiff_t r = r0 + q, si0 = r * w->scale_ld + g0;
            const uint8_t *row = w->codes + r * w->row_bytes;
            /* this row's next chunk (past its end: the next pass's row), while this one is computed */
            for (ptrdiff_t b = c1 >> 1; b < (c1 >> 1) + (MOED_NIB_CHUNK >> 1); b += 64)
                __builtin_prefetch(row + moed_prefetch_at(b, w->row_bytes, nrows));
            if (ng == 16 && kind == MOED_MXFP4) {
                moed_v16_store(sf, moed_v16_load_e8m0((const uint8_t *)w->scales + si0));
            } else if (ng == 16) {
                moed_v16_store(sf, moed_v16_load_f16((const uint16_t *)w->scales + si0));
                if (kind == MOED_INT4) moed_v16_store(mf, moed_v16_load_f16(w->mins + si0));
            } else {
                for (ptrdiff_t k = 0; k < ng; k++) {
                    sf[k] = moed_scale_at(w, si0 + k);
                    if (kind == MOED_INT4) mf[k] = moed_min_at(w, si0 + k);
                }
            }
            __m256 a[4] = {acc[q][0], acc[q][1], acc[q][2], acc[q][3]};
            if (g == 32) {   /* one step per group */
                const uint8_t *p = row + (c0 >> 1);
                for (ptrdiff_t k = 0; k < ng; k++) {
                    const __m256 s = _mm256_set1_ps(sf[k]);
                    const __m256 m = _mm256_set1_ps(kind == MOED_INT4 ? mf[k] : -8.0f * sf[k]);
                    const __m256 tab = kind == MOED_MXFP4 ? _mm256_mul_ps(c.e2m1, s) : s;
                    moed_nibc_step(kind, &c, p + 16 * k, xd + 32 * k, s, m, tab, a);
                }
            } else {
                for (ptrdiff_t k = 0, j = c0; k < ng; k++) {
                    const ptrdiff_t end = (g0 + k + 1) * g < c1 ? (g0 + k + 1) * g : c1;
                    const __m256 s = _mm256_set1_ps(sf[k]);
                    const __m256 m = _mm256_set1_ps(kind == MOED_INT4 ? mf[k] : -8.0f * sf[k]);
                    const __m256 tab = kind == MOED_MXFP4 ? _mm256_mul_ps(c.e2m1, s) : s;
                    for (; j < end; j += 32)
                        moed_nibc_step(kind, &c, row + (j >> 1), xd + (j - c0), s, m, tab, a);
                }
            }
            for (int k = 0; k < 4; k++) acc[q][k] = a[k];
        }
    }
    for (int q = 0; q < nrows; q++)
        out[q] = moed_v16_hsum(moed_v16_add((moed_v16){acc[q][0], acc[q][1]},
                                            (moed_v16){acc[q][2], acc[q][3]}));
}
#ifndef MOED_QPASS_NIBC
#define MOED_QPASS_NIBC 8
#endif
MOED_DEFINE_QKERNEL_CHUNKED(mxfp4, MOED_QPASS_NIBC, MOED_QPASS_PAIRED, moed_qdot_nibc, MOED_MXFP4)
MOED_DEFINE_QKERNEL_CHUNKED(int4m, MOED_QPASS_NIBC, MOED_QPASS_PAIRED, moed_qdot_nibc, MOED_INT4)
MOED_DEFINE_QKERNEL_CHUNKED(int4s, MOED_QPASS_NIBC, MOED_QPASS_PAIRED, moed_qdot_nibc, MOED_INT4 + 16)
MOED_DEFINE_QKERNEL(int8, MOED_QPASS_NATURAL)
MOED_DEFINE_QKERNEL(fp8, MOED_QPASS_NATURAL)
#else
MOED_DEFINE_QKERNEL(mxfp4, MOED_QPASS_PAIRED)
MOED_DEFINE_QKERNEL(int4m, MOED_QPASS_PAIRED)
MOED_DEFINE_QKERNEL(int4s, MOED_QPASS_PAIRED)
MOED_DEFINE_QKERNEL(int8, MOED_QPASS_NATURAL)
MOED_DEFINE_QKERNEL(fp8, MOED_QPASS_FP8)
#endif

/* The SIMD kernels for rows r0 .. r0+nrows-1 of w, or NULL if they do not apply. */
static inline const moed_qkernel *moed_qkernel_for(const moed_weight *w, ptrdiff_t r0,
                                                   int nrows) {
    switch (w->fmt) {
    case MOED_MXFP4: return &moed_qkernel_mxfp4;
    case MOED_INT4: return w->mins ? &moed_qkernel_int4m : &moed_qkernel_int4s;
    case MOED_INT8: return &moed_qkernel_int8;
    case MOED_FP8_E4M3:
        return moed_fp8_simd_ok(w, r0, nrows) ? &moed_qkernel_fp8 : NULL;
    default: return NULL;
    }
}

/* The SIMD path for nrows <= MOED_ROWS rows; 0 if it does not apply. Rows go in
 * passes of k->pass, the rest one by one. */
static inline int moed_qdot_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                      const float *x, float *out) {
    const moed_qkernel *k = moed_qkernel_for(w, r0, nrows);
    if (!k) return 0;
    int q = 0;
    for (; q + k->pass <= nrows; q += k->pass) k->dotp(w, r0 + q, x, out + q);
    for (; q < nrows; q++) k->dot1(w, r0 + q, x, out + q);
    return 1;
}

/* Decode columns [c0, c1) of rows r0 .. r0+nrows-1 into buf (row q at buf + q * ldb). */
static inline void moed_qtile_rows(const moed_qkernel *k, const moed_weight *w, ptrdiff_t r0,
                                   int nrows, ptrdiff_t c0, ptrdiff_t c1, float *buf,
                                   ptrdiff_t ldb) {
    int q = 0;
    for (; q + k->tpass <= nrows; q += k->tpass) k->tilep(w, r0 + q, c0, c1, buf + q * ldb, ldb);
    for (; q < nrows; q++) k->tile1(w, r0 + q, c0, c1, buf + q * ldb, ldb);
}

/* The accumulation of one token over a decoded tile (row q at buf + q * MOED_TILE_COLS),
 * columns [c0, c1) of x: the lane arithmetic of the mat-vec, in the same order. */
static inline __attribute__((always_inline)) void
moed_tile_accumulate(const float *buf, const int nrows, ptrdiff_t c0, ptrdiff_t c1,
                     const float *x, const int paired, moed_v16 *a0, moed_v16 *a1) {
    moed_v16 b0[MOED_ROWS], b1[MOED_ROWS];
    for (int q = 0; q < nrows; q++) { b0[q] = a0[q]; b1[q] = a1[q]; }
    for (ptrdiff_t j = c0; j < c1; j += 32) {
        moed_v16 x0, x1;
        moed_load_x32(x + j, paired, &x0, &x1);
        for (int q = 0; q < nrows; q++) {
            const float *v = buf + q * MOED_TILE_COLS + (j - c0);
            moed_sink(0, moed_v16_load(v), moed_v16_load(v + 16), x0, x1, b0 + q, b1 + q, NULL, 0);
        }
    }
    for (int q = 0; q < nrows; q++) { a0[q] = b0[q]; a1[q] = b1[q]; }
}

/* out[t * ldo + q] = w_(r0+q) . x_t for t < T and q < nrows: each tile of columns is
 * decoded once per MOED_TILE_TOKENS tokens. Bit-equal to T mat-vec calls. */
static void moed_qmatmul_rows_tiled(const moed_weight *w, const moed_qkernel *k,
                                    ptrdiff_t r0, int nrows, const float *x, ptrdiff_t T,
                                    float *out, ptrdiff_t ldo) {
    float buf[MOED_ROWS * MOED_TILE_COLS] __attribute__((aligned(64)));
    moed_v16 a0[MOED_TILE_TOKENS][MOED_ROWS], a1[MOED_TILE_TOKENS][MOED_ROWS];
    const ptrdiff_t C = w->cols, C32 = C - C % 32;
    const int paired = moed_is_paired(w->fmt);
    for (ptrdiff_t t0 = 0; t0 < T; t0 += MOED_TILE_TOKENS) {
        int nt = T - t0 < MOED_TILE_TOKENS ? (int)(T - t0) : MOED_TILE_TOKENS;
        for (int t = 0; t < nt; t++)
            for (int q = 0; q < nrows; q++) a0[t][q] = a1[t][q] = moed_v16_zero();
        for (ptrdiff_t c0 = 0; c0 < C32; c0 += MOED_TILE_COLS) {
            ptrdiff_t c1 = c0 + MOED_TILE_COLS < C32 ? c0 + MOED_TILE_COLS : C32;
            moed_qtile_rows(k, w, r0, nrows, c0, c1, buf, MOED_TILE_COLS);
            for (int t = 0; t < nt; t++) {
                const float *xt = x + (t0 + t) * C;
                int q = 0;
                for (; q + MOED_TILE_ACC_ROWS <= nrows; q += MOED_TILE_ACC_ROWS)
                    moed_tile_accumulate(buf + q * MOED_TILE_COLS, MOED_TILE_ACC_ROWS, c0, c1, xt,
                                         paired, a0[t] + q, a1[t] + q);
                if (q < nrows)
                    moed_tile_accumulate(buf + q * MOED_TILE_COLS, nrows - q, c0, c1, xt, paired,
                                         a0[t] + q, a1[t] + q);
            }
        }
        for (int t = 0; t < nt; t++)
            for (int q = 0; q < nrows; q++)
                out[(t0 + t) * ldo + q] = moed_qtail(
                    w, r0 + q, x + (t0 + t) * C, moed_v16_hsum(moed_v16_add(a0[t][q], a1[t][q])));
    }
}

/* The SIMD mat-mat for nrows <= MOED_ROWS rows and T >= 2 tokens; 0 if it does not
 * apply. */
static inline int moed_qmatmul_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                         const float *x, ptrdiff_t T, float *out,
                                         ptrdiff_t ldo) {
    const moed_qkernel *k = moed_qkernel_for(w, r0, nrows);
    if (!k) return 0;
    moed_qmatmul_rows_tiled(w, k, r0, nrows, x, T, out, ldo);
    return 1;
}
#else
static inline void moed_quant_init_simd(void) {}
static inline const moed_qkernel *moed_qkernel_for(const moed_weight *w, ptrdiff_t r0,
                                                   int nrows) {
    (void)w; (void)r0; (void)nrows;
    return NULL;
}
static inline int moed_qdot_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                      const float *x, float *out) {
    (void)w; (void)r0; (void)nrows; (void)x; (void)out;
    return 0;
}
static inline int moed_qmatmul_rows_simd(const moed_weight *w, ptrdiff_t r0, int nrows,
                                         const float *x, ptrdiff_t T, float *out,
                                         ptrdiff_t ldo) {
    (void)w; (void)r0; (void)nrows; (void)x; (void)T; (void)out; (void)ldo;
    return 0;
}
/* Never called: moed_qkernel_for gives no kernel here. */
static inline void moed_qtile_rows(const moed_qkernel *k, const moed_weight *w, ptrdiff_t r0,
                                   int nrows, ptrdiff_t c0, ptrdiff_t c1, float *buf,
                                   ptrdiff_t ldb) {
    (void)k; (void)w; (void)r0; (void)nrows; (void)c0; (void)c1; (void)buf; (void)ldb;
}
#endif

/* ------------------------------------------------------------------ dispatch */

static inline const char *moed_simd_path(void) {
#if defined(MOED_V16_AVX512)
    return "avx512";
#elif defined(MOED_V16_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* Fill the decoding tables; called once when the module is imported. */
static inline void moed_quant_init(void) {
    for (int b = 0; b < 256; b++) moed_e4m3_table[b] = moed_e4m3_to_f32((uint8_t)b);
    moed_quant_init_simd();
}

/* out[q * ldo + j] = the value of weight (r0 + q, j), exactly, for q < nrows <=
 * MOED_ROWS: the SIMD decoders where they apply (paired lanes put back in column
 * order), else moed_w_dequant. */
static inline void moed_w_dequant_rows(const moed_weight *w, ptrdiff_t r0, int nrows,
                                       float *out, ptrdiff_t ldo) {
    const ptrdiff_t C = w->cols, C32 = C - C % 32;
    const moed_qkernel *k = w->fmt > MOED_BF16 ? moed_qkernel_for(w, r0, nrows) : NULL;
    ptrdiff_t j = 0;
    if (k) {
        float buf[MOED_ROWS * MOED_TILE_COLS] __attribute__((aligned(64)));
        const int paired = moed_is_paired(w->fmt);
        for (; j < C32; j += MOED_TILE_COLS) {
            ptrdiff_t c1 = j + MOED_TILE_COLS < C32 ? j + MOED_TILE_COLS : C32;
            moed_qtile_rows(k, w, r0, nrows, j, c1, buf, MOED_TILE_COLS);
            for (int q = 0; q < nrows; q++)
                for (ptrdiff_t c = j; c < c1; c += 32) {
                    const float *v = buf + q * MOED_TILE_COLS + (c - j);
                    float *o = out + q * ldo + c;
                    for (int l = 0; l < 16; l++) {
                        if (paired) { o[2 * l] = v[l]; o[2 * l + 1] = v[16 + l]; }
                        else { o[l] = v[l]; o[16 + l] = v[16 + l]; }
                    }
                }
        }
        j = C32;
    }
    for (int q = 0; q < nrows; q++) moed_w_dequant(w, r0 + q, j, C - j, out + q * ldo + j);
}

/* The instruction-set extensions the kernels were compiled to use, space-separated. */
static inline const char *moed_simd_features(void) {
    return ""
#ifdef __AVX512F__
        " avx512f"
#endif
#ifdef __AVX512BW__
        " avx512bw"
#endif
#ifdef __AVX512VBMI__
        " avx512vbmi"
#endif
#ifdef __AVX512VNNI__
        " avx512vnni"
#endif
#ifdef __AVXVNNI__
        " avxvnni"
#endif
#ifdef __AVX512BF16__
        " avx512bf16"
#endif
#ifdef __AVX2__
        " avx2"
#endif
#ifdef __F16C__
        " f16c"
#endif
        ;
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

/* out[t * ldo + q] = w_(r0+q) . x_t for t < T, q < nrows <= MOED_ROWS (x: [T, C]).
 * Bit-equal to T calls of moed_w_dot_rows: the quantised SIMD kernels decode a tile
 * of columns once for several tokens; every other case goes token by token. */
static inline void moed_w_matmul_rows(const moed_weight *w, ptrdiff_t r0, int nrows,
                                      const float *x, ptrdiff_t T, float *out,
                                      ptrdiff_t ldo, int simd) {
    float o[MOED_ROWS];
    if (T >= 2 && simd && w->fmt > MOED_BF16 && moed_qmatmul_rows_simd(w, r0, nrows, x, T, out, ldo))
        return;
    for (ptrdiff_t t = 0; t < T; t++) {
        moed_w_dot_rows(w, r0, nrows, x + t * w->cols, o, simd);
        for (int q = 0; q < nrows; q++) out[t * ldo + q] = o[q];
    }
}

#endif
