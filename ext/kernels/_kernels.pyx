# cython: language_level=3
"""Compute kernels of the forward pass.

Design:
- Each kernel is a `nogil` loop over independent outputs (rows, heads, tokens)
  run on `n_threads` threads by moed's pool (`_pool.h`, `moed_pool_run`): one item
  function per loop (`_*_item`, its arguments in a `_*Job` struct), items claimed
  in chunks at run time. No item holds a reduction over other items: every output
  is reduced inside one item, in an order fixed by the shapes alone (see
  `_kernels_impl.h`). So results are bit-identical for any `n_threads`, any
  placement of items on threads, any alignment of the weight buffer, and any batch
  size; placement may change speed, never output.
- Weights may be f32, f16 or bf16 (`ml_dtypes.bfloat16`) arrays or block-quantised
  (`QuantizedWeight`, below) and stay in that format; they are dequantised on the
  fly and accumulated in f32, one fused multiply-add per product. Activations, the
  KV cache and routing are f32 (never quantised).
- Outputs are allocated by the caller and written in full. The thin Python
  wrappers validate shape, dtype and C-contiguity and raise `ValueError`;
  nothing inside `nogil` raises or allocates (`expert_ffn` fills its table of
  weight descriptors before it releases the GIL).
- The SIMD path is chosen at compile time (`build_info()` says which: "avx512",
  "avx2" or "portable"); every path gives the same bits.

Shape legend: T tokens, H hidden_size, R rows of a weight, C columns, E
num_experts, K top_k, N token-expert pairs, I expert intermediate_size,
nH attention heads, nKV key/value heads, D head_dim, S KV-cache capacity.

Block-quantised weights (`QuantizedWeight`, C helpers in `_quant_impl.h`):
- Every weight-taking kernel (`matmul`, `expert_ffn`, `dequantize_rows`,
  `dequantize`) accepts a `QuantizedWeight` wherever it accepts an f32/f16/bf16
  array; the caller's code does not change. Logical shape [R, C] =
  [out_features, in_features]. Formats (`fmt`):
    "fp8_e4m3"  codes uint8 [R, C] (or ml_dtypes.float8_e4m3fn) holding
                float8_e4m3fn bytes; scales [ceil(R/br), ceil(C/bc)] float32,
                bfloat16 or uint8 UE8M0 (2^(s-127)), one per (br, bc) block
                (`block_size`, the config's `weight_block_size`; the last block
                of each direction may be partial). value = fp8 * scale of its
                block (DeepSeek-V3's `weight` / `weight_scale_inv`).
    "mxfp4"     codes uint8 [R, C/32, 16], two E2M1 values per byte (element 2i
                in the low nibble of byte i, 2i+1 in the high nibble); scales
                uint8 E8M0 [R, C/32]. value = e2m1 * 2^(s-127) (OCP Microscaling
                Formats v1.0; GPT-OSS's `*_blocks` / `*_scales`).
    "int8"      codes int8 [R, C]; scales float16 [R, C/g], one per g
                consecutive inputs. value = code * scale.
    "int4"      codes uint8 [R, C/2], nibble order as MXFP4; scales float16
                [R, C/g]; optional mins float16 [R, C/g]. value = code * scale +
                min, or (code - 8) * scale without mins.
  g is a multiple of 32 (moed's repack uses 32, 64 or 128).
- Dequantisation is exact (the f32 value numpy computes from the definition
  above) and a quantised row is reduced exactly like the dense row of its
  dequantised values: fp8/int8 like f32, mxfp4/int4 like bf16 (see
  `_quant_impl.h`). So `matmul(q, x)` is bit-equal to `matmul(dequantize(q), x)`
  for fp8/int8 and to `matmul(dequantize(q).astype(bfloat16), x)` for mxfp4
  (E2M1 x 2^k is exact in bf16), on every SIMD path.
- Values are not checked per call: NaN, inf or negative scales and E8M0 255 are
  refused by the loader; the kernels compute with what the bytes say (NaN codes
  and E8M0 255 give NaN).
- Mat-mat (T > 1) decodes a tile of weights once for up to 8 tokens; each token's
  row is still bit-equal to its mat-vec.

Fast numerics (`fast=1` or `fast=True` of `matmul`, `matmul_heads`, `expert_ffn`,
`expert_ffn_fused`; C helpers in `_idot_impl.h`), version 2, "q8x2-32":
- Applies to int8, int4 (with or without mins) and mxfp4 weights; f32/f16/bf16
  arrays and fp8 stay exact. The activations are quantised per block of 32 columns
  into two int8 planes, the codes and their residual, and each block is dotted with the
  weight's integer codes exactly, once per plane.
- Why two planes: version 1 ("q8-32", one plane, as llama.cpp's Q8_0 activations) cost
  KL(exact || fast) = 5.3e-4 / 6.4e-4 nats mean and 99.0 % / 99.1 % top-1 agreement on the
  default model repacked to int4 / int8, against a bar of <= 1e-4 nats and >= 99.5 %;
  a simulated second plane holding the residual gave 3.3e-6 / 5.1e-6 nats and
  99.98 % / 100 %. The second plane costs a second integer dot per weight vector (the
  weight bytes, loaded and decoded once, meet both planes).
- Activations (once per row and call, `quantize_activations`), for each block b, in
  this order (IEEE f32, round to nearest even, no fused multiply-add):
  a = max|x_i| (exact); d_b = a / 127.0f; e_b = d_b / 254.0f;
  q1_i = 0 if d_b == 0, else clamp(rint(x_i / d_b), -127, 127) (f32 division, round
  half to even); r_i = x_i - (float)q1_i * d_b (the product rounded, then the
  difference); q2_i = 0 if e_b == 0, else clamp(rint(r_i / e_b), -127, 127);
  s1_b = sum q1_i, s2_b = sum q2_i (int32). llama.cpp rounds x * (1/d) with roundf;
  dividing keeps the reciprocal's extra rounding out. |r_i| <= d_b / 2 up to roundings,
  so q2 rarely clamps (a subnormal d_b, whose e_b has few bits, makes it clamp), and e_b
  underflows to 0 for d_b below about 127 x 2^-149 (then the block has one plane).
- Integer block dots S1_rb = sum c_i * q1_i and S2_rb = sum c_i * q2_i, exact (int32,
  any order), where the code c is: int8 as stored; int4 with mins the nibble (0..15);
  int4 without mins nibble - 8; mxfp4 2 x E2M1 (-12..12).
- Weight scale sw_rb: the f16 scale of the group holding block b (groups of 32, 64 or
  128 columns: a block never straddles two), or mxfp4's 2^(e - 128) (the 0.5 undoes
  the doubled codes; exact in f32, e = 255 gives NaN); m_rb the f16 min (int4 mins).
- Combination, in this order, IEEE f32, no fused multiply-add:
  t_rb = (float)S1_rb * (sw_rb * d_b);
  t_rb = t_rb + (float)S2_rb * (sw_rb * e_b)  (the product computed, then the sum);
  with mins: u = d_b * (float)s1_b, v = e_b * (float)s2_b, t_rb = t_rb + m_rb * (u + v);
  y_r = ((0.0f + t_r0) + t_r1) + ... left to right over the blocks.
- So y_r depends only on the row, x and the shapes: every SIMD path ("fast" in
  `build_info()`), the portable one, any thread count, any number of tokens and any
  alignment give the same bits. Activations should be finite (a block holding inf or
  NaN gives unspecified outputs). In the expert FFNs each x row is quantised once for
  gate and up, and each hidden row once for down.

Fast numerics of bf16 weights (`fast=2`; C helpers in `_bdot_impl.h`), "bf16-dp": the
arithmetic of AVX-512 BF16's VDPBF16PS, which is also what llama.cpp's CPU backend does
with BF16 weights (its activations are converted to bf16 before the dot).
- Activations, once per row and call: each x_i rounded to bf16, to nearest with ties
  to even (NaN stays NaN, quiet); a result whose exponent bits are 0 (a subnormal)
  becomes a zero of its sign. Rows are padded with zeros to a multiple of 32 columns;
  the weight row is read as zeros past its end.
- y_r: 16 f32 lanes from +0.0; for step i = 0, 1, .. (columns 32i .. 32i + 31), in lane
  l: acc = F(fma(w[32i + 2l + 1], x[32i + 2l + 1], acc)), then acc = F(fma(w[32i + 2l],
  x[32i + 2l], acc)), where fma rounds once (to nearest even), the weights pass through
  F too, and F maps a subnormal to a zero of its sign (Intel SDM, VDPBF16PS: "FP32 FMA
  with DAZ in, FTZ out, RNE"); then the fixed tree of 16 lanes (l + (l + 8), + 4, + 2,
  + 1), plain f32 adds. One accumulator per row, so the mat-vec and every mat-mat tile
  compute the same operations: rows are bit-equal whatever T is.
- Paths (`build_info()["fast_bf16"]`): "avx512-bf16" (VDPBF16PS: 32 products an
  instruction, about twice the f32 FMA rate); "emulated" on every other build, the
  same operations with f32 fma and explicit flushes (no faster than exact mode, so
  `numerics = "auto"` leaves bf16 weights exact; `numerics = "fast"` asks for it).
"""
cimport cython
from libc.math cimport expf, sqrtf, INFINITY
from libc.stdint cimport uint16_t, int32_t, int64_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

import numpy as np
cimport numpy as cnp

import ml_dtypes

cnp.import_array()

cdef extern from "_kernels_impl.h" nogil:
    int MOED_F32
    int MOED_F16
    int MOED_BF16
    size_t moed_dtype_size(int dtype)
    float moed_dot(int dtype, const void *w, const float *x, Py_ssize_t n)
    int MOED_ROWS
    void moed_dot_rows(int dtype, const char *w, size_t ldw, int nrows, const float *x,
                       Py_ssize_t n, float *out)
    void moed_axpy(float a, const float *x, float *y, Py_ssize_t n)
    void moed_axpy_w(int dtype, float a, const void *w, float *y, Py_ssize_t n)
    float moed_silu(float g)
    float moed_clamped_swiglu(float g, float u, float alpha, float limit)

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)

cdef extern from *:
    """
    #ifdef _OPENMP
    static int moed_openmp_flag(void) { return 1; }
    #else
    static int moed_openmp_flag(void) { return 0; }
    #endif
    """
    int moed_openmp_flag() nogil


def openmp_enabled():
    """True when the kernels were built with OpenMP. The kernels' threads are moed's
    own pool (`_pool.h`) either way; this only says what the compiler accepted."""
    return bool(moed_openmp_flag())


cdef extern from "_pool.h" nogil:
    ctypedef void (*moed_pool_fn)(void *ctx, Py_ssize_t item, int tid) noexcept nogil
    void moed_pool_run(int n_threads, Py_ssize_t n_items, moed_pool_fn fn, void *ctx)
    int moed_pool_threaded()
    void moed_pool_set_spin_ns(long ns)
    long moed_pool_spin_ns()
    int moed_pool_workers()
    void moed_pool_stats(uint64_t *out)


