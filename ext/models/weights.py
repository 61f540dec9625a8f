"""Linear weights as the kernels take them, built from the pieces the checkpoint stores.

A `StoredWeight` (ext/formats/quant.py) says where a weight's pieces are and in which
format; this module turns the pieces' arrays — read into RAM, memory-mapped, or views of
an expert cache slot — into what `ext.kernels` multiplies by: the array itself for
f32/f16/bf16, a `QuantizedWeight` over the piece arrays (no copy) for a quantised format.
Nothing is converted: an FP8 weight stays FP8 bytes in RAM.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ext.formats.checkpoint import Checkpoint, TensorInfo
from ext.formats.quant import PLAIN_FORMATS, StoredWeight
from ext.kernels._kernels import QuantizedWeight, dequantize

Weight = np.ndarray | QuantizedWeight   # what the kernels accept as a weight [R, C]


def compute_weight(weight: StoredWeight, arrays: tuple[np.ndarray, ...]) -> Weight:
    """The kernels' weight for `weight`, over `arrays` (its pieces in order, each of the
    piece's dtype and shape). The result aliases the arrays: it lives as long as they do.
    Raises ValueError (from QuantizedWeight) when the arrays do not fit the format."""
    if weight.format in PLAIN_FORMATS.values():
        return arrays[0]
    return QuantizedWeight(**weight.layout.kernel_args(weight, arrays))


def read_weight(checkpoint: Checkpoint, weight: StoredWeight) -> Weight:
    """Read every piece of `weight` into RAM (owned arrays), check its scales and build
    the kernels' weight. Raises BadScaleError (NaN, inf, negative or E8M0-255 scales),
    and what `Checkpoint.read` raises."""
    arrays = tuple(checkpoint.read(p) for p in weight.pieces)
    weight.check_values(dict(zip(weight.layout.roles, arrays)))
    return compute_weight(weight, arrays)


def view_weight(weight: StoredWeight, view: Callable[[TensorInfo], np.ndarray]) -> Weight:
    """The kernels' weight over arrays that `view(piece)` returns (memory maps, slots)."""
    return compute_weight(weight, tuple(view(p) for p in weight.pieces))


def float_values(weight: Weight) -> np.ndarray:
    """float32 [R, C]: the values the kernels multiply by (a QuantizedWeight decoded by
    the kernels' own `dequantize`), in a new array."""
    return np.array(weight, np.float32) if isinstance(weight, np.ndarray) else dequantize(weight)


def weight_values(checkpoint: Checkpoint, weight: StoredWeight) -> np.ndarray:
    """float32 [R, C] values of `weight` read from `checkpoint` (see `float_values`).
    Raises as `read_weight`."""
    return float_values(read_weight(checkpoint, weight))
