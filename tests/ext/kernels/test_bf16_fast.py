"""Fast numerics of bf16 weights ("bf16-dp", `fast=2`, `numerics = "fast-bf16"`; the
`_kernels` module docstring) against an
independent numpy reading of the rule, bit for bit: activations rounded to bf16 (ties
to even, subnormals to signed zero), pairs of products accumulated odd column first
with one rounding each and subnormals flushed (VDPBF16PS's definition), the 16-lane
tree. On an AVX-512 BF16 machine this checks the instruction against its definition.

fma(a, b, c) of float32 values is read as float64 a * b + c rounded to float32: the
product of two bf16 values is exact in float32 already, and the float64 sum is exact
too unless the operands are more than 29 binades apart, where the float32 rounding
of a value within half an ulp of the larger operand is still correct (no double
rounding can land on a float32 tie: a bf16 product has at most 16 significant bits).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ext.kernels import _kernels as kern

F32 = np.float32


def round_bf16(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits: nearest, ties to even; NaN quiet; subnormal results to +-0."""
    u = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = np.where(nan, (u >> 16) | 0x40, r)
    r = np.where((r & 0x7F80) == 0, r & 0x8000, r)
    return r.astype(np.uint16)


def as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(F32)


def flush(v: np.ndarray) -> np.ndarray:
    u = np.asarray(v, F32).view(np.uint32)
    return np.where((u & 0x7F800000) == 0, u & 0x80000000, u).astype(np.uint32).view(F32)


def fma(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def reference(w_bits: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out [T, R] for bf16 weight bits w_bits [R, C] and f32 activations x [T, C]."""
    R, C = w_bits.shape
    T = x.shape[0]
    Cp = (C + 31) // 32 * 32
    wp = np.zeros((R, Cp), np.uint16)
    wp[:, :C] = w_bits
    xb = np.zeros((T, Cp), np.uint16)
    xb[:, :C] = round_bf16(x)
    wf, xf = flush(as_f32(wp)), as_f32(xb)
    acc = np.zeros((T, R, 16), F32)
    for c in range(0, Cp, 32):
        for h in (1, 0):                       # the odd column of each pair first
            idx = c + 2 * np.arange(16) + h
            acc = flush(fma(wf[None, :, idx], xf[:, None, idx], acc))
    for s in (8, 4, 2, 1):
        acc[..., :s] = acc[..., :s] + acc[..., s:2 * s]
    return acc[..., 0]


def _case(rng, R, C, T, spread):
    """Weights and activations over `spread` binades (subnormal products when large)."""
    w = (rng.standard_normal((R, C)) * np.exp(rng.uniform(-spread, 5, (R, C)))).astype(F32)
    w[0, :5] = [1e-39, -1e-40, 3e-42, 0.0, -0.0]          # subnormal and signed-zero weights
    x = (rng.standard_normal((T, C)) * np.exp(rng.uniform(-spread - 5, 5, (T, C)))).astype(F32)
    x[0, :3] = [1e-39, -2e-41, -0.0]
    return w.astype(ml_dtypes.bfloat16), x


def _bits(a):
    return np.ascontiguousarray(a, F32).view(np.uint32)


def test_rounding_reference_agrees_with_ml_dtypes_on_normal_values():
    x = np.random.default_rng(0).standard_normal(100000).astype(F32) * 1e3
    assert np.array_equal(round_bf16(x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("R, C, T, spread", [(37, 416, 5, 40), (16, 1024, 9, 2), (8, 100, 3, 40),
                                             (5, 31, 1, 40), (9, 64, 6, 0)])
@pytest.mark.parametrize("simd", [True, False])
def test_bf16_fast_is_its_rule_bit_for_bit(R, C, T, spread, simd):
    w, x = _case(np.random.default_rng(R * C + T), R, C, T, spread)
    out = np.empty((T, R), F32)
    (kern.matmul if simd else kern._matmul_portable)(w, x, out, 2, fast=2)
    assert np.array_equal(_bits(out), _bits(reference(w.view(np.uint16), x)))


def test_bf16_fast_rows_equal_alone_and_level_one_stays_exact():
    w, x = _case(np.random.default_rng(3), 24, 200, 7, 5)
    together = np.empty((7, 24), F32)
    kern.matmul(w, x, together, 2, fast=2)
    for t in range(7):
        alone = np.empty((1, 24), F32)
        kern.matmul(w, x[t:t + 1].copy(), alone, 1, fast=2)
        assert np.array_equal(_bits(alone[0]), _bits(together[t]))
    exact, level1 = np.empty((7, 24), F32), np.empty((7, 24), F32)
    kern.matmul(w, x, exact, 1, fast=0)
    kern.matmul(w, x, level1, 1, fast=True)
    assert np.array_equal(_bits(exact), _bits(level1))
    assert not np.array_equal(_bits(exact), _bits(together))


def test_bf16_fast_expert_ffn_equals_its_matmuls():
    rng = np.random.default_rng(4)
    H, I, N = 96, 64, 5
    mk = lambda r, c: (rng.standard_normal((r, c), dtype=F32) * 0.2).astype(ml_dtypes.bfloat16)
    g, u, d = [mk(I, H)], [mk(I, H)], [mk(H, I)]
    x = rng.standard_normal((N, H), dtype=F32)
    out = np.empty((N, H), F32)
    kern.expert_ffn(g, u, d, x, np.array([0, N], np.int64), np.empty((N, I), F32), out, 2, fast=2)
    go, uo, want = np.empty((N, I), F32), np.empty((N, I), F32), np.empty((N, H), F32)
    kern.matmul(g[0], x, go, 1, fast=2)
    kern.matmul(u[0], x, uo, 1, fast=2)
    h = (go / (F32(1) + np.exp(-go)) * uo).astype(F32)
    kern.matmul(d[0], h, want, 1, fast=2)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)   # silu's own rounding aside
