"""Rotary position embedding tables: the angles of one step's positions.

Formula: RoPE (Su et al. 2021) as transformers' `*RotaryEmbedding` computes it in
float32 — inv_freq[i] = 1 / theta^(2i / dim) for i < dim / 2, angle = position ×
inv_freq — applied in the rotate-half layout by `ext.kernels._kernels.rope`.
"""
from __future__ import annotations

import numpy as np

F32 = np.float32


class Rope:
    """cos/sin tables [T, dim/2] for up to `chunk` positions (buffers owned here,
    overwritten by each `set_positions`)."""

    def __init__(self, theta: float, dim: int, chunk: int):
        self.dim = dim
        self.inv_freq = (F32(1.0) / (F32(theta) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim)))).astype(F32)
        self._cos = np.empty((chunk, dim // 2), F32)
        self._sin = np.empty((chunk, dim // 2), F32)
        self.cos = self._cos[:0]
        self.sin = self._sin[:0]

    def set_positions(self, positions: np.ndarray) -> None:
        """Angles for `positions` ([T] float32); `cos` and `sin` become [T, dim/2] views."""
        T = positions.shape[0]
        self.cos, self.sin = self._cos[:T], self._sin[:T]
        np.multiply.outer(positions, self.inv_freq, out=self.cos)   # angles [T, dim/2]
        np.sin(self.cos, out=self.sin)
        np.cos(self.cos, out=self.cos)
