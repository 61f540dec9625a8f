"""Fast numerics ("q8x2-32": activations per block of 32 as two int8 planes, the codes and
their residual, exact integer block dots of each plane, a fixed f32 combination) in the
kernels, against tests/fast_reference.py, the independent numpy reading of the
specification.

What is checked, bit for bit: `quantize_activations` (zero blocks, ties x / d = n + 1/2,
subnormal and huge magnitudes, one dominant element, residuals the second plane clamps,
second-plane scales that underflow to 0); `matmul(..., fast=True)` and
`_matmul_portable(..., fast=True)` for int8, int4 with and without mins and MXFP4, group
sizes 32, 64 and 128, row counts that fill no SIMD register, 1, 3 and 9 tokens, 1 and 2
threads, extreme scales; the placement promises (a mat-mat row is its mat-vec, a row
does not depend on its neighbours, the thread count or the buffers' alignment, and no
kernel touches memory outside its arrays);
`expert_ffn` and `expert_ffn_fused` in fast mode as the composition of fast matmuls;
fast mode leaving dense and FP8 weights exact. Not the specification, a sanity bound:
fast results stay within 1e-4 (relative, in norm) of the exact ones.
"""
import ctypes
import ctypes.util
import mmap
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest

import fast_reference as fr
import quant_reference as ref
from ext.kernels import _kernels as k

F32 = np.float32


def _rng(*key):
    """A generator seeded by `key` (ints, bools and strings)."""
    return np.random.default_rng([20261204, *(zlib.crc32(v.encode()) if isinstance(v, str) else int(v)
                                              for v in key)])


