"""Independent numpy reading of moed's fast numerics, version 2 ("q8x2-32"), for the
kernel tests to compare with bit for bit.

Written from the fast-numerics specification and the weight formats' definitions (the
element decoders of tests/quant_reference.py), never from moed's kernels. Every float
operation is one numpy float32 operation, in the order the specification writes it
(numpy rounds each float32 operation to nearest even and never fuses a multiply-add);
integers are exact in int32/int64; nothing is computed in float64.

The specification, in short (section numbers are its own):
  1. each activation row is quantised per block of 32 columns into two int8 planes:
     d_b = max|x_i| / 127, e_b = d_b / 254,
     q1_i = clamp(rint(x_i / d_b), -127, 127) (0 when d_b == 0),
     r_i = x_i - (float)q1_i * d_b (the product rounded, then the difference),
     q2_i = clamp(rint(r_i / e_b), -127, 127) (0 when e_b == 0),
     s1_b, s2_b = the sums of the q1_i, of the q2_i;
  2. S1_rb, S2_rb = sums over the block of c_i * q1_i, of c_i * q2_i, exact, with the
     integer weight code c_i (int8 code; int4 code with mins, code - 8 without; MXFP4
     twice the E2M1 value);
  3. the weight's block scale sw_rb (the float16 group scale, or 2^(e - 128) for an
     MXFP4 E8M0 byte e) and, for int4 with mins, the float16 group min m_rb;
  4. t_rb = (float)S1_rb * (sw_rb * d_b); t_rb = t_rb + (float)S2_rb * (sw_rb * e_b);
     [int4 with mins: t_rb = t_rb + m_rb * (d_b * (float)s1_b + e_b * (float)s2_b)];
     y_r = (((0 + t_r0) + t_r1) + ...) + t_r,nb-1, left to right over the blocks.
"""
from __future__ import annotations

import numpy as np

from quant_reference import e2m1_values, unpack_nibbles

F32 = np.float32
BLOCK = 32  # columns per activation block (spec: "blocks are the C/32 runs of 32")


