"""Tests for ext/kernels/_kernels.pyx: every kernel against a numpy float64 reference.

Conventions: weights are f32, f16 or bf16 (`ml_dtypes.bfloat16`), activations f32.
Numerical agreement is checked against float64 with a bound relative to the sum of
absolute products (|w| @ |x|), which is what f32 accumulation error scales with; the
determinism promises of the module docstring (mat-mat rows equal mat-vec, any
`n_threads`, any alignment, any batch size) are checked bit for bit (np.array_equal).
Shape legend as in the kernels: T tokens, R rows, C columns, H hidden_size,
I intermediate_size, E experts, K top_k, N token-expert rows, S cache capacity.
"""

import ml_dtypes
import numpy as np
import pytest

from ext.kernels import _kernels as kern

WDTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
WDTYPE_IDS = ["f32", "f16", "bf16"]
THREADS = [1, 2]

# Column counts around the 16/32-element blocks and the scalar tail of the dot product.
COLUMNS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 100, 4096]
TOKENS = [1, 3, 4, 5, 9]
RTOL = 1e-5  # relative to sum(|w| |x|)
# Calls with less work than this many multiply-adds run on one thread whatever
# n_threads says (MIN_PARALLEL_WORK in _kernels.pyx is 65536); thread-equality
# tests stay well above it so that two threads really run.
PARALLEL_WORK = 4 * 65536

wdtypes = pytest.mark.parametrize("wdtype", WDTYPES, ids=WDTYPE_IDS)
threads = pytest.mark.parametrize("n_threads", THREADS)


def _rng(*key):
    return np.random.default_rng([20250611, *key])