def _same(a, b):
    """Bit-equal float32 arrays, except that any NaN equals any NaN (a NaN's payload and
    sign are not what the specification fixes)."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    if not np.array_equal(nan, np.isnan(b)):
        return False
    return np.array_equal(np.where(nan, 0, a.view(np.uint32)), np.where(nan, 0, b.view(np.uint32)))


def _first_difference(got, want):
    bad = np.argwhere(~((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))))
    if not len(bad):
        return "none"
    i = tuple(bad[0])
    return f"{len(bad)} differ, first at {i}: got {got[i]!r} want {want[i]!r}"


# ------------------------------------------------------------------ weights

# variant -> (fmt, group size, with mins)
VARIANTS = {
    "int8-g32": ("int8", 32, False),
    "int8-g64": ("int8", 64, False),
    "int8-g128": ("int8", 128, False),
    "int4-g32": ("int4", 32, False),
    "int4-g64": ("int4", 64, False),
    "int4-g128": ("int4", 128, False),
    "int4-g32-mins": ("int4", 32, True),
    "int4-g64-mins": ("int4", 64, True),
    "int4-g128-mins": ("int4", 128, True),
    "mxfp4": ("mxfp4", 32, False),
}


def _parts(variant, R, C, rng):
    """(fmt, codes, scales, mins or None): a random weight [R, C] of the variant."""
    fmt, g, mins = VARIANTS[variant]
    if fmt == "int8":
        return (fmt, *ref.random_int8(rng, R, C, g), None)
    if fmt == "int4":
        return (fmt, *ref.random_int4(rng, R, C, g, mins))
    return (fmt, *ref.random_mxfp4(rng, R, C), None)


def _weight(parts):
    fmt, codes, scales, mins = parts
    return k.QuantizedWeight(fmt, codes, scales, mins)


def _reference(parts, x):
    return fr.fast_matmul(*parts, x)


def _matmul(w, x, n_threads=1, fn=None, fast=True):
    out = np.full((x.shape[0], w.shape[0]), np.nan, F32)
    (fn or k.matmul)(w, x, out, n_threads, fast=fast)
    return out


# Column counts: 32 (one block), 416 (13 blocks: no power of two), 4096; groups of 64
# and 128 need C a multiple of them, so they take 384 instead of 32 and 416.
def _fast_cases():
    for variant, (fmt, g, _) in VARIANTS.items():
        for C in (32, 416, 4096) if g == 32 else (384, 4096):
            yield pytest.param(variant, C, id=f"{variant}-{C}")


# ------------------------------------------------------------- the reference itself

def _scalar_reading(parts, x):
    """Spec sections 1-4 one number at a time (numpy float32 scalars, Python ints), with
    its own E2M1 table: a second reading of the specification that the vectorised
    fast_reference must agree with bit for bit."""
    fmt, codes, scales, mins = parts
    T, C = x.shape
    R = codes.shape[0]
    e2m1_doubled = [0, 1, 2, 3, 4, 6, 8, 12]  # 2 x {0, 0.5, 1, 1.5, 2, 3, 4, 6}

    def code(r, i):
        if fmt == "int8":
            return int(codes[r, i])
        if fmt == "int4":
            byte = int(codes[r, i // 2])
            nib = byte & 15 if i % 2 == 0 else byte >> 4
            return nib if mins is not None else nib - 8
        byte = int(codes[r, i // 32, (i % 32) // 2])
        nib = byte & 15 if i % 2 == 0 else byte >> 4
        return -e2m1_doubled[nib & 7] if nib & 8 else e2m1_doubled[nib & 7]

    def scale(r, b):
        if fmt == "mxfp4":
            e = int(scales[r, b])
            return F32(np.nan) if e == 255 else F32(2.0 ** (e - 128))
        g = C // scales.shape[1]
        return F32(scales[r, b * 32 // g])

    y = np.zeros((T, R), F32)
    for t in range(T):
        for r in range(R):
            acc = F32(0.0)
            for b in range(C // 32):
                xs = [F32(v) for v in x[t, 32 * b:32 * b + 32]]
                d = max(abs(v) for v in xs) / F32(127.0)
                e = d / F32(254.0)
                q1 = [0 if d == 0 else int(min(max(np.rint(v / d), -127), 127)) for v in xs]
                res = [v - F32(q) * d for v, q in zip(xs, q1)]
                q2 = [0 if e == 0 else int(min(max(np.rint(v / e), -127), 127)) for v in res]
                S1 = sum(code(r, 32 * b + i) * q1[i] for i in range(32))
                S2 = sum(code(r, 32 * b + i) * q2[i] for i in range(32))
                term = F32(S1) * (scale(r, b) * d)
                term = term + F32(S2) * (scale(r, b) * e)
                if mins is not None:
                    m = F32(mins[r, b * 32 // (C // mins.shape[1])])
                    term = term + m * (d * F32(sum(q1)) + e * F32(sum(q2)))
                acc = acc + term
            y[t, r] = acc
    return y


@pytest.mark.parametrize("variant", ["int8-g64", "int4-g32", "int4-g64-mins", "mxfp4"])
def test_reference_agrees_with_a_scalar_reading_and_with_float64(variant):
    rng = _rng(1, variant)
    parts = _parts(variant, 3, 128, rng)
    x = rng.standard_normal((2, 128), dtype=F32)
    x[1, 32:64] = 0
    y = _reference(parts, x)
    assert y.dtype == F32 and y.shape == (2, 3)
    assert _same(y, _scalar_reading(parts, x))
    # Loosely the exact product of the dequantised weight (about 1/(254 * 254) of each
    # block's largest term).
    fmt, codes, scales, mins = parts
    values = {"int8": lambda: ref.dequantize_int8(codes, scales),
              "int4": lambda: ref.dequantize_int4(codes, scales, mins),
              "mxfp4": lambda: ref.dequantize_mxfp4(codes, scales)}[fmt]().astype(np.float64)
    x64 = x.astype(np.float64)
    assert np.all(np.abs(y - x64 @ values.T) <= 1e-4 * (np.abs(x64) @ np.abs(values).T))


def test_reference_quantisation_invariants():
    x = _rng(2).standard_normal((4, 416), dtype=F32) * F32(3.0)
    q1, q2, d, e, s1, s2 = fr.quantize_activations(x)
    assert (q1.dtype, q2.dtype, d.dtype, e.dtype, s1.dtype, s2.dtype) == (np.int8, np.int8, F32, F32,
                                                                          np.int32, np.int32)
    assert q1.shape == q2.shape == x.shape and d.shape == e.shape == s1.shape == s2.shape == (4, 13)
    assert np.abs(q1.astype(np.int32)).max() <= 127 and np.abs(q2.astype(np.int32)).max() <= 127
    blocks = q1.reshape(4, 13, 32)
    assert np.array_equal(np.abs(blocks.astype(np.int32)).max(axis=2), np.full((4, 13), 127))
    assert np.array_equal(blocks.sum(axis=2, dtype=np.int32), s1)
    assert np.array_equal(q2.reshape(4, 13, 32).sum(axis=2, dtype=np.int32), s2)
    assert _same(e, d / F32(254.0))
    dd, ee = np.repeat(d, 32, axis=1).astype(np.float64), np.repeat(e, 32, axis=1).astype(np.float64)
    assert np.all(np.abs(q1 * dd - x) <= 0.5001 * dd)
    # The second plane holds the residual: together they are within about half a step of e.
    assert np.all(np.abs(q1 * dd + q2 * ee - x) <= 0.51 * ee)   # up to the roundings of r
    assert np.abs(q2.astype(np.int32)).max() >= 120


# ------------------------------------------------------- activation quantisation

def _division_ties(rng):
    """One block of 32 whose values x / d round (half to even) differently from
    x * (1 / d): the specification divides, a reciprocal would not give its bits. Element
    0 is the block's largest |x|, a, with d = a / 127 not a power of two."""
    while True:
        a = F32(rng.uniform(0.5, 4.0))
        d = a / F32(127.0)
        inv = F32(1.0) / d
        base = (np.arange(-126, 126, dtype=F32) + F32(0.5)) * d
        near = [base]
        for direction in (np.inf, -np.inf):
            v = base
            for _ in range(2):
                v = np.nextafter(v, F32(direction))
                near.append(v)
        near = np.concatenate(near).astype(F32)
        near = near[(np.abs(near) < a) & (np.rint(near / d) != np.rint(near * inv))]
        if near.size >= 31:
            return np.concatenate([[a], rng.choice(near, 31, replace=False)]).astype(F32)


# Multiples k of the least subnormal 2^-149 with largest |k| 190: d = 190/127 * 2^-149
# rounds to 2^-149, so x / d = k and the clamp to +-127 acts.
SUBNORMAL_STEPS = [190, -190, 189, -150, 128, -128, 127, 100, -64, 3, -1, 1, 0] + [2] * 19


