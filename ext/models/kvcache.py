"""The per-sequence cache of what each layer's attention keeps per token.

Every layer keeps a few float32 arrays whose axis -2 is the token (GQA: K and V,
[nKV, S, D] each; MLA: the compressed latent and rotary key, [S, kv_lora_rank +
qk_rope_head_dim]); the attention kind says which (`cache_shapes`). S, the capacity,
grows by doubling (a copy) up to `max_capacity`.
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32

# Per layer, one (leading dims..., width) tuple per array; S is inserted before width.
CacheShapes = list[tuple[tuple[int, ...], ...]]


def cache_bytes_per_token(shapes: CacheShapes) -> int:
    """Bytes one token adds to a cache of these shapes (float32)."""
    return sum(4 * math.prod(shape) for layer in shapes for shape in layer)


class KVCache:
    """One sequence's attention cache: `layers[l]` is the tuple of layer l's arrays.

    Owned by the sequence; `length` tokens are filled. Grows by doubling (a copy)
    when a step would pass the capacity, up to `max_capacity`.
    """

    def __init__(self, shapes: CacheShapes, capacity: int, max_capacity: int):
        self.shapes = shapes
        self.max_capacity = max_capacity
        self.length = 0
        self.layers: list[tuple[np.ndarray, ...]] = []
        self._allocate(min(max(capacity, 1), max_capacity))

    def _allocate(self, capacity: int) -> None:
        old = self.layers
        self.layers = [tuple(np.zeros((*shape[:-1], capacity, shape[-1]), F32) for shape in layer)
                       for layer in self.shapes]
        for new_layer, old_layer in zip(self.layers, old):
            for new, was in zip(new_layer, old_layer):
                new[..., : self.length, :] = was[..., : self.length, :]
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer)

    def read(self, start: int, stop: int) -> list[np.ndarray]:
        """A copy of what positions start:stop hold: one array per cache array, layer by
        layer, each [..., stop - start, width] float32. ValueError past `length`."""
        if not 0 <= start <= stop <= self.length:
            raise ValueError(f"positions {start}:{stop} outside the {self.length} held")
        return [a[..., start:stop, :].copy() for layer in self.layers for a in layer]

    def write(self, start: int, block: list[np.ndarray]) -> None:
        """Put `block` (as `read` returns it) at positions start:start+n and hold them:
        `length` becomes start + n. start must be <= `length` (what followed is
        forgotten); ValueError otherwise, for a block of another shape, or past
        max_capacity."""
        arrays = [a for layer in self.layers for a in layer]
        n = block[0].shape[-2] if block else 0
        if len(block) != len(arrays) or any(b.shape[:-2] != a.shape[:-2] or b.shape[-1] != a.shape[-1]
                                            or b.shape[-2] != n for a, b in zip(arrays, block)):
            raise ValueError("the block does not have this cache's shapes")
        if not 0 <= start <= self.length:
            raise ValueError(f"a block at {start} would leave a gap after the {self.length} held")
        self.length = start
        self.reserve(n)
        arrays = [a for layer in self.layers for a in layer]     # reserve may reallocate
        for a, b in zip(arrays, block):
            a[..., start:start + n, :] = b
        self.length = start + n

    def copy(self) -> KVCache:
        """An independent copy holding the same positions (same capacity)."""
        out = KVCache.__new__(KVCache)
        out.shapes, out.max_capacity = self.shapes, self.max_capacity
        out.length, out.capacity = self.length, self.capacity
        out.layers = [tuple(a.copy() for a in layer) for layer in self.layers]
        return out

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` more; ValueError past max_capacity."""
        need = self.length + n_tokens
        if need > self.max_capacity:
            raise ValueError(f"sequence of {need} tokens exceeds the context of {self.max_capacity}")
        if need > self.capacity:
            self._allocate(min(self.max_capacity, max(need, 2 * self.capacity)))
