"""Pin selection: which experts live in the pinned tier of the expert cache.

Conventions (the whole module):
  L MoE layers, E experts per layer. `expected_hits` is [L, E] float (e.g.
  `UsageStats.counts()`: decayed activations, a proxy for hits per token to come).
  Pins are `(layer_index, expert)` pairs, layer_index being a row of that array; the
  cache speaks model layer ids — convert with `pins_to_layer_ids`.
  Sizes are bytes (`expert_bytes`, `budget_bytes`); with the cache's uniform slots, pass
  expert_bytes=1 and a budget in slots.

The value of a pin is its density: expected hits per byte. docs/design.md "Usage statistics
and pin set": at start, the pin set is the experts with the highest expected hits per byte
within the pin budget; while serving it is re-evaluated with hysteresis.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

Pin = tuple[int, int]


def _as_bytes(expert_bytes: int | np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    sizes = np.broadcast_to(np.asarray(expert_bytes, dtype=np.float64), shape)
    if np.any(sizes <= 0) or not np.all(np.isfinite(sizes)):
        raise ValueError("expert_bytes must be positive")
    return sizes


def _check_hits(expected_hits: np.ndarray) -> np.ndarray:
    hits = np.asarray(expected_hits, dtype=np.float64)
    if hits.ndim != 2:
        raise ValueError(f"expected_hits must be [layers, experts], got shape {hits.shape}")
    if not np.all(np.isfinite(hits)) or np.any(hits < 0):
        raise ValueError("expected_hits must be finite and >= 0")
    return hits


def _density_order(hits: np.ndarray, sizes: np.ndarray) -> list[Pin]:
    """All (layer_index, expert) with hits > 0, densest first, ties to lower (layer, expert)."""
    density = hits / sizes
    layer_idx, expert = np.nonzero(hits > 0)
    # lexsort: last key is primary -> sort by -density, then layer, then expert.
    order = np.lexsort((expert, layer_idx, -density[layer_idx, expert]))
    return [(int(layer_idx[i]), int(expert[i])) for i in order]


def select_pins(expected_hits: np.ndarray, expert_bytes: int | np.ndarray,
                budget_bytes: int) -> frozenset[Pin]:
    """The pin set: greedy by expected hits per byte within the budget.

    expected_hits: [L, E] float, >= 0. expert_bytes: one size for all experts or [L, E].
    budget_bytes: >= 0. Candidates are taken densest first (ties to the lower
    (layer_index, expert)); one that does not fit is skipped and smaller ones after it may
    still fit. Experts with zero expected hits are never pinned.
    Returns frozenset of (layer_index, expert). Raises ValueError on bad shapes, negative
    or non-finite hits, non-positive sizes or a negative budget.
    """
    hits = _check_hits(expected_hits)
    sizes = _as_bytes(expert_bytes, hits.shape)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    chosen: list[Pin] = []
    left = float(budget_bytes)
    for pin in _density_order(hits, sizes):
        size = sizes[pin]
        if size <= left:
            chosen.append(pin)
            left -= size
    return frozenset(chosen)


def pins_to_layer_ids(pins: Iterable[Pin], moe_layers: Sequence[int]) -> frozenset[Pin]:
    """Map (layer_index, expert) pins to (layer id, expert) as `ExpertCache.set_pins` takes."""
    return frozenset((int(moe_layers[li]), int(e)) for li, e in pins)


class PinPolicy:
    """Re-evaluates a pin set while serving, with hysteresis and a bounded swap rate.

    expert_bytes: one size or [L, E] bytes (1 when the budget is in slots).
    hysteresis: > 1; a newcomer displaces an incumbent only when its hits per byte exceed
    the incumbent's by this factor (newcomer > hysteresis * incumbent).
    max_swaps_per_eval: >= 1; at most this many pins are added per call (each addition is a
    read). The caller calls `reevaluate` every N tokens, so pins change at a bounded rate.
    """

    def __init__(self, expert_bytes: int | np.ndarray = 1, hysteresis: float = 1.5,
                 max_swaps_per_eval: int = 4):
        if not hysteresis >= 1.0:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if max_swaps_per_eval < 1:
            raise ValueError(f"max_swaps_per_eval must be >= 1, got {max_swaps_per_eval}")
        self.expert_bytes = expert_bytes
        self.hysteresis = float(hysteresis)
        self.max_swaps_per_eval = int(max_swaps_per_eval)

    def reevaluate(self, current_pins: Iterable[Pin], expected_hits: np.ndarray,
                   budget_bytes: int) -> tuple[frozenset[Pin], frozenset[Pin]]:
        """(add, remove): the changes to make to `current_pins`, as (layer_index, expert).

        1. If the budget shrank, the least dense incumbents are removed until the rest
           fits (not rate-limited: memory pressure must be obeyed at once).
        2. Free budget is filled densest-first with non-pinned experts that have hits.
        3. Swaps: the densest outsider replaces the least dense incumbent while
           outsider density > hysteresis * incumbent density and the swap fits.
        Steps 2 and 3 together add at most max_swaps_per_eval pins.
        Raises ValueError like `select_pins`, or for a pin outside expected_hits.
        """
        hits = _check_hits(expected_hits)
        sizes = _as_bytes(self.expert_bytes, hits.shape)
        density = hits / sizes
        current = set(current_pins)
        for li, e in current:
            if not (0 <= li < hits.shape[0] and 0 <= e < hits.shape[1]):
                raise ValueError(f"pin {(li, e)} outside expected_hits of shape {hits.shape}")

        def weakest_first(pins: Iterable[Pin]) -> list[Pin]:
            return sorted(pins, key=lambda p: (density[p], -p[0], -p[1]))

        add: set[Pin] = set()
        remove: set[Pin] = set()
        used = sum(float(sizes[p]) for p in current)
        incumbents = weakest_first(current)
        while used > budget_bytes and incumbents:          # 1. shrink
            p = incumbents.pop(0)
            remove.add(p)
            used -= float(sizes[p])

        outsiders = [p for p in _density_order(hits, sizes) if p not in current]
        adds_left = self.max_swaps_per_eval
        for p in list(outsiders):                          # 2. fill free budget
            if adds_left == 0:
                break
            if float(sizes[p]) <= budget_bytes - used:
                add.add(p)
                used += float(sizes[p])
                outsiders.remove(p)
                adds_left -= 1
        while adds_left > 0 and outsiders and incumbents:  # 3. swaps with hysteresis
            newcomer, incumbent = outsiders[0], incumbents[0]
            if not density[newcomer] > self.hysteresis * density[incumbent]:
                break
            if used - float(sizes[incumbent]) + float(sizes[newcomer]) > budget_bytes:
                break
            outsiders.pop(0)
            incumbents.pop(0)
            add.add(newcomer)
            remove.add(incumbent)
            used += float(sizes[newcomer]) - float(sizes[incumbent])
            adds_left -= 1
        return frozenset(add), frozenset(remove)