def _plane(v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 codes clamp(rint(v / scale), -127, 127) per block (v [T, nb, 32], scale
    [T, nb]), 0 in the blocks whose scale is 0; v / scale one f32 division, rint half
    to even."""
    zero = scale == 0
    safe = np.where(zero, F32(1.0), scale)               # only to avoid 0/0; masked below
    ratio = v / safe[:, :, None]                         # f32 division
    assert ratio.dtype == F32
    r = np.clip(np.rint(ratio), F32(-127.0), F32(127.0))  # half to even, then clamp
    return np.where(zero[:, :, None], 0, r.astype(np.int32)).astype(np.int8)


def quantize_activations(x: np.ndarray):
    """Spec section 1: x float32 [T, C] (C a multiple of 32) ->
    (q1 int8 [T, C], q2 int8 [T, C], d float32 [T, C/32], e float32 [T, C/32],
     s1 int32 [T, C/32], s2 int32 [T, C/32]).

    a_b = max |x_i| over the block (exact); d_b = a_b / 127.0f; e_b = d_b / 254.0f (f32
    divisions); q1_i = 0 if d_b == 0, else clamp(rint(x_i / d_b), -127, 127);
    r_i = x_i - (float)q1_i * d_b (the product rounded, then the difference);
    q2_i = 0 if e_b == 0, else clamp(rint(r_i / e_b), -127, 127) (f32 divisions, rint
    half to even); s1_b, s2_b = the exact sums of the block's q1_i and q2_i.
    """
    x = np.asarray(x)
    assert x.dtype == F32 and x.ndim == 2 and x.shape[1] % BLOCK == 0, (x.dtype, x.shape)
    T, C = x.shape
    xb = x.reshape(T, C // BLOCK, BLOCK)
    a = np.max(np.abs(xb), axis=2)                       # f32, exact
    d = a / F32(127.0)                                   # f32 division
    e = d / F32(254.0)                                   # f32 division
    assert d.dtype == F32 and e.dtype == F32
    q1 = _plane(xb, d)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = q1.astype(F32) * d[:, :, None]            # f32 product (exact q1 in f32)
        r = xb - prod                                    # f32 difference
        assert prod.dtype == F32 and r.dtype == F32
        q2 = _plane(r, e)
    s1 = q1.astype(np.int32).sum(axis=2, dtype=np.int32)
    s2 = q2.astype(np.int32).sum(axis=2, dtype=np.int32)
    return q1.reshape(T, C), q2.reshape(T, C), d.astype(F32), e.astype(F32), s1, s2


def weight_codes(fmt: str, codes: np.ndarray, mins=None) -> np.ndarray:
    """Spec section 2: the integer weight codes c_i as int32 [R, C] in natural column order.

    int8: the int8 code; int4 with mins: the 4-bit code (0..15); int4 without mins: the
    code minus 8; MXFP4: twice the E2M1 value (-12..12). Nibble order as the formats
    define it (element 2i in the low nibble of byte i)."""
    if fmt == "int8":
        return np.asarray(codes).view(np.int8).astype(np.int32)
    if fmt == "int4":
        c = unpack_nibbles(np.asarray(codes).view(np.uint8)).astype(np.int32)
        return c if mins is not None else c - 8
    if fmt == "mxfp4":
        blocks = np.asarray(codes).view(np.uint8)
        R, G, _ = blocks.shape
        doubled = e2m1_values(unpack_nibbles(blocks)) * F32(2.0)  # exact: 0, +-1 .. +-12
        c = doubled.astype(np.int32)
        assert np.array_equal(c.astype(F32), doubled)
        return c.reshape(R, G * BLOCK)
    raise ValueError(f"fast numerics do not apply to format {fmt!r}")


def block_scales(fmt: str, scales: np.ndarray, C: int) -> np.ndarray:
    """Spec section 3: sw_rb as float32 [R, C/32].

    int8 / int4: the float16 scale of the group holding block b, as f32 (exact);
    MXFP4: 2^(e - 128) for the block's E8M0 byte e (exact in f32, subnormal for e = 0),
    NaN for e = 255."""
    nb = C // BLOCK
    if fmt == "mxfp4":
        e = np.asarray(scales).view(np.uint8).astype(np.int32)
        assert e.shape[1] == nb, (e.shape, C)
        sw = np.ldexp(np.ones(e.shape, F32), e - 128)
        assert sw.dtype == F32
        return np.where(e == 255, F32(np.nan), sw).astype(F32)
    return group_values(scales, C)


def group_values(v: np.ndarray, C: int) -> np.ndarray:
    """The float16 per-group values v [R, C/g] (g = 32, 64 or 128) as float32 per block of
    32, [R, C/32]: each block lies in one group (spec section 3)."""
    v = np.asarray(v)
    assert v.dtype == np.float16, v.dtype
    g = C // v.shape[1]
    assert g * v.shape[1] == C and g % BLOCK == 0, (v.shape, C)
    return np.repeat(v.astype(F32), g // BLOCK, axis=1)


def block_dots(c: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Spec section 2: S[t, r, b] = sum over block b's 32 columns of c[r, i] * q[t, i],
    exact (int64), for codes c int [R, C] and activations q int8 [T, C]."""
    R, C = c.shape
    T = q.shape[0]
    cb = c.astype(np.int64).reshape(R, C // BLOCK, BLOCK)
    qb = q.astype(np.int64).reshape(T, C // BLOCK, BLOCK)
    S = np.einsum("rbi,tbi->trb", cb, qb)
    assert S.dtype == np.int64 and np.all(np.abs(S) < 2 ** 24)  # (float)S is exact
    return S


def fast_matmul(fmt: str, codes: np.ndarray, scales: np.ndarray, mins, x: np.ndarray) -> np.ndarray:
    """y [T, R] float32 of a quantised weight [R, C] applied to x float32 [T, C] in fast
    numerics (spec sections 1-4).

    fmt "int8" (codes int8 [R, C], scales float16 [R, C/g]), "int4" (codes uint8
    [R, C/2], scales and optional mins float16 [R, C/g]) or "mxfp4" (codes uint8
    [R, C/32, 16], scales E8M0 bytes [R, C/32]). Section 4 exactly:
        t_rb = (float)S1_rb * (sw_rb * d_b)
        t_rb = t_rb + (float)S2_rb * (sw_rb * e_b)
        u = d_b * (float)s1_b; v = e_b * (float)s2_b;
        t_rb = t_rb + m_rb * (u + v)                    (int4 with mins only)
        y_r  = (((0.0f + t_r0) + t_r1) + ...) + t_r,nb-1
    the sum over blocks an explicit loop, vectorised over rows and tokens only.
    """
    x = np.asarray(x)
    assert x.dtype == F32 and x.ndim == 2
    T, C = x.shape
    assert C % BLOCK == 0, C
    nb = C // BLOCK
    if mins is not None and fmt != "int4":
        raise ValueError("mins are only defined for int4")
    c = weight_codes(fmt, codes, mins)
    R = c.shape[0]
    assert c.shape == (R, C), (c.shape, x.shape)
    sw = block_scales(fmt, scales, C)                    # [R, nb] f32
    m = group_values(mins, C) if mins is not None else None
    q1, q2, d, e, s1, s2 = quantize_activations(x)
    S1 = block_dots(c, q1).astype(F32)                   # [T, R, nb], exact conversion
    S2 = block_dots(c, q2).astype(F32)
    s1f, s2f = s1.astype(F32), s2.astype(F32)            # [T, nb], exact (|s| <= 32 * 127)
    y = np.zeros((T, R), F32)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for b in range(nb):
            t = S1[:, :, b] * (sw[None, :, b] * d[:, None, b])     # (float)S1 * (sw * d)
            t2 = S2[:, :, b] * (sw[None, :, b] * e[:, None, b])    # (float)S2 * (sw * e)
            t = t + t2
            if m is not None:
                u = d[:, None, b] * s1f[:, None, b]
                v = e[:, None, b] * s2f[:, None, b]
                t = t + m[None, :, b] * (u + v)
            y = y + t                                    # left to right over blocks
            assert y.dtype == F32 and t.dtype == F32
    return y
