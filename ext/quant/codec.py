"""Choosing the codes, scale and minimum of every group of a weight (numpy only).

A weight W [R, C] is cut into groups of g = scheme.group(C) consecutive elements of a
row; each group is quantised on its own into the format of ext/formats/repacked.py. Two
methods:

    "rtn"     round to nearest on the group's range: int8 and symmetric int4 take the
              element of largest magnitude v and scale = v / -qmin (int4: v / -8, so v
              lands on level -8, as llama.cpp's Q4_0; int8: |v| / 127); int4 with min
              takes min = min(x), scale = (max(x) - min(x)) / 15 (llama.cpp's Q4_1).
    "search"  least weighted squared error, sum_i w_i (x_i - value_i)^2, by a search in
              the spirit of llama.cpp's k-quants (make_qkx2_quants / make_qx_quants in
              ggml-quants.c): for each of a grid of candidate inverse scales the codes are
              rounded, the scale (and min) that fit them best in weighted least squares
              are solved in closed form, and the candidate of least error is kept; then
              a few rounds alternate nearest codes and the least-squares fit (neither step
              can increase the error).

The error weights w (one per element, [R, C], >= 0) say which elements matter: uniform
when none are given; `magnitude_weights` is k-quants' choice without data (rms of the
group + |x|); `importance_weights` multiplies a column's importance from calibration
text (the mean square of the activation it multiplies, as llama.cpp's imatrix) in.

Scales and minimums are rounded to float16 before the final codes are chosen, so the
codes are the nearest ones for the stored values. All arithmetic is float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ext.formats.repacked import QuantScheme, dequantize, pack_int4

METHODS = ("rtn", "search")
F32 = np.float32
F16_MAX = float(np.finfo(np.float16).max)
# The search grid (inverse scales per group) and the refinement rounds; see `_search_*`.
ASYM_STEPS = np.arange(-10, 11, dtype=F32) / F32(10)      # (15 + step) / range, as k-quants'
SYM_STEPS = np.arange(-9, 10, dtype=F32) / F32(10)        # -(qmax + step) / v
REFINE_ROUNDS = 2


class QuantizationError(ValueError):
    """A weight that cannot be quantised (its values overflow float16 scales)."""


@dataclass(frozen=True)
class QuantizedTensor:
    """One weight in the repack format: codes (int8 [R, C] or packed uint8 [R, C/2]),
    float16 scale [R, C/g] and, for int4 with min, float16 min [R, C/g]."""

    scheme: QuantScheme
    shape: tuple[int, int]
    codes: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        """float32 [R, C] values (ext.formats.repacked.dequantize)."""
        return dequantize(self.scheme, self.codes, self.scale, self.min)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (0 if self.min is None else self.min.nbytes)


def _groups(w: np.ndarray, scheme: QuantScheme) -> tuple[np.ndarray, int]:
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {list(w.shape)}")
    scheme.shapes(w.shape)   # raises ValueError for a row the scheme cannot cut
    g = scheme.group(w.shape[1])
    return np.ascontiguousarray(w, F32).reshape(-1, g), g


def magnitude_weights(w: np.ndarray, scheme: QuantScheme) -> np.ndarray:
    """k-quants' error weights without calibration data: rms of the group + |x|, [R, C]."""
    x, g = _groups(w, scheme)
    rms = np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    return (rms + np.abs(x)).reshape(w.shape)


def importance_weights(w: np.ndarray, importance: np.ndarray, scheme: QuantScheme, *,
                       magnitude: bool = False) -> np.ndarray:
    """Error weights from a column importance [C] (>= 0): importance[c], or with
    `magnitude`, importance[c] * sqrt(sigma^2 + x^2) as llama.cpp's imatrix quantisers
    weigh them (sigma^2 the mean square of the row)."""
    imp = np.asarray(importance, F32).reshape(1, -1)
    if imp.shape[1] != w.shape[1]:
        raise ValueError(f"importance has {imp.shape[1]} columns, the weight {w.shape[1]}")
    if not magnitude:
        return np.broadcast_to(imp, w.shape)
    x = np.asarray(w, F32)
    sigma2 = np.mean(x * x, axis=1, keepdims=True)
    return imp * np.sqrt(sigma2 + x * x)


