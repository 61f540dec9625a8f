"""The quantiser: its output decodes (by an independent reading of the format spec) to
values whose error is what each method promises, and its codes are the nearest ones for
the stored float16 scales and minimums."""
from __future__ import annotations

import numpy as np
import pytest

from ext.formats.repacked import QuantScheme
from ext.quant.codec import (QuantizationError, importance_weights, magnitude_weights,
                             quantize, quantize_gptq)

SCHEMES = [QuantScheme("int8", 32), QuantScheme("int8", 128), QuantScheme("int4", 32, True),
           QuantScheme("int4", 64, True), QuantScheme("int4", 32), QuantScheme("int4", 128)]


def decode(scheme: QuantScheme, codes, scale, minimum):
    """The format as ext/formats/repacked.py's docstring states it, written independently:
    int4 bytes hold element 2i in the low nibble; value = q * s (int8), code * s + min
    (int4 with min), (code - 8) * s (int4); g = min(group_size, C)."""
    scale = scale.astype(np.float32)
    if scheme.scheme == "int4":
        lo, hi = codes & 15, codes >> 4
        q = np.stack([lo, hi], axis=-1).reshape(codes.shape[0], -1).astype(np.float32)
    else:
        q = codes.astype(np.float32)
    R, C = q.shape
    g = min(scheme.group_size, C)
    out = np.empty((R, C), np.float32)
    for k in range(C // g):
        cols = slice(k * g, (k + 1) * g)
        s = scale[:, k:k + 1]
        if scheme.scheme == "int4" and scheme.min:
            out[:, cols] = q[:, cols] * s + minimum[:, k:k + 1].astype(np.float32)
        elif scheme.scheme == "int4":
            out[:, cols] = (q[:, cols] - 8) * s
        else:
            out[:, cols] = q[:, cols] * s
    return out


def weight(shape=(48, 256), seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w[:, 7] *= 10                                    # an outlier column, as real weights have
    return w


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("method", ["rtn", "search"])
def test_codes_decode_to_the_quantised_values_and_are_nearest(scheme, method):
    w = weight()
    q = quantize(w, scheme, method=method, weights=magnitude_weights(w, scheme))
    R, C = w.shape
    g = min(scheme.group_size, C)
    assert q.codes.shape == ((R, C // 2) if scheme.scheme == "int4" else (R, C))
    assert q.codes.dtype == (np.uint8 if scheme.scheme == "int4" else np.int8)
    assert q.scale.dtype == np.float16 and q.scale.shape == (R, C // g)
    assert (q.min is not None) == scheme.min
    values = decode(scheme, q.codes, q.scale, q.min)
    np.testing.assert_array_equal(values, q.dequantize())
    # Nearest: no other level of its group is closer to any weight (float32 rounding aside).
    s = q.scale.astype(np.float32)[:, :, None]                    # [R, G, 1]
    if scheme.scheme == "int4":
        codes = np.arange(16, dtype=np.float32)
        levels = codes * s + q.min.astype(np.float32)[:, :, None] if scheme.min else (codes - 8) * s
    else:
        levels = np.arange(-127, 128, dtype=np.float32) * s           # [R, G, L]
    x = w.reshape(R, C // g, g)
    best = np.abs(x[..., None] - levels[:, :, None, :]).min(-1)  # [R, G, g]
    got = np.abs(x - values.reshape(R, C // g, g))
    assert np.all(got <= best + 1e-6 * np.abs(x).max())
    if scheme.scheme == "int8":
        assert np.abs(q.codes.astype(int)).max() <= 127


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_search_has_less_weighted_error_than_round_to_nearest(scheme):
    w = weight(seed=1)
    wt = magnitude_weights(w, scheme)
    e_rtn = float((wt * (quantize(w, scheme, method="rtn").dequantize() - w) ** 2).sum())
    e_search = float((wt * (quantize(w, scheme, method="search", weights=wt).dequantize() - w) ** 2).sum())
    assert e_search < e_rtn


def test_rtn_is_llama_cpp_q4_1_and_q4_0():
    """int4 with min: min = min(x), scale = (max - min) / 15; symmetric: the element of
    largest magnitude lands on level -8."""
    x = np.array([[-0.3, 0.1, 0.2, 0.6] * 8], np.float32)
    q = quantize(x, QuantScheme("int4", 32, True), method="rtn")
    assert q.min[0, 0] == np.float16(-0.3) and q.scale[0, 0] == np.float16(0.9 / 15)
    s = quantize(x, QuantScheme("int4", 32), method="rtn")
    assert s.scale[0, 0] == np.float16(-0.6 / 8)
    assert s.dequantize()[0, 3] == pytest.approx(0.6, rel=1e-3)


def test_importance_moves_error_off_the_columns_that_matter():
    w = weight(seed=2)
    scheme = QuantScheme("int4", 32, True)
    imp = np.ones(w.shape[1], np.float32)
    imp[::32] = 1000.0                                 # first column of every group matters
    plain = quantize(w, scheme, weights=None).dequantize()
    weighted = quantize(w, scheme, weights=importance_weights(w, imp, scheme)).dequantize()
    cols = slice(0, None, 32)
    assert np.abs(weighted - w)[:, cols].mean() < 0.5 * np.abs(plain - w)[:, cols].mean()


def test_gptq_has_less_output_error_on_correlated_inputs():
    """For inputs X with correlated columns, GPTQ's ||(Q - W) X|| is below searched rounding's."""
    rng = np.random.default_rng(3)
    w = weight((32, 128), seed=3)
    mix = rng.standard_normal((128, 128)) * 0.3 + np.eye(128)
    X = rng.standard_normal((2048, 128)) @ mix
    H = X.T @ X / X.shape[0]
    scheme = QuantScheme("int4", 32, True)

    def out_err(q):
        d = (q.dequantize() - w).astype(np.float64)
        return float(np.einsum("rc,cd,rd->", d, H, d))
    g = quantize_gptq(w, scheme, H)
    s = quantize(w, scheme, weights=importance_weights(w, np.diag(H), scheme))
    assert out_err(g) < 0.8 * out_err(s)
    np.testing.assert_array_equal(decode(scheme, g.codes, g.scale, g.min), g.dequantize())


def test_a_constant_group_and_a_zero_row_decode_exactly():
    """int4 represents them exactly; int8 within its float16 scale's rounding (2^-11)."""
    w = np.zeros((2, 64), np.float32)
    w[1] = 0.25
    for scheme in SCHEMES:
        for method in ("rtn", "search"):
            d = quantize(w, scheme, method=method).dequantize()
            tol = 0.25 * 2.0 ** -11 if scheme.scheme == "int8" else 0.0
            assert np.abs(d - w).max() <= tol, (scheme, method)
            assert (d[0] == 0).all()


def test_values_beyond_float16_scales_are_refused():
    w = np.full((1, 32), 1e9, np.float32)
    w[0, 0] = -1e9
    with pytest.raises(QuantizationError, match="float16"):
        quantize(w, QuantScheme("int8", 32), method="rtn")


@pytest.mark.parametrize("shape,match", [((4, 48), "multiple of"), ((4, 16), "multiple of 32"),
                                         ((4, 4, 32), "2-D")])
def test_shapes_the_scheme_cannot_cut_are_refused(shape, match):
    with pytest.raises(ValueError, match=match):
        quantize(np.zeros(shape, np.float32), QuantScheme("int4", 32, True))


def test_unknown_scheme_group_size_and_method_are_refused():
    with pytest.raises(ValueError, match="unknown scheme"):
        QuantScheme("int3", 32)
    with pytest.raises(ValueError, match="group_size"):
        QuantScheme("int4", 48)
    with pytest.raises(ValueError, match="minimum"):
        QuantScheme("int8", 32, True)
    with pytest.raises(ValueError, match="unknown method"):
        quantize(np.zeros((1, 32), np.float32), QuantScheme("int8", 32), method="best")


def test_bits_per_weight():
    assert QuantScheme("int4", 32, True).bits_per_weight == 5.0
    assert QuantScheme("int4", 32).bits_per_weight == 4.5
    assert QuantScheme("int4", 128, True).bits_per_weight == 4.25
    assert QuantScheme("int8", 32).bits_per_weight == 8.5
