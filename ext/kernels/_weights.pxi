# Included by _kernels.pyx: the weight descriptor every weight-taking kernel reads, and
# QuantizedWeight, the block-quantised weight type (formats in the module docstring).

cdef extern from "_quant_impl.h" nogil:
    int MOED_FP8_E4M3
    int MOED_MXFP4
    int MOED_INT8
    int MOED_INT4
    int MOED_SCALE_F32
    int MOED_SCALE_BF16
    int MOED_SCALE_F16
    int MOED_SCALE_E8M0
    ctypedef struct moed_weight:
        int fmt
        int scale_dtype
        Py_ssize_t rows
        Py_ssize_t cols
        const unsigned char *codes
        size_t row_bytes
        const void *scales
        const uint16_t *mins
        Py_ssize_t scale_rows
        Py_ssize_t scale_cols
        Py_ssize_t scale_ld
    void moed_w_dot_rows(const moed_weight *w, Py_ssize_t r0, int nrows, const float *x,
                         float *out, int simd)
    void moed_w_matmul_rows(const moed_weight *w, Py_ssize_t r0, int nrows, const float *x,
                            Py_ssize_t T, float *out, Py_ssize_t ldo, int simd)
    void moed_w_dequant_rows(const moed_weight *w, Py_ssize_t r0, int nrows, float *out,
                             Py_ssize_t ldo)
    void moed_w_dequant(const moed_weight *w, Py_ssize_t r, Py_ssize_t j0, Py_ssize_t n,
                        float *out)
    const char *moed_simd_path()
    const char *moed_simd_features()
    void moed_quant_init()

moed_quant_init()

_U8 = np.dtype(np.uint8)
_I8 = np.dtype(np.int8)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

FORMATS = ("fp8_e4m3", "mxfp4", "int8", "int4")
_FORMAT_NAMES = {MOED_F32: "float32", MOED_F16: "float16", MOED_BF16: "bfloat16",
                 MOED_FP8_E4M3: "fp8_e4m3", MOED_MXFP4: "mxfp4", MOED_INT8: "int8",
                 MOED_INT4: "int4"}
_FP8_SCALES = {_F32: MOED_SCALE_F32, _BF16: MOED_SCALE_BF16, _U8: MOED_SCALE_E8M0,
               _E8M0: MOED_SCALE_E8M0}
_E8M0_SCALES = {_U8: MOED_SCALE_E8M0, _E8M0: MOED_SCALE_E8M0}
_F16_SCALES = {_F16: MOED_SCALE_F16}


