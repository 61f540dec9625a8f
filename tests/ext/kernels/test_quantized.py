"""Block-quantised weights (QuantizedWeight) in the kernels, against the independent numpy
implementation of each format in tests/quant_reference.py.

What is checked: `dequantize` bit for bit against the reference for every format and
scale dtype (odd shapes, partial fp8 blocks, special codes); `matmul` and `expert_ffn`
against float64 on the reference values; the determinism promises bit for bit (the
SIMD path equals the portable reference path, mat-mat rows equal mat-vec, 1 and 2
threads, read-only and misaligned buffers); the reduction-order contract (a quantised
row is reduced like the dense row of its values); and every constructor error.
"""
import ml_dtypes
import numpy as np
import pytest

import quant_reference as ref
from ext.kernels import _kernels as kern

RTOL = 1e-5  # relative to sum(|w| |x|), as in test_kernels.py
PARALLEL_WORK = 4 * 65536  # above MIN_PARALLEL_WORK: two threads really run


def _rng(*key):
    return np.random.default_rng([20250612, *key])


# A variant is (fmt, options); `_make` builds (QuantizedWeight, reference f32 values).
VARIANTS = {
    "fp8-f32": ("fp8_e4m3", {"scale_dtype": "float32"}),
    "fp8-bf16": ("fp8_e4m3", {"scale_dtype": "bfloat16"}),
    "fp8-ue8m0": ("fp8_e4m3", {"scale_dtype": "ue8m0"}),
    "fp8-block64x96": ("fp8_e4m3", {"scale_dtype": "float32", "block_size": (64, 96)}),
    "fp8-block3x40": ("fp8_e4m3", {"scale_dtype": "bfloat16", "block_size": (3, 40)}),
    "fp8-block1x32": ("fp8_e4m3", {"scale_dtype": "ue8m0", "block_size": (1, 32)}),
    "mxfp4": ("mxfp4", {}),
    "int8-g32": ("int8", {"g": 32}),
    "int8-g64": ("int8", {"g": 64}),
    "int8-g128": ("int8", {"g": 128}),
    "int8-g96": ("int8", {"g": 96}),  # groups that straddle the 512-column tiles
    "int4-g32": ("int4", {"g": 32, "mins": False}),
    "int4-g64": ("int4", {"g": 64, "mins": False}),
    "int4-g128": ("int4", {"g": 128, "mins": False}),
    "int4-g32-mins": ("int4", {"g": 32, "mins": True}),
    "int4-g64-mins": ("int4", {"g": 64, "mins": True}),
    "int4-g128-mins": ("int4", {"g": 128, "mins": True}),
    "int4-g96-mins": ("int4", {"g": 96, "mins": True}),
}
variants = pytest.mark.parametrize("variant", list(VARIANTS))


