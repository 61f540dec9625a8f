"""Rotary position embedding: the frequencies of a model and the angles of one step.

Formula: RoPE (Su et al. 2021) as transformers' `*RotaryEmbedding` computes it in
float32 — inv_freq[i] = 1 / theta^(2i / dim) for i < dim / 2, angle = position ×
inv_freq, cos and sin times an attention factor (1 for plain RoPE) — applied by
`ext.kernels._kernels.rope` to the `dim` rotated dims of each head (all of head_dim,
the first ones with GLM-4.5's partial rotary factor, MLA's rotary part), in the
rotate-half layout or DeepSeek's interleaved pairs. YaRN (Peng et al. 2023) changes
inv_freq and the attention factor as transformers' `_compute_yarn_parameters` does.
"""
from __future__ import annotations

import math

import numpy as np

from ext.kernels import _kernels as K_
from ext.models.config import ModelConfig, YarnScaling

F32 = np.float32


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(theta: float, dim: int, scaling: YarnScaling | None) -> tuple[np.ndarray, float]:
    """(inv_freq [ceil(dim/2)] float32, attention factor) of RoPE over `dim` dims."""
    exponents = np.arange(0, dim, 2, dtype=F32) / F32(dim)
    pos_freqs = F32(theta) ** exponents
    if scaling is None:
        return (F32(1.0) / pos_freqs).astype(F32), 1.0
    y = scaling
    factor = y.factor
    if y.attention_factor is not None:
        attention = y.attention_factor
    elif y.mscale and y.mscale_all_dim:
        attention = yarn_mscale(factor, y.mscale) / yarn_mscale(factor, y.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) \
            / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                        # as transformers: no singularity
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
    extrapolation = F32(1.0) - ramp                          # share of the original frequency
    inv_extra = F32(1.0) / pos_freqs
    inv_inter = F32(1.0) / (F32(factor) * pos_freqs)
    inv_freq = inv_inter * (F32(1.0) - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(F32), float(attention)


class Rope:
    """cos/sin tables [T, R/2] for up to `chunk` positions (buffers owned here,
    overwritten by each `set_positions`), R = the rotated dims of a head."""

    def __init__(self, config: ModelConfig, chunk: int):
        dim = config.rotary_dim or (config.mla.qk_rope_head_dim if config.mla else config.head_dim)
        self.inv_freq, self.attention_factor = rope_frequencies(config.rope_theta, dim, config.rope_scaling)
        self.interleave = config.rope_interleave
        half = self.inv_freq.shape[0]
        self.rotated_dims = 2 * half
        self._cos = np.empty((chunk, half), F32)
        self._sin = np.empty((chunk, half), F32)
        self.cos = self._cos[:0]
        self.sin = self._sin[:0]

    def set_positions(self, positions: np.ndarray) -> None:
        """Angles for `positions` ([T] float32); `cos` and `sin` become [T, R/2] views."""
        T = positions.shape[0]
        self.cos, self.sin = self._cos[:T], self._sin[:T]
        np.multiply.outer(positions, self.inv_freq, out=self.cos)   # angles [T, R/2]
        np.sin(self.cos, out=self.sin)
        np.cos(self.cos, out=self.cos)
        if self.attention_factor != 1.0:
            self.cos *= F32(self.attention_factor)
            self.sin *= F32(self.attention_factor)

    def apply(self, x: np.ndarray, offset: int = 0) -> None:
        """Rotate dims offset..offset+R-1 of every head of x [T, heads, D] in place."""
        K_.rope(x, self.cos, self.sin, offset, self.interleave)