def pool_info():
    """The compute pool: {"threaded": False if built with MOED_POOL_SERIAL (every call
    runs on the caller), "workers": threads started so far (0 until a call asks for
    more than one thread), "spin_ns": how long a worker spins for the next call
    before it sleeps, and counts since the process started: "jobs" (calls run on more
    than one thread), "chunks" (their chunks), "worker_chunks" (chunks a worker ran,
    not the caller), "sleeps" (times a worker slept), "stalls" (times the caller
    waited long for a worker that had lost its core, and ran the next calls alone),
    "wait_seconds" (time callers spent waiting for chunks workers held)}."""
    cdef uint64_t st[6]
    moed_pool_stats(st)
    return {"threaded": bool(moed_pool_threaded()), "workers": moed_pool_workers(),
            "spin_ns": moed_pool_spin_ns(), "jobs": st[0], "chunks": st[1],
            "worker_chunks": st[2], "sleeps": st[3], "stalls": st[4],
            "wait_seconds": st[5] * 1e-9}


def set_pool_spin(long ns) -> None:
    """Set how long (ns, >= 0) an idle worker spins before it sleeps. Placement only.
    Raises ValueError for ns < 0."""
    if ns < 0:
        raise ValueError(f"spin must be >= 0 ns, got {ns}")
    moed_pool_set_spin_ns(ns)


# ---------------------------------------------------------------- validation

cdef inline object _shape(cnp.ndarray a):
    return (<object>a).shape


cdef int _wcode(cnp.ndarray a, str name) except -1:
    """Format code of a weight array; rejects anything not f32/f16/bf16."""
    dt = a.dtype
    if dt == _BF16:
        return MOED_BF16
    if dt == _F16:
        return MOED_F16
    if dt == _F32:
        return MOED_F32
    raise ValueError(f"{name}: unsupported weight dtype {dt} (f32, f16, bf16; "
                     "quantised codes go in a QuantizedWeight)")


cdef inline void _need_c(cnp.ndarray a, str name) except *:
    if not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise ValueError(f"{name}: must be C-contiguous")


cdef inline void _need_f32(cnp.ndarray a, str name, int ndim) except *:
    if a.dtype != _F32:
        raise ValueError(f"{name}: dtype must be float32, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {_shape(a)}")
    _need_c(a, name)


cdef inline void _need_writable(cnp.ndarray a, str name) except *:
    if not a.flags.writeable:
        raise ValueError(f"{name}: output must be writable")


cdef inline void _need_threads(int n_threads) except *:
    if n_threads < 1:
        raise ValueError(f"n_threads must be >= 1, got {n_threads}")


# Below this many multiply-adds a call runs on one thread: handing work to the pool
# costs more than it saves. Results do not depend on the thread count. The pool's
# workers spin for the next call while a model decodes (see `_pool.h`), so a call pays
# for publishing a job and for one chunk's cache lines changing core, not for a wake-up;
# it starts the computation without waiting for anyone. POOL_MIN_PARALLEL_WORK is set
# from bf16 mat-vecs timed on 1 and 2 threads (the pool at its default spin; see the
# commit that set it for the figures). It was 6 Mi with libgomp's passive workers (a
# ~60 us futex wake per region) and 64 Ki with libgomp's spinning ones.
cdef enum:
    POOL_MIN_PARALLEL_WORK = 32768
cdef Py_ssize_t _min_parallel_work = POOL_MIN_PARALLEL_WORK


def parallel_threshold() -> int:
    """Multiply-adds below which a call runs on one thread whatever n_threads says."""
    return _min_parallel_work


def set_parallel_threshold(Py_ssize_t work) -> None:
    """Set `parallel_threshold` (>= 1). Placement only: results do not depend on it.
    Raises ValueError for work < 1."""
    global _min_parallel_work
    if work < 1:
        raise ValueError(f"parallel threshold must be >= 1, got {work}")
    _min_parallel_work = work


cdef inline int _threads_for(Py_ssize_t work, int n_threads) noexcept nogil:
    return n_threads if work >= _min_parallel_work else 1


include "_weights.pxi"


cdef extern from "_idot_impl.h" nogil:
    ctypedef struct moed_qact:
        signed char *q1
        signed char *q2
        float *d
        float *e
        float *ds
        int32_t *s1
        int32_t *s2
        Py_ssize_t rows
        Py_ssize_t cols
        Py_ssize_t nb
        Py_ssize_t ldq
        Py_ssize_t ldb
        int paired
    size_t moed_qact_bytes(Py_ssize_t T, Py_ssize_t C)
    void moed_qact_init(moed_qact *a, void *buf, Py_ssize_t T, Py_ssize_t C, int paired)
    void moed_qact_row(const moed_qact *a, Py_ssize_t t, const float *x)
    Py_ssize_t moed_qact_index(int paired, Py_ssize_t j)
    int moed_fast_applies(const moed_weight *w)
    int moed_fast_paired(int fmt)
    void moed_idot_rows(const moed_weight *w, Py_ssize_t r0, int nrows, const moed_qact *a,
                        Py_ssize_t t, float *out, int simd)
    void moed_imatmul_rows(const moed_weight *w, Py_ssize_t r0, int nrows, const moed_qact *a,
                           Py_ssize_t t0, Py_ssize_t T, float *out, Py_ssize_t ldo, int simd)
    const char *moed_fast_path()
    const char *moed_bf16_fast_path()


# ------------------------------------------------------------- fast numerics

cdef inline bint _fast_for(int fast, const moed_weight *w) noexcept nogil:
    """Does the fast level `fast` change weight w? 1: int8, int4 and mxfp4 weights
    ("q8x2-32"); 2: bf16 weights too ("bf16-dp"); 0: none."""
    if fast <= 0 or not moed_fast_applies(w):
        return False
    return w.fmt != MOED_BF16 or fast >= 2


cdef void *_qact_alloc(moed_qact *a, Py_ssize_t T, Py_ssize_t C, int paired) except NULL:
    """Scratch for the quantised activations of T rows of C columns (the caller frees
    the returned pointer); a describes it."""
    cdef void *buf = malloc(moed_qact_bytes(T if T > 0 else 1, C))
    if buf == NULL:
        raise MemoryError()
    moed_qact_init(a, buf, T, C, paired)
    return buf


ctypedef struct _QactJob:
    const moed_qact *a
    const float *x
    Py_ssize_t ldx


cdef void _qact_item(void *ctx, Py_ssize_t t, int tid) noexcept nogil:
    cdef _QactJob *j = <_QactJob *>ctx
    moed_qact_row(j.a, t, j.x + t * j.ldx)


cdef void _qact_rows(const moed_qact *a, const float *x, Py_ssize_t ldx, Py_ssize_t T,
                     int n_threads) noexcept nogil:
    """Quantise rows x[t * ldx] (t < T) into a, rows split between the threads."""
    cdef _QactJob j
    if T == 1:
        moed_qact_row(a, 0, x)
        return
    j.a = a
    j.x = x
    j.ldx = ldx
    moed_pool_run(_threads_for(T * a.cols * 16, n_threads), T, _qact_item, &j)


