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

def _rowsum(spec: str, *arrays: np.ndarray) -> np.ndarray:
    return np.einsum(spec, *arrays).astype(np.float64)


class _Sums:
    """Per-group weighted sums that do not depend on the codes: sum w, sum w x, sum w x^2,
    so that each candidate's least-squares fit and its error cost three reductions over
    the codes instead of a pass over the residuals. Reductions are float32 einsums (far
    faster than ndarray.sum over a short last axis), combined in float64."""

    def __init__(self, x: np.ndarray, wt: np.ndarray):
        self.x, self.wt = x, wt
        self.sw = _rowsum("gi->g", wt)
        self.sx = _rowsum("gi,gi->g", wt, x)
        self.sxx = _rowsum("gi,gi,gi->g", wt, x, x)
        self.tol = 1e-9 * self.sxx           # errors closer than this are ties

    def code_sums(self, q: np.ndarray):
        wq = self.wt * q
        return (_rowsum("gi->g", wq), _rowsum("gi,gi->g", wq, q),
                _rowsum("gi,gi->g", wq, self.x))

    def fit_asym(self, q: np.ndarray):
        """Weighted least-squares (scale, min) for codes q, and the weighted squared error,
        per group. Groups whose codes are all equal get scale 0 and the weighted mean."""
        sl, sll, sxl = self.code_sums(q)
        sw, sx = self.sw, self.sx
        det = sw * sll - sl * sl
        ok = det > 1e-9 * np.maximum(sw * sll, 1e-300)
        safe = np.where(ok, det, 1.0)
        scale = np.where(ok, (sw * sxl - sx * sl) / safe, 0.0)
        minimum = np.where(ok, (sll * sx - sl * sxl) / safe, sx / sw)
        err = (self.sxx - 2 * scale * sxl - 2 * minimum * sx + scale * scale * sll
               + 2 * scale * minimum * sl + minimum * minimum * sw)
        return scale, minimum, err

    def fit_sym(self, q: np.ndarray):
        """Weighted least-squares scale for signed codes q, and the error, per group."""
        _, sll, sxl = self.code_sums(q)
        ok = sll > 0
        scale = np.where(ok, sxl / np.where(ok, sll, 1.0), 0.0)
        return scale, self.sxx - 2 * scale * sxl + scale * scale * sll


def _keep_better(best: list, new: tuple, tol: np.ndarray) -> None:
    """best = [values..., err]: take `new`'s entries where its error is smaller by more
    than `tol` (a tie keeps the earlier candidate: round to nearest comes first)."""
    better = new[-1] < best[-1] - tol
    for i, v in enumerate(new):
        best[i] = np.where(better, v, best[i])


def _search_asym(x: np.ndarray, wt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sums = _Sums(x, wt)
    mn, mx = x.min(axis=1), x.max(axis=1)
    rng = mx - mn
    flat = rng <= 0
    inv_rng = np.where(flat, F32(0), F32(1) / np.where(flat, F32(1), rng))
    shifted = x - mn[:, None]
    q = np.empty_like(x)

    def codes(iscale):
        np.multiply(shifted, iscale[:, None], out=q)
        np.rint(q, out=q)
        return np.clip(q, 0, 15, out=q)

    s0, m0 = (rng / F32(15)).astype(np.float64), mn.astype(np.float64)
    sl, sll, sxl = sums.code_sums(codes(inv_rng * 15))
    e0 = (sums.sxx - 2 * s0 * sxl - 2 * m0 * sums.sx + s0 * s0 * sll + 2 * s0 * m0 * sl
          + m0 * m0 * sums.sw)
    best = [s0, m0, e0]                                   # round to nearest on the range
    for step in ASYM_STEPS:
        _keep_better(best, sums.fit_asym(codes((F32(15) + step) * inv_rng)), sums.tol)
    for _ in range(REFINE_ROUNDS):                        # nearest codes <-> least squares
        s, m = best[0].astype(F32), best[1].astype(F32)
        safe = np.where(s == 0, F32(1), s)
        np.subtract(x, m[:, None], out=q)
        np.divide(q, safe[:, None], out=q)
        np.rint(q, out=q)
        np.clip(q, 0, 15, out=q)
        q[s == 0] = 0
        _keep_better(best, sums.fit_asym(q), sums.tol)
    return best[0].astype(F32), best[1].astype(F32)


def _search_sym(x: np.ndarray, wt: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    sums = _Sums(x, wt)
    v = x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]
    zero = v == 0
    inv_v = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), v))
    # int4 puts v on the wide side (level qmin); int8 is symmetric, either side will do.
    wide = qmin == -qmax - 1
    top, sign = (F32(-qmin), F32(-1)) if wide else (F32(qmax), F32(1))
    unit = F32(1) if qmax < 16 else F32(10)
    q = np.empty_like(x)

    def codes(iscale):
        np.multiply(x, iscale[:, None], out=q)
        np.rint(q, out=q)
        return np.clip(q, qmin, qmax, out=q)

    s0 = _rtn_sym(x, qmin, qmax).astype(np.float64)
    _, sll, sxl = sums.code_sums(codes(np.where(s0 == 0, 0, 1 / np.where(s0 == 0, 1, s0)).astype(F32)))
    best = [s0, sums.sxx - 2 * s0 * sxl + s0 * s0 * sll]  # round to nearest
    for step in SYM_STEPS:
        _keep_better(best, sums.fit_sym(codes(sign * (top + step * unit) * inv_v)), sums.tol)
    for _ in range(REFINE_ROUNDS):
        s = best[0].astype(F32)
        inv = np.where(s == 0, F32(0), F32(1) / np.where(s == 0, F32(1), s))
        _keep_better(best, sums.fit_sym(codes(inv)), sums.tol)
    return best[0].astype(F32)