def _weights(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _f32(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _matmul(w, x, n_threads=1):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    kern.matmul(w, x, out, n_threads)
    return out


def _assert_matmul_close(out, w, x, rtol=RTOL):
    """|out - x @ w.T| <= rtol * (|x| @ |w|.T), all in float64."""
    w64, x64 = w.astype(np.float64), x.astype(np.float64)
    ref = x64 @ w64.T
    bound = rtol * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(out.astype(np.float64) - ref)
    assert out.shape == ref.shape
    assert np.all(err <= bound), f"max err/bound {np.max(err / np.maximum(bound, 1e-300)):.3g}"


def _placed(a, offset):
    """A copy of `a` whose first byte sits at `offset` mod 64."""
    buf = np.zeros(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 64 == offset
    assert view.flags.c_contiguous
    return view


# ------------------------------------------------------------------- matmul

@wdtypes
@threads
@pytest.mark.parametrize("C", COLUMNS)
def test_matmul_matches_float64_reference(wdtype, n_threads, C):
    rng = _rng(1, C)
    R = 7
    w = _weights(rng, (R, C), wdtype)
    x = _f32(rng, (max(TOKENS), C))
    for T in TOKENS:
        _assert_matmul_close(_matmul(w, x[:T], n_threads), w, x[:T])


@wdtypes
@pytest.mark.parametrize("C", COLUMNS)
def test_matmul_rows_of_mat_mat_equal_mat_vec(wdtype, C):
    rng = _rng(2, C)
    w = _weights(rng, (5, C), wdtype)
    x = _f32(rng, (9, C))
    vec = np.concatenate([_matmul(w, x[t:t + 1]) for t in range(9)])  # [9, R] one token at a time
    for T in TOKENS:
        mat = _matmul(w, x[:T])  # [T, R]
        assert np.array_equal(mat, vec[:T]), f"T={T}"
    # A token's result does not depend on the tokens batched before it either.
    assert np.array_equal(_matmul(w, x[3:9]), vec[3:9])


@wdtypes
@pytest.mark.parametrize("C", [15, 33, 100, 4096])
def test_matmul_row_independent_of_neighbouring_rows(wdtype, C):
    # Rows are computed in groups; a row's value must not depend on its group.
    rng = _rng(22, C)
    R = 11
    w = _weights(rng, (R, C), wdtype)
    x = _f32(rng, (3, C))
    full = _matmul(w, x)  # [T, R]
    for r in range(R):
        assert np.array_equal(_matmul(w[r:r + 1], x)[:, 0], full[:, r]), f"row {r}"
    for start in (1, 2, 3):
        assert np.array_equal(_matmul(w[start:], x), full[:, start:]), f"rows {start}:"


@wdtypes
@pytest.mark.parametrize("C", [17, 33, 100, 4096])
def test_matmul_one_and_two_threads_bit_equal(wdtype, C):
    rng = _rng(3, C)
    T = 5
    R = max(37, -(-PARALLEL_WORK // (C * T)) | 1)  # odd: a partial group of rows
    w = _weights(rng, (R, C), wdtype)
    x = _f32(rng, (T, C))
    one = _matmul(w, x, 1)
    two = _matmul(w, x, 2)
    assert np.array_equal(one, two)
    _assert_matmul_close(one, w, x)


@wdtypes
@threads
def test_matmul_on_read_only_memory_maps_is_bit_equal(tmp_path, wdtype, n_threads):
    rng = _rng(4)
    R, C, T = 11, 113, 5
    w = _weights(rng, (R, C), wdtype)
    x = _f32(rng, (T, C))
    w.tofile(tmp_path / "w.bin")
    x.tofile(tmp_path / "x.bin")
    wm = np.memmap(tmp_path / "w.bin", dtype=wdtype, mode="r", shape=(R, C))
    xm = np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="r", shape=(T, C))
    assert not wm.flags.writeable and not xm.flags.writeable
    assert np.array_equal(_matmul(wm, xm, n_threads), _matmul(w, x, n_threads))


@wdtypes
@threads
def test_matmul_bit_equal_at_every_alignment(wdtype, n_threads):
    rng = _rng(5)
    R, C, T = 6, 113, 5  # a full group of rows and a partial one; 113 = 3 x 32 + 17
    w = _weights(rng, (R, C), wdtype)
    x = _f32(rng, (T, C))
    expected = _matmul(_placed(w, 0), _placed(x, 0), n_threads)
    _assert_matmul_close(expected, w, x)
    for offset in range(0, 64, 2):
        got_w = _matmul(_placed(w, offset), x, n_threads)
        got_x = _matmul(w, _placed(x, offset), n_threads)
        assert np.array_equal(got_w, expected), f"weights at offset {offset}"
        assert np.array_equal(got_x, expected), f"x at offset {offset}"


# Two products on one accumulator (one lane, or the scalar tail): -1, then a product with
# a bit below half an ulp of 1 that a separately rounded product loses (a tie, to even)
# and a fused multiply-add keeps. Per dtype: (w1, x1) exact in that dtype and f32.
FMA_CASES = {"f32": (1 + 2.0 ** -12, 1 + 2.0 ** -12), "f16": (1 + 2.0 ** -10, 1 + 2.0 ** -14),
             "bf16": (1 + 2.0 ** -7, 1 + 2.0 ** -17)}


@wdtypes
@pytest.mark.parametrize("C, first, second", [(2, 0, 1), (64, 0, 32), (33, 0, 32)],
                         ids=["tail", "lane", "lane-then-tail"])
def test_matmul_accumulates_with_one_rounding_per_product(wdtype, C, first, second):
    # bf16 rows pair even columns in a0's lanes, so columns 0 and 32 share lane 0 in
    # every dtype; with C = 33 the second product is the scalar tail added to the sum.
    w1, x1 = FMA_CASES[WDTYPE_IDS[WDTYPES.index(wdtype)]]
    fused = np.float32(w1 * x1 - 1)   # exact in float64, and representable in f32
    unfused = np.float32(np.float32(w1 * x1) - np.float32(1))
    assert fused != unfused
    w = np.zeros((3, C), wdtype)
    x = np.zeros((2, C), np.float32)
    w[:, first], w[:, second] = 1, w1
    x[:, first], x[:, second] = -1, x1
    assert w.astype(np.float64)[0, second] == w1 and x.astype(np.float64)[0, second] == x1
    assert np.all(_matmul(w, x) == fused)
    assert np.all(_matmul(w, x[:1]) == fused)
    # The transposed product (a sum of rows x[r] * w[r]) in its lanes and its tail.
    wt = np.zeros((2, 17), wdtype)
    wt[0], wt[1] = 1, w1
    xt = np.array([[[-1, x1]]], np.float32)
    out = np.zeros((1, 1, 17), np.float32)
    kern.matmul_heads(wt, 0, 2, xt, out, True, 1)
    assert np.all(out == fused)


def _matmul_error(w, x, out, match, n_threads=1):
    sentinel = out.copy() if out.flags.writeable else None
    with pytest.raises(ValueError, match=match):
        kern.matmul(w, x, out, n_threads)
    if sentinel is not None:
        assert np.array_equal(out, sentinel, equal_nan=True), "out written before the error"


def test_matmul_rejects_bad_shapes():
    w = np.ones((4, 6), np.float32)
    x = np.ones((2, 6), np.float32)
    out = np.full((2, 4), np.nan, np.float32)
    _matmul_error(np.ones(6, np.float32), x, out, "w:")
    _matmul_error(np.ones((1, 4, 6), np.float32), x, out, "w:")
    _matmul_error(w, np.ones((2, 5), np.float32), out, "x:")
    _matmul_error(w, np.ones(6, np.float32), out, "x:")
    _matmul_error(w, x, np.full((2, 5), np.nan, np.float32), "out:")
    _matmul_error(w, x, np.full((3, 4), np.nan, np.float32), "out:")
    _matmul_error(w, x, np.full((4, 2), np.nan, np.float32), "out:")  # transposed


def test_matmul_rejects_bad_dtypes():
    w = np.ones((4, 6), np.float32)
    x = np.ones((2, 6), np.float32)
    out = np.full((2, 4), np.nan, np.float32)
    for bad_w in (w.astype(np.float64), w.astype(np.int16), w.astype(np.uint16),
                  w.astype(ml_dtypes.float8_e4m3fn)):
        _matmul_error(bad_w, x, out, "w: unsupported weight dtype")
    _matmul_error(w, x.astype(np.int32), out, "x: dtype")
    _matmul_error(w, x.astype(np.float16), out, "x: dtype")
    _matmul_error(w, x, out.astype(np.float64), "out: dtype")


def test_matmul_rejects_non_contiguous_and_read_only():
    w = np.ones((4, 12), np.float32)
    x = np.ones((2, 12), np.float32)
    out = np.full((2, 4), np.nan, np.float32)
    _matmul_error(w[:, ::2], x[:, ::2], out, "w: must be C-contiguous")
    _matmul_error(np.asfortranarray(w), x, out, "w: must be C-contiguous")
    _matmul_error(w[:, :6], x[:, :6], out, "C-contiguous")
    _matmul_error(w[:, ::2], np.ones((2, 6), np.float32), out, "w:")
    _matmul_error(w, np.ones((4, 12), np.float32)[::2], out, "x: must be C-contiguous")
    _matmul_error(w, x, np.full((4, 4), np.nan, np.float32)[::2], "out: must be C-contiguous")
    frozen = np.full((2, 4), np.nan, np.float32)
    frozen.flags.writeable = False
    _matmul_error(w, x, frozen, "out: output must be writable")
    assert np.isnan(frozen).all()
    _matmul_error(w, x, out, "n_threads", n_threads=0)


# ---------------------------------------------------------- dequantize_rows

@wdtypes
def test_dequantize_rows_is_exact(wdtype):
    rng = _rng(6)
    V, H = 9, 37
    w = _weights(rng, (V, H), wdtype)
    # Special values survive exactly: signed zero, infinities, the smallest subnormal.
    tiny = {np.dtype(np.float16): 2.0 ** -24, np.dtype(ml_dtypes.bfloat16): 2.0 ** -133,
            np.dtype(np.float32): 2.0 ** -149}[wdtype]
    w[4, :4] = np.array([-0.0, np.inf, -np.inf, tiny]).astype(wdtype)
    ids = np.array([4, 0, 8, 4, 3], np.int64)
    out = np.full((len(ids), H), np.nan, np.float32)
    kern.dequantize_rows(w, ids, out)
    ref = w.astype(np.float64)[ids].astype(np.float32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    assert np.signbit(out[0, 0]) and out[0, 3] == tiny


def test_dequantize_rows_rejects_out_of_range_ids():
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    for bad in (4, -1, 2 ** 40):
        out = np.full((2, 3), np.nan, np.float32)
        with pytest.raises(ValueError, match=f"token id {bad} out of range"):
            kern.dequantize_rows(w, np.array([0, bad], np.int64), out)
        assert np.isnan(out).all()
    with pytest.raises(ValueError, match="ids"):
        kern.dequantize_rows(w, np.array([0, 1], np.int32), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="out"):
        kern.dequantize_rows(w, np.array([0, 1], np.int64), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="unsupported weight dtype"):
        kern.dequantize_rows(w.astype(np.float64), np.array([0], np.int64), np.zeros((1, 3), np.float32))


def test_dequantize_rows_rejects_one_dimensional_weights():
    with pytest.raises(ValueError):
        kern.dequantize_rows(np.arange(10, dtype=np.float32), np.array([0], np.int64),
                             np.zeros((1, 4), np.float32))


# ------------------------------------------------------------------ rmsnorm

def _rmsnorm_ref(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


@threads
@pytest.mark.parametrize("H", [1, 17, 64, 100, 4096])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_matches_reference(n_threads, H, eps):
    rng = _rng(7, H)
    # Row scales where eps is negligible, where it dominates (mean x^2 ~ eps) and zero.
    scales = np.array([1.0, 30.0, 1e-3, 3e-4, 0.0], np.float32)[:, None]
    x = _f32(rng, (5, H)) * scales
    w = _f32(rng, H) + 1.0
    out = np.full_like(x, np.nan)
    kern.rmsnorm(x, w, eps, out, n_threads)
    np.testing.assert_allclose(out, _rmsnorm_ref(x, w, eps), rtol=1e-5, atol=0)
    assert np.all(out[4] == 0)


@threads
def test_rmsnorm_in_place_equals_out_of_place(n_threads):
    rng = _rng(8)
    x = _f32(rng, (6, 100))
    w = _f32(rng, 100)
    out = np.empty_like(x)
    kern.rmsnorm(x, w, 1e-6, out, n_threads)
    y = x.copy()
    kern.rmsnorm(y, w, 1e-6, y, n_threads)
    assert np.array_equal(y, out)
    assert not np.array_equal(y, x)


def test_rmsnorm_threads_bit_equal_and_errors():
    rng = _rng(9)
    x = _f32(rng, (9, 4096))
    w = _f32(rng, 4096)
    one, two = np.empty_like(x), np.empty_like(x)
    kern.rmsnorm(x, w, 1e-6, one, 1)
    kern.rmsnorm(x, w, 1e-6, two, 2)
    assert np.array_equal(one, two)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="weight: dtype"):
        kern.rmsnorm(x, w.astype(np.float16), 1e-6, out)
    with pytest.raises(ValueError, match="rmsnorm"):
        kern.rmsnorm(x, w[:100].copy(), 1e-6, out)
    with pytest.raises(ValueError, match="rmsnorm"):
        kern.rmsnorm(x, w, 1e-6, out[:3])
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        kern.rmsnorm(np.asfortranarray(x), w, 1e-6, out)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: output must be writable"):
        kern.rmsnorm(x, w, 1e-6, out)


# --------------------------------------------------------------------- rope

def _rope_tables(positions, D, theta=10000.0):
    inv_freq = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)  # [D/2]
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq  # [T, D/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rope_ref(x, cos, sin):
    """transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, float64."""
    x64 = x.astype(np.float64)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x64[..., half:], x64[..., :half]], axis=-1)
    cos_full = np.concatenate([cos, cos], axis=-1).astype(np.float64)[:, None, :]  # [T, 1, D]
    sin_full = np.concatenate([sin, sin], axis=-1).astype(np.float64)[:, None, :]
    return x64 * cos_full + rotated * sin_full


@pytest.mark.parametrize("D", [2, 8, 64, 128])
def test_rope_matches_rotate_half_reference(D):
    rng = _rng(10, D)
    T, nH = 5, 3
    x = _f32(rng, (T, nH, D))
    cos, sin = _rope_tables([0, 1, 7, 100, 4000], D)
    ref = _rope_ref(x, cos, sin)
    y = x.copy()
    kern.rope(y, cos, sin)
    half = D // 2
    pair = np.abs(x[..., :half]) + np.abs(x[..., half:])  # bound per rotated pair
    bound = 4e-7 * np.concatenate([pair, pair], axis=-1)
    assert np.all(np.abs(y - ref) <= bound)
    assert np.array_equal(y[0], x[0])  # position 0: cos 1, sin 0
    # Norm of every (i, i + D/2) pair is preserved; the interleaved (GPT-J) layout would not match.
    np.testing.assert_allclose(y[..., :half] ** 2 + y[..., half:] ** 2,
                               x[..., :half] ** 2 + x[..., half:] ** 2, rtol=1e-5, atol=1e-6)


def test_rope_rejects_bad_shapes_and_read_only():
    x = np.ones((2, 3, 8), np.float32)
    cos, sin = _rope_tables([0, 1], 8)
    with pytest.raises(ValueError, match="rope"):
        kern.rope(np.ones((2, 3, 7), np.float32), cos[:, :3].copy(), sin[:, :3].copy())
    with pytest.raises(ValueError, match="rope"):
        kern.rope(x, cos[:1].copy(), sin[:1].copy())
    with pytest.raises(ValueError, match="rope"):
        kern.rope(x, cos, sin[:, :3].copy())
    with pytest.raises(ValueError, match="x: dtype"):
        kern.rope(x.astype(np.float64), cos, sin)
    with pytest.raises(ValueError, match="x: expected 3 dimensions"):
        kern.rope(np.ones((2, 8), np.float32), cos, sin)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="x: output must be writable"):
        kern.rope(x, cos, sin)


# ---------------------------------------------------------------- attention

NH, NKV = 4, 2  # GQA: query heads 0, 1 read kv head 0; 2, 3 read kv head 1


def _allowed(q_pos, S, window):
    """Key positions a query at q_pos sees: causal, and kv_idx > q_idx - window if windowed."""
    kv = np.arange(S)
    keep = kv <= q_pos
    if window > 0:
        keep &= kv > q_pos - window
    return keep


def _attention_ref(q, k, v, pos0, window, scale):
    T, nH, D = q.shape
    nKV, S, _ = k.shape
    out = np.zeros((T, nH, D))
    for t in range(T):
        keep = _allowed(pos0 + t, S, window)
        for h in range(nH):
            kh = h // (nH // nKV)
            s = (k[kh][keep].astype(np.float64) @ q[t, h].astype(np.float64)) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[kh][keep].astype(np.float64)
    return out


def _attention(q, k, v, pos0, window, scale, n_threads=1):
    out = np.full_like(q, np.nan)
    kern.attention(q, k, v, pos0, window, scale, out, n_threads)
    return out


def _cache(rng, S, D, pos0, T, window):
    """k, v caches with NaN wherever no query of this call may look."""
    k = _f32(rng, (NKV, S, D))
    v = _f32(rng, (NKV, S, D))
    k[:, pos0 + T:] = v[:, pos0 + T:] = np.nan
    if window > 0:
        first = max(0, pos0 - window + 1)  # earliest key the first query sees
        k[:, :first] = v[:, :first] = np.nan
    return k, v


@threads
@pytest.mark.parametrize("pos0", [0, 6])
@pytest.mark.parametrize("window", [0, -1, 1, 3, 100])
def test_attention_matches_softmax_reference(n_threads, pos0, window):
    rng = _rng(11, pos0, window + 1)
    T, D, S = 5, 24, 16
    q = _f32(rng, (T, NH, D), scale=2.0)
    k, v = _cache(rng, S, D, pos0, T, window)
    scale = 1.0 / np.sqrt(D)
    out = _attention(q, k, v, pos0, window, np.float32(scale), n_threads)
    assert np.isfinite(out).all()  # no masked (NaN) key or value was read
    np.testing.assert_allclose(out, _attention_ref(q, k, v, pos0, window, np.float32(scale)),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("pos0", [0, 4])
@pytest.mark.parametrize("window", [0, 1, 3, 6])
def test_attention_includes_exactly_the_window_keys(pos0, window):
    # q = 0: uniform weights over the included keys; v one-hot in the key position and
    # scaled by (kv head + 1), so out[t, h, s] = (kv_head(h) + 1) / n_keys if key s is included.
    T, S = 5, 16
    q = np.zeros((T, NH, S), np.float32)
    k = np.ones((NKV, S, S), np.float32)
    v = np.stack([np.eye(S, dtype=np.float32) * (kv + 1) for kv in range(NKV)])
    out = _attention(q, k, v, pos0, window, 0.25)
    for t in range(T):
        keep = _allowed(pos0 + t, S, window)
        assert keep[pos0 + t] and (window <= 0 or keep.sum() == min(window, pos0 + t + 1))
        for h in range(NH):
            expected = np.where(keep, (h // 2 + 1) / keep.sum(), 0.0)
            np.testing.assert_allclose(out[t, h], expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("window", [0, 64])
def test_attention_threads_bit_equal_and_rows_alone(window):
    rng = _rng(12, window)
    T, D, S, pos0 = 32, 128, 240, 200  # enough work per query for the threads to overlap
    assert T * NH * (pos0 + T) * D * 2 >= PARALLEL_WORK
    q = _f32(rng, (T, NH, D))
    k, v = _cache(rng, S, D, pos0, T, window)
    one = _attention(q, k, v, pos0, window, 0.2, 1)
    assert np.array_equal(one, _attention(q, k, v, pos0, window, 0.2, 2))
    # A query's result does not depend on the other queries in the call (decode == prefill).
    for t in range(T):
        alone = _attention(q[t:t + 1].copy(), k, v, pos0 + t, window, 0.2, 1)
        assert np.array_equal(alone[0], one[t])


def test_attention_window_as_long_as_context_equals_no_window():
    rng = _rng(13)
    T, D, S = 4, 16, 8
    q = _f32(rng, (T, NH, D))
    k, v = _f32(rng, (NKV, S, D)), _f32(rng, (NKV, S, D))
    assert np.array_equal(_attention(q, k, v, 4, 0, 0.25), _attention(q, k, v, 4, 8, 0.25))
    assert not np.array_equal(_attention(q, k, v, 4, 0, 0.25), _attention(q, k, v, 4, 7, 0.25))


def test_attention_rejects_invalid_shapes():
    T, D, S = 2, 8, 6
    q = np.zeros((T, NH, D), np.float32)
    k = np.zeros((NKV, S, D), np.float32)
    out = np.zeros_like(q)

    def bad(match, q=q, k=k, v=k, pos0=0, out=out, n_threads=1):
        with pytest.raises(ValueError, match=match):
            kern.attention(q, k, v, pos0, 0, 0.5, out, n_threads)

    bad("query heads not a multiple", q=np.zeros((T, 3, D), np.float32), out=np.zeros((T, 3, D), np.float32))
    bad("attention: q", k=np.zeros((NKV, S, D + 1), np.float32))
    bad("attention: q", v=np.zeros((NKV, S + 1, D), np.float32))
    bad("attention: out", out=np.zeros((T, NH, D + 1), np.float32))
    bad("exceed cache", pos0=S - 1)
    bad("exceed cache", pos0=-1)
    bad("q: dtype", q=q.astype(np.float64))
    bad("k_cache: expected 3 dimensions", k=np.zeros((S, D), np.float32))
    bad("q: must be C-contiguous", q=np.zeros((T, NH, 2 * D), np.float32)[:, :, ::2])
    frozen = np.zeros_like(q)
    frozen.flags.writeable = False
    bad("out: output must be writable", out=frozen)
    bad("n_threads", n_threads=0)


# ------------------------------------------------------------------ routing

def _route(logits, top_k, renormalize):
    T = logits.shape[0]
    ids = np.full((T, top_k), -7, np.int32)
    weights = np.full((T, top_k), np.nan, np.float32)
    kern.route(logits, top_k, renormalize, ids, weights)
    return ids, weights


def _route_ref(logits, top_k, renormalize):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :top_k]  # descending, ties -> lower id
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w /= w.sum(axis=1, keepdims=True)
    return ids, w


@pytest.mark.parametrize("E, top_k", [(8, 1), (8, 2), (8, 8), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_softmax_top_k(E, top_k, renormalize):
    logits = _f32(_rng(14, E, top_k), (6, E), scale=2.0)
    ids, weights = _route(logits, top_k, renormalize)
    ref_ids, ref_w = _route_ref(logits, top_k, renormalize)
    assert ids.dtype == np.int32
    assert np.array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=0)
    assert np.all(np.diff(weights, axis=1) <= 0)  # rank order: descending
    sums = weights.astype(np.float64).sum(axis=1)
    if renormalize:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
    elif top_k < E:
        assert np.all(sums < 0.999)


def test_route_ties_go_to_the_lower_id():
    logits = np.array([[1, 3, 3, 0, 3, 2],
                       [5, 5, 5, 5, 5, 5],
                       [4, 1, 2, 2, 0, 2],
                       [0, 0, 9, 0, 0, 0]], np.float32)
    ids, weights = _route(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3], [0, 2, 3, 5], [2, 0, 1, 3]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2]
    assert np.all(weights[1] == weights[1, 0])
    np.testing.assert_allclose(weights[1], 1 / 6, rtol=1e-6)
    ids, weights = _route(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1], [0, 2], [2, 0]]
    np.testing.assert_allclose(weights[:2], 0.5, rtol=1e-6)
    np.testing.assert_allclose(weights[2], [1 / (1 + np.exp(-2)), 1 / (1 + np.exp(2))], rtol=1e-6)


def test_route_renormalize_changes_only_the_scale():
    logits = np.log(np.array([[0.5, 0.2, 0.2, 0.1]], np.float32))
    ids, raw = _route(logits, 2, False)
    ids_n, norm = _route(logits, 2, True)
    assert ids.tolist() == ids_n.tolist() == [[0, 1]]
    np.testing.assert_allclose(raw, [[0.5, 0.2]], rtol=1e-6)
    np.testing.assert_allclose(norm, [[0.5 / 0.7, 0.2 / 0.7]], rtol=1e-6)


def test_route_rejects_bad_arguments():
    logits = np.zeros((2, 4), np.float32)
    ids, weights = np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32)
    for top_k in (0, 5):
        with pytest.raises(ValueError, match=f"top_k {top_k} not in"):
            kern.route(logits, top_k, True, np.zeros((2, top_k), np.int32),
                       np.zeros((2, top_k), np.float32))
    with pytest.raises(ValueError, match="ids"):
        kern.route(logits, 2, True, ids.astype(np.int64), weights)
    with pytest.raises(ValueError, match="route"):
        kern.route(logits, 2, True, np.zeros((2, 3), np.int32), weights)
    with pytest.raises(ValueError, match="route"):
        kern.route(logits, 2, True, ids, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="router_logits: dtype"):
        kern.route(logits.astype(np.float64), 2, True, ids, weights)


def test_route_never_returns_an_invalid_expert_id():
    for bad in (np.nan, np.inf, -np.inf):
        logits = np.array([[0.0, 1.0, 2.0], [bad, 0.0, 1.0]], np.float32)
        ids = np.zeros((2, 1), np.int32)
        with pytest.raises(ValueError, match="NaN or inf"):
            kern.route(logits, 1, True, ids, np.zeros((2, 1), np.float32))


# ------------------------------------------------------------- expert FFN

H, I = 40, 56  # 40 = 32 + 8 tail; 56 = 32 + 16 + 8 tail


def _experts(rng, n, dtype):
    gates = [_weights(rng, (I, H), dtype, H ** -0.5) for _ in range(n)]
    ups = [_weights(rng, (I, H), dtype, H ** -0.5) for _ in range(n)]
    downs = [_weights(rng, (H, I), dtype, I ** -0.5) for _ in range(n)]
    return gates, ups, downs


def _silu(g):
    return g / (1.0 + np.exp(-g))


def _ffn(gates, ups, downs, x, sizes, n_threads=1):
    """Run expert_ffn on groups of the given sizes; returns (out [N, H], hbuf [N, I])."""
    group_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(group_start[-1])
    assert x.shape == (N, H)
    hbuf = np.full((N, I), np.nan, np.float32)
    out = np.full((N, H), np.nan, np.float32)
    kern.expert_ffn(gates, ups, downs, x, group_start, hbuf, out, n_threads)
    return out, hbuf


def _assert_ffn_close(out, hbuf, gate, up, down, x):
    """Both stages of y = down @ (silu(gate @ x) * (up @ x)) against float64."""
    g64, u64, d64, x64 = (a.astype(np.float64) for a in (gate, up, down, x))
    g, u = x64 @ g64.T, x64 @ u64.T  # [n, I]
    h = _silu(g) * u
    gb, ub = np.abs(x64) @ np.abs(g64).T, np.abs(x64) @ np.abs(u64).T
    assert np.all(np.abs(hbuf - h) <= RTOL * gb * ub + RTOL * np.abs(h))
    h_got = hbuf.astype(np.float64)
    assert np.all(np.abs(out - h_got @ d64.T) <= RTOL * (np.abs(h_got) @ np.abs(d64).T))
    y = h @ d64.T  # the end-to-end reference
    assert np.all(np.abs(out - y) <= 4 * RTOL * ((gb * ub) @ np.abs(d64).T))


@wdtypes
@threads
def test_expert_ffn_matches_swiglu_reference(wdtype, n_threads):
    rng = _rng(15)
    sizes = [3, 0, 9, 1, 4]  # an empty group; 9 = two passes of four tokens + one
    gates, ups, downs = _experts(rng, len(sizes), wdtype)
    x = _f32(rng, (sum(sizes), H))
    out, hbuf = _ffn(gates, ups, downs, x, sizes, n_threads)
    assert np.isfinite(out).all()  # every row written
    start = 0
    for k, n in enumerate(sizes):
        rows = slice(start, start + n)
        _assert_ffn_close(out[rows], hbuf[rows], gates[k], ups[k], downs[k], x[rows])
        start += n


@wdtypes
@threads
def test_expert_ffn_result_independent_of_group_size_and_neighbours(wdtype, n_threads):
    rng = _rng(16)
    gates, ups, downs = _experts(rng, 2, wdtype)
    x = _f32(rng, (9, H))
    nine, _ = _ffn(gates[:1], ups[:1], downs[:1], x, [9], n_threads)
    for t in range(9):
        alone, _ = _ffn(gates[:1], ups[:1], downs[:1], x[t:t + 1].copy(), [1], n_threads)
        assert np.array_equal(alone[0], nine[t]), f"token {t}"
    four, _ = _ffn(gates[:1], ups[:1], downs[:1], x[:4].copy(), [4], n_threads)
    assert np.array_equal(four, nine[:4])
    # Same expert's group behind another expert's group (row offset 3) and a reversed batch.
    xx = np.concatenate([_f32(rng, (3, H)), x])
    mixed, _ = _ffn(gates[::-1], ups[::-1], downs[::-1], xx, [3, 9], n_threads)
    assert np.array_equal(mixed[3:], nine)
    rev, _ = _ffn(gates[:1], ups[:1], downs[:1], x[::-1].copy(), [9], n_threads)
    assert np.array_equal(rev[::-1], nine)


@wdtypes
def test_expert_ffn_one_and_two_threads_bit_equal(wdtype):
    rng = _rng(17)
    sizes = [5, 0, 2, 9, 1, 13, 17]
    assert 3 * sum(sizes) * H * I >= PARALLEL_WORK
    gates, ups, downs = _experts(rng, len(sizes), wdtype)
    x = _f32(rng, (sum(sizes), H))
    out1, h1 = _ffn(gates, ups, downs, x, sizes, 1)
    out2, h2 = _ffn(gates, ups, downs, x, sizes, 2)
    assert np.array_equal(out1, out2) and np.array_equal(h1, h2)


def test_expert_ffn_read_only_misaligned_weights_bit_equal(tmp_path):
    rng = _rng(18)
    dtype = np.dtype(ml_dtypes.bfloat16)
    gates, ups, downs = _experts(rng, 2, dtype)
    x = _f32(rng, (6, H))
    expected, _ = _ffn(gates, ups, downs, x, [4, 2])
    maps = []
    for i, w in enumerate(gates + ups + downs):
        w.tofile(tmp_path / f"{i}.bin")
        maps.append(np.memmap(tmp_path / f"{i}.bin", dtype=dtype, mode="r", shape=w.shape))
    got, _ = _ffn(maps[0:2], maps[2:4], maps[4:6], x, [4, 2])
    assert np.array_equal(got, expected)
    placed = [_placed(w, 2 + 6 * i) for i, w in enumerate(gates + ups + downs)]
    got, _ = _ffn(placed[0:2], placed[2:4], placed[4:6], x, [4, 2])
    assert np.array_equal(got, expected)


def test_expert_ffn_rejects_bad_arguments():
    rng = _rng(19)
    gates, ups, downs = _experts(rng, 2, np.float32)
    x = _f32(rng, (3, H))
    gs = np.array([0, 2, 3], np.int64)

    def bad(match, gates=gates, ups=ups, downs=downs, x=x, gs=gs, hbuf=None, out=None):
        hbuf = np.zeros((3, I), np.float32) if hbuf is None else hbuf
        out = np.full((3, H), np.nan, np.float32) if out is None else out
        with pytest.raises(ValueError, match=match):
            kern.expert_ffn(gates, ups, downs, x, gs, hbuf, out, 1)

    bad("differ in length", ups=ups[:1])
    bad("group_start", gs=np.array([0, 3], np.int64))
    bad("group_start", gs=gs.astype(np.int32))
    bad("group_start must run from 0", gs=np.array([1, 2, 3], np.int64))
    bad("group_start must run from 0", gs=np.array([0, 2, 2], np.int64))
    bad("non-decreasing", gs=np.array([0, 4, 3], np.int64), x=_f32(rng, (3, H)))
    bad(r"ups\[1\]: format float16 differs from gates\[0\] \(float32\)", ups=[ups[0], ups[1].astype(np.float16)])
    bad(r"gates\[1\]: unsupported weight dtype", gates=[gates[0], gates[1].astype(np.float64)])
    bad(r"downs\[1\]: shape", downs=[downs[0], downs[1].T.copy()])
    bad(r"gates\[0\]: shape", gates=[gates[0][:, :H - 1].copy(), gates[1][:, :H - 1].copy()])
    bad(r"gates\[1\]: must be C-contiguous", gates=[gates[0], np.asfortranarray(gates[1])])
    bad("expert_ffn: x", hbuf=np.zeros((3, I + 1), np.float32))
    bad("expert_ffn: x", out=np.zeros((3, H + 1), np.float32))
    bad("x: dtype", x=x.astype(np.float64))
    frozen = np.zeros((3, H), np.float32)
    frozen.flags.writeable = False
    bad("out: output must be writable", out=frozen)
    frozen = np.zeros((3, I), np.float32)
    frozen.flags.writeable = False
    bad("hbuf: output must be writable", hbuf=frozen)


# ---------------------------------------------------------------- combine

def _combine(y, rows, weights):
    out = np.full((rows.shape[0], y.shape[1]), np.nan, np.float32)
    kern.combine_experts(y, rows, weights, out)
    return out


def test_combine_experts_sums_in_rank_order_skipping_minus_one():
    rng = _rng(20)
    N, T, K = 7, 4, 3
    y = _f32(rng, (N, H))
    rows = np.array([[0, 1, 2], [3, -1, 4], [-1, -1, -1], [6, 5, 0]], np.int64)
    weights = _f32(rng, (T, K))
    out = _combine(y, rows, weights)
    ref32 = np.zeros((T, H), np.float32)  # the documented order, in f32
    ref64 = np.zeros((T, H))
    for t in range(T):
        for r in range(K):
            if rows[t, r] >= 0:
                ref32[t] = ref32[t] + weights[t, r] * y[rows[t, r]]
                ref64[t] += np.float64(weights[t, r]) * y[rows[t, r]].astype(np.float64)
    assert np.array_equal(out, ref32)
    np.testing.assert_allclose(out, ref64, rtol=1e-5, atol=1e-6)
    assert np.all(out[2] == 0)


def test_combine_experts_order_is_rank_order():
    # In f32, (1e8 + 1) - 1e8 == 0 while (1e8 - 1e8) + 1 == 1: the order is observable.
    y = np.array([[1e8], [1.0], [-1e8]], np.float32)
    w = np.ones((1, 3), np.float32)
    assert _combine(y, np.array([[0, 1, 2]], np.int64), w)[0, 0] == 0.0
    assert _combine(y, np.array([[0, 2, 1]], np.int64), w)[0, 0] == 1.0
    assert _combine(y, np.array([[0, -1, 2]], np.int64), w)[0, 0] == 0.0


def test_combine_experts_rejects_bad_arguments():
    y = np.zeros((3, 4), np.float32)
    rows = np.array([[0, 1]], np.int64)
    w = np.ones((1, 2), np.float32)
    out = np.zeros((1, 4), np.float32)
    with pytest.raises(ValueError, match=r"rows\[0, 1\] = 3 not in \[-1, 3\)"):
        kern.combine_experts(y, np.array([[0, 3]], np.int64), w, out)
    with pytest.raises(ValueError, match=r"rows\[0, 0\] = -2 not in \[-1, 3\)"):
        kern.combine_experts(y, np.array([[-2, 1]], np.int64), w, out)
    with pytest.raises(ValueError, match="rows"):
        kern.combine_experts(y, rows.astype(np.int32), w, out)
    with pytest.raises(ValueError, match="combine_experts"):
        kern.combine_experts(y, rows, np.ones((1, 3), np.float32), out)
    with pytest.raises(ValueError, match="combine_experts"):
        kern.combine_experts(y, rows, w, np.zeros((1, 5), np.float32))
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: output must be writable"):
        kern.combine_experts(y, rows, w, out)


# ------------------------------------------------- route -> experts -> combine

def _moe(x, router, experts, top_k, n_threads=1):
    """The MoE block from the kernels: route, group by expert, expert_ffn, combine."""
    gates, ups, downs = experts
    T, E = x.shape[0], router.shape[0]
    logits = _matmul(router, x)  # [T, E]
    ids, weights = _route(logits, top_k, True)  # [T, K]
    order = [(t, r) for e in range(E) for t in range(T) for r in range(top_k) if ids[t, r] == e]
    sizes = [int((ids == e).sum()) for e in range(E)]
    rows = np.full((T, top_k), -1, np.int64)
    for n, (t, r) in enumerate(order):
        rows[t, r] = n
    xg = np.ascontiguousarray(x[[t for t, _ in order]])  # [N, H] grouped by expert
    y, _ = _ffn(gates, ups, downs, xg, sizes, n_threads)
    return _combine(y, rows, weights), ids, weights, sizes


@wdtypes
@threads
def test_moe_block_matches_reference_and_is_batch_invariant(wdtype, n_threads):
    rng = _rng(21)
    E, K, T = 4, 2, 9
    experts = _experts(rng, E, wdtype)
    router = _weights(rng, (E, H), wdtype, H ** -0.5)
    x = _f32(rng, (T, H))
    out, ids, weights, sizes = _moe(x, router, experts, K, n_threads)
    assert max(sizes) >= 5 and sum(sizes) == T * K
    gates, ups, downs = ([a.astype(np.float64) for a in ws] for ws in experts)
    for t in range(T):
        x64 = x[t].astype(np.float64)
        ref = sum(np.float64(weights[t, r]) *
                  (downs[e] @ (_silu(gates[e] @ x64) * (ups[e] @ x64)))
                  for r, e in enumerate(ids[t]))
        bound = sum(np.abs(downs[e]) @ ((np.abs(gates[e]) @ np.abs(x64)) * (np.abs(ups[e]) @ np.abs(x64)))
                    for e in ids[t])
        assert np.all(np.abs(out[t] - ref) <= 4 * RTOL * bound)
    for t in range(T):
        alone, *_ = _moe(x[t:t + 1].copy(), router, experts, K, n_threads)
        assert np.array_equal(alone[0], out[t]), f"token {t}"


def test_expert_ffn_rejects_non_arrays_and_rows_without_experts():
    w = np.ones((2, 4), np.float32)
    args = (np.ones((1, 4), np.float32), np.array([0, 1], np.int64), np.zeros((1, 2), np.float32),
            np.zeros((1, 4), np.float32), 1)
    with pytest.raises(ValueError, match=r"gates\[0\]: expected a numpy array"):
        kern.expert_ffn([memoryview(w)], [w], [w.T.copy()], *args)
    with pytest.raises(ValueError, match="no experts"):
        kern.expert_ffn([], [], [], np.ones((1, 4), np.float32), np.array([0], np.int64),
                        np.zeros((1, 2), np.float32), np.zeros((1, 4), np.float32), 1)