cdef cnp.ndarray _part(object a, str name, tuple dtypes, int ndim):
    """`a` as an ndarray after checking its type, dtype, rank and C-contiguity."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if arr.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {arr.dtype}, expected "
                         + " or ".join(str(d) for d in dtypes))
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {_shape(arr)}")
    _need_c(arr, name)
    return arr


cdef Py_ssize_t _group(str fmt, Py_ssize_t C, Py_ssize_t G, object group_size) except -1:
    """The group size g = C / G of an int4/int8 weight (checked against `group_size`)."""
    if G < 1 or C % G:
        raise ValueError(f"{fmt} scales: {G} groups per row do not divide {C} columns")
    cdef Py_ssize_t g = C // G
    if g % 32:
        raise ValueError(f"{fmt}: group size {g} is not a multiple of 32")
    if group_size is not None and group_size != g:
        raise ValueError(f"{fmt}: group_size {group_size} but the scales imply {g} "
                         f"({G} groups of {C} columns)")
    return g


cdef class QuantizedWeight:
    """A block-quantised weight matrix [R, C] = [out_features, in_features] that the
    kernels decode on the fly (formats: `FORMATS`, defined in the module docstring).

    QuantizedWeight(fmt, codes, scales, mins=None, *, block_size=None, group_size=None)

    Args:
        fmt: "fp8_e4m3", "mxfp4", "int8" or "int4".
        codes: fp8_e4m3: uint8 or float8_e4m3fn [R, C]; mxfp4: uint8 [R, C/32, 16];
            int8: int8 [R, C]; int4: uint8 [R, C/2].
        scales: fp8_e4m3: float32, bfloat16 or uint8/float8_e8m0fnu (UE8M0)
            [ceil(R/br), ceil(C/bc)]; mxfp4: uint8/float8_e8m0fnu (E8M0) [R, C/32];
            int8, int4: float16 [R, C/g].
        mins: int4 only: float16 [R, C/g], or None (symmetric: (code - 8) * scale).
        block_size: fp8_e4m3 only: (br, bc), the config's `weight_block_size`;
            default (128, 128). Not inferred from the scale grid (ambiguous when
            a dimension is not a multiple of the block).
        group_size: int4/int8 only: g, a multiple of 32; inferred from the shapes
            when None, checked against them otherwise.

    Every array must be C-contiguous; any alignment, read-only allowed (memory
    maps, cache slots). The object keeps references to the arrays, copies
    nothing and reads them on every call: build it once per buffer and reuse it
    while the buffer's contents change.

    Values are not checked (that is the loader's job, once per tensor): scales
    that are NaN, inf or negative, or E8M0 255 (NaN), flow into the result as
    the format defines them.

    Raises:
        ValueError: an unknown format, a missing or extra array, or an array of
            the wrong type, dtype, rank, shape or layout; the message names it.
    """

    cdef moed_weight desc
    cdef readonly str fmt
    cdef readonly object codes
    cdef readonly object scales
    cdef readonly object mins
    cdef readonly tuple shape
    cdef readonly object block_size
    cdef readonly object group_size

    def __init__(self, str fmt, codes, scales, mins=None, *, block_size=None,
                 group_size=None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown quantised format {fmt!r} (expected one of "
                             + ", ".join(FORMATS) + ")")
        if mins is not None and fmt != "int4":
            raise ValueError(f"{fmt}: mins are only defined for int4")
        if block_size is not None and fmt != "fp8_e4m3":
            raise ValueError(f"{fmt}: block_size is only defined for fp8_e4m3")
        if group_size is not None and fmt not in ("int4", "int8"):
            raise ValueError(f"{fmt}: group_size is only defined for int4 and int8")
        cdef moed_weight d
        cdef cnp.ndarray c, s, m = None
        cdef Py_ssize_t R, C, G, br, bc
        d.mins = NULL
        d.scale_rows = 1
        if fmt == "fp8_e4m3":
            c = _part(codes, "fp8_e4m3 codes", (_U8, _E4M3), 2)
            R, C = c.shape[0], c.shape[1]
            br, bc = (128, 128) if block_size is None else _block(block_size)
            s = _part(scales, "fp8_e4m3 scales", tuple(_FP8_SCALES), 2)
            grid = ((R + br - 1) // br, (C + bc - 1) // bc)
            if _shape(s) != grid:
                raise ValueError(f"fp8_e4m3 scales: shape {_shape(s)}, expected {grid} "
                                 f"for a [{R}, {C}] weight in blocks of ({br}, {bc})")
            d.fmt, d.scale_dtype = MOED_FP8_E4M3, _FP8_SCALES[s.dtype]
            d.row_bytes, d.scale_rows, d.scale_cols, d.scale_ld = C, br, bc, grid[1]
            self.block_size = (br, bc)
        elif fmt == "mxfp4":
            c = _part(codes, "mxfp4 codes", (_U8,), 3)
            if c.shape[2] != 16:
                raise ValueError(f"mxfp4 codes: shape {_shape(c)}, expected [R, C/32, 16]")
            R, G = c.shape[0], c.shape[1]
            C = 32 * G
            s = _part(scales, "mxfp4 scales", tuple(_E8M0_SCALES), 2)
            if _shape(s) != (R, G):
                raise ValueError(f"mxfp4 scales: shape {_shape(s)}, expected {(R, G)} "
                                 f"(one per 32 values of codes {_shape(c)})")
            d.fmt, d.scale_dtype = MOED_MXFP4, MOED_SCALE_E8M0
            d.row_bytes, d.scale_cols, d.scale_ld = C // 2, 32, G
        else:
            if fmt == "int8":
                c = _part(codes, "int8 codes", (_I8,), 2)
                R, C = c.shape[0], c.shape[1]
            else:
                c = _part(codes, "int4 codes", (_U8,), 2)
                R, C = c.shape[0], 2 * c.shape[1]
            s = _part(scales, f"{fmt} scales", tuple(_F16_SCALES), 2)
            if s.shape[0] != R:
                raise ValueError(f"{fmt} scales: shape {_shape(s)}, expected {R} rows "
                                 f"like codes {_shape(c)}")
            G = s.shape[1]
            self.group_size = _group(fmt, C, G, group_size)
            if mins is not None:
                m = _part(mins, "int4 mins", tuple(_F16_SCALES), 2)
                if _shape(m) != _shape(s):
                    raise ValueError(f"int4 mins: shape {_shape(m)}, expected {_shape(s)} "
                                     "like the scales")
                d.mins = <const uint16_t *>cnp.PyArray_DATA(m)
            d.fmt = MOED_INT8 if fmt == "int8" else MOED_INT4
            d.scale_dtype = MOED_SCALE_F16
            d.row_bytes = C if fmt == "int8" else C // 2
            d.scale_cols, d.scale_ld = self.group_size, G
        if R < 1 or C < 1:
            raise ValueError(f"{fmt}: empty weight [{R}, {C}]")
        d.rows, d.cols = R, C
        d.codes = <const unsigned char *>cnp.PyArray_DATA(c)
        d.scales = cnp.PyArray_DATA(s)
        self.desc = d
        self.fmt, self.codes, self.scales, self.mins = fmt, c, s, m
        self.shape = (R, C)

    @property
    def ndim(self):
        """2, like the [R, C] array it stands for."""
        return 2

    @property
    def nbytes(self):
        """Bytes of codes, scales and mins together."""
        return self.codes.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    @property
    def bits_per_weight(self):
        """8 * nbytes / (R * C)."""
        return 8.0 * self.nbytes / (self.shape[0] * self.shape[1])

    def __repr__(self):
        extra = (f", block_size={self.block_size}" if self.block_size is not None else
                 f", group_size={self.group_size}" if self.group_size is not None else "")
        if self.fmt == "fp8_e4m3":
            extra += f", scales={self.scales.dtype}"
        if self.fmt == "int4":
            extra += ", mins" if self.mins is not None else ", symmetric"
        return f"QuantizedWeight({self.fmt!r}, shape={self.shape}{extra})"


cdef tuple _block(object block_size):
    try:
        br, bc = (int(v) for v in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"fp8_e4m3: block_size {block_size!r} is not a pair of integers") from None
    if br < 1 or bc < 1:
        raise ValueError(f"fp8_e4m3: block_size {block_size!r} must be positive")
    return br, bc


cdef int _describe(object w, str name, moed_weight *d) except -1:
    """Fill `d` for a dense weight array (f32/f16/bf16 [R, C]) or a QuantizedWeight."""
    if isinstance(w, QuantizedWeight):
        d[0] = (<QuantizedWeight>w).desc
        if d.codes == NULL:
            raise ValueError(f"{name}: QuantizedWeight was not initialised")
        return 0
    if not isinstance(w, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array or QuantizedWeight, "
                         f"got {type(w).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>w
    cdef int code = _wcode(a, name)
    _need_c(a, name)
    if a.ndim != 2:
        raise ValueError(f"{name}: expected 2 dimensions, got shape {_shape(a)}")
    d.fmt = code
    d.scale_dtype = 0
    d.rows, d.cols = a.shape[0], a.shape[1]
    d.codes = <const unsigned char *>cnp.PyArray_DATA(a)
    d.row_bytes = d.cols * moed_dtype_size(code)
    d.scales = NULL
    d.mins = NULL
    d.scale_rows = d.scale_cols = d.scale_ld = 1
    return 0


def build_info():
    """How the kernels were built: {"simd": "avx512" | "avx2" | "portable", "fast":
    "avx512-vnni" | "avx2-vnni" | "avx2" | "portable", "openmp": bool, "features":
    [...]}. "fast" names the integer-dot path of the fast numerics, "fast_bf16" that of
    bf16 weights ("avx512-bf16" | "emulated"). "simd" names the path the kernels run (chosen at compile
    time: the build targets the machine it is installed on unless MOED_PORTABLE=1);
    "features" lists the instruction-set extensions compiled in (with "avx512vbmi",
    fp8 is decoded by byte tables, else through binary16); "parallel_threshold" the
    multiply-adds below which a call runs on one thread (`parallel_threshold()`)."""
    return {"simd": moed_simd_path().decode(), "fast": moed_fast_path().decode(),
            "fast_bf16": moed_bf16_fast_path().decode(),
            "openmp": bool(moed_openmp_flag()),
            "features": moed_simd_features().decode().split(), "parallel_threshold": _min_parallel_work}