def quantize(w: np.ndarray, scheme: QuantScheme, *, method: str = "search",
             weights: np.ndarray | None = None) -> QuantizedTensor:
    """Quantise a weight [R, C] (any float dtype) with `scheme` by `method`.

    weights: per-element error weights [R, C] (>= 0) for "search" (default uniform); a
    group whose weights sum to 0 is fitted with uniform weights.
    Raises ValueError (a shape the scheme cannot cut, an unknown method, weights of
    another shape) and QuantizationError (a scale or min beyond float16's range).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    x, g = _groups(w, scheme)
    if weights is None or method == "rtn":
        wt = np.ones_like(x)
    else:
        if weights.shape != w.shape:
            raise ValueError(f"weights of shape {list(weights.shape)} for a weight of {list(w.shape)}")
        wt = np.ascontiguousarray(weights, F32).reshape(x.shape)
        dead = wt.sum(axis=1) <= 0
        if dead.any():
            wt = wt.copy()
            wt[dead] = 1
    if scheme.min:
        scale, minimum = (_rtn_asym(x) if method == "rtn" else _search_asym(x, wt))
    else:
        qmin, qmax = _levels(scheme)
        scale = _rtn_sym(x, qmin, qmax) if method == "rtn" else _search_sym(x, wt, qmin, qmax)
        minimum = None
    scale16 = _to_f16(scale, "scale")
    min16 = None if minimum is None else _to_f16(minimum, "min")
    codes = _nearest(x, scale16.astype(F32), None if min16 is None else min16.astype(F32), scheme)
    R, C = w.shape
    codes = codes.reshape(R, C)
    if scheme.scheme == "int4":
        stored = pack_int4(codes + (0 if scheme.min else 8))
    else:
        stored = codes.astype(np.int8)
    return QuantizedTensor(scheme=scheme, shape=(R, C), codes=stored,
                           scale=scale16.reshape(R, C // g),
                           min=None if min16 is None else min16.reshape(R, C // g))


def _levels(scheme: QuantScheme) -> tuple[int, int]:
    """Signed code range of a symmetric scheme: int4 [-8, 7], int8 [-127, 127]."""
    return (-8, 7) if scheme.scheme == "int4" else (-127, 127)


def _to_f16(v: np.ndarray, what: str) -> np.ndarray:
    if not np.isfinite(v).all() or np.abs(v).max(initial=0) > F16_MAX:
        raise QuantizationError(f"a group's {what} exceeds float16's range (|{what}| > {F16_MAX:g})")
    return v.astype(np.float16)


def _nearest(x: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None,
             scheme: QuantScheme) -> np.ndarray:
    """Nearest codes [G, g] for per-group scale (and min): asymmetric codes in 0..15,
    symmetric ones signed (qmin..qmax); a zero scale gives code 0 (the value min, or 0)."""
    s = scale[:, None]
    safe = np.where(s == 0, F32(1), s)
    if minimum is not None:
        q = np.rint((x - minimum[:, None]) / safe)
        lo, hi = 0, 15
    else:
        q = np.rint(x / safe)
        lo, hi = _levels(scheme)
    q = np.clip(q, lo, hi)
    return np.where(s == 0, F32(0), q).astype(np.int16)


# ------------------------------------------------------------------ round to nearest

def _rtn_sym(x: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    v = x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]     # signed largest magnitude
    if qmin == -qmax:                                           # int8: |v| / qmax
        return np.abs(v) / F32(qmax)
    return v / F32(qmin)                                        # int4: v -> level qmin


def _rtn_asym(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mn, mx = x.min(axis=1), x.max(axis=1)
    return (mx - mn) / F32(15), mn


# ------------------------------------------------------------------ search

def _fit_asym(x, wt, q):
    """Weighted least-squares (scale, min) for fixed codes q, and its error, per group.
    Groups whose codes are all equal get scale 0 and the weighted mean."""
    sw = wt.sum(1)
    sl = (wt * q).sum(1)
    sll = (wt * q * q).sum(1)
    sx = (wt * x).sum(1)
    sxl = (wt * x * q).sum(1)
    det = sw * sll - sl * sl
    ok = det > F32(1e-12) * np.maximum(sw * sll, F32(1e-30))
    safe = np.where(ok, det, F32(1))
    scale = np.where(ok, (sw * sxl - sx * sl) / safe, F32(0))
    minimum = np.where(ok, (sll * sx - sl * sxl) / safe, sx / sw)
    err = (wt * (scale[:, None] * q + minimum[:, None] - x) ** 2).sum(1)
    return scale, minimum, err


def _search_asym(x: np.ndarray, wt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mn, mx = x.min(axis=1), x.max(axis=1)
    rng = mx - mn
    flat = rng <= 0
    inv_rng = np.where(flat, F32(0), F32(1) / np.where(flat, F32(1), rng))
    best_s, best_m = rng / F32(15), mn.copy()
    best_e = (wt * (np.clip(np.rint((x - mn[:, None]) * (inv_rng * 15)[:, None]), 0, 15)
                    * best_s[:, None] + mn[:, None] - x) ** 2).sum(1)
    for step in ASYM_STEPS:
        iscale = (F32(15) + step) * inv_rng
        q = np.clip(np.rint((x - mn[:, None]) * iscale[:, None]), 0, 15)
        s, m, e = _fit_asym(x, wt, q)
        better = e < best_e
        best_s, best_m, best_e = (np.where(better, s, best_s), np.where(better, m, best_m),
                                  np.where(better, e, best_e))
    for _ in range(REFINE_ROUNDS):
        safe = np.where(best_s == 0, F32(1), best_s)
        q = np.clip(np.rint((x - best_m[:, None]) / safe[:, None]), 0, 15)
        q = np.where(best_s[:, None] == 0, F32(0), q)
        s, m, e = _fit_asym(x, wt, q)
        better = e < best_e
        best_s, best_m, best_e = (np.where(better, s, best_s), np.where(better, m, best_m),
                                  np.where(better, e, best_e))
    return best_s, best_m


def _fit_sym(x, wt, q):
    sqq = (wt * q * q).sum(1)
    ok = sqq > 0
    scale = np.where(ok, (wt * x * q).sum(1) / np.where(ok, sqq, F32(1)), F32(0))
    err = (wt * (scale[:, None] * q - x) ** 2).sum(1)
    return scale, err


def _search_sym(x: np.ndarray, wt: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    v = x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]
    zero = v == 0
    inv_v = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), v))
    # int4 puts v on the wide side (level qmin); int8 is symmetric, either side will do.
    top = F32(-qmin if qmin == -qmax - 1 else qmax)
    sign = F32(-1) if qmin == -qmax - 1 else F32(1)
    best_s = _rtn_sym(x, qmin, qmax)
    safe = np.where(best_s == 0, F32(1), best_s)
    best_e = (wt * (np.clip(np.rint(x / safe[:, None]), qmin, qmax) * best_s[:, None] - x) ** 2).sum(1)
    for step in SYM_STEPS:
        iscale = sign * (top + step * (F32(1) if qmax < 16 else F32(10))) * inv_v
        q = np.clip(np.rint(x * iscale[:, None]), qmin, qmax)
        s, e = _fit_sym(x, wt, q)
        better = e < best_e
        best_s, best_e = np.where(better, s, best_s), np.where(better, e, best_e)
    for _ in range(REFINE_ROUNDS):
        safe = np.where(best_s == 0, F32(1), best_s)
        q = np.clip(np.rint(x / safe[:, None]), qmin, qmax)
        s, e = _fit_sym(x, wt, q)
        better = e < best_e
        best_s, best_e = np.where(better, s, best_s), np.where(better, e, best_e)
    return best_s


# ------------------------------------------------------------------ error feedback (GPTQ)

GPTQ_DAMP = 0.01     # of the mean diagonal, added to the moment matrix (GPTQ's percdamp)
GPTQ_BLOCK = 128     # columns updated lazily together


def quantize_gptq(w: np.ndarray, scheme: QuantScheme, moments: np.ndarray, *,
                  damp: float = GPTQ_DAMP) -> QuantizedTensor:
    """Quantise W [R, C] column by column, pushing each column's rounding error onto the
    columns not yet quantised so as to keep W x close for the inputs x whose mean
    x x^T is `moments` [C, C] (the method of Frantar et al., "GPTQ", 2022, section 3, with
    lazy block updates). Each group's scale (and min) is searched, weighted by the
    diagonal of `moments`, when the quantiser reaches the group's first column.
    """
    x, g = _groups(w, scheme)
    R, C = w.shape
    W = np.array(w, np.float64)
    H = np.array(moments, np.float64)
    if H.shape != (C, C):
        raise ValueError(f"moments of shape {list(H.shape)} for a weight of {C} columns")
    diag = np.diag(H).copy()
    dead = diag <= 0
    H[dead, dead] = 1.0
    H[np.diag_indices(C)] += damp * max(float(np.mean(np.diag(H))), 1e-30)
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T          # upper triangular
    imp = np.where(dead, 0.0, diag).astype(F32)
    codes = np.empty((R, C), np.int16)
    scales = np.empty((R, C // g), F32)
    mins = np.empty((R, C // g), F32) if scheme.min else None
    qmin, qmax = _levels(scheme)
    for b0 in range(0, C, max(GPTQ_BLOCK, g)):
        b1 = min(C, b0 + max(GPTQ_BLOCK, g))
        err = np.zeros((R, b1 - b0))
        for j in range(b0, b1):
            if j % g == 0:
                grp = W[:, j:j + g].astype(F32)
                wt = np.broadcast_to(imp[j:j + g], grp.shape)
                wt = np.where(wt.sum(1, keepdims=True) > 0, wt, F32(1))
                if scheme.min:
                    s, m = _search_asym(grp, np.ascontiguousarray(wt, F32))
                    mins[:, j // g] = _to_f16(m, "min").astype(F32)
                else:
                    s = _search_sym(grp, np.ascontiguousarray(wt, F32), qmin, qmax)
                scales[:, j // g] = _to_f16(s, "scale").astype(F32)
            s = scales[:, j // g]
            m = None if mins is None else mins[:, j // g]
            col = W[:, j:j + 1].astype(F32)
            q = _nearest(col, s, m, scheme)[:, 0]
            value = q * s + (m if m is not None else 0)
            e = (W[:, j] - value) / Hinv[j, j]
            W[:, j + 1:b1] -= np.outer(e, Hinv[j, j + 1:b1])
            err[:, j - b0] = e
            codes[:, j] = q
        W[:, b1:] -= err @ Hinv[b0:b1, b1:]
    if scheme.scheme == "int4":
        stored = pack_int4(codes + (0 if scheme.min else 8))
    else:
        stored = codes.astype(np.int8)
    return QuantizedTensor(scheme=scheme, shape=(R, C), codes=stored,
                           scale=scales.astype(np.float16),
                           min=None if mins is None else mins.astype(np.float16))
