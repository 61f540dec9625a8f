"""The attention kernels against an independent numpy reading of their rule
(ext/kernels/_attn_impl.h's header): scores in moed_dot's order, the maximum, Cephes'
exponential, the total in 16 lanes then the tree, and the values in key order, bit for
bit; and the exponential's accuracy.

fma(a, b, c) of float32 values is read here as float64 a * b (exact) + c rounded to
float32: a double rounding that can differ from one fused rounding only when the
float64 sum falls exactly halfway between two float32 values; the data are fixed, so
a test that passes once passes always.
"""
from __future__ import annotations

import numpy as np
import pytest

from ext.kernels import _kernels as kern

F32 = np.float32
EXP_C = [F32(c) for c in (1.9875691500E-4, 1.3981999507E-3, 8.3334519073E-3,
                          4.1665795894E-2, 1.6666665459E-1, 5.0000001201E-1)]


def fma(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def tree16(lanes: np.ndarray) -> np.ndarray:
    """moed_hsum16 over the last axis (16 lanes): l + (l + 8), then + 4, + 2, + 1."""
    l = lanes.astype(F32).copy()
    for s in (8, 4, 2, 1):
        l[..., :s] = l[..., :s] + l[..., s:2 * s]
    return l[..., 0]


def dot(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """moed_dot(q, k_s) for every row k_s of k [n, D]: two 16-lane accumulators over
    32-column steps, a 16-column step, the tree, then the scalar tail."""
    n, D = k.shape
    a0, a1 = np.zeros((n, 16), F32), np.zeros((n, 16), F32)
    j = 0
    while j + 32 <= D:
        a0 = fma(q[j:j + 16], k[:, j:j + 16], a0)
        a1 = fma(q[j + 16:j + 32], k[:, j + 16:j + 32], a1)
        j += 32
    if j + 16 <= D:
        a0 = fma(q[j:j + 16], k[:, j:j + 16], a0)
        j += 16
    d = tree16(a0 + a1)
    for jj in range(j, D):
        d = fma(q[jj], k[:, jj], d)
    return d


def exp_ref(x: np.ndarray) -> np.ndarray:
    """Cephes' expf as _attn_impl.h spells it, lane by lane in float32."""
    x = np.asarray(x, F32)
    low = x < F32(-87.0)
    xc = np.where(low, F32(0), x).astype(F32)
    t = fma(xc, F32(1.44269504088896341), F32(12582912.0))
    n = (t + F32(-12582912.0)).astype(F32)
    r = fma(n, F32(-0.693359375), xc)
    r = fma(n, F32(2.12194440e-4), r)
    p = np.full_like(r, EXP_C[0])
    for c in EXP_C[1:]:
        p = fma(p, r, c)
    y = fma(p, (r * r).astype(F32), r)
    y = (y + F32(1.0)).astype(F32)
    bits = ((t.view(np.uint32).astype(np.int64) - 0x4b400000 + 127) << 23).astype(np.uint32)
    out = (y * bits.view(F32)).astype(F32)
    return np.where(low, F32(0), out).astype(F32)


def attend_row(q, k, v, lo, hi, scale, sink=None):
    """One row of the rule: q [Dk], k [S, Dk], v [S, Dv]."""
    sc = (dot(q, k[lo:hi]) * F32(scale)).astype(F32)
    m = sc.max()
    if sink is not None and sink > m:
        m = F32(sink)
    e = exp_ref((sc + (-m)).astype(F32))
    n = hi - lo
    full = n // 16 * 16
    acc = np.zeros(16, F32)
    for i in range(0, full, 16):
        acc = (acc + e[i:i + 16]).astype(F32)
    total = tree16(acc)
    for i in range(full, n):
        total = F32(total + e[i])
    if sink is not None:
        total = F32(total + exp_ref(np.array([F32(sink) - m], F32))[0])
    out = np.zeros(v.shape[1], F32)
    for i in range(n):
        out = fma(e[i], v[lo + i], out)
    return (out / total).astype(F32)


def _bits(a):
    return np.ascontiguousarray(a, F32).view(np.uint32)


def test_exp_within_two_ulp_of_exp():
    x = np.concatenate([np.linspace(-87, 0, 200001, dtype=F32), -np.logspace(-8, 0, 1001, dtype=F32)])
    got = exp_ref(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(F32)).astype(np.float64)
    assert (np.abs(got - want) / ulp).max() < 2
    assert exp_ref(np.array([0.0, -0.0], F32)).tolist() == [1.0, 1.0]
    assert exp_ref(np.array([-87.5, -np.inf], F32)).tolist() == [0.0, 0.0]
    assert np.isnan(exp_ref(np.array([np.nan], F32))[0])


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("D, window, sinks", [(64, 0, False), (128, 0, True), (40, 7, False),
                                              (19, 0, True), (16, 3, False)])
def test_attention_is_its_rule_bit_for_bit(n_threads, D, window, sinks):
    rng = np.random.default_rng(D + window)
    T, NH, NKV, S, pos0 = 9, 6, 2, 64, 37          # 46 keys for the last row: 2 blocks + 14
    q = rng.standard_normal((T, NH, D), dtype=F32)
    k = rng.standard_normal((NKV, S, D), dtype=F32)
    v = rng.standard_normal((NKV, S, D), dtype=F32)
    sink = (rng.standard_normal(NH, dtype=F32) * 3).astype(F32) if sinks else None
    out = np.empty_like(q)
    kern.attention(q, k, v, pos0, window, 0.125, out, n_threads, sink)
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(NH):
            kh = h // (NH // NKV)
            want = attend_row(q[t, h], k[kh], v[kh], lo, p + 1, 0.125,
                              None if sink is None else sink[h])
            assert np.array_equal(_bits(out[t, h]), _bits(want)), (t, h)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_latent_attention_is_its_rule_bit_for_bit(n_threads):
    rng = np.random.default_rng(7)
    T, NH, Dk, Dv, S, pos0 = 5, 12, 72, 64, 48, 20   # 12 heads: two blocks of 8 and 4
    q = rng.standard_normal((T, NH, Dk), dtype=F32)
    cache = rng.standard_normal((S, Dk), dtype=F32)
    out = np.empty((T, NH, Dv), F32)
    kern.latent_attention(q, cache, pos0, 0.2, out, n_threads)
    for t in range(T):
        for h in range(NH):
            want = attend_row(q[t, h], cache, cache[:, :Dv], 0, pos0 + t + 1, 0.2)
            assert np.array_equal(_bits(out[t, h]), _bits(want)), (t, h)


def test_large_scores_underflow_to_zero_weight():
    """A key 100 below the best gets weight 0 (e^-100 < e^-87), not a subnormal."""
    q = np.zeros((1, 1, 16), F32)
    q[0, 0, 0] = 1.0
    k = np.zeros((1, 2, 16), F32)
    k[0, 1, 0] = 100.0
    v = np.zeros((1, 2, 16), F32)
    v[0, 0] = 1.0
    out = np.empty_like(q)
    kern.attention(q, k, v, 1, 0, 1.0, out, 1)
    assert np.array_equal(out[0, 0], np.zeros(16, F32))