def _columns(variant, C):
    """C rounded up to what the variant's layout needs (groups of g or 32 columns)."""
    fmt, opt = VARIANTS[variant]
    unit = opt.get("g", 32) if fmt in ("int8", "int4", "mxfp4") else 1
    return -(-C // unit) * unit


def _make(variant, R, C, rng):
    """(QuantizedWeight [R, C], its float32 values by the reference)."""
    fmt, opt = VARIANTS[variant]
    if fmt == "fp8_e4m3":
        block = opt.get("block_size", (128, 128))
        codes, scales = ref.random_fp8(rng, R, C, block, opt["scale_dtype"])
        w = kern.QuantizedWeight(fmt, codes, scales, block_size=block)
        return w, ref.dequantize_fp8(codes, scales, block)
    if fmt == "mxfp4":
        blocks, scales = ref.random_mxfp4(rng, R, C)
        return kern.QuantizedWeight(fmt, blocks, scales), ref.dequantize_mxfp4(blocks, scales)
    if fmt == "int8":
        codes, scales = ref.random_int8(rng, R, C, opt["g"])
        return kern.QuantizedWeight(fmt, codes, scales), ref.dequantize_int8(codes, scales)
    codes, scales, mins = ref.random_int4(rng, R, C, opt["g"], opt["mins"])
    w = kern.QuantizedWeight(fmt, codes, scales, mins, group_size=opt["g"])
    return w, ref.dequantize_int4(codes, scales, mins)


def _case(variant, R, C, T, *key):
    """(QuantizedWeight [R, C'], its reference values, x [T, C'] float32) with C' the
    variant's column count for C, seeded by `key`."""
    rng = _rng(*key)
    w, values = _make(variant, R, _columns(variant, C), rng)
    return w, values, rng.standard_normal((T, w.shape[1]), dtype=np.float32)


def _matmul(w, x, n_threads=1, fn=kern.matmul):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    fn(w, x, out, n_threads)
    return out


def _assert_close(out, w_values, x, rtol=RTOL):
    """|out - x @ w.T| <= rtol * (|x| @ |w|.T), in float64 on the reference values."""
    w64, x64 = w_values.astype(np.float64), x.astype(np.float64)
    err = np.abs(out.astype(np.float64) - x64 @ w64.T)
    bound = rtol * (np.abs(x64) @ np.abs(w64).T)
    assert out.shape == err.shape
    assert np.all(err <= bound), f"max err/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"


def _bits_equal(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ------------------------------------------------------- the reference itself

def test_reference_decoders_agree_with_ml_dtypes():
    # The decoders in quant_reference are written from the specs; ml_dtypes is a
    # second, independent implementation of the same formats.
    every = np.arange(256, dtype=np.uint8)
    for mine, theirs in ((ref.e4m3_values(every), every.view(ml_dtypes.float8_e4m3fn)),
                         (ref.e8m0_values(every), every.view(ml_dtypes.float8_e8m0fnu)),
                         (ref.e2m1_values(every[:16]), every[:16].view(ml_dtypes.float4_e2m1fn))):
        theirs = theirs.astype(np.float32)
        assert np.array_equal(np.isnan(mine), np.isnan(theirs))
        assert _bits_equal(np.nan_to_num(mine), np.nan_to_num(theirs))
    assert np.isnan(ref.e4m3_values(np.array([0x7F, 0xFF], np.uint8))).all()


# ----------------------------------------------------------------- dequantize

# (R, C) before C is rounded up to the variant's unit: R and C not multiples of 128,
# fp8 blocks partial in both directions, mxfp4/int C a multiple of 32 but not of 128.
SHAPES = [(1, 32), (7, 96), (130, 200), (201, 416)]
shapes = pytest.mark.parametrize("R, C", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])


@variants
@shapes
def test_dequantize_is_exact(variant, R, C):
    C = _columns(variant, C)
    w, values = _make(variant, R, C, _rng(1, R, C))
    assert w.shape == (R, C)
    got = kern.dequantize(w)
    assert got.dtype == np.float32 and got.shape == (R, C)
    assert _bits_equal(got, values)
    out = np.full((R, C), np.nan, np.float32)
    assert kern.dequantize(w, out, 2) is out and _bits_equal(out, values)


def test_dequantize_fp8_special_codes_and_scales():
    codes = np.tile(np.arange(256, dtype=np.uint8), (3, 1))  # [3, 256]: every code
    for scale_dtype, scales in (
            ("float32", np.array([[1.0, 2.0 ** -7], [3.0e-5, -1.0], [np.inf, 0.0]], np.float32)),
            ("bfloat16", np.array([[1.0, 2.0 ** -7], [3.0e-5, -1.0], [np.inf, 0.0]],
                                  np.float32).astype(ml_dtypes.bfloat16)),
            ("ue8m0", np.array([[127, 0], [1, 254], [255, 126]], np.uint8))):
        w = kern.QuantizedWeight("fp8_e4m3", codes, scales, block_size=(1, 128))
        with np.errstate(all="ignore"):  # inf x 0, NaN codes, 448 x 2^127
            expected = ref.dequantize_fp8(codes, scales, (1, 128))
        got = kern.dequantize(w)
        assert np.array_equal(np.isnan(got), np.isnan(expected)), scale_dtype
        assert _bits_equal(np.nan_to_num(got), np.nan_to_num(expected)), scale_dtype
    assert np.isnan(got[:, [0x7F, 0xFF]]).all()  # the e4m3fn NaN codes stay NaN
    assert np.isnan(got[2, :128]).all()  # E8M0 255 is NaN
    assert got[0, 0x81] == -(2.0 ** -9) * 2.0 ** -127  # subnormal code 0x81 x scale 0 (2^-127)


def test_dequantize_mxfp4_special_scales():
    blocks = np.tile(ref.pack_nibbles(np.arange(32, dtype=np.uint8) % 16), (4, 1, 1))  # [4, 1, 16]
    scales = np.array([[127], [0], [254], [255]], np.uint8)
    got = kern.dequantize(kern.QuantizedWeight("mxfp4", blocks, scales))
    with np.errstate(over="ignore"):  # 6 x 2^127 is inf in f32
        expected = ref.dequantize_mxfp4(blocks, scales)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert _bits_equal(np.nan_to_num(got), np.nan_to_num(expected))
    assert got[0, :16].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(got[0, 8]) and got[1, 1] == 2.0 ** -128 and got[2, 7] == np.inf
    assert np.isnan(got[3]).all()


@variants
def test_dequantize_rows_gathers_exact_rows(variant):
    w, values = _make(variant, 9, _columns(variant, 100), _rng(2))
    ids = np.array([4, 0, 8, 4], np.int64)
    out = np.full((4, w.shape[1]), np.nan, np.float32)
    kern.dequantize_rows(w, ids, out)
    assert _bits_equal(out, values[ids])


# --------------------------------------------------------------------- matmul

@variants
@shapes
def test_matmul_matches_reference(variant, R, C):
    w, values, x = _case(variant, R, C, 7, 3, R, C)
    for T in (1, 3, 7):
        _assert_close(_matmul(w, x[:T]), values, x[:T])


def test_matmul_fp8_deepseek_kv_a_shape():
    # DeepSeek-V3's kv_a_proj_with_mqa: 576 x 7168, a 5 x 56 grid of 128 x 128 blocks.
    rng = _rng(4)
    w, values = _make("fp8-f32", 576, 7168, rng)
    assert w.scales.shape == (5, 56)
    x = rng.standard_normal((2, 7168), dtype=np.float32)
    _assert_close(_matmul(w, x, 2), values, x)


# Column counts around the 32-column steps, the tails and the fp8 blocks.
ORDER_COLUMNS = [32, 64, 96, 160, 416, 608, 4096]
FP8_COLUMNS = [1, 15, 16, 17, 31, 33, 100, 127, 129, 200, 300]


def _order_cases():
    for variant in VARIANTS:
        cols = ORDER_COLUMNS + (FP8_COLUMNS if variant.startswith("fp8") else [])
        for C in sorted({_columns(variant, c) for c in cols}):
            yield pytest.param(variant, C, id=f"{variant}-{C}")


@pytest.mark.parametrize("variant, C", list(_order_cases()))
@pytest.mark.parametrize("T", [1, 3], ids=["mat-vec", "mat-mat"])
def test_simd_path_bit_equal_to_portable_path(variant, C, T):
    # One token runs the mat-vec kernels (on AVX2, in column chunks of 512), several
    # the tiled mat-mat; 11 rows: passes of 8 or 4 rows, then single rows.
    w, values, x = _case(variant, 11, C, T, 5, C)
    fast = _matmul(w, x)
    assert _bits_equal(fast, _matmul(w, x, fn=kern._matmul_portable))
    _assert_close(fast, values, x)


def _special_scales_case(fmt, rng):
    """A [6, 1024] mxfp4 or int4 (with mins) weight whose scales include zero, the
    extremes, inf and NaN (E8M0: 0, 1, 254, 255), and int4 mins inf and NaN."""
    R, C = 6, 1024
    if fmt == "mxfp4":
        codes = rng.integers(0, 256, (R, C // 32, 16), dtype=np.uint8)
        scales = rng.integers(100, 130, (R, C // 32), dtype=np.uint8)
        scales[0, :4] = [0, 1, 254, 255]
        scales[1, 5] = 255
        scales[2] = 0
        return kern.QuantizedWeight("mxfp4", codes, scales)
    # powers of two and mins a multiple of them: every finite value is exact in bf16
    codes = rng.integers(0, 256, (R, C // 2), dtype=np.uint8)
    scales = np.ldexp(1.0, rng.integers(-10, -3, (R, C // 32))).astype(np.float16)
    mins = (scales.astype(np.float32) * rng.integers(-64, 64, scales.shape)).astype(np.float16)
    scales[0, :5] = [0.0, -1.0, np.inf, np.nan, 2.0 ** -24]  # 2^-24: a binary16 subnormal
    mins[0, :5] = [0.25, -3.0, 0.0, 1.0, -5 * 2.0 ** -24]
    mins[1, :4] = [np.inf, -np.inf, np.nan, -0.0]
    scales[2, 20:], mins[2, 20:] = 2.0 ** 15, -(2.0 ** 15)
    return kern.QuantizedWeight("int4", codes, scales, mins)


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("T", [1, 3], ids=["mat-vec", "mat-mat"])
def test_nibble_special_scales_give_the_reference_bits(fmt, T):
    # The AVX2 kernels compute int4 values arithmetically and move mxfp4's sign bit in;
    # these must give the bits of the dense row of the dequantised values whatever the
    # scales hold (the loader refuses such scales, the kernels do not check).
    rng = _rng(29, len(fmt), T)
    w = _special_scales_case(fmt, rng)
    x = rng.standard_normal((T, w.shape[1]), dtype=np.float32)
    with np.errstate(all="ignore"):
        values = kern.dequantize(w)
        dense = _matmul(values.astype(ml_dtypes.bfloat16), x)
    assert np.array_equal(values.astype(ml_dtypes.bfloat16).astype(np.float32), values, equal_nan=True)
    fast, portable = _matmul(w, x), _matmul(w, x, fn=kern._matmul_portable)
    for got in (fast, portable):
        assert np.array_equal(np.isnan(got), np.isnan(dense))
        assert _bits_equal(np.nan_to_num(got), np.nan_to_num(dense))
    assert np.isnan(fast[:, 0]).all()


@pytest.mark.parametrize("variant, C", list(_order_cases()))
def test_quantised_row_reduces_like_the_dense_row_of_its_values(variant, C):
    # fp8/int8 are reduced like f32 rows, mxfp4/int4 like bf16 rows (module docstring).
    rng = _rng(6, C)
    fmt, opt = VARIANTS[variant]
    if fmt == "int4":  # values exact in bf16: power-of-two scales, mins a multiple of them
        codes = rng.integers(0, 256, (5, C // 2), dtype=np.uint8)
        scales = np.ldexp(1.0, rng.integers(-10, -3, (5, C // opt["g"]))).astype(np.float16)
        mins = (scales.astype(np.float32) * rng.integers(-64, 64, scales.shape)).astype(np.float16)
        w = kern.QuantizedWeight("int4", codes, scales, mins if opt["mins"] else None)
        values = ref.dequantize_int4(codes, scales, mins if opt["mins"] else None)
    else:
        w, values = _make(variant, 5, C, rng)
    x = rng.standard_normal((2, C), dtype=np.float32)
    dense = values.astype(ml_dtypes.bfloat16) if fmt in ("mxfp4", "int4") else values
    assert np.array_equal(dense.astype(np.float32), values)  # the dense row holds the same values
    assert _bits_equal(_matmul(w, x), _matmul(dense, x))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16", "ue8m0"])
def test_fp8_extreme_scales_and_nan_codes_give_the_reference_bits(scale_dtype):
    # Scales near the top of the f32 range (the binary16 decoding path folds 2^8 into
    # the scale and must step aside), zero, negative, inf and NaN; NaN codes in one row.
    rng = _rng(23, len(scale_dtype))
    R, C = 8, 256
    codes = rng.integers(0, 256, (R, C), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1
    codes[:2] &= 0xBF  # |value| < 2 where the scales reach 2^125 (keeps the products finite)
    codes[1, 200] = 0x7F
    if scale_dtype == "ue8m0":
        scales = np.array([[247, 250], [127, 0], [255, 120], [1, 254]], np.uint8)
    else:
        scales = np.array([[2.0 ** 125, 2.0 ** 121], [-1.0, 0.0], [np.nan, np.inf],
                           [2.0 ** -140, 3e38]], np.float32)
        if scale_dtype == "bfloat16":
            scales = scales.astype(ml_dtypes.bfloat16)
    w = kern.QuantizedWeight("fp8_e4m3", codes, scales, block_size=(2, 128))
    x = rng.standard_normal((2, C), dtype=np.float32) * np.float32(1e-30)
    with np.errstate(all="ignore"):
        dense = _matmul(kern.dequantize(w), x)
    fast, portable = _matmul(w, x), _matmul(w, x, fn=kern._matmul_portable)
    for got in (fast, portable):
        assert np.array_equal(np.isnan(got), np.isnan(dense))
        assert _bits_equal(np.nan_to_num(got), np.nan_to_num(dense))
    assert np.isnan(fast[:, 1]).all() and np.isfinite(fast[:, 0]).all()


@variants
def test_matmul_rows_equal_mat_vec_and_do_not_depend_on_neighbours(variant):
    # 19 tokens: two tiles of 8 tokens that share decoded weights and a partial one;
    # 600 columns: a second tile of columns.
    w, _, x = _case(variant, 11, 600, 19, 7)
    batch = _matmul(w, x)
    for t in range(19):
        assert _bits_equal(_matmul(w, x[t:t + 1]), batch[t:t + 1]), f"token {t}"
    assert _bits_equal(_matmul(w, x[2:7]), batch[2:7])
    for r in (0, 5, 10):  # a weight of one row: the row's value does not depend on its group
        assert _bits_equal(_matmul(_row(w, r), x)[:, 0], batch[:, r]), f"row {r}"


def _row(w, r):
    """The one-row QuantizedWeight of row r of w (its codes, scales and mins rows)."""
    srow = r // w.block_size[0] if w.fmt == "fp8_e4m3" else r
    mins = None if w.mins is None else w.mins[r:r + 1]
    return kern.QuantizedWeight(w.fmt, w.codes[r:r + 1], w.scales[srow:srow + 1], mins,
                                block_size=(1, w.block_size[1]) if w.block_size else None,
                                group_size=w.group_size)


@variants
def test_matmul_one_and_two_threads_bit_equal(variant):
    C, T = _columns(variant, 416), 5
    w, values, x = _case(variant, max(37, -(-PARALLEL_WORK // (C * T)) | 1), C, T, 8)
    one = _matmul(w, x, 1)
    assert _bits_equal(one, _matmul(w, x, 2))
    _assert_close(one, values, x)


def _parts(w):
    return [a for a in (w.codes, w.scales, w.mins) if a is not None]


def _rebuilt(w, parts):
    mins = parts[2] if len(parts) == 3 else None
    return kern.QuantizedWeight(w.fmt, parts[0], parts[1], mins, block_size=w.block_size,
                                group_size=w.group_size)


@variants
def test_matmul_on_read_only_memory_maps_is_bit_equal(variant, tmp_path):
    w, _, x = _case(variant, 13, 200, 3, 9)
    maps = []
    for i, a in enumerate(_parts(w)):
        a.tofile(tmp_path / f"{i}.bin")
        maps.append(np.memmap(tmp_path / f"{i}.bin", dtype=a.dtype, mode="r", shape=a.shape))
    assert not any(m.flags.writeable for m in maps)
    mapped = _rebuilt(w, maps)
    assert _bits_equal(_matmul(mapped, x, 2), _matmul(w, x, 2))
    assert _bits_equal(kern.dequantize(mapped), kern.dequantize(w))


def _at_offset(a, offset):
    """A copy of `a` whose first byte sits `offset` bytes past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 64 == offset and view.flags.c_contiguous
    return view


@variants
def test_matmul_bit_equal_at_odd_offsets(variant):
    w, _, x = _case(variant, 6, 200, 3, 10)
    expected = _matmul(w, x)
    for offset in (1, 3, 7, 33, 63):
        placed = _rebuilt(w, [_at_offset(a, offset) for a in _parts(w)])
        assert _bits_equal(_matmul(placed, x), expected), f"offset {offset}"
        assert _bits_equal(_matmul(w, _at_offset(x, (5 * offset) % 64)), expected)


def test_weight_is_a_view_not_a_copy():
    rng = _rng(11)
    codes, scales, mins = ref.random_int4(rng, 4, 64, 32, True)
    w = kern.QuantizedWeight("int4", codes, scales, mins)
    assert w.codes is codes and w.scales is scales and w.mins is mins
    before = kern.dequantize(w)
    codes[0, 0] ^= 0x11
    scales[1, 1] = 3.0
    after = kern.dequantize(w)
    assert _bits_equal(after, ref.dequantize_int4(codes, scales, mins))
    assert not np.array_equal(after[0, :2], before[0, :2]) and after[1, 40] != before[1, 40]


# ------------------------------------------------------------------ the object

def test_attributes():
    rng = _rng(12)
    codes, scales = ref.random_fp8(rng, 576, 7168)
    w = kern.QuantizedWeight("fp8_e4m3", codes, scales)
    assert (w.fmt, w.shape, w.ndim, w.block_size, w.group_size) == ("fp8_e4m3", (576, 7168), 2,
                                                                    (128, 128), None)
    assert w.nbytes == 576 * 7168 + 5 * 56 * 4
    assert repr(w) == "QuantizedWeight('fp8_e4m3', shape=(576, 7168), block_size=(128, 128), scales=float32)"
    blocks, e8 = ref.random_mxfp4(rng, 10, 64)
    w = kern.QuantizedWeight("mxfp4", blocks, e8.view(ml_dtypes.float8_e8m0fnu))
    assert (w.shape, w.nbytes, w.bits_per_weight) == ((10, 64), 10 * 32 + 10 * 2, 4.25)
    codes, scales, mins = ref.random_int4(rng, 3, 256, 64, True)
    w = kern.QuantizedWeight("int4", codes, scales, mins)
    assert (w.shape, w.group_size, w.nbytes) == ((3, 256), 64, 3 * 128 + 2 * 3 * 4 * 2)
    assert repr(w) == "QuantizedWeight('int4', shape=(3, 256), group_size=64, mins)"
    assert kern.FORMATS == ("fp8_e4m3", "mxfp4", "int8", "int4")


def test_fp8_codes_may_be_float8_e4m3fn():
    rng = _rng(13)
    codes, scales = ref.random_fp8(rng, 5, 70, (2, 32))
    a = kern.QuantizedWeight("fp8_e4m3", codes, scales, block_size=(2, 32))
    b = kern.QuantizedWeight("fp8_e4m3", codes.view(ml_dtypes.float8_e4m3fn), scales, block_size=[2, 32])
    assert _bits_equal(kern.dequantize(a), kern.dequantize(b))


def _error(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        kern.QuantizedWeight(*args, **kwargs)


def test_constructor_errors_name_what_is_wrong():
    rng = _rng(14)
    f8, f8s = ref.random_fp8(rng, 200, 300)  # grid (2, 3)
    mx, mxs = ref.random_mxfp4(rng, 4, 64)
    i8, i8s = ref.random_int8(rng, 4, 128, 32)
    i4, i4s, i4m = ref.random_int4(rng, 4, 128, 32, True)
    _error("unknown quantised format 'q4_k'", "q4_k", i4, i4s)
    _error("fp8_e4m3: mins are only defined for int4", "fp8_e4m3", f8, f8s, f8s)
    _error("int8: block_size is only defined for fp8_e4m3", "int8", i8, i8s, block_size=(1, 32))
    _error("mxfp4: group_size is only defined for int4 and int8", "mxfp4", mx, mxs, group_size=32)
    # fp8
    _error("fp8_e4m3 codes: expected a numpy array, got list", "fp8_e4m3", f8.tolist(), f8s)
    _error("fp8_e4m3 codes: dtype int8", "fp8_e4m3", f8.view(np.int8), f8s)
    _error("fp8_e4m3 codes: dtype float8_e5m2", "fp8_e4m3", f8.view(ml_dtypes.float8_e5m2), f8s)
    _error("fp8_e4m3 codes: expected 2 dimensions", "fp8_e4m3", f8.reshape(-1), f8s)
    _error("fp8_e4m3 codes: must be C-contiguous", "fp8_e4m3", np.asfortranarray(f8), f8s)
    _error("fp8_e4m3 scales: dtype float16", "fp8_e4m3", f8, f8s.astype(np.float16))
    _error("fp8_e4m3 scales: dtype float64", "fp8_e4m3", f8, f8s.astype(np.float64))
    _error(r"fp8_e4m3 scales: shape \(2, 2\), expected \(2, 3\) for a \[200, 300\] weight "
           r"in blocks of \(128, 128\)", "fp8_e4m3", f8, f8s[:, :2].copy())
    _error(r"fp8_e4m3 scales: shape \(2, 3\), expected \(4, 5\)", "fp8_e4m3", f8, f8s,
           block_size=(64, 64))
    _error("fp8_e4m3 scales: must be C-contiguous", "fp8_e4m3", f8,
           np.ones((3, 2), np.float32).T)
    _error("fp8_e4m3: block_size 128 is not a pair", "fp8_e4m3", f8, f8s, block_size=128)
    _error(r"fp8_e4m3: block_size \(0, 128\) must be positive", "fp8_e4m3", f8, f8s, block_size=(0, 128))
    _error(r"fp8_e4m3: empty weight \[0, 300\]", "fp8_e4m3", f8[:0], f8s[:0])
    # mxfp4
    _error("mxfp4 codes: expected 3 dimensions", "mxfp4", mx.reshape(4, 32), mxs)
    _error(r"mxfp4 codes: shape \(4, 4, 8\), expected \[R, C/32, 16\]", "mxfp4", mx.reshape(4, 4, 8), mxs)
    _error("mxfp4 codes: dtype int8", "mxfp4", mx.view(np.int8), mxs)
    _error("mxfp4 scales: dtype float32", "mxfp4", mx, mxs.astype(np.float32))
    _error(r"mxfp4 scales: shape \(4, 1\), expected \(4, 2\)", "mxfp4", mx, mxs[:, :1].copy())
    _error(r"mxfp4 scales: shape \(3, 2\), expected \(4, 2\)", "mxfp4", mx, mxs[:3])
    # int8
    _error("int8 codes: dtype uint8", "int8", i8.view(np.uint8), i8s)
    _error("int8 scales: dtype float32", "int8", i8, i8s.astype(np.float32))
    _error("int8 scales: shape \\(3, 4\\), expected 4 rows", "int8", i8, i8s[:3])
    _error("int8 scales: 3 groups per row do not divide 128 columns", "int8", i8, i8s[:, :3].copy())
    _error("int8: group size 16 is not a multiple of 32", "int8", i8,
           np.ones((4, 8), np.float16))
    _error(r"int8: group_size 64 but the scales imply 32 \(4 groups of 128 columns\)", "int8",
           i8, i8s, group_size=64)
    # int4
    _error("int4 codes: dtype int8", "int4", i4.view(np.int8), i4s, i4m)
    _error("int4 codes: expected 2 dimensions", "int4", i4.reshape(4, 4, 16), i4s, i4m)
    _error("int4 scales: dtype bfloat16", "int4", i4, i4s.astype(ml_dtypes.bfloat16), i4m)
    _error("int4 mins: dtype float32", "int4", i4, i4s, i4m.astype(np.float32))
    _error(r"int4 mins: shape \(4, 2\), expected \(4, 4\) like the scales", "int4", i4, i4s,
           i4m[:, :2].copy())
    _error("int4 mins: expected a numpy array, got float", "int4", i4, i4s, 0.5)
    _error(r"int4: group_size 128 but the scales imply 32", "int4", i4, i4s, group_size=128)
    _error("int4 scales: 5 groups per row do not divide 128 columns", "int4", i4,
           np.ones((4, 5), np.float16))


def test_kernels_refuse_non_weights():
    x = np.ones((1, 32), np.float32)
    out = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match="w: expected a numpy array or QuantizedWeight, got dict"):
        kern.matmul({}, x, out)
    blank = kern.QuantizedWeight.__new__(kern.QuantizedWeight)
    with pytest.raises(ValueError, match="w: QuantizedWeight was not initialised"):
        kern.matmul(blank, x, out)
    with pytest.raises(ValueError, match="w: unsupported weight dtype uint8"):
        kern.dequantize(np.zeros((4, 32), np.uint8))
    i8, i8s = ref.random_int8(_rng(15), 4, 64, 32)
    w = kern.QuantizedWeight("int8", i8, i8s)
    with pytest.raises(ValueError, match=r"x: shape \(1, 32\) does not match w \(4, 64\)"):
        kern.matmul(w, x, out)
    with pytest.raises(ValueError, match=r"out: shape \(4, 32\), expected \(4, 64\)"):
        kern.dequantize(w, np.zeros((4, 32), np.float32))


def test_build_info_names_the_simd_path():
    info = kern.build_info()
    assert set(info) == {"simd", "fast", "fast_bf16", "openmp", "features", "parallel_threshold"}
    assert info["simd"] in ("avx512", "avx2", "portable")
    assert info["fast_bf16"] == ("avx512-bf16" if "avx512bf16" in info["features"] else "emulated")
    assert info["openmp"] is kern.openmp_enabled()
    needs = {"avx512": {"avx512f", "avx512bw"}, "avx2": {"avx2", "f16c"}, "portable": set()}
    assert needs[info["simd"]] <= set(info["features"])
    # the fast numerics' integer-dot path: VNNI where compiled in, on the vectors of "simd"
    fast = {"avx512": ("avx512-vnni", "avx2-vnni", "avx2"), "avx2": ("avx2-vnni", "avx2"),
            "portable": ("portable",)}
    assert info["fast"] in fast[info["simd"]]
    assert (info["fast"] == "avx512-vnni") == ("avx512vnni" in info["features"] and info["simd"] == "avx512")


# ----------------------------------------------------------------- expert FFN

H, I = 96, 160  # multiples of 32, not of 128; fp8 blocks partial in both directions
FFN_VARIANTS = ["fp8-f32", "fp8-ue8m0", "fp8-block3x40", "mxfp4", "int8-g32", "int4-g32",
                "int4-g32-mins"]


def _experts(variant, n, rng):
    """n experts (gates, ups, downs as QuantizedWeights) and their reference values."""
    made = [[_make(variant, rows, cols, rng) for rows, cols in ((I, H), (I, H), (H, I))]
            for _ in range(n)]
    weights = [[m[p][0] for m in made] for p in range(3)]
    values = [[m[p][1] for m in made] for p in range(3)]
    return weights, values


def _ffn(weights, x, sizes, n_threads=1):
    group_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(group_start[-1])
    hbuf = np.full((N, I), np.nan, np.float32)
    out = np.full((N, H), np.nan, np.float32)
    kern.expert_ffn(*weights, x, group_start, hbuf, out, n_threads)
    return out


def _silu(g):
    return g / (1.0 + np.exp(-g))


@pytest.mark.parametrize("variant", FFN_VARIANTS)
def test_expert_ffn_quantised_matches_reference_and_is_deterministic(variant):
    rng = _rng(16)
    sizes = [3, 0, 9, 1, 13, 17]
    weights, values = _experts(variant, len(sizes), rng)
    x = rng.standard_normal((sum(sizes), H), dtype=np.float32)
    out = _ffn(weights, x, sizes)
    start = 0
    for k, n in enumerate(sizes):
        g, u, d = (v[k].astype(np.float64) for v in values)
        x64 = x[start:start + n].astype(np.float64)
        y = (_silu(x64 @ g.T) * (x64 @ u.T)) @ d.T
        bound = ((np.abs(x64) @ np.abs(g).T) * (np.abs(x64) @ np.abs(u).T)) @ np.abs(d).T
        assert np.all(np.abs(out[start:start + n] - y) <= 4 * RTOL * bound), f"expert {k}"
        start += n
    assert 3 * sum(sizes) * H * I >= PARALLEL_WORK
    assert _bits_equal(_ffn(weights, x, sizes, 2), out)
    # A token alone gives the bits it gets inside its group.
    alone = _ffn([w[2:3] for w in weights], x[3:4].copy(), [1])
    assert _bits_equal(alone, out[3:4])


def test_expert_ffn_refuses_mixed_formats():
    rng = _rng(17)
    (q8,), _ = zip(*[_experts("int8-g32", 1, rng)])
    (q4,), _ = zip(*[_experts("int4-g32", 1, rng)])
    x = rng.standard_normal((1, H), dtype=np.float32)
    args = (x, np.array([0, 1], np.int64), np.zeros((1, I), np.float32), np.zeros((1, H), np.float32))
    with pytest.raises(ValueError, match=r"ups\[0\]: format int4 differs from gates\[0\] \(int8\)"):
        kern.expert_ffn(q8[0], q4[1], q8[2], *args)
    dense = kern.dequantize(q8[2][0])
    with pytest.raises(ValueError, match=r"downs\[0\]: format float32 differs from gates\[0\] \(int8\)"):
        kern.expert_ffn(q8[0], q8[1], [dense], *args)
    with pytest.raises(ValueError, match=r"downs\[0\]: shape \(160, 96\), expected \(96, 160\)"):
        kern.expert_ffn(q8[0], q8[1], q8[0], *args)
