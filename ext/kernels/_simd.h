/* 16-lane f32 vectors for the kernels in _kernels_impl.h and _quant_impl.h.
 *
 * Design:
 * - The kernels' reduction orders are defined on 16 lanes. `moed_v16` holds them as
 *   one zmm register (AVX-512), two ymm registers (AVX2: lanes 0-7 in .lo, 8-15 in
 *   .hi), or a GCC vector extension value (portable builds, any architecture). Each
 *   operation below computes every lane with the same single f32 operation on every
 *   path, so a kernel written with them gives the same bits on all three.
 *   moed_v16_fma(a, b, c) is a * b + c with one rounding (vfmadd on AVX-512 and on
 *   AVX2, which is therefore built only with FMA; fmaf per lane in the portable
 *   build, correctly rounded on any machine).
 * - Why not GCC vector extensions everywhere: GCC 12 keeps a 64-byte vector on a
 *   256-bit target partly in memory (spills and element moves in the inner loops)
 *   and converts byte and _Float16 vectors one element at a time.
 * - Loads are unaligned; nothing depends on the address of the data.
 */
#ifndef MOED_SIMD_H
#define MOED_SIMD_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float moed_vf __attribute__((vector_size(64)));        /* 16 x f32 */
typedef uint32_t moed_vu32 __attribute__((vector_size(64)));   /* 16 x u32 */
typedef uint16_t moed_vu16 __attribute__((vector_size(32)));   /* 16 x u16 */
typedef _Float16 moed_vh __attribute__((vector_size(32)));     /* 16 x f16 */