# Blocks of subnormal multiples k of 2^-149 (integers of that unit), whose residuals the
# second plane clamps: the largest |k|, 127 * D, gives d = D units exactly, and e = D / 254
# rounds down to E units, so a residual r = k - D * q1 (exact) of |r| > 127 E gives
# r / e beyond 127 (r / E rounds half to even). The residuals stay below D / 2 (no ties
# of x / d), around random multiples of D.
CLAMP_UNITS = {368: (1, [150, -170, 182, -181, 100, -100, 127, 128, -128, 0, 183, -183]),
               600: (2, [299, -298, 255, -255, 254, 253, -253, 1, 2, 3, -299, 299])}


def _clamp_block(D, rng):
    E, residuals = CLAMP_UNITS[D]
    k = [127 * D] + [int(rng.integers(-120, 121)) * D + r for r in residuals]
    k += [int(rng.integers(-126, 127)) * D + int(rng.integers(-D // 2, D // 2 + 1)) for _ in range(32 - len(k))]
    return np.ldexp(np.array(k, F32), -149)


def _special_activations():
    """[3, 640] float32: every row a run of 20 blocks of 32, each exercising one rule (row 1
    holds values near the top of the range, which make the products overflow)."""
    rng = _rng(3)
    T, nb = 3, 20
    x = rng.standard_normal((T, nb, 32)).astype(F32)
    x[:, 0] = 0                                          # d = 0: q = 0, s = 0
    x[0, 1] = -0.0                                       # negative zeros
    # d = 127 / 127 = 1 exactly: x / d = n + 1/2 ties go to the even neighbour
    x[:, 2] = np.arange(32, dtype=F32) - F32(15.5)
    x[:, 2, 31] = 127.0
    x[:, 3, :8] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5]
    x[:, 3, 8:] = 3.0
    x[:, 3, 31] = -127.0
    x[:, 4] = F32(63.5) * rng.choice([-1, 1], 32).astype(F32)  # d = 0.5, x / d = +-127
    x[:, 4, :6] = [1.25, -1.25, 0.75, 0.25, -0.25, 62.25]   # ties of d = 0.5
    x[:, 5] *= F32(1e-41)                                # subnormal: d has few bits
    x[:, 6] = 0
    x[:, 6, 7] = F32(1e-45)                              # the least subnormal: d = 0
    x[:, 7] *= F32(1e6)
    x[1, 7] *= F32(1e31)                                 # huge (in one row: it makes inf)
    x[1, 7, 3] = -np.finfo(F32).max
    x[:, 8] *= F32(1e-3)
    x[:, 8, 17] = 1e4                                    # one dominant element: most q = 0
    x[:, 9] = F32(1e-30) * rng.standard_normal(32).astype(F32)
    x[:, 10] = rng.integers(-127, 128, 32).astype(F32) * F32(0.125)  # exact multiples of d
    x[:, 10, 0] = 127 * 0.125
    x[:, 11] = np.float32(2.0 ** -126)                   # least normal everywhere
    x[:, 12] = -F32(7.0)                                 # one value: q = -127 each
    x[2, 13] = rng.standard_normal(32).astype(F32) * F32(1e20)
    for t in range(T):
        x[t, 14] = _division_ties(rng) * (F32(-1.0) if t == 1 else F32(1.0))
    x[:, 15] = np.ldexp(np.array(SUBNORMAL_STEPS, F32), -149)
    for t in range(T):                                   # the second plane clamps
        x[t, 16] = _clamp_block(368, rng)
        x[t, 17] = -_clamp_block(600, rng) if t == 1 else _clamp_block(600, rng)
    # d = 100 units of 2^-149, e = 100/254 of one rounds to 0: q2 = 0 with r != 0
    x[:, 18] = np.ldexp(rng.integers(-12700, 12701, (T, 32)).astype(F32), -149)
    x[:, 18, 5] = np.ldexp(F32(-12700.0), -149)
    x[:, 19] = rng.standard_normal((T, 32)).astype(F32) * F32(1e3)
    assert x.dtype == F32
    return x.reshape(T, nb * 32)


def _quantize(x):
    """The kernels' quantize_activations(x, q1, q2, d, e, s1, s2), into arrays filled with
    junk first."""
    T, C = x.shape
    q1, q2 = np.full((T, C), 99, np.int8), np.full((T, C), -99, np.int8)
    d, e = np.full((T, C // 32), np.nan, F32), np.full((T, C // 32), np.nan, F32)
    s1, s2 = np.full((T, C // 32), -99999, np.int32), np.full((T, C // 32), 99999, np.int32)
    k.quantize_activations(x, q1, q2, d, e, s1, s2)
    return q1, q2, d, e, s1, s2


def _assert_same_quantisation(got, want):
    for name, g, w in zip(("q1", "q2", "d", "e", "s1", "s2"), got, want):
        if g.dtype == F32:
            assert _same(g, w), f"{name}: {_first_difference(g, w)}"
        else:
            assert g.dtype == w.dtype and np.array_equal(g, w), f"{name}: {np.argwhere(g != w)[:5]}"


def _assert_quantised_equal(x):
    _assert_same_quantisation(_quantize(x), fr.quantize_activations(x))


def test_quantize_activations_special_blocks():
    x = _special_activations()
    _assert_quantised_equal(x)
    q, q2, d, e, s, s2 = fr.quantize_activations(x)
    # The reference does what the cases were built for.
    assert not q[:, :32].any() and not s[:, 0].any() and not d[:, 0].any()
    assert not q2[:, :32].any() and not s2[:, 0].any() and not e[:, 0].any()
    assert not q[0, 32:64].any() and s[0, 1] == 0 and d[0, 1] == 0
    assert q[0, 64:96].tolist() == [round(v) for v in np.arange(32) - 15.5][:31] + [127]
    assert q[0, 96:104].tolist() == [0, 0, 2, -2, 2, -2, 126, -126]
    assert q[0, 128:134].tolist() == [2, -2, 2, 0, 0, 124]
    assert not q[:, 192:224].any() and d[0, 6] == 0
    assert np.count_nonzero(q[0, 256:288]) <= 2 and q[0, 256 + 17] == 127
    assert (q[:, 384:416] == -127).all()
    xb, qb = x.reshape(3, 20, 32), q.reshape(3, 20, 32)
    # block 14: division, not a reciprocal; block 15: the clamp
    differs = qb[:, 14, 1:] != np.rint(xb[:, 14, 1:] * (F32(1.0) / d[:, 14:15])).astype(np.int8)
    assert differs.all()
    assert d[0, 15] == 2.0 ** -149
    assert qb[0, 15].tolist() == [127, -127, 127, -127, 127, -127, 127, 100, -64, 3, -1, 1, 0] + [2] * 19
    # the ties of d = 1 leave residuals of exactly +-1/2: 127 steps of e = 1/254
    assert np.abs(q2.reshape(3, 20, 32)[:, 2, :31].astype(np.int32)).tolist() == [[127] * 31] * 3
    # e underflows to 0 while d does not (subnormal blocks): no second plane
    q2b = q2.reshape(3, 20, 32)
    for b in (15, 18):
        assert (d[:, b] != 0).all() and (e[:, b] == 0).all() and not q2b[:, b].any() and not s2[:, b].any()
    assert (xb[:, 18] != qb[:, 18] * d[:, 18:19]).any()   # residuals the second plane drops
    # blocks 16 and 17: the residuals clamped to +-127
    for b, D in ((16, 368), (17, 600)):
        E, residuals = CLAMP_UNITS[D]
        assert (d[:, b] == np.ldexp(F32(D), -149)).all() and (e[:, b] == np.ldexp(F32(E), -149)).all()
        sign = np.array([1, -1, 1] if b == 17 else [1, 1, 1])[:, None]
        want = sign * np.clip(np.rint(np.array(residuals) / E), -127, 127).astype(int)
        assert np.array_equal(q2b[:, b, 1:1 + len(residuals)], want), (b, q2b[:, b, 1:1 + len(residuals)])
        assert (np.abs(q2b[:, b].astype(np.int32)) == 127).sum(axis=1).min() >= 6


@pytest.mark.parametrize("C", [32, 416, 4096])
@pytest.mark.parametrize("T", [1, 3, 9])
def test_quantize_activations_random(C, T):
    rng = _rng(4, C, T)
    x = rng.standard_normal((T, C), dtype=F32) * np.exp2(rng.integers(-20, 20, (T, 1))).astype(F32)
    _assert_quantised_equal(x)


def test_quantize_activations_every_tie():
    # d = 1: every x = n + 1/2 for n in -127 .. 126, one per element.
    halves = np.arange(-127, 127, dtype=F32) + F32(0.5)
    x = np.zeros((1, 32 * 10), F32).reshape(10, 32)
    x[:, 0] = 127.0
    flat = x[:, 1:].reshape(-1)
    flat[:halves.size] = halves
    x[:, 1:] = flat.reshape(10, 31)
    x = x.reshape(1, -1)
    _assert_quantised_equal(x)
    q, q2 = (v.reshape(10, 32)[:, 1:].reshape(-1)[:halves.size] for v in fr.quantize_activations(x)[:2])
    assert np.array_equal(q, np.rint(halves).astype(np.int8)) and not (q % 2).any()
    # the residual +-1/2 is 127 steps of e = 1/254 (which rounds down: 1/2 / e rounds to 127)
    assert np.array_equal(q2.astype(np.int32), np.where(halves > q, 127, -127))


def test_quantize_activations_second_plane_at_its_limit_in_normal_blocks():
    # Residuals of about +-d/2 (x / d near a tie) over the normal range: r / e lands next
    # to +-127 (beyond it only by the roundings of d, e and r), where the clamp and the
    # rounding decide; the kernels agree bit for bit.
    rng = _rng(20)
    T, nb = 4, 40
    d = np.ldexp(F32(1.0), rng.integers(-120, 120, (T, nb))).astype(F32) * rng.uniform(1, 2, (T, nb)).astype(F32)
    n = rng.integers(-126, 127, (T, nb, 32)).astype(F32)
    frac = rng.choice([F32(0.5), F32(-0.5), F32(0.4999), F32(-0.49999997), F32(0.25)], (T, nb, 32))
    x = ((n + frac) * d[:, :, None]).astype(F32)
    x[:, :, 0] = F32(127.0) * d
    x = x.reshape(T, nb * 32)
    _assert_quantised_equal(x)
    q2 = fr.quantize_activations(x)[1]
    assert (np.abs(q2.astype(np.int32)) == 127).mean() > 0.2


def test_quantize_activations_refuses_mismatched_outputs_by_name():
    x = np.zeros((2, 64), F32)
    good = [np.zeros((2, 64), np.int8), np.zeros((2, 64), np.int8), np.zeros((2, 2), F32),
            np.zeros((2, 2), F32), np.zeros((2, 2), np.int32), np.zeros((2, 2), np.int32)]
    k.quantize_activations(x, *good)
    for i, name, bad in ((1, "q2", np.zeros((2, 64), np.uint8)), (3, "e", np.zeros((2, 3), F32)),
                         (5, "s2", np.zeros((2, 2), np.int64)), (0, "q1", np.zeros((2, 32), np.int8))):
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError, match=name):
            k.quantize_activations(x, *args)
    with pytest.raises(TypeError):
        k.quantize_activations(x, *good[:4])   # the version-1 signature (x, q, d, s)


# -------------------------------------------------------------------- matmul

@pytest.mark.parametrize("variant, C", list(_fast_cases()))
@pytest.mark.parametrize("fn", ["matmul", "_matmul_portable"])
def test_fast_matmul_bit_equal_to_reference(variant, C, fn):
    rng = _rng(5, variant, C)
    R = 37  # not a multiple of 8 or 16: full passes of rows, then the rest
    parts = _parts(variant, R, C, rng)
    w = _weight(parts)
    x = rng.standard_normal((9, C), dtype=F32)
    x[4, :32] = 0  # a zero block
    want = _reference(parts, x)
    for T in (1, 3, 9):
        for n_threads in (1, 2):
            got = _matmul(w, x[:T], n_threads, getattr(k, fn))
            assert _same(got, want[:T]), f"T={T} n_threads={n_threads}: {_first_difference(got, want[:T])}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fast_matmul_special_activations(variant):
    rng = _rng(6, variant)
    x = _special_activations()
    parts = _parts(variant, 21, x.shape[1], rng)
    w = _weight(parts)
    with np.errstate(all="ignore"):
        want = _reference(parts, x)
    for fn in (k.matmul, k._matmul_portable):
        got = _matmul(w, x, 2, fn)
        assert _same(got, want), _first_difference(got, want)
        for t in range(3):
            assert _same(_matmul(w, x[t:t + 1], 1, fn), want[t:t + 1]), f"token {t}"


@pytest.mark.parametrize("T", [1, 3])
def test_fast_mxfp4_extreme_scales(T):
    # E8M0 0 (2^-128, a subnormal block scale) and 1, 2 near zero; 253, 254 near the top
    # (products overflow to inf, inf - inf is NaN); 255 is NaN.
    rng = _rng(8, T)
    R, C = 19, 512
    blocks, scales = ref.random_mxfp4(rng, R, C)
    scales[0, :8] = [0, 1, 2, 127, 200, 253, 254, 255]
    scales[1] = 0
    scales[2] = rng.integers(0, 4, C // 32)
    scales[3] = rng.integers(250, 255, C // 32)
    scales[4, 5] = 255
    scales[5] = 254
    scales[6] = rng.integers(0, 255, C // 32)
    parts = ("mxfp4", blocks, scales, None)
    x = rng.standard_normal((T, C), dtype=F32)
    x[:, 64:96] *= F32(1e-38)  # d subnormal too: sw * d underflows in blocks of e = 0
    with np.errstate(all="ignore"):
        want = _reference(parts, x)
    assert np.isnan(want[:, 0]).all() and np.isnan(want[:, 4]).all()
    assert np.isinf(want[:, 5]).any() or np.isnan(want[:, 5]).any()
    assert np.all(np.isfinite(want[:, 1])) and np.all(np.abs(want[:, 1]) < 1e-30)
    w = k.QuantizedWeight("mxfp4", blocks, scales)
    w8 = k.QuantizedWeight("mxfp4", blocks, scales.view(ml_dtypes.float8_e8m0fnu))
    for fn in (k.matmul, k._matmul_portable):
        for ww in (w, w8):
            got = _matmul(ww, x, 2, fn)
            assert _same(got, want), _first_difference(got, want)


@pytest.mark.parametrize("variant", ["int8-g32", "int4-g32", "int4-g32-mins"])
def test_fast_extreme_float16_scales(variant):
    # Zero, negative, subnormal, the largest, inf and NaN scales (and mins): the kernels do
    # not check them (the loader does), the specification still fixes the bits.
    rng = _rng(9, variant)
    fmt, codes, scales, mn = _parts(variant, 11, 256, rng)
    scales[0, :6] = [0.0, -1.0, 2.0 ** -24, 65504.0, np.inf, np.nan]
    scales[1] = 2.0 ** -24  # binary16 subnormal
    scales[2] = 65504.0
    if mn is not None:
        mn[0, :4] = [-65504.0, 2.0 ** -24, -0.0, 0.0]
        mn[3, :3] = [np.inf, -np.inf, np.nan]
        mn[4] = -65504.0
    parts = (fmt, codes, scales, mn)
    x = rng.standard_normal((3, 256), dtype=F32) * F32(1e30)
    x[1] = rng.standard_normal(256).astype(F32) * F32(1e-40)  # subnormal activations
    x[2, 32:64] = 0
    with np.errstate(all="ignore"):
        want = _reference(parts, x)
    w = _weight(parts)
    for fn in (k.matmul, k._matmul_portable):
        got = _matmul(w, x, 2, fn)
        assert _same(got, want), _first_difference(got, want)
        assert _same(_matmul(w, x[1:2], 1, fn), want[1:2])


@pytest.mark.parametrize("fmt, g, mins", [("int8", 96, False), ("int4", 96, True), ("int4", 256, False)],
                         ids=["int8-g96", "int4-g96-mins", "int4-g256"])
def test_fast_other_group_sizes_take_the_scale_of_the_group_holding_the_block(fmt, g, mins):
    # The specification names groups of 32, 64 and 128; the constructor accepts any
    # multiple of 32, and its rule (the scale of the group holding block b) still fixes
    # the bits.
    rng = _rng(19, fmt, g, mins)
    C = 768
    if fmt == "int8":
        parts = (fmt, *ref.random_int8(rng, 21, C, g), None)
    else:
        parts = (fmt, *ref.random_int4(rng, 21, C, g, mins))
    w = _weight(parts)
    x = rng.standard_normal((3, C), dtype=F32)
    want = _reference(parts, x)
    for fn in (k.matmul, k._matmul_portable):
        for T in (1, 3):
            got = _matmul(w, x[:T], 2, fn)
            assert _same(got, want[:T]), _first_difference(got, want[:T])


# ------------------------------------------------------------------ placement

def _row(w, r):
    """The one-row QuantizedWeight of row r of w."""
    mins = None if w.mins is None else w.mins[r:r + 1]
    return k.QuantizedWeight(w.fmt, w.codes[r:r + 1], w.scales[r:r + 1], mins,
                             group_size=w.group_size)


@pytest.mark.parametrize("variant", ["int8-g32", "int4-g64", "int4-g32-mins", "mxfp4"])
def test_fast_rows_do_not_depend_on_tokens_rows_or_threads(variant):
    rng = _rng(10, variant)
    parts = _parts(variant, 37, 640, rng)
    w = _weight(parts)
    x = rng.standard_normal((19, 640), dtype=F32)
    batch = _matmul(w, x, 1)
    assert _same(batch, _reference(parts, x))
    assert _same(_matmul(w, x, 2), batch)
    assert _same(_matmul(w, x, 2, k._matmul_portable), batch)
    for t in range(19):
        assert _same(_matmul(w, x[t:t + 1], 1), batch[t:t + 1]), f"token {t}"
    assert _same(_matmul(w, x[2:7], 2), batch[2:7])
    for r in (0, 8, 15, 16, 36):
        assert _same(_matmul(_row(w, r), x)[:, 0], batch[:, r]), f"row {r}"
    sub = k.QuantizedWeight(w.fmt, w.codes[5:30], w.scales[5:30], None if w.mins is None else w.mins[5:30])
    assert _same(_matmul(sub, x, 2), batch[:, 5:30])


def _at_offset(a, offset):
    """A copy of `a` whose first byte sits `offset` bytes past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 64 == offset and view.flags.c_contiguous
    return view


@pytest.mark.parametrize("variant", ["int8-g128", "int4-g32", "int4-g64-mins", "mxfp4"])
def test_fast_matmul_bit_equal_at_odd_offsets(variant):
    rng = _rng(11, variant)
    fmt, codes, scales, mins = parts = _parts(variant, 13, 384, rng)
    x = rng.standard_normal((3, 384), dtype=F32)
    want = _reference(parts, x)
    for offset in (1, 3, 7, 33, 63):
        placed = k.QuantizedWeight(fmt, _at_offset(codes, offset), _at_offset(scales, (offset * 3) % 64),
                                   None if mins is None else _at_offset(mins, (offset * 5) % 64))
        xo = _at_offset(x, (4 * offset) % 64)
        for fn in (k.matmul, k._matmul_portable):
            for T in (1, 3):
                got = _matmul(placed, xo[:T], 2, fn)
                assert _same(got, want[:T]), f"offset {offset} T={T}: {_first_difference(got, want[:T])}"
    xq = _at_offset(x, 5)
    got = [_at_offset(a, o) for a, o in ((np.zeros((3, 384), np.int8), 1), (np.zeros((3, 384), np.int8), 7),
                                         (np.zeros((3, 12), F32), 4), (np.zeros((3, 12), F32), 8),
                                         (np.zeros((3, 12), np.int32), 12), (np.zeros((3, 12), np.int32), 20))]
    k.quantize_activations(xq, *got)
    _assert_same_quantisation(got, fr.quantize_activations(x))


class _GuardedPages:
    """Copies of arrays placed against an inaccessible page (just after their last byte,
    or just before their first): a kernel that reads or writes outside an array faults."""

    def __init__(self):
        self._maps = []
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def place(self, a, at_end):
        page = mmap.PAGESIZE
        n = -(-a.nbytes // page)
        mm = mmap.mmap(-1, (n + 2) * page)
        buf = np.frombuffer(mm, np.uint8)
        for p in (0, n + 1):
            assert self._libc.mprotect(buf.ctypes.data + p * page, page, 0) == 0  # PROT_NONE
        start = (n + 1) * page - a.nbytes if at_end else page
        view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
        view[...] = a
        self._maps.append(mm)
        return view


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect through the C library")
@pytest.mark.parametrize("at_end", [True, False], ids=["guard-after", "guard-before"])
@pytest.mark.parametrize("variant", ["int8-g32", "int4-g32", "int4-g32-mins", "mxfp4"])
def test_fast_kernels_stay_inside_their_arrays(variant, at_end):
    # One row and odd column counts: the tails of a row are the tails of the buffer.
    rng = _rng(18, variant, at_end)
    pages = _GuardedPages()
    for C in (32, 96, 416):
        for R in (1, 17):
            fmt, codes, scales, mins = parts = _parts(variant, R, C, rng)
            w = k.QuantizedWeight(fmt, pages.place(codes, at_end), pages.place(scales, at_end),
                                  None if mins is None else pages.place(mins, at_end))
            for T in (1, 9):
                x = rng.standard_normal((T, C), dtype=F32)
                want = _reference(parts, x)
                for fn in (k.matmul, k._matmul_portable):
                    out = pages.place(np.full((T, R), np.nan, F32), at_end)
                    fn(w, pages.place(x, at_end), out, 2, fast=True)
                    assert _same(out, want), f"C={C} R={R} T={T} {fn.__name__}"
                got = [pages.place(np.zeros(shape, dtype), at_end)
                       for shape, dtype in (((T, C), np.int8), ((T, C), np.int8), ((T, C // 32), F32),
                                            ((T, C // 32), F32), ((T, C // 32), np.int32),
                                            ((T, C // 32), np.int32))]
                k.quantize_activations(pages.place(x, at_end), *got)
                _assert_same_quantisation(got, fr.quantize_activations(x))


# ----------------------------------------------------------------- expert FFNs

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.expf.restype = ctypes.c_float
_libm.expf.argtypes = [ctypes.c_float]


def _expf(a):
    """The C library's expf, element by element (the kernels' activation functions call
    it; numpy's float32 exp is a different approximation)."""
    a = np.asarray(a, F32)
    return np.array([_libm.expf(float(v)) for v in a.reshape(-1)], F32).reshape(a.shape)


def _silu_times(g, u):
    """silu(g) * u in float32 as the kernels define silu: g / (1 + expf(-g))."""
    return (g / (F32(1.0) + _expf(-g))) * u


def _clamped_swiglu(g, u, alpha, limit):
    """GPT-OSS's activation in float32 as the kernels define it: g = min(g, limit),
    u = clamp(u, -limit, limit), (u + 1) * (g * (1 / (1 + expf(-(g * alpha)))))."""
    alpha, limit = F32(alpha), F32(limit)
    g = np.where(g > limit, limit, g)
    u = np.where(u > limit, limit, u)
    u = np.where(u < -limit, -limit, u)
    sig = F32(1.0) / (F32(1.0) + _expf(-(g * alpha)))
    return (u + F32(1.0)) * (g * sig)


H, I = 96, 160  # multiples of 32, not of 128
FFN_SIZES = [3, 0, 9, 1, 5]


@pytest.mark.parametrize("variant", ["int8-g32", "int4-g32", "int4-g32-mins", "mxfp4"])
def test_fast_expert_ffn_is_the_composition_of_fast_matmuls(variant):
    rng = _rng(12, variant)
    K = len(FFN_SIZES)
    parts = [[_parts(variant, r, c, rng) for r, c in ((I, H), (I, H), (H, I))] for _ in range(K)]
    weights = [[_weight(p[j]) for p in parts] for j in range(3)]
    gs = np.concatenate([[0], np.cumsum(FFN_SIZES)]).astype(np.int64)
    N = int(gs[-1])
    x = rng.standard_normal((N, H), dtype=F32)
    results = []
    for n_threads in (1, 2):
        hbuf = np.full((N, I), np.nan, F32)
        out = np.full((N, H), np.nan, F32)
        k.expert_ffn(*weights, x, gs, hbuf, out, n_threads, fast=True)
        results.append((hbuf, out))
    (hbuf, out), (hbuf2, out2) = results
    assert _same(out2, out) and _same(hbuf2, hbuf)
    for e in range(K):
        a, b = gs[e], gs[e + 1]
        if a == b:
            continue
        xe = x[a:b]
        gate, up = (_reference(parts[e][j], xe) for j in (0, 1))
        assert _same(_matmul(weights[0][e], xe), gate) and _same(_matmul(weights[1][e], xe), up)
        h = _silu_times(gate, up)
        assert _same(hbuf[a:b], h), f"expert {e} hidden: {_first_difference(hbuf[a:b], h)}"
        # The down projection quantises the hidden rows the kernel computed.
        want = _reference(parts[e][2], hbuf[a:b])
        assert _same(out[a:b], want), f"expert {e}: {_first_difference(out[a:b], want)}"
        assert _same(_matmul(weights[2][e], hbuf[a:b]), want)
    # A token alone gives the bits it gets inside its group.
    alone_h, alone = np.zeros((1, I), F32), np.zeros((1, H), F32)
    k.expert_ffn([weights[0][2]], [weights[1][2]], [weights[2][2]], x[5:6].copy(),
                 np.array([0, 1], np.int64), alone_h, alone, 1, fast=True)
    assert _same(alone, out[5:6])


def test_fast_expert_ffn_fused_mxfp4_is_the_composition_of_fast_matmuls():
    rng = _rng(13)
    K, Hf, If = 3, 96, 64
    alpha, limit = 1.702, 7.0
    gs = np.array([0, 2, 2, 7], np.int64)
    N = int(gs[-1])
    gu_parts = [("mxfp4", *ref.random_mxfp4(rng, 2 * If, Hf), None) for _ in range(K)]
    dn_parts = [("mxfp4", *ref.random_mxfp4(rng, Hf, If), None) for _ in range(K)]
    gate_ups, downs = [_weight(p) for p in gu_parts], [_weight(p) for p in dn_parts]
    b1 = rng.standard_normal((K, 2 * If), dtype=F32)
    b2 = rng.standard_normal((K, Hf), dtype=F32)
    x = rng.standard_normal((N, Hf), dtype=F32)
    outs = []
    for n_threads in (1, 2):
        hbuf = np.full((N, If), np.nan, F32)
        out = np.full((N, Hf), np.nan, F32)
        k.expert_ffn_fused(gate_ups, downs, b1, b2, x, gs, hbuf, out, False, alpha, limit,
                           n_threads, fast=True)
        outs.append((hbuf, out))
    (hbuf, out), (hbuf2, out2) = outs
    assert _same(out, out2) and _same(hbuf, hbuf2)
    for e in range(K):
        a, b = gs[e], gs[e + 1]
        if a == b:
            continue
        z = _matmul(gate_ups[e], x[a:b])
        assert _same(z, _reference(gu_parts[e], x[a:b]))
        z = z + b1[e]
        h = _clamped_swiglu(z[:, 0::2], z[:, 1::2], alpha, limit)
        assert _same(hbuf[a:b], h), f"expert {e} hidden: {_first_difference(hbuf[a:b], h)}"
        want = _reference(dn_parts[e], hbuf[a:b]) + b2[e]
        assert _same(out[a:b], want), f"expert {e}: {_first_difference(out[a:b], want)}"


# --------------------------------------------------- formats fast mode leaves exact

DENSE_CASES = ["f32", "f16", "bf16", "fp8-float32", "fp8-bfloat16", "fp8-ue8m0"]


def _dense_weight(case, rng):
    """A [37, 100] dense weight or a [37, 300] FP8 one in blocks of 16 x 128 (columns not
    a multiple of 32: fast mode does not apply to them)."""
    if case.startswith("fp8-"):
        codes, scales = ref.random_fp8(rng, 37, 300, (16, 128), case.removeprefix("fp8-"))
        return k.QuantizedWeight("fp8_e4m3", codes, scales, block_size=(16, 128))
    w = rng.standard_normal((37, 100), dtype=F32) * F32(0.1)
    return {"f32": w, "f16": w.astype(np.float16), "bf16": w.astype(ml_dtypes.bfloat16)}[case]


@pytest.mark.parametrize("case", DENSE_CASES)
def test_fast_mode_leaves_dense_and_fp8_weights_exact(case):
    rng = _rng(15, case)
    w = _dense_weight(case, rng)
    x = rng.standard_normal((9, w.shape[1]), dtype=F32)
    for fn in (k.matmul, k._matmul_portable):
        for T in (1, 3, 9):
            for n_threads in (1, 2):
                exact = _matmul(w, x[:T], n_threads, fn, fast=False)
                assert _same(_matmul(w, x[:T], n_threads, fn, fast=True), exact), (fn, T, n_threads)


def test_fast_mode_leaves_dense_expert_ffns_exact():
    rng = _rng(16)
    sizes = [2, 0, 5]
    gs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    N = int(gs[-1])
    weights = [[(rng.standard_normal((r, c), dtype=F32) * F32(0.1)).astype(ml_dtypes.bfloat16)
                for _ in sizes] for r, c in ((I, H), (I, H), (H, I))]
    x = rng.standard_normal((N, H), dtype=F32)
    outs = []
    for fast in (False, True):
        out = np.full((N, H), np.nan, F32)
        k.expert_ffn(*weights, x, gs, np.zeros((N, I), F32), out, 2, fast=fast)
        outs.append(out)
    assert _same(outs[0], outs[1])
    # GPT-OSS's fused experts on plain transposed ([in, out]) weights.
    K, If = len(sizes), 64
    gate_ups = [(rng.standard_normal((H, 2 * If), dtype=F32) * F32(0.1)).astype(ml_dtypes.bfloat16)
                for _ in range(K)]
    downs = [(rng.standard_normal((If, H), dtype=F32) * F32(0.1)).astype(ml_dtypes.bfloat16)
             for _ in range(K)]
    b1 = rng.standard_normal((K, 2 * If), dtype=F32)
    b2 = rng.standard_normal((K, H), dtype=F32)
    fused = []
    for fast in (False, True):
        out = np.full((N, H), np.nan, F32)
        k.expert_ffn_fused(gate_ups, downs, b1, b2, x, gs, np.zeros((N, If), F32), out, True,
                           1.702, 7.0, 2, fast=fast)
        fused.append(out)
    assert _same(fused[0], fused[1])


# ------------------------------------------------------------- fast vs exact

@pytest.mark.parametrize("variant", ["int8-g128", "int4-g32", "int4-g64-mins", "mxfp4"])
def test_fast_is_close_to_exact(variant):
    # A sanity bound, not the specification: two int8 planes per 32 lose about
    # 1/(2 * 127 * 254) of each block's largest value.
    rng = _rng(17, variant)
    parts = _parts(variant, 64, 4096, rng)
    w = _weight(parts)
    x = rng.standard_normal((3, 4096), dtype=F32)
    exact, fast = _matmul(w, x, 2, fast=False), _matmul(w, x, 2, fast=True)
    assert not _same(exact, fast)  # fast mode really is another computation
    default = np.full_like(exact, np.nan)
    k.matmul(w, x, default, 2)
    assert _same(default, exact)  # and it is asked for: exact is the default
    err = np.linalg.norm((fast - exact).astype(np.float64), axis=1)
    assert np.all(err < 1e-4 * np.linalg.norm(exact.astype(np.float64), axis=1)), err


def test_build_info_names_the_fast_path():
    assert k.build_info()["fast"] in ("avx512-vnni", "avx2-vnni", "avx2", "portable")