def quantize_activations(cnp.ndarray x, cnp.ndarray q1, cnp.ndarray q2, cnp.ndarray d,
                         cnp.ndarray e, cnp.ndarray s1, cnp.ndarray s2):
    """The fast mode's activation quantisation (module docstring, "Fast numerics") of
    each row of x, as the kernels compute it: both planes, their scales and sums.

    Args:
        x: [T, C] float32, C a multiple of 32.
        q1: [T, C] int8, writable: the first plane's codes, in column order.
        q2: [T, C] int8, writable: the second plane's (the residual's) codes.
        d: [T, C/32] float32, writable: the first plane's block scales.
        e: [T, C/32] float32, writable: the second plane's block scales (d / 254).
        s1: [T, C/32] int32, writable: the block sums of q1.
        s2: [T, C/32] int32, writable: the block sums of q2.
    Raises ValueError on a shape, dtype, contiguity or writability mismatch.
    """
    _need_f32(x, "x", 2)
    cdef Py_ssize_t T = x.shape[0], C = x.shape[1]
    if C % 32:
        raise ValueError(f"x: {C} columns are not a multiple of 32")
    for arr, name, dt, shape in ((q1, "q1", np.int8, (T, C)), (q2, "q2", np.int8, (T, C)),
                                 (d, "d", np.float32, (T, C // 32)), (e, "e", np.float32, (T, C // 32)),
                                 (s1, "s1", np.int32, (T, C // 32)), (s2, "s2", np.int32, (T, C // 32))):
        if arr.dtype != dt or arr.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D {np.dtype(dt)} array, got {arr.dtype} {_shape(arr)}")
        _need_c(arr, name)
        _need_writable(arr, name)
        if _shape(arr) != shape:
            raise ValueError(f"quantize_activations: x {_shape(x)}, {name} {_shape(arr)}; "
                             f"expected {name} {shape}")
    if T == 0:
        return
    cdef moed_qact a
    cdef void *buf = _qact_alloc(&a, T, C, 0)
    cdef Py_ssize_t t, nb = C // 32
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef signed char *q1p = <signed char *>cnp.PyArray_DATA(q1)
    cdef signed char *q2p = <signed char *>cnp.PyArray_DATA(q2)
    cdef float *dp = <float *>cnp.PyArray_DATA(d)
    cdef float *ep = <float *>cnp.PyArray_DATA(e)
    cdef int32_t *s1p = <int32_t *>cnp.PyArray_DATA(s1)
    cdef int32_t *s2p = <int32_t *>cnp.PyArray_DATA(s2)
    try:
        with nogil:
            for t in range(T):
                moed_qact_row(&a, t, xp + t * C)
                memcpy(q1p + t * C, a.q1 + t * a.ldq, C)
                memcpy(q2p + t * C, a.q2 + t * a.ldq, C)
                memcpy(dp + t * nb, a.d + t * a.ldb, nb * sizeof(float))
                memcpy(ep + t * nb, a.e + t * a.ldb, nb * sizeof(float))
                memcpy(s1p + t * nb, a.s1 + t * a.ldb, nb * sizeof(int32_t))
                memcpy(s2p + t * nb, a.s2 + t * a.ldb, nb * sizeof(int32_t))
    finally:
        free(buf)


# ------------------------------------------------------------------- matmul

cdef inline void _matmul_rows(const moed_weight *w, const float *x, Py_ssize_t T,
                              float *out, Py_ssize_t g, int simd) noexcept nogil:
    """out[t, r] = w_r . x[t] for the rows r of group g (MOED_ROWS rows) and t < T.

    The group's rows stay in cache while the T tokens pass over them."""
    cdef Py_ssize_t r0 = g * MOED_ROWS
    cdef int nr = <int>(w.rows - r0) if w.rows - r0 < MOED_ROWS else MOED_ROWS
    moed_w_matmul_rows(w, r0, nr, x, T, out + r0, w.rows, simd)


ctypedef struct _MatmulJob:
    # one row group (MOED_ROWS rows) of w per item
    const moed_weight *w
    const float *x           # [T, C], or NULL with a
    const moed_qact *a       # the fast mode's quantised x
    Py_ssize_t T
    float *out               # [T, R]; dequantize: [R, C]
    int simd


cdef void _matmul_item(void *ctx, Py_ssize_t g, int tid) noexcept nogil:
    cdef _MatmulJob *j = <_MatmulJob *>ctx
    _matmul_rows(j.w, j.x, j.T, j.out, g, j.simd)


cdef void _matmul_fast_item(void *ctx, Py_ssize_t g, int tid) noexcept nogil:
    cdef _MatmulJob *j = <_MatmulJob *>ctx
    cdef Py_ssize_t r0 = g * MOED_ROWS
    cdef int nr = <int>(j.w.rows - r0) if j.w.rows - r0 < MOED_ROWS else MOED_ROWS
    moed_imatmul_rows(j.w, r0, nr, j.a, 0, j.T, j.out + r0, j.w.rows, j.simd)


cdef void _dequant_item(void *ctx, Py_ssize_t g, int tid) noexcept nogil:
    cdef _MatmulJob *j = <_MatmulJob *>ctx
    cdef Py_ssize_t r0 = g * MOED_ROWS
    cdef int nr = <int>(j.w.rows - r0) if j.w.rows - r0 < MOED_ROWS else MOED_ROWS
    moed_w_dequant_rows(j.w, r0, nr, j.out + r0 * j.w.cols, j.w.cols)


cdef void _matmul(const moed_weight *w, const float *x, Py_ssize_t T, float *out,
                  int n_threads, int simd) noexcept nogil:
    cdef _MatmulJob j
    j.w = w
    j.x = x
    j.a = NULL
    j.T = T
    j.out = out
    j.simd = simd
    moed_pool_run(n_threads, (w.rows + MOED_ROWS - 1) // MOED_ROWS, _matmul_item, &j)


cdef void _matmul_fast(const moed_weight *w, const moed_qact *a, Py_ssize_t T, float *out,
                       int n_threads, int simd) noexcept nogil:
    cdef _MatmulJob j
    j.w = w
    j.x = NULL
    j.a = a
    j.T = T
    j.out = out
    j.simd = simd
    moed_pool_run(n_threads, (w.rows + MOED_ROWS - 1) // MOED_ROWS, _matmul_fast_item, &j)


cdef _matmul_checked(object w, cnp.ndarray x, cnp.ndarray out, int n_threads, int simd,
                     int fast):
    cdef moed_weight d
    _describe(w, "w", &d)
    _need_f32(x, "x", 2)
    _need_f32(out, "out", 2)
    _need_writable(out, "out")
    _need_threads(n_threads)
    cdef Py_ssize_t R = d.rows, C = d.cols, T = x.shape[0]
    if x.shape[1] != C:
        raise ValueError(f"x: shape {_shape(x)} does not match w {(R, C)}")
    if out.shape[0] != T or out.shape[1] != R:
        raise ValueError(f"out: shape {_shape(out)}, expected ({T}, {R})")
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef moed_qact a
    cdef void *buf
    if _fast_for(fast, &d) and T > 0:
        buf = _qact_alloc(&a, T, C, moed_fast_paired(d.fmt))
        try:
            with nogil:
                n_threads = _threads_for(R * C * T, n_threads)
                _qact_rows(&a, xp, C, T, n_threads)
                _matmul_fast(&d, &a, T, op, n_threads, simd)
        finally:
            free(buf)
        return
    with nogil:
        _matmul(&d, xp, T, op, _threads_for(R * C * T, n_threads), simd)


def matmul(object w, cnp.ndarray x, cnp.ndarray out, int n_threads=1, int fast=0):
    """out = x @ w.T with w dequantised on the fly.

    Args:
        w: [R, C] float32, float16 or bfloat16 array, C-contiguous (may be
            read-only, e.g. a memory map; any alignment), or a QuantizedWeight.
        x: [T, C] float32, C-contiguous.
        out: [T, R] float32, C-contiguous, writable; fully overwritten.
        n_threads: OpenMP threads (rows are split between them).
        fast: the fast numerics level (module docstring): 1 (or True) with an int8,
            int4 or mxfp4 weight, x quantised to two int8 planes per block of 32 ("q8x2-32");
            2 also with a bf16 weight, x rounded to bf16 ("bf16-dp"); 0 (False), and every
            weight the level does not cover, exact.

    Row t of `out` is bit-equal whatever T is (mat-mat rows equal mat-vec).
    Raises ValueError on a shape, dtype or contiguity mismatch.
    """
    _matmul_checked(w, x, out, n_threads, 1, fast)


def _matmul_portable(object w, cnp.ndarray x, cnp.ndarray out, int n_threads=1, int fast=0):
    """`matmul` on the portable reference path of the quantised formats (what a
    MOED_PORTABLE=1 build runs), for tests that compare the SIMD path with it."""
    _matmul_checked(w, x, out, n_threads, 0, fast)


def dequantize(object w, cnp.ndarray out=None, int n_threads=1):
    """The float32 values [R, C] of a weight: exactly what the kernels multiply by.

    Args:
        w: a QuantizedWeight or a float32/float16/bfloat16 [R, C] array.
        out: optional [R, C] float32, C-contiguous, writable; allocated if None.
        n_threads: OpenMP threads (rows are split between them).
    Returns `out`. Raises ValueError on a bad weight or `out`.
    """
    cdef moed_weight d
    _describe(w, "w", &d)
    _need_threads(n_threads)
    if out is None:
        out = np.empty((d.rows, d.cols), np.float32)
    _need_f32(out, "out", 2)
    _need_writable(out, "out")
    if out.shape[0] != d.rows or out.shape[1] != d.cols:
        raise ValueError(f"out: shape {_shape(out)}, expected {(d.rows, d.cols)}")
    cdef _MatmulJob j
    j.w = &d
    j.out = <float *>cnp.PyArray_DATA(out)
    with nogil:
        moed_pool_run(_threads_for(d.rows * d.cols, n_threads),
                      (d.rows + MOED_ROWS - 1) // MOED_ROWS, _dequant_item, &j)
    return out


cdef void _head_rows(const moed_weight *w, Py_ssize_t r0, Py_ssize_t nr, const float *x,
                     Py_ssize_t x_stride, Py_ssize_t T, float *out, Py_ssize_t out_stride,
                     int simd) noexcept nogil:
    """out[t * out_stride + q] = w_{r0+q} . x[t * x_stride] for q < min(nr, MOED_ROWS)
    and t < T (each row reduced as `matmul` reduces it)."""
    cdef float o[8]
    cdef Py_ssize_t t, q
    if nr > MOED_ROWS:
        nr = MOED_ROWS
    for t in range(T):
        moed_w_dot_rows(w, r0, <int>nr, x + t * x_stride, o, simd)
        for q in range(nr):
            out[t * out_stride + q] = o[q]


cdef enum:
    AXPY_CHUNK = 256     # dequantised values per step of a transposed product


cdef void _head_rows_t(const moed_weight *w, Py_ssize_t r0, Py_ssize_t rows, const float *x,
                       float *out) noexcept nogil:
    """out[j] = sum over r < rows, in order, of x[r] * w[r0 + r, j] (one fused
    multiply-add per row and output; dense rows are read in place, quantised ones dequantised first —
    exactly, so the sum is the same)."""
    cdef Py_ssize_t C = w.cols, r, j, n
    cdef float buf[AXPY_CHUNK]
    for j in range(C):
        out[j] = 0.0
    for r in range(rows):
        if w.fmt == MOED_F32 or w.fmt == MOED_F16 or w.fmt == MOED_BF16:
            moed_axpy_w(w.fmt, x[r], w.codes + (r0 + r) * w.row_bytes, out, C)
        else:
            j = 0
            while j < C:
                n = C - j if C - j < AXPY_CHUNK else AXPY_CHUNK
                moed_w_dequant(w, r0 + r, j, n, buf)
                moed_axpy_w(MOED_F32, x[r], buf, out + j, n)
                j = j + n


cdef void _head_rows_fast(const moed_weight *w, Py_ssize_t r0, Py_ssize_t nr, const moed_qact *a,
                          Py_ssize_t a0, Py_ssize_t a_stride, Py_ssize_t T, float *out,
                          Py_ssize_t out_stride) noexcept nogil:
    """_head_rows in fast mode: token t's activations are row a0 + t * a_stride of a."""
    cdef float o[8]
    cdef Py_ssize_t t, q
    if nr > MOED_ROWS:
        nr = MOED_ROWS
    for t in range(T):
        moed_idot_rows(w, r0, <int>nr, a, a0 + t * a_stride, o, 1)
        for q in range(nr):
            out[t * out_stride + q] = o[q]


ctypedef struct _HeadsJob:
    const moed_weight *w
    const float *x
    const moed_qact *a
    float *out
    Py_ssize_t T, NH, G, C, row0, rows, ngroups


cdef void _heads_fast_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    """Row group f % ngroups of head f // ngroups, fast mode."""
    cdef _HeadsJob *j = <_HeadsJob *>ctx
    cdef Py_ssize_t h = f // j.ngroups, g = f % j.ngroups
    _head_rows_fast(j.w, h * j.G + j.row0 + g * MOED_ROWS, j.rows - g * MOED_ROWS, j.a, h,
                    j.NH, j.T, j.out + h * j.rows + g * MOED_ROWS, j.NH * j.rows)


cdef void _heads_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    """Row group f % ngroups of head f // ngroups."""
    cdef _HeadsJob *j = <_HeadsJob *>ctx
    cdef Py_ssize_t h = f // j.ngroups, g = f % j.ngroups
    _head_rows(j.w, h * j.G + j.row0 + g * MOED_ROWS, j.rows - g * MOED_ROWS, j.x + h * j.C,
               j.NH * j.C, j.T, j.out + h * j.rows + g * MOED_ROWS, j.NH * j.rows, 1)


cdef void _heads_t_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    """Head f % NH of token f // NH, transposed."""
    cdef _HeadsJob *j = <_HeadsJob *>ctx
    cdef Py_ssize_t h = f % j.NH, t = f // j.NH
    _head_rows_t(j.w, h * j.G + j.row0, j.rows, j.x + (t * j.NH + h) * j.rows,
                 j.out + (t * j.NH + h) * j.C)


def matmul_heads(object w, Py_ssize_t row0, Py_ssize_t rows, cnp.ndarray x,
                 cnp.ndarray out, bint transpose, int n_threads=1, int fast=0):
    """Per-head products with one row block of each head's rows of a weight.

    w holds nH equal groups of G = R / nH consecutive rows; head h uses the block
    W_h = w[h*G + row0 : h*G + row0 + rows] ([rows, C]). For each token t:
        transpose False: out[t, h] = W_h @ x[t, h]      (x [T, nH, C], out [T, nH, rows])
        transpose True:  out[t, h] = W_h.T @ x[t, h]    (x [T, nH, rows], out [T, nH, C])
    The first reduces each output as `matmul` does; the second sums the block's rows
    in order (r = 0, 1, ..., rows-1, one fused multiply-add per row). Used by MLA to fold
    kv_b_proj's key rows into the query and its value rows into the output.

    Args:
        w: [R, C] float32/float16/bfloat16 array, C-contiguous, or a QuantizedWeight;
            R a multiple of nH.
        row0, rows: the block within each head's group, row0 + rows <= G.
        x, out: float32 C-contiguous as above; out is overwritten.
        fast: the fast numerics level, as `matmul`'s, with transpose False; ignored
            otherwise.
    Raises ValueError on a shape, dtype or contiguity mismatch.
    """
    cdef moed_weight d
    _describe(w, "w", &d)
    _need_f32(x, "x", 3)
    _need_f32(out, "out", 3)
    _need_writable(out, "out")
    _need_threads(n_threads)
    cdef Py_ssize_t T = x.shape[0], NH = x.shape[1], R = d.rows, C = d.cols
    if NH == 0 or R % NH:
        raise ValueError(f"matmul_heads: {R} weight rows are not {NH} equal head groups")
    cdef Py_ssize_t G = R // NH
    if row0 < 0 or rows < 1 or row0 + rows > G:
        raise ValueError(f"matmul_heads: rows {row0}..{row0 + rows} outside a head's {G}")
    cdef Py_ssize_t cin = rows if transpose else C, cout = C if transpose else rows
    if x.shape[2] != cin or out.shape[0] != T or out.shape[1] != NH or out.shape[2] != cout:
        raise ValueError(f"matmul_heads: w {(R, C)}, x {_shape(x)}, out {_shape(out)}, "
                         f"rows {rows}, transpose {bool(transpose)}")
    cdef _HeadsJob j
    j.w = &d
    j.x = <const float *>cnp.PyArray_DATA(x)
    j.a = NULL
    j.out = <float *>cnp.PyArray_DATA(out)
    j.T, j.NH, j.G, j.C, j.row0, j.rows = T, NH, G, C, row0, rows
    j.ngroups = (rows + MOED_ROWS - 1) // MOED_ROWS
    n_threads = _threads_for(T * NH * rows * C, n_threads)
    cdef moed_qact a
    cdef void *buf
    if not transpose and _fast_for(fast, &d) and T > 0:
        buf = _qact_alloc(&a, T * NH, C, moed_fast_paired(d.fmt))
        j.a = &a
        try:
            with nogil:
                _qact_rows(&a, j.x, C, T * NH, n_threads)
                moed_pool_run(n_threads, NH * j.ngroups, _heads_fast_item, &j)
        finally:
            free(buf)
    elif not transpose:
        with nogil:
            moed_pool_run(n_threads, NH * j.ngroups, _heads_item, &j)
    else:
        with nogil:
            moed_pool_run(n_threads, NH * T, _heads_t_item, &j)


def dequantize_rows(object w, cnp.ndarray ids, cnp.ndarray out):
    """out[t] = f32(w[ids[t]]): embedding lookup.

    Args:
        w: [V, H] float32/float16/bfloat16, C-contiguous, or a QuantizedWeight.
        ids: [T] int64 row indices, each in [0, V).
        out: [T, H] float32, writable.
    Raises ValueError on shape/dtype mismatch or an id out of range.
    """
    cdef moed_weight d
    _describe(w, "w", &d)
    _need_f32(out, "out", 2)
    _need_writable(out, "out")
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise ValueError("ids: expected a 1-D int64 array")
    cdef Py_ssize_t V = d.rows, H = d.cols, T = ids.shape[0]
    if out.shape[0] != T or out.shape[1] != H:
        raise ValueError(f"out: shape {_shape(out)}, expected ({T}, {H})")
    cdef const int64_t[::1] idv = ids
    cdef Py_ssize_t t
    for t in range(T):
        if idv[t] < 0 or idv[t] >= V:
            raise ValueError(f"token id {idv[t]} out of range [0, {V})")
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    with nogil:
        for t in range(T):
            moed_w_dequant(&d, idv[t], 0, H, op + t * H)


# ------------------------------------------------------------------ rmsnorm

ctypedef struct _NormJob:
    const float *x
    const float *w
    float *out
    Py_ssize_t H
    float eps


cdef void _rmsnorm_item(void *ctx, Py_ssize_t t, int tid) noexcept nogil:
    cdef _NormJob *j = <_NormJob *>ctx
    cdef Py_ssize_t H = j.H, i
    cdef const float *x = j.x + t * H
    cdef float ss = moed_dot(MOED_F32, x, x, H)
    cdef float r = 1.0 / sqrtf(ss / H + j.eps)
    for i in range(H):
        j.out[t * H + i] = j.w[i] * (x[i] * r)


def rmsnorm(cnp.ndarray x, cnp.ndarray weight, float eps, cnp.ndarray out,
            int n_threads=1):
    """out = weight * (x / sqrt(mean(x**2) + eps)) row by row.

    Formula: RMSNorm (Zhang & Sennrich 2019) as transformers' *RMSNorm computes
    it in f32: x * rsqrt(variance + eps), then times weight.

    Args:
        x: [T, H] float32. weight: [H] float32. out: [T, H] float32 (may be x).
    """
    _need_f32(x, "x", 2)
    _need_f32(weight, "weight", 1)
    _need_f32(out, "out", 2)
    _need_writable(out, "out")
    _need_threads(n_threads)
    cdef Py_ssize_t T = x.shape[0], H = x.shape[1]
    if weight.shape[0] != H or out.shape[0] != T or out.shape[1] != H:
        raise ValueError(f"rmsnorm: x {_shape(x)}, weight {_shape(weight)}, out {_shape(out)}")
    cdef _NormJob j
    j.x = <const float *>cnp.PyArray_DATA(x)
    j.w = <const float *>cnp.PyArray_DATA(weight)
    j.out = <float *>cnp.PyArray_DATA(out)
    j.H = H
    j.eps = eps
    with nogil:
        moed_pool_run(_threads_for(T * H * 8, n_threads), T, _rmsnorm_item, &j)


# --------------------------------------------------------------------- rope

cdef enum:
    MAX_ROPE_DIM = 1024   # rotated dims per head the interleaved layout can take


def rope(cnp.ndarray x, cnp.ndarray cos, cnp.ndarray sin, Py_ssize_t offset=0,
         bint interleaved=False):
    """Rotary position embedding in place on dims offset..offset+R-1 of each head
    (R = 2 * cos.shape[1]); the other dims are left as they are.

    Rotate-half layout (GPT-NeoX / HF), for each token t, head h and i < R/2, with
    x = the head's rotated dims:
        x'[i]       = x[i] * cos[t, i] - x[i + R/2] * sin[t, i]
        x'[i + R/2] = x[i + R/2] * cos[t, i] + x[i] * sin[t, i]
    as transformers' `apply_rotary_pos_emb` with `rotate_half` (on the first R dims
    when rotary dims are partial, GLM-4.5). `interleaved`: the pairs are (x[2i],
    x[2i + 1]) and the result is written in the rotate-half layout,
        x'[i] = x[2i] cos - x[2i+1] sin,  x'[i + R/2] = x[2i+1] cos + x[2i] sin,
    as DeepSeek-V3's `apply_rotary_pos_emb_interleave` (`rope_interleave`).

    Args:
        x: [T, nHeads, D] float32, modified in place.
        cos, sin: [T, R/2] float32 (angles = position * inv_freq, times any
            attention factor); offset + R <= D, D even.
        offset: first rotated dim of each head.
        interleaved: the DeepSeek pair layout (R <= 1024).
    """
    _need_f32(x, "x", 3)
    _need_f32(cos, "cos", 2)
    _need_f32(sin, "sin", 2)
    _need_writable(x, "x")
    cdef Py_ssize_t T = x.shape[0], NH = x.shape[1], D = x.shape[2], half = cos.shape[1]
    if offset < 0 or offset + 2 * half > D or half == 0 or cos.shape[0] != T \
            or _shape(sin) != _shape(cos) or D % 2:
        raise ValueError(f"rope: x {_shape(x)}, cos {_shape(cos)}, sin {_shape(sin)}, offset {offset}")
    if interleaved and 2 * half > MAX_ROPE_DIM:
        raise ValueError(f"rope: {2 * half} interleaved dims exceed {MAX_ROPE_DIM}")
    cdef float *xp = <float *>cnp.PyArray_DATA(x)
    cdef const float *cp = <const float *>cnp.PyArray_DATA(cos)
    cdef const float *sp = <const float *>cnp.PyArray_DATA(sin)
    cdef Py_ssize_t t, h, i
    cdef float a, b, c, sn
    cdef float *row
    cdef float pairs[MAX_ROPE_DIM]
    with nogil:
        for t in range(T):
            for h in range(NH):
                row = xp + (t * NH + h) * D + offset
                if interleaved:
                    for i in range(2 * half):
                        pairs[i] = row[i]
                for i in range(half):
                    if interleaved:
                        a = pairs[2 * i]
                        b = pairs[2 * i + 1]
                    else:
                        a = row[i]
                        b = row[i + half]
                    c = cp[t * half + i]
                    sn = sp[t * half + i]
                    row[i] = a * c - b * sn
                    row[i + half] = b * c + a * sn


# ---------------------------------------------------------------- attention

cdef extern from "_attn_impl.h" nogil:
    int MOED_AQ
    void moed_attend_rows(int nq, const float *const *q, float *const *out,
                          const Py_ssize_t *lo, const Py_ssize_t *hi, const float *sink,
                          const float *k, Py_ssize_t ks, const float *v, Py_ssize_t vs,
                          Py_ssize_t Dk, Py_ssize_t Dv, float scale, float *scores,
                          Py_ssize_t sstride)


ctypedef struct _AttnJob:
    # One item: up to MOED_AQ query rows that read one key/value head (or MLA's shared
    # cache): tb consecutive tokens x hb heads. f = (token block * NKV + kv head) * nhb
    # + head block.
    const float *q
    const float *k
    const float *v
    const float *sinks       # [NH] or NULL
    float *out
    float *scratch           # [n_threads, MOED_AQ * sstride]: row tid is the running thread's
    Py_ssize_t T, NH, NKV, group, hb, nhb, tb, S, Dk, Dv, ks, vs, pos0, window, sstride
    bint latent              # keys/values: one [S, Dk] cache for every head
    float scale


cdef void _attention_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _AttnJob *j = <_AttnJob *>ctx
    cdef Py_ssize_t hblock = f % j.nhb, kvh = (f // j.nhb) % j.NKV, t0 = f // (j.nhb * j.NKV) * j.tb
    cdef Py_ssize_t h0 = kvh * j.group + hblock * j.hb
    cdef Py_ssize_t nh = j.hb if (hblock + 1) * j.hb <= j.group else j.group - hblock * j.hb
    cdef Py_ssize_t nt = j.tb if t0 + j.tb <= j.T else j.T - t0
    cdef const float *qr[8]
    cdef float *outr[8]
    cdef Py_ssize_t lo[8]
    cdef Py_ssize_t hi[8]
    cdef float sk[8]
    cdef int n = 0
    cdef Py_ssize_t t, h, p
    for t in range(t0, t0 + nt):
        p = j.pos0 + t
        for h in range(h0, h0 + nh):
            qr[n] = j.q + (t * j.NH + h) * j.Dk
            outr[n] = j.out + (t * j.NH + h) * j.Dv
            hi[n] = p + 1
            lo[n] = p - j.window + 1 if j.window > 0 and p - j.window + 1 > 0 else 0
            if j.sinks != NULL:
                sk[n] = j.sinks[h]
            n += 1
    cdef Py_ssize_t koff = 0 if j.latent else kvh * j.S * j.Dk
    moed_attend_rows(n, qr, outr, lo, hi, sk if j.sinks != NULL else NULL,
                     j.k + koff, j.ks, j.v + koff, j.vs, j.Dk, j.Dv, j.scale,
                     j.scratch + tid * MOED_AQ * j.sstride, j.sstride)


cdef void _attention_run(_AttnJob *j, int n_threads, Py_ssize_t work) except *:
    """Blocks of rows (MOED_AQ at most: the heads of one key/value head for a few
    tokens) over the pool; the scores scratch is this call's own."""
    j.hb = j.group if j.group < MOED_AQ else MOED_AQ
    j.nhb = (j.group + j.hb - 1) // j.hb
    j.tb = MOED_AQ // j.hb
    j.sstride = j.pos0 + j.T
    cdef Py_ssize_t items = (j.T + j.tb - 1) // j.tb * j.NKV * j.nhb
    cdef int nt = _threads_for(work, n_threads)
    j.scratch = <float *>malloc(nt * MOED_AQ * j.sstride * sizeof(float))
    if j.scratch == NULL:
        raise MemoryError(f"attention: {nt} x {MOED_AQ} x {j.sstride} scores")
    with nogil:
        moed_pool_run(nt, items, _attention_item, j)
    free(j.scratch)


def attention(cnp.ndarray q, cnp.ndarray k_cache, cnp.ndarray v_cache,
              Py_ssize_t pos0, Py_ssize_t window, float scale, cnp.ndarray out,
              int n_threads=1, cnp.ndarray sinks=None):
    """Causal (optionally sliding-window) attention of T queries over the cache.

    Query t sits at absolute position pos0 + t and attends to cached positions
    p with max(0, pos0 + t - window + 1) <= p <= pos0 + t (window <= 0: no
    window) — transformers' sliding mask keeps kv_idx > q_idx - sliding_window.
    Query head h reads key/value head h // (nH / nKV) (grouped-query attention).
    With `sinks`, head h's softmax denominator also holds exp(sinks[h]) (GPT-OSS:
    transformers' eager attention concatenates the sink logit and drops its column).
    Work is split over blocks of up to 8 (token, head) rows of one key/value head,
    which read the keys and values once for the block; each output's arithmetic is
    fixed by its query and key range alone (the rule and the exponential are in
    _attn_impl.h), so it does not depend on T, the thread count or the other rows.

    Args:
        q: [T, nH, D] float32 (after RoPE).
        k_cache, v_cache: [nKV, S, D] float32; positions < pos0 + T filled.
        pos0: position of the first query. window: sliding window, <= 0 for none.
        scale: score multiplier (1/sqrt(D) in every family here).
        out: [T, nH, D] float32, writable.
        sinks: None, or [nH] float32 sink logits.
    Raises ValueError on shape mismatch or if pos0 + T exceeds S; MemoryError when
    the scores scratch (threads x 8 x (pos0 + T) float32) cannot be allocated.
    """
    _need_f32(q, "q", 3)
    _need_f32(k_cache, "k_cache", 3)
    _need_f32(v_cache, "v_cache", 3)
    _need_f32(out, "out", 3)
    _need_writable(out, "out")
    _need_threads(n_threads)
    cdef Py_ssize_t T = q.shape[0], NH = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t NKV = k_cache.shape[0], S = k_cache.shape[1]
    if k_cache.shape[2] != D or _shape(v_cache) != _shape(k_cache):
        raise ValueError(f"attention: q {_shape(q)}, k {_shape(k_cache)}, v {_shape(v_cache)}")
    if NKV == 0 or NH % NKV:
        raise ValueError(f"attention: {NH} query heads not a multiple of {NKV} kv heads")
    if _shape(out) != _shape(q):
        raise ValueError(f"attention: out {_shape(out)} != q {_shape(q)}")
    if pos0 < 0 or pos0 + T > S:
        raise ValueError(f"attention: positions {pos0}..{pos0 + T} exceed cache {S}")
    cdef const float *sinkp = NULL
    if sinks is not None:
        _need_f32(sinks, "sinks", 1)
        if sinks.shape[0] != NH:
            raise ValueError(f"sinks: shape {_shape(sinks)}, expected ({NH},)")
        sinkp = <const float *>cnp.PyArray_DATA(sinks)
    if T == 0:
        return
    cdef _AttnJob j
    j.q = <const float *>cnp.PyArray_DATA(q)
    j.k = <const float *>cnp.PyArray_DATA(k_cache)
    j.v = <const float *>cnp.PyArray_DATA(v_cache)
    j.sinks = sinkp
    j.out = <float *>cnp.PyArray_DATA(out)
    j.T, j.NH, j.NKV, j.group, j.S, j.Dk, j.Dv = T, NH, NKV, NH // NKV, S, D, D
    j.ks, j.vs, j.pos0, j.window, j.latent = D, D, pos0, window, False
    j.scale = scale
    _attention_run(&j, n_threads, T * NH * (pos0 + T) * D * 2)


def latent_attention(cnp.ndarray q, cnp.ndarray cache, Py_ssize_t pos0, float scale,
                     cnp.ndarray out, int n_threads=1):
    """Causal attention of T queries over a compressed (MLA) cache, without expanding it.

    Every head shares one key per position, cache[p] = [latent c_p (Dv dims) | rotary
    key (Dk - Dv dims)], and one value, c_p itself. With the query already folded
    through kv_b_proj's key rows (q = [W_UK^T q_nope | q_rope], DeepSeek-V2 §2.1.2),
    the score q . cache[p] equals transformers' q_nope . k_nope + q_rope . k_rope, and
    out[t, h] = sum_p softmax_p * c_p is the latent the caller unfolds through the
    value rows. Query t sits at position pos0 + t and sees p <= pos0 + t. Work is
    split over blocks of up to 8 (token, head) rows, which read the cache once for the
    block; each output's arithmetic is `attention`'s (fixed by its query and position).

    Args:
        q: [T, nH, Dk] float32.
        cache: [S, Dk] float32; positions < pos0 + T filled.
        scale: score multiplier (1/sqrt(qk_head_dim), times YaRN's mscale^2).
        out: [T, nH, Dv] float32, writable (Dv < Dk: the latent dims).
    Raises ValueError on shape mismatch or if pos0 + T exceeds S; MemoryError when
    the scores scratch cannot be allocated.
    """
    _need_f32(q, "q", 3)
    _need_f32(cache, "cache", 2)
    _need_f32(out, "out", 3)
    _need_writable(out, "out")
    _need_threads(n_threads)
    cdef Py_ssize_t T = q.shape[0], NH = q.shape[1], Dk = q.shape[2]
    cdef Py_ssize_t S = cache.shape[0], Dv = out.shape[2]
    if cache.shape[1] != Dk or out.shape[0] != T or out.shape[1] != NH or not 0 < Dv <= Dk:
        raise ValueError(f"latent_attention: q {_shape(q)}, cache {_shape(cache)}, out {_shape(out)}")
    if pos0 < 0 or pos0 + T > S:
        raise ValueError(f"latent_attention: positions {pos0}..{pos0 + T} exceed cache {S}")
    if T == 0:
        return
    cdef _AttnJob j
    j.q = <const float *>cnp.PyArray_DATA(q)
    j.k = j.v = <const float *>cnp.PyArray_DATA(cache)
    j.sinks = NULL
    j.out = <float *>cnp.PyArray_DATA(out)
    j.T, j.NH, j.NKV, j.group, j.S, j.Dk, j.Dv = T, NH, 1, NH, S, Dk, Dv
    j.ks, j.vs, j.pos0, j.window, j.latent = Dk, Dk, pos0, 0, True
    j.scale = scale
    _attention_run(&j, n_threads, T * NH * (pos0 + T) * (Dk + Dv))


# ------------------------------------------------------------------ routing

cdef inline void _need_routing_out(cnp.ndarray router_logits, int top_k, cnp.ndarray ids,
                                   cnp.ndarray weights) except *:
    _need_f32(router_logits, "router_logits", 2)
    _need_f32(weights, "weights", 2)
    if ids.dtype != np.int32 or ids.ndim != 2:
        raise ValueError("ids: expected a 2-D int32 array")
    _need_c(ids, "ids")
    cdef Py_ssize_t T = router_logits.shape[0], E = router_logits.shape[1]
    if top_k < 1 or top_k > E:
        raise ValueError(f"top_k {top_k} not in [1, {E}]")
    _need_writable(ids, "ids")
    _need_writable(weights, "weights")
    if not np.isfinite(router_logits).all():
        raise ValueError("router_logits contain NaN or inf")
    if ids.shape[0] != T or ids.shape[1] != top_k or weights.shape[0] != T \
            or weights.shape[1] != top_k:
        raise ValueError(f"route: ids {_shape(ids)}, weights {_shape(weights)}, expected ({T}, {top_k})")


def route(cnp.ndarray router_logits, int top_k, bint renormalize,
          cnp.ndarray ids, cnp.ndarray weights):
    """Softmax top-k routing, per token.

    probs = softmax(router_logits) in f32 over all E experts; the top_k largest
    are selected in descending order, a tie going to the lower expert id; when
    `renormalize` (HF `norm_topk_prob`, always on for Mixtral) the selected
    probabilities are divided by their sum. Source: transformers'
    `*TopKRouter.forward` of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

    Args:
        router_logits: [T, E] float32.
        ids: [T, K] int32 output, experts in rank order.
        weights: [T, K] float32 output.
    """
    _need_routing_out(router_logits, top_k, ids, weights)
    cdef Py_ssize_t T = router_logits.shape[0], E = router_logits.shape[1]
    cdef float[:, ::1] probs = np.empty((T, E), dtype=np.float32)
    cdef const float[:, ::1] lg = router_logits
    cdef int32_t[:, ::1] idv = ids
    cdef float[:, ::1] wv = weights
    cdef Py_ssize_t t, e, r, best
    cdef float m, total, bv
    with nogil:
        for t in range(T):
            m = -INFINITY
            for e in range(E):
                if lg[t, e] > m:
                    m = lg[t, e]
            total = 0.0
            for e in range(E):
                probs[t, e] = expf(lg[t, e] - m)
                total = total + probs[t, e]
            for e in range(E):
                probs[t, e] = probs[t, e] / total
            for r in range(top_k):
                best = -1
                bv = -INFINITY
                for e in range(E):
                    if probs[t, e] > bv or (best < 0 and probs[t, e] >= bv):
                        bv = probs[t, e]
                        best = e
                idv[t, r] = <int32_t>best
                wv[t, r] = bv
                probs[t, best] = -INFINITY
            if renormalize:
                total = 0.0
                for r in range(top_k):
                    total = total + wv[t, r]
                for r in range(top_k):
                    wv[t, r] = wv[t, r] / total


cdef inline float _sigmoid(float x) noexcept nogil:
    return <float>1.0 / (<float>1.0 + expf(-x))


cdef inline Py_ssize_t _argmax(const float *v, Py_ssize_t n) noexcept nogil:
    """Index of the largest of v[0..n-1] (-inf allowed), the lowest index on a tie."""
    cdef Py_ssize_t e, best = -1
    cdef float bv = -INFINITY
    for e in range(n):
        if v[e] > bv or (best < 0 and v[e] >= bv):
            bv = v[e]
            best = e
    return best


def route_grouped(cnp.ndarray router_logits, cnp.ndarray correction_bias, int n_group,
                  int topk_group, int top_k, bint renormalize, float scaling,
                  cnp.ndarray ids, cnp.ndarray weights):
    """Sigmoid routing with a selection-only correction bias and group-limited choice.

    Per token: s = sigmoid(router_logits) in f32; the choice score c = s +
    correction_bias decides *which* experts, never their weights. The experts form
    n_group equal groups of consecutive ids; each group is ranked by the sum of its
    two best choice scores, the topk_group best groups are kept (all of them when
    topk_group == n_group), and the top_k largest c among their experts are chosen
    in descending order. Their weights are the unbiased s, divided by (their sum +
    1e-20) when `renormalize` (HF `norm_topk_prob`), then times `scaling`
    (`routed_scaling_factor`). Ties (of groups or experts) go to the lower id.
    Source: transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter (`noaux_tc`).

    Args:
        router_logits: [T, E] float32.
        correction_bias: [E] float32 (`e_score_correction_bias`).
        n_group, topk_group: `n_group` divides E; 1 <= topk_group <= n_group; groups
            of at least 2 experts when some are dropped.
        ids: [T, K] int32 output, experts in rank order. weights: [T, K] float32 output.
    Raises ValueError on shapes, NaN/inf logits, or a grouping that cannot hold top_k.
    """
    _need_routing_out(router_logits, top_k, ids, weights)
    _need_f32(correction_bias, "correction_bias", 1)
    cdef Py_ssize_t T = router_logits.shape[0], E = router_logits.shape[1]
    if correction_bias.shape[0] != E:
        raise ValueError(f"correction_bias: shape {_shape(correction_bias)}, expected ({E},)")
    if not np.isfinite(correction_bias).all():
        raise ValueError("correction_bias contains NaN or inf")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"route_grouped: {E} experts, n_group {n_group}, topk_group {topk_group}")
    cdef Py_ssize_t G = E // n_group
    if topk_group < n_group and G < 2:
        raise ValueError(f"route_grouped: groups of {G} expert(s) cannot be ranked by their top 2")
    if top_k > topk_group * G:
        raise ValueError(f"route_grouped: top_k {top_k} exceeds the {topk_group * G} experts "
                         f"of {topk_group} groups")
    cdef float[:, ::1] choice = np.empty((T, E), dtype=np.float32)
    cdef float[::1] gscore = np.empty(n_group, dtype=np.float32)
    cdef unsigned char[::1] keep = np.empty(n_group, dtype=np.uint8)
    cdef const float[:, ::1] lg = router_logits
    cdef const float[::1] bias = correction_bias
    cdef int32_t[:, ::1] idv = ids
    cdef float[:, ::1] wv = weights
    cdef Py_ssize_t t, e, r, g, best, first
    cdef float a1, a2, v, total
    with nogil:
        for t in range(T):
            for e in range(E):
                choice[t, e] = _sigmoid(lg[t, e]) + bias[e]
            if topk_group < n_group:
                for g in range(n_group):                 # top-2 sum per group
                    a1 = -INFINITY
                    a2 = -INFINITY
                    for e in range(g * G, (g + 1) * G):
                        v = choice[t, e]
                        if v > a1:
                            a2 = a1
                            a1 = v
                        elif v > a2:
                            a2 = v
                    gscore[g] = a1 + a2
                for g in range(n_group):
                    keep[g] = 0
                for r in range(topk_group):              # keep the best groups
                    best = _argmax(&gscore[0], n_group)
                    keep[best] = 1
                    gscore[best] = -INFINITY
                for g in range(n_group):                 # drop the others
                    if not keep[g]:
                        for e in range(g * G, (g + 1) * G):
                            choice[t, e] = -INFINITY
            for r in range(top_k):
                best = _argmax(&choice[t, 0], E)
                idv[t, r] = <int32_t>best
                wv[t, r] = _sigmoid(lg[t, best])
                choice[t, best] = -INFINITY
            if renormalize:
                total = 0.0
                for r in range(top_k):
                    total = total + wv[t, r]
                total = total + 1e-20
                for r in range(top_k):
                    wv[t, r] = wv[t, r] / total
            for r in range(top_k):
                wv[t, r] = wv[t, r] * scaling


def route_topk_softmax(cnp.ndarray router_logits, int top_k, cnp.ndarray ids,
                       cnp.ndarray weights):
    """Top-k first, then softmax over the chosen logits only (GPT-OSS).

    Per token: the top_k largest router_logits in descending order (ties to the lower
    id); weights = softmax of those top_k values in f32, so they always sum to 1.
    Source: transformers' GptOssTopKRouter.forward (topk, then softmax over dim 1).

    Args:
        router_logits: [T, E] float32 (the router's bias already added).
        ids: [T, K] int32 output in rank order. weights: [T, K] float32 output.
    """
    _need_routing_out(router_logits, top_k, ids, weights)
    cdef Py_ssize_t T = router_logits.shape[0], E = router_logits.shape[1]
    cdef float[:, ::1] work = np.array(router_logits, dtype=np.float32, order="C")
    cdef const float[:, ::1] lg = router_logits
    cdef int32_t[:, ::1] idv = ids
    cdef float[:, ::1] wv = weights
    cdef Py_ssize_t t, r, best
    cdef float m, total
    with nogil:
        for t in range(T):
            for r in range(top_k):
                best = _argmax(&work[t, 0], E)
                idv[t, r] = <int32_t>best
                wv[t, r] = lg[t, best]
                work[t, best] = -INFINITY
            m = wv[t, 0]
            total = 0.0
            for r in range(top_k):
                wv[t, r] = expf(wv[t, r] - m)
                total = total + wv[t, r]
            for r in range(top_k):
                wv[t, r] = wv[t, r] / total


# ------------------------------------------------------------- expert FFN

cdef enum:
    FFN_TOKENS = 8   # tokens of one _gate_up_rows pass
    FFN_OUTS = 64    # FFN_TOKENS x MOED_ROWS (8)


cdef void _gate_up_rows(const moed_weight *wg, const moed_weight *wu, Py_ssize_t g,
                        const float *x, Py_ssize_t n, float *hbuf) noexcept nogil:
    """hbuf[j, i] = silu(gate_i . x_j) * (up_i . x_j) for the rows i of group g
    and the n tokens x_j."""
    cdef Py_ssize_t H = wg.cols, I = wg.rows
    cdef Py_ssize_t i0 = g * MOED_ROWS, j0 = 0, j, q, nt
    cdef int nr = <int>(I - i0) if I - i0 < MOED_ROWS else MOED_ROWS
    cdef float go[FFN_OUTS]
    cdef float uo[FFN_OUTS]
    while j0 < n:
        nt = n - j0 if n - j0 < FFN_TOKENS else FFN_TOKENS
        moed_w_matmul_rows(wg, i0, nr, x + j0 * H, nt, go, nr, 1)
        moed_w_matmul_rows(wu, i0, nr, x + j0 * H, nt, uo, nr, 1)
        for j in range(nt):
            for q in range(nr):
                hbuf[(j0 + j) * I + i0 + q] = moed_silu(go[j * nr + q]) * uo[j * nr + q]
        j0 += nt


cdef void _gate_up_rows_fast(const moed_weight *wg, const moed_weight *wu, Py_ssize_t g,
                             const moed_qact *a, Py_ssize_t t0, Py_ssize_t n,
                             float *hbuf) noexcept nogil:
    """_gate_up_rows in fast mode: the tokens are rows t0 .. t0+n-1 of a."""
    cdef Py_ssize_t I = wg.rows
    cdef Py_ssize_t i0 = g * MOED_ROWS, j0 = 0, j, q, nt
    cdef int nr = <int>(I - i0) if I - i0 < MOED_ROWS else MOED_ROWS
    cdef float go[FFN_OUTS]
    cdef float uo[FFN_OUTS]
    while j0 < n:
        nt = n - j0 if n - j0 < FFN_TOKENS else FFN_TOKENS
        moed_imatmul_rows(wg, i0, nr, a, t0 + j0, nt, go, nr, 1)
        moed_imatmul_rows(wu, i0, nr, a, t0 + j0, nt, uo, nr, 1)
        for j in range(nt):
            for q in range(nr):
                hbuf[(j0 + j) * I + i0 + q] = moed_silu(go[j * nr + q]) * uo[j * nr + q]
        j0 += nt


cdef void _down_rows_fast(const moed_weight *w, Py_ssize_t g, const moed_qact *a, Py_ssize_t t0,
                          Py_ssize_t n, float *out) noexcept nogil:
    """out[j, r] = the fast w_r . h_(t0 + j) for the rows r of group g (no bias)."""
    cdef Py_ssize_t r0 = g * MOED_ROWS
    cdef int nr = <int>(w.rows - r0) if w.rows - r0 < MOED_ROWS else MOED_ROWS
    moed_imatmul_rows(w, r0, nr, a, t0, n, out + r0, w.rows, 1)


ctypedef struct _FfnJob:
    # expert_ffn / expert_ffn_fused. Item f of the first projection is row (or column)
    # group f % G1 of expert f // G1; of the second, group f % G2 of expert f // G2.
    const moed_weight *wg    # gates (expert_ffn) or gate_ups (fused), K of them
    const moed_weight *wu    # ups (expert_ffn) or NULL
    const moed_weight *wdn   # downs
    const int64_t *gs        # group_start [K + 1]
    const float *x           # [N, H]
    const moed_qact *ax      # fast mode: x quantised
    const moed_qact *ah      # fast mode: hbuf quantised
    const float *b1          # fused: gate_up_bias [K, 2I]
    const float *b2          # fused: down_bias [K, H]
    float *h                 # hbuf [N, I]
    float *out               # [N, H]
    Py_ssize_t hidden, inter, G1, G2   # H, I (`I` is a macro of complex.h)
    float alpha, limit
    bint transposed


cdef void _ffn_gate_up_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G1, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0:
        _gate_up_rows(j.wg + k, j.wu + k, f % j.G1, j.x + row0 * j.hidden, n, j.h + row0 * j.inter)


cdef void _ffn_gate_up_fast_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G1, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0:
        _gate_up_rows_fast(j.wg + k, j.wu + k, f % j.G1, j.ax, row0, n, j.h + row0 * j.inter)


cdef void _ffn_down_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G2, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0:
        _matmul_rows(j.wdn + k, j.h + row0 * j.inter, n, j.out + row0 * j.hidden, f % j.G2, 1)


cdef void _ffn_down_fast_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G2, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0:
        _down_rows_fast(j.wdn + k, f % j.G2, j.ah, row0, n, j.out + row0 * j.hidden)


cdef void _fused_gate_up_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G1, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0 and j.transposed:
        _fused_gate_up_cols(j.wg + k, j.b1 + k * 2 * j.inter, f % j.G1, j.x + row0 * j.hidden, n,
                            j.h + row0 * j.inter, j.alpha, j.limit)
    elif n > 0:
        _fused_gate_up_rows(j.wg + k, j.b1 + k * 2 * j.inter, f % j.G1, j.x + row0 * j.hidden, n,
                            j.h + row0 * j.inter, j.alpha, j.limit)


cdef void _fused_gate_up_fast_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G1, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0:
        _fused_gate_up_rows_fast(j.wg + k, j.b1 + k * 2 * j.inter, f % j.G1, j.ax, row0, n,
                                 j.h + row0 * j.inter, j.alpha, j.limit)


cdef void _fused_down_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G2, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0 and j.transposed:
        _down_cols(j.wdn + k, j.b2 + k * j.hidden, f % j.G2, j.h + row0 * j.inter, n, j.out + row0 * j.hidden)
    elif n > 0:
        _down_rows(j.wdn + k, j.b2 + k * j.hidden, f % j.G2, j.h + row0 * j.inter, n, j.out + row0 * j.hidden)


cdef void _fused_down_fast_item(void *ctx, Py_ssize_t f, int tid) noexcept nogil:
    cdef _FfnJob *j = <_FfnJob *>ctx
    cdef Py_ssize_t k = f // j.G2, row0 = j.gs[k], n = j.gs[k + 1] - row0
    if n > 0:
        _down_rows_fast_bias(j.wdn + k, j.b2 + k * j.hidden, f % j.G2, j.ah, row0, n, j.out + row0 * j.hidden)


cdef int _need_expert_rows(str name, Py_ssize_t K, cnp.ndarray x, cnp.ndarray group_start,
                           cnp.ndarray hbuf, cnp.ndarray out, int n_threads) except -1:
    """Check an expert FFN's token rows, groups and buffers; 1 when there is nothing to
    compute (no experts and no rows)."""
    _need_f32(x, "x", 2)
    _need_f32(hbuf, "hbuf", 2)
    _need_f32(out, "out", 2)
    _need_writable(out, "out")
    _need_writable(hbuf, "hbuf")
    _need_threads(n_threads)
    if group_start.dtype != np.int64 or group_start.ndim != 1 or group_start.shape[0] != K + 1:
        raise ValueError(f"group_start: expected int64 [{K + 1}]")
    cdef Py_ssize_t N = x.shape[0]
    if K == 0:
        if N:
            raise ValueError(f"{name}: {N} token rows but no experts")
        return 1
    cdef const int64_t[::1] gs = group_start
    if gs[0] != 0 or gs[K] != N:
        raise ValueError(f"group_start must run from 0 to {N}")
    return 0


def expert_ffn(list gates, list ups, list downs, cnp.ndarray x,
               cnp.ndarray group_start, cnp.ndarray hbuf, cnp.ndarray out,
               int n_threads=1, int fast=0):
    """SwiGLU expert FFNs for groups of tokens: y = down(silu(gate x) * up x).

    Expert k (weights gates[k], ups[k], downs[k]) is applied to the token rows
    x[group_start[k]:group_start[k+1]], writing the matching rows of `out`.
    Each (expert, output row) is one unit of parallel work; the weighted sum
    over experts is done afterwards by `combine_experts`, in top-k rank order.

    Args:
        gates, ups: K weights [I, H]; downs: K weights [H, I]; all of one format:
            arrays of one dtype (f32, f16 or bf16; C-contiguous, any alignment,
            may be read-only) or QuantizedWeights of one `fmt` (their scale
            dtypes, block and group sizes may differ).
        x: [N, H] float32 gathered token rows, grouped by expert.
        group_start: [K + 1] int64, 0 = group_start[0] <= ... <= group_start[K] = N.
        hbuf: [N, I] float32 scratch (the activations silu(gate x) * up x).
        out: [N, H] float32, writable.
        fast: the fast numerics level, as `matmul`'s (module docstring): each row of
            x is quantised (or rounded) once for gate and up, each row of hbuf once for
            down; every product is bit-equal to `matmul(..., fast=fast)` of its rows.
    Raises ValueError on any shape, dtype or format mismatch, naming the expert index.
    """
    cdef Py_ssize_t K = len(gates)
    if len(ups) != K or len(downs) != K:
        raise ValueError("expert_ffn: gates, ups and downs differ in length")
    if _need_expert_rows("expert_ffn", K, x, group_start, hbuf, out, n_threads):
        return
    cdef Py_ssize_t N = x.shape[0], H = x.shape[1]
    cdef const int64_t[::1] gs = group_start
    cdef moed_weight *wd = <moed_weight *>malloc(3 * K * sizeof(moed_weight))
    if wd == NULL:
        raise MemoryError()
    cdef moed_weight *wg = wd
    cdef moed_weight *wu = wd + K
    cdef moed_weight *wdn = wd + 2 * K
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef float *hp = <float *>cnp.PyArray_DATA(hbuf)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef Py_ssize_t I
    cdef int k
    cdef _FfnJob j
    cdef moed_qact ax, ah
    cdef void *bx = NULL
    cdef void *bh = NULL
    try:
        for k in range(K):
            _describe(gates[k], f"gates[{k}]", wg + k)
            _describe(ups[k], f"ups[{k}]", wu + k)
            _describe(downs[k], f"downs[{k}]", wdn + k)
        I = wg[0].rows
        if hbuf.shape[0] < N or hbuf.shape[1] != I or out.shape[0] != N or out.shape[1] != H:
            raise ValueError(f"expert_ffn: x {_shape(x)}, hbuf {_shape(hbuf)}, out {_shape(out)}, I={I}")
        for k in range(K):
            if gs[k + 1] < gs[k]:
                raise ValueError("group_start must be non-decreasing")
            _check_expert(wg + k, wg, f"gates[{k}]", I, H)
            _check_expert(wu + k, wg, f"ups[{k}]", I, H)
            _check_expert(wdn + k, wg, f"downs[{k}]", H, I)
        j.wg, j.wu, j.wdn, j.gs, j.x, j.h, j.out = wg, wu, wdn, &gs[0], xp, hp, op
        j.ax = j.ah = NULL
        j.b1 = j.b2 = NULL
        j.hidden, j.inter = H, I
        j.G1 = (I + MOED_ROWS - 1) // MOED_ROWS  # row groups of gate/up
        j.G2 = (H + MOED_ROWS - 1) // MOED_ROWS  # row groups of down
        j.transposed = False
        n_threads = _threads_for(3 * N * H * I, n_threads)
        if _fast_for(fast, wg) and N > 0:
            bx = _qact_alloc(&ax, N, H, moed_fast_paired(wg.fmt))
            bh = _qact_alloc(&ah, N, I, moed_fast_paired(wg.fmt))
            j.ax, j.ah = &ax, &ah
            with nogil:
                _qact_rows(&ax, xp, H, N, n_threads)
                moed_pool_run(n_threads, K * j.G1, _ffn_gate_up_fast_item, &j)
                _qact_rows(&ah, hp, I, N, n_threads)
                moed_pool_run(n_threads, K * j.G2, _ffn_down_fast_item, &j)
            return
        with nogil:
            moed_pool_run(n_threads, K * j.G1, _ffn_gate_up_item, &j)
            moed_pool_run(n_threads, K * j.G2, _ffn_down_item, &j)
    finally:
        free(wd)
        free(bx)
        free(bh)


cdef int _check_expert(const moed_weight *d, const moed_weight *first, str name,
                       Py_ssize_t rows, Py_ssize_t cols) except -1:
    """An expert projection has the format of gates[0] and the shape [rows, cols]."""
    if d.fmt != first.fmt:
        raise ValueError(f"{name}: format {_FORMAT_NAMES[d.fmt]} differs from gates[0] "
                         f"({_FORMAT_NAMES[first.fmt]})")
    if d.rows != rows or d.cols != cols:
        raise ValueError(f"{name}: shape {(d.rows, d.cols)}, expected {(rows, cols)}")
    return 0


cdef enum:
    FUSED_COLUMNS = 256   # output columns per unit of a transposed ([in, out]) projection


cdef void _fused_gate_up_rows(const moed_weight *w, const float *bias, Py_ssize_t g,
                              const float *x, Py_ssize_t n, float *hbuf, float alpha,
                              float limit) noexcept nogil:
    """Rows 4g..4g+3 of an interleaved gate_up [2I, H] (gate i = row 2i, up i = row
    2i + 1) for the n tokens x_j: hbuf[j, i] = clamped_swiglu(gate + b[2i], up + b[2i+1])."""
    cdef Py_ssize_t H = w.cols, I = w.rows // 2
    cdef Py_ssize_t r0 = g * MOED_ROWS, j, q
    cdef int nr = <int>(w.rows - r0) if w.rows - r0 < MOED_ROWS else MOED_ROWS
    cdef float o[8]
    for j in range(n):
        moed_w_dot_rows(w, r0, nr, x + j * H, o, 1)
        for q in range(0, nr, 2):
            hbuf[j * I + (r0 + q) // 2] = moed_clamped_swiglu(
                o[q] + bias[r0 + q], o[q + 1] + bias[r0 + q + 1], alpha, limit)


cdef void _fused_gate_up_rows_fast(const moed_weight *w, const float *bias, Py_ssize_t g,
                                   const moed_qact *a, Py_ssize_t t0, Py_ssize_t n, float *hbuf,
                                   float alpha, float limit) noexcept nogil:
    """_fused_gate_up_rows in fast mode: the tokens are rows t0 .. t0+n-1 of a."""
    cdef Py_ssize_t I = w.rows // 2
    cdef Py_ssize_t r0 = g * MOED_ROWS, j0 = 0, j, q, nt
    cdef int nr = <int>(w.rows - r0) if w.rows - r0 < MOED_ROWS else MOED_ROWS
    cdef float o[FFN_OUTS]
    while j0 < n:
        nt = n - j0 if n - j0 < FFN_TOKENS else FFN_TOKENS
        moed_imatmul_rows(w, r0, nr, a, t0 + j0, nt, o, nr, 1)
        for j in range(nt):
            for q in range(0, nr, 2):
                hbuf[(j0 + j) * I + (r0 + q) // 2] = moed_clamped_swiglu(
                    o[j * nr + q] + bias[r0 + q], o[j * nr + q + 1] + bias[r0 + q + 1], alpha, limit)
        j0 += nt


cdef void _down_rows_fast_bias(const moed_weight *w, const float *bias, Py_ssize_t g,
                               const moed_qact *a, Py_ssize_t t0, Py_ssize_t n,
                               float *out) noexcept nogil:
    """_down_rows in fast mode: the tokens are rows t0 .. t0+n-1 of a."""
    cdef Py_ssize_t H = w.rows
    cdef Py_ssize_t r0 = g * MOED_ROWS, j0 = 0, j, q, nt
    cdef int nr = <int>(H - r0) if H - r0 < MOED_ROWS else MOED_ROWS
    cdef float o[FFN_OUTS]
    while j0 < n:
        nt = n - j0 if n - j0 < FFN_TOKENS else FFN_TOKENS
        moed_imatmul_rows(w, r0, nr, a, t0 + j0, nt, o, nr, 1)
        for j in range(nt):
            for q in range(nr):
                out[(j0 + j) * H + r0 + q] = o[j * nr + q] + bias[r0 + q]
        j0 += nt


cdef void _columns_t(const moed_weight *w, Py_ssize_t c0, Py_ssize_t nc, const float *x,
                     float *acc) noexcept nogil:
    """acc[c] = sum over rows r, in order, of x[r] * w[r, c0 + c] for c < nc, w a plain
    [in, out] weight (one fused multiply-add per row and output)."""
    cdef Py_ssize_t r, c
    cdef size_t item = w.row_bytes // w.cols
    for c in range(nc):
        acc[c] = 0.0
    for r in range(w.rows):
        moed_axpy_w(w.fmt, x[r], w.codes + r * w.row_bytes + c0 * item, acc, nc)


cdef void _fused_gate_up_cols(const moed_weight *w, const float *bias, Py_ssize_t g,
                              const float *x, Py_ssize_t n, float *hbuf, float alpha,
                              float limit) noexcept nogil:
    """Columns of block g of a transposed interleaved gate_up [H, 2I] (gate i = column
    2i, up i = column 2i + 1) for the n tokens x_j, into hbuf[j, i]."""
    cdef Py_ssize_t H = w.rows, I = w.cols // 2
    cdef Py_ssize_t c0 = g * FUSED_COLUMNS, j, c
    cdef Py_ssize_t nc = w.cols - c0 if w.cols - c0 < FUSED_COLUMNS else FUSED_COLUMNS
    cdef float acc[FUSED_COLUMNS]
    for j in range(n):
        _columns_t(w, c0, nc, x + j * H, acc)
        for c in range(0, nc, 2):
            hbuf[j * I + (c0 + c) // 2] = moed_clamped_swiglu(
                acc[c] + bias[c0 + c], acc[c + 1] + bias[c0 + c + 1], alpha, limit)


cdef void _down_rows(const moed_weight *w, const float *bias, Py_ssize_t g, const float *h,
                     Py_ssize_t n, float *out) noexcept nogil:
    """out[j, r] = w_r . h_j + bias[r] for the rows r of group g of a down [H, I]."""
    cdef Py_ssize_t H = w.rows, I = w.cols
    cdef Py_ssize_t r0 = g * MOED_ROWS, j, q
    cdef int nr = <int>(H - r0) if H - r0 < MOED_ROWS else MOED_ROWS
    cdef float o[8]
    for j in range(n):
        moed_w_dot_rows(w, r0, nr, h + j * I, o, 1)
        for q in range(nr):
            out[j * H + r0 + q] = o[q] + bias[r0 + q]


cdef void _down_cols(const moed_weight *w, const float *bias, Py_ssize_t g, const float *h,
                     Py_ssize_t n, float *out) noexcept nogil:
    """Columns of block g of a transposed down [I, H]: out[j, c] = sum_i h_j[i] w[i, c] + bias[c]."""
    cdef Py_ssize_t I = w.rows, H = w.cols
    cdef Py_ssize_t c0 = g * FUSED_COLUMNS, j, c
    cdef Py_ssize_t nc = H - c0 if H - c0 < FUSED_COLUMNS else FUSED_COLUMNS
    cdef float acc[FUSED_COLUMNS]
    for j in range(n):
        _columns_t(w, c0, nc, h + j * I, acc)
        for c in range(nc):
            out[j * H + c0 + c] = acc[c] + bias[c0 + c]


def expert_ffn_fused(list gate_ups, list downs, cnp.ndarray gate_up_bias,
                     cnp.ndarray down_bias, cnp.ndarray x, cnp.ndarray group_start,
                     cnp.ndarray hbuf, cnp.ndarray out, bint transposed, float alpha,
                     float limit, int n_threads=1, int fast=0):
    """GPT-OSS's expert FFNs for groups of tokens: y = down(act(gate_up x + b1)) + b2,
    act the clamped SwiGLU of `moed_clamped_swiglu` on the interleaved gate/up pairs.

    Expert k is applied to x[group_start[k]:group_start[k+1]]. The projections are
    stored as GPT-OSS ships them: `transposed` False — gate_up [2I, H] with gate i in
    row 2i and up i in row 2i + 1, down [H, I], rows = outputs (MXFP4 QuantizedWeights,
    or plain arrays); `transposed` True — plain f32/f16/bf16 arrays [in, out] as
    transformers stores them: gate_up [H, 2I] (gate i in column 2i) and down [I, H].
    A row-major output is reduced as `matmul` reduces a row; a transposed one sums
    its inputs in order, one fused multiply-add each. Each (expert, block of outputs) is one unit
    of parallel work; results do not depend on the thread count or on which tokens
    share a call.

    Args:
        gate_ups, downs: K weights as above, all of one format.
        gate_up_bias: [K, 2I] float32 (`gate_up_proj_bias` rows of the K experts).
        down_bias: [K, H] float32.
        x: [N, H] float32 token rows grouped by expert. group_start: [K + 1] int64.
        hbuf: [N, I] float32 scratch. out: [N, H] float32, writable.
        alpha, limit: `swiglu_alpha`, `swiglu_limit`.
        fast: the fast numerics level, as `matmul`'s, with row-major weights: x's rows
            quantised (or rounded) once for gate_up, hbuf's once for down; each
            projection bit-equal to `matmul(..., fast=fast)` plus its bias.
    Raises ValueError on a shape, dtype or format mismatch, naming the expert index.
    """
    cdef Py_ssize_t K = len(gate_ups)
    if len(downs) != K:
        raise ValueError("expert_ffn_fused: gate_ups and downs differ in length")
    _need_f32(gate_up_bias, "gate_up_bias", 2)
    _need_f32(down_bias, "down_bias", 2)
    if _need_expert_rows("expert_ffn_fused", K, x, group_start, hbuf, out, n_threads):
        return
    cdef Py_ssize_t N = x.shape[0], H = x.shape[1]
    cdef const int64_t[::1] gs = group_start
    cdef moed_weight *wd = <moed_weight *>malloc(2 * K * sizeof(moed_weight))
    if wd == NULL:
        raise MemoryError()
    cdef moed_weight *wg = wd
    cdef moed_weight *wdn = wd + K
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const float *b1 = <const float *>cnp.PyArray_DATA(gate_up_bias)
    cdef const float *b2 = <const float *>cnp.PyArray_DATA(down_bias)
    cdef float *hp = <float *>cnp.PyArray_DATA(hbuf)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef Py_ssize_t I
    cdef int k
    cdef _FfnJob j
    cdef moed_qact ax, ah
    cdef void *bx = NULL
    cdef void *bh = NULL
    try:
        for k in range(K):
            _describe(gate_ups[k], f"gate_ups[{k}]", wg + k)
            _describe(downs[k], f"downs[{k}]", wdn + k)
        I = (wg[0].cols if transposed else wg[0].rows) // 2
        if transposed and wg[0].fmt not in (MOED_F32, MOED_F16, MOED_BF16):
            raise ValueError("expert_ffn_fused: transposed ([in, out]) weights must be plain "
                             "f32/f16/bf16 arrays")
        if hbuf.shape[0] < N or hbuf.shape[1] != I or out.shape[0] != N or out.shape[1] != H:
            raise ValueError(f"expert_ffn_fused: x {_shape(x)}, hbuf {_shape(hbuf)}, out {_shape(out)}, I={I}")
        if _shape(gate_up_bias) != (K, 2 * I) or _shape(down_bias) != (K, H):
            raise ValueError(f"expert_ffn_fused: biases {_shape(gate_up_bias)}, {_shape(down_bias)}, "
                             f"expected {(K, 2 * I)}, {(K, H)}")
        for k in range(K):
            if gs[k + 1] < gs[k]:
                raise ValueError("group_start must be non-decreasing")
            if transposed:
                _check_expert(wg + k, wg, f"gate_ups[{k}]", H, 2 * I)
                _check_expert(wdn + k, wg, f"downs[{k}]", I, H)
            else:
                _check_expert(wg + k, wg, f"gate_ups[{k}]", 2 * I, H)
                _check_expert(wdn + k, wg, f"downs[{k}]", H, I)
        j.wg, j.wu, j.wdn, j.gs, j.x, j.h, j.out = wg, NULL, wdn, &gs[0], xp, hp, op
        j.ax = j.ah = NULL
        j.b1, j.b2 = b1, b2
        j.hidden, j.inter = H, I
        j.alpha, j.limit = alpha, limit
        j.transposed = transposed
        if transposed:
            j.G1 = (2 * I + FUSED_COLUMNS - 1) // FUSED_COLUMNS
            j.G2 = (H + FUSED_COLUMNS - 1) // FUSED_COLUMNS
        else:
            j.G1 = (2 * I + MOED_ROWS - 1) // MOED_ROWS
            j.G2 = (H + MOED_ROWS - 1) // MOED_ROWS
        n_threads = _threads_for(3 * N * H * I, n_threads)
        if not transposed and _fast_for(fast, wg) and N > 0:
            bx = _qact_alloc(&ax, N, H, moed_fast_paired(wg.fmt))
            bh = _qact_alloc(&ah, N, I, moed_fast_paired(wg.fmt))
            j.ax, j.ah = &ax, &ah
            with nogil:
                _qact_rows(&ax, xp, H, N, n_threads)
                moed_pool_run(n_threads, K * j.G1, _fused_gate_up_fast_item, &j)
                _qact_rows(&ah, hp, I, N, n_threads)
                moed_pool_run(n_threads, K * j.G2, _fused_down_fast_item, &j)
            return
        with nogil:
            moed_pool_run(n_threads, K * j.G1, _fused_gate_up_item, &j)
            moed_pool_run(n_threads, K * j.G2, _fused_down_item, &j)
    finally:
        free(wd)
        free(bx)
        free(bh)


def combine_experts(cnp.ndarray y, cnp.ndarray rows, cnp.ndarray weights,
                    cnp.ndarray out):
    """out[t] = sum over rank r of weights[t, r] * y[rows[t, r]], in rank order.

    The sum starts from weights[t, 0] * y[rows[t, 0]] and adds ranks 1..K-1 in
    order, so it does not depend on which experts were computed together.

    Args:
        y: [N, H] float32 expert outputs. rows: [T, K] int64 row of y per token
            and rank (-1 skips the rank). weights: [T, K] float32.
        out: [T, H] float32, writable, overwritten.
    """
    _need_f32(y, "y", 2)
    _need_f32(weights, "weights", 2)
    _need_f32(out, "out", 2)
    _need_writable(out, "out")
    if rows.dtype != np.int64 or rows.ndim != 2:
        raise ValueError("rows: expected a 2-D int64 array")
    cdef Py_ssize_t T = rows.shape[0], K = rows.shape[1], N = y.shape[0], H = y.shape[1]
    if weights.shape[0] != T or weights.shape[1] != K or out.shape[0] != T or out.shape[1] != H:
        raise ValueError(f"combine_experts: rows {_shape(rows)}, weights {_shape(weights)}, out {_shape(out)}")
    cdef const int64_t[:, ::1] rv = rows
    cdef Py_ssize_t t, r, j
    for t in range(T):
        for r in range(K):
            if rv[t, r] >= N or rv[t, r] < -1:
                raise ValueError(f"rows[{t}, {r}] = {rv[t, r]} not in [-1, {N})")
    cdef const float *yp = <const float *>cnp.PyArray_DATA(y)
    cdef const float *wp = <const float *>cnp.PyArray_DATA(weights)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    with nogil:
        for t in range(T):
            for j in range(H):
                op[t * H + j] = 0.0
            for r in range(K):
                if rv[t, r] >= 0:
                    moed_axpy(wp[t * K + r], yp + rv[t, r] * H, op + t * H, H)