# ------------------------------------------------------------------ error feedback (GPTQ)

GPTQ_DAMP = 0.01     # of the mean diagonal, added to the moment matrix (GPTQ's percdamp)
GPTQ_BLOCK = 128     # columns updated lazily together


def quantize_gptq(w: np.ndarray, scheme: QuantScheme, moments: np.ndarray, *,
                  damp: float = GPTQ_DAMP, static_groups: bool = False,
                  act_order: bool = False) -> QuantizedTensor:
    """Quantise W [R, C] column by column, pushing each column's rounding error onto the
    columns not yet quantised so as to keep W x close for the inputs x whose mean
    x x^T is `moments` [C, C] (the method of Frantar et al., "GPTQ", 2022, section 3, with
    lazy block updates). Each group's scale (and min) is searched, weighted by the
    diagonal of `moments`: when the quantiser reaches the group's first column (on the
    weights as the error feedback has left them), or with `static_groups` for every group
    at once on the original weights — which lets `act_order` take the columns in order of
    decreasing importance (GPTQ's "act-order").
    """
    x, g = _groups(w, scheme)
    R, C = w.shape
    W = np.array(w, F32)
    H = np.array(moments, np.float64)
    if H.shape != (C, C):
        raise ValueError(f"moments of shape {list(H.shape)} for a weight of {C} columns")
    diag = np.diag(H).copy()
    dead = diag <= 0
    H[dead, dead] = 1.0
    H[np.diag_indices(C)] += damp * max(float(np.mean(np.diag(H))), 1e-30)
    imp = np.where(dead, 0.0, diag).astype(F32)
    qmin, qmax = _levels(scheme)
    scales = np.empty((R, C // g), F32)
    mins = np.empty((R, C // g), F32) if scheme.min else None

    def fit(cols: slice, values: np.ndarray) -> None:
        grp = values.astype(F32).reshape(-1, g)
        wt = np.ascontiguousarray(np.broadcast_to(imp[cols], values.shape), F32)
        wt = wt.reshape(-1, g)
        wt = np.where(wt.sum(1, keepdims=True) > 0, wt, F32(1))
        k0, k1 = cols.start // g, cols.stop // g
        if scheme.min:
            sc, mn = _search_asym(grp, wt)
            mins[:, k0:k1] = _to_f16(mn, "min").astype(F32).reshape(R, -1)
        else:
            sc = _search_sym(grp, wt, qmin, qmax)
        scales[:, k0:k1] = _to_f16(sc, "scale").astype(F32).reshape(R, -1)

    if static_groups:
        fit(slice(0, C), W)
    order = np.argsort(-imp, kind="stable") if (act_order and static_groups) else np.arange(C)
    W, H = W[:, order], H[np.ix_(order, order)]
    # The upper Cholesky factor U of H^-1 (H^-1 = U^T U): row j holds what quantising
    # column j does to the columns after it. Factored in float64, used in float32.
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T.astype(F32)
    codes = np.empty((R, C), np.int16)
    block = max(GPTQ_BLOCK, g)
    for b0 in range(0, C, block):
        b1 = min(C, b0 + block)
        err = np.zeros((R, b1 - b0), F32)
        for j in range(b0, b1):
            col = order[j]                                   # the column's own index
            if not static_groups and col % g == 0:
                fit(slice(col, col + g), W[:, j:j + g])
            s = scales[:, col // g]
            m = None if mins is None else mins[:, col // g]
            q = _nearest(W[:, j:j + 1], s, m, scheme)[:, 0]
            value = q * s + (m if m is not None else 0)
            e = (W[:, j] - value) / Hinv[j, j]
            W[:, j + 1:b1] -= np.outer(e, Hinv[j, j + 1:b1])
            err[:, j - b0] = e
            codes[:, col] = q
        W[:, b1:] -= err @ Hinv[b0:b1, b1:]
    if scheme.scheme == "int4":
        stored = pack_int4(codes + (0 if scheme.min else 8))
    else:
        stored = codes.astype(np.int8)
    return QuantizedTensor(scheme=scheme, shape=(R, C), codes=stored,
                           scale=scales.astype(np.float16),
                           min=None if mins is None else mins.astype(np.float16))