/* Fixed pairwise tree over 16 lanes: (0+8, 1+9, ...), then 4, 2, 1. */
static inline float moed_hsum16(float l[16]) {
    for (int s = 8; s > 0; s >>= 1)
        for (int i = 0; i < s; i++)
            l[i] = l[i] + l[i + s];
    return l[0];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MOED_V16_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define MOED_V16_AVX2 1
#endif

#if defined(MOED_V16_AVX512) || defined(MOED_V16_AVX2)
#include <immintrin.h>
#endif

#if defined(MOED_V16_AVX512)
/* ------------------------------------------------------------------ AVX-512 */
typedef __m512 moed_v16;
typedef __m512i moed_v16i;   /* 16 x 32-bit */

static inline moed_v16 moed_v16_zero(void) { return _mm512_setzero_ps(); }
static inline moed_v16 moed_v16_set1(float s) { return _mm512_set1_ps(s); }
static inline moed_v16 moed_v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline moed_v16 moed_v16_add(moed_v16 a, moed_v16 b) { return _mm512_add_ps(a, b); }
static inline moed_v16 moed_v16_mul(moed_v16 a, moed_v16 b) { return _mm512_mul_ps(a, b); }
static inline moed_v16 moed_v16_fma(moed_v16 a, moed_v16 b, moed_v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline void moed_v16_store(float *p, moed_v16 a) { _mm512_storeu_ps(p, a); }

/* 16 binary16 values at p, exactly. */
static inline moed_v16 moed_v16_load_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* The binary16 value at p (any alignment) in every lane, exactly. */
static inline moed_v16 moed_v16_set1_f16(const void *p) {
    short h;
    memcpy(&h, p, 2);
    return _mm512_cvtph_ps(_mm256_set1_epi16(h));
}

/* 16 bf16 values at p, exactly (each the upper half of its f32). */
static inline moed_v16 moed_v16_load_bf16(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

/* 32 bf16 values at p: the even-indexed ones and the odd-indexed ones, exactly. */
static inline void moed_v16_load_bf16_pairs(const uint16_t *p, moed_v16 *even, moed_v16 *odd) {
    __m512i u = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* a = v[0..15], b = v[16..31] -> even = v[0, 2, .., 30], odd = v[1, 3, .., 31]. */
static inline void moed_v16_deinterleave(moed_v16 a, moed_v16 b, moed_v16 *even, moed_v16 *odd) {
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
}

/* 16 bytes at p, zero-extended to 32-bit lanes. */
static inline moed_v16i moed_v16i_load_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline moed_v16i moed_v16i_srl4(moed_v16i a) { return _mm512_srli_epi32(a, 4); }

/* table[idx & 15] in each lane (the bits of idx above 3 are ignored). */
static inline moed_v16 moed_v16_lookup(moed_v16 table, moed_v16i idx) {
    return _mm512_permutexvar_ps(idx, table);
}

/* 16 signed bytes at p as f32, exactly. */
static inline moed_v16 moed_v16_load_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 E8M0 scales at p as f32: 2^(s - 127), s = 0 the subnormal 2^-127, 255 NaN. */
static inline moed_v16 moed_v16_load_e8m0(const uint8_t *p) {
    __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i u = _mm512_slli_epi32(s, 23);
    u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()),
                              _mm512_set1_epi32(0x00400000));
    u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                              _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(u);
}

#elif defined(MOED_V16_AVX2)
/* --------------------------------------------------------------------- AVX2 */
typedef struct { __m256 lo, hi; } moed_v16;      /* lanes 0-7, 8-15 */
typedef struct { __m256i lo, hi; } moed_v16i;

static inline moed_v16 moed_v16_zero(void) { return (moed_v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline moed_v16 moed_v16_set1(float s) { return (moed_v16){_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline moed_v16 moed_v16_load(const float *p) {
    return (moed_v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline moed_v16 moed_v16_add(moed_v16 a, moed_v16 b) {
    return (moed_v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline moed_v16 moed_v16_mul(moed_v16 a, moed_v16 b) {
    return (moed_v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
static inline moed_v16 moed_v16_fma(moed_v16 a, moed_v16 b, moed_v16 c) {
    return (moed_v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline void moed_v16_store(float *p, moed_v16 a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}

static inline moed_v16 moed_v16_load_f16(const uint16_t *p) {
    return (moed_v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}

static inline moed_v16 moed_v16_load_bf16(const uint16_t *p) {
    __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
    return (moed_v16){_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                      _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}

static inline moed_v16 moed_v16_set1_f16(const void *p) {
    short h;
    memcpy(&h, p, 2);
    __m256 f = _mm256_cvtph_ps(_mm_set1_epi16(h));
    return (moed_v16){f, f};
}

static inline void moed_v16_load_bf16_pairs(const uint16_t *p, moed_v16 *even, moed_v16 *odd) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256i u0 = _mm256_loadu_si256((const __m256i *)p);
    __m256i u1 = _mm256_loadu_si256((const __m256i *)(p + 16));
    *even = (moed_v16){_mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)),
                       _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16))};
    *odd = (moed_v16){_mm256_castsi256_ps(_mm256_and_si256(u0, high)),
                      _mm256_castsi256_ps(_mm256_and_si256(u1, high))};
}

/* Even and odd lanes of the 16 values (a, b): in-lane shuffle, then 64-bit reorder. */
static inline void moed_v8_deinterleave(__m256 a, __m256 b, __m256 *even, __m256 *odd) {
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

static inline void moed_v16_deinterleave(moed_v16 a, moed_v16 b, moed_v16 *even, moed_v16 *odd) {
    moed_v8_deinterleave(a.lo, a.hi, &even->lo, &odd->lo);
    moed_v8_deinterleave(b.lo, b.hi, &even->hi, &odd->hi);
}

static inline moed_v16i moed_v16i_load_u8(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (moed_v16i){_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
}
static inline moed_v16i moed_v16i_srl4(moed_v16i a) {
    return (moed_v16i){_mm256_srli_epi32(a.lo, 4), _mm256_srli_epi32(a.hi, 4)};
}

/* Two 8-entry permutes and a blend on bit 3 of the index. */
static inline __m256 moed_v8_lookup(__m256 tlo, __m256 thi, __m256i i) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, i), _mm256_permutevar8x32_ps(thi, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}
static inline moed_v16 moed_v16_lookup(moed_v16 table, moed_v16i idx) {
    return (moed_v16){moed_v8_lookup(table.lo, table.hi, idx.lo),
                      moed_v8_lookup(table.lo, table.hi, idx.hi)};
}

static inline moed_v16 moed_v16_load_i8(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (moed_v16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}

/* Nibble codes as f32, exactly: lanes & 15 (the low nibble of each lane's byte). */
static inline moed_v16 moed_v16i_nib_f32(moed_v16i a) {
    const __m256i m = _mm256_set1_epi32(15);
    return (moed_v16){_mm256_cvtepi32_ps(_mm256_and_si256(a.lo, m)),
                      _mm256_cvtepi32_ps(_mm256_and_si256(a.hi, m))};
}
/* table[idx & 7] with the sign of bit 3 of idx, in each lane (bits above 3 ignored):
 * one 8-entry permute for the magnitude and the sign bit moved into place. */
static inline __m256 moed_v8_lookup_signed8(__m256 t, __m256i i) {
    __m256 mag = _mm256_permutevar8x32_ps(t, i);
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(i, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}
static inline moed_v16 moed_v16_lookup_signed8(moed_v16 table, moed_v16i idx) {
    return (moed_v16){moed_v8_lookup_signed8(table.lo, idx.lo),
                      moed_v8_lookup_signed8(table.lo, idx.hi)};
}

static inline __m256 moed_v8_e8m0(__m256i s) {
    __m256i u = _mm256_slli_epi32(s, 23);
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(s, _mm256_setzero_si256()));
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(s, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(u);
}
static inline moed_v16 moed_v16_load_e8m0(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (moed_v16){moed_v8_e8m0(_mm256_cvtepu8_epi32(b)),
                      moed_v8_e8m0(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}

#else
/* ----------------------------------------------------------------- portable */
typedef moed_vf moed_v16;
typedef moed_vu32 moed_v16i;

static inline moed_v16 moed_v16_zero(void) { return (moed_v16){0}; }
static inline moed_v16 moed_v16_set1(float s) { return (moed_v16){0} + s; }
static inline moed_v16 moed_v16_load(const float *p) {
    moed_v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline moed_v16 moed_v16_add(moed_v16 a, moed_v16 b) { return a + b; }
static inline moed_v16 moed_v16_mul(moed_v16 a, moed_v16 b) { return a * b; }
/* fmaf is correctly rounded wherever it runs (an instruction, or libm's exact
 * emulation on a CPU without one), so this gives the bits of the SIMD paths. */
static inline moed_v16 moed_v16_fma(moed_v16 a, moed_v16 b, moed_v16 c) {
    for (int l = 0; l < 16; l++) c[l] = fmaf(a[l], b[l], c[l]);
    return c;
}
static inline void moed_v16_store(float *p, moed_v16 a) { memcpy(p, &a, sizeof a); }

static inline moed_v16 moed_v16_load_f16(const uint16_t *p) {
    moed_vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, moed_vf);
}

static inline moed_v16 moed_v16_load_bf16(const uint16_t *p) {
    moed_vu16 h;
    moed_v16 v;
    memcpy(&h, p, sizeof h);
    moed_vu32 u = __builtin_convertvector(h, moed_vu32) << 16;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline moed_v16 moed_v16_set1_f16(const void *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return moed_v16_set1((float)h);
}

static inline void moed_v16_load_bf16_pairs(const uint16_t *p, moed_v16 *even, moed_v16 *odd) {
    moed_vu32 u;
    memcpy(&u, p, sizeof u);
    moed_vu32 lo = u << 16, hi = u & 0xffff0000u;
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
}

static inline void moed_v16_deinterleave(moed_v16 a, moed_v16 b, moed_v16 *even, moed_v16 *odd) {
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

/* The fixed tree of moed_hsum16 over the lanes of a. */
static inline float moed_v16_hsum(moed_v16 a) {
    float l[16];
    moed_v16_store(l, a);
    return moed_hsum16(l);
}

#endif
