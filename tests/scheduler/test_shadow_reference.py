"""scheduler.shadow.ShadowLRU (its layers compiled, scheduler/_shadow.pyx) replays as its
first implementation did. `ReferenceShadowLRU` below is that implementation, copied from
scheduler/shadow.py as it was before the layers were compiled (only the class name
changed); it lives here as the oracle. Seeded random accesses (batches larger than a
layer's capacity included) and pin changes with new capacities (grown and shrunk) drive
both; every miss count, pin load, resident set and same_state verdict must agree."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import pytest

from scheduler._shadow import LayerLRU
from scheduler.shadow import ShadowLRU


class ReferenceShadowLRU:
    """Per-layer LRU of `capacities[li]` dynamic slots (each >= 1), plus pins.

    pins: (layer index, expert) pairs that always hit and hold no dynamic slot.
    Raises ValueError for an empty capacity list or a capacity < 1.
    """

    def __init__(self, capacities: Sequence[int], pins: Iterable[tuple[int, int]] = ()):
        if not capacities or min(capacities) < 1:
            raise ValueError(f"capacities must be >= 1 per layer, got {list(capacities)}")
        self.capacities = [int(c) for c in capacities]
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in self.capacities]
        self._pins: list[set[int]] = [set() for _ in self.capacities]
        self._pin_slot: dict[tuple[int, int], int] = {}   # the pinned slot index each pin holds
        self.pin_loads = 0                  # pins that were not resident when set: reads
        self.set_pins(pins)

    def access(self, layer: int, experts: Sequence[int]) -> int:
        """One step of `layer` needs `experts` (distinct ids): the number of misses.

        More misses than the layer's capacity (a prefill chunk's union) are served as the
        cache serves them: in batches of at most its capacity, in the order given.
        """
        lru, pins = self._lru[layer], self._pins[layer]
        capacity = self.capacities[layer]
        misses = 0
        for start in range(0, len(experts), capacity):
            batch = experts[start:start + capacity]
            new = []
            for e in batch:                 # residents first: they cannot be evicted now
                if e in pins:
                    continue
                if e in lru:
                    lru.move_to_end(e)
                else:
                    new.append(e)
            for e in new:
                if len(lru) >= capacity:
                    lru.popitem(last=False)
                lru[e] = None
            misses += len(new)
        return misses

    def set_pins(self, pins: Iterable[tuple[int, int]],
                 capacities: Sequence[int] | None = None) -> None:
        """A new pin set (and, optionally, new dynamic capacities), applied in the order
        `ExpertCache.set_pins` applies it: each dropped pin, in the order of the pinned
        slots holding them, joins its layer's LRU as the most recent when the layer has a
        free slot, else it is dropped; then each new pin resident in the dynamic tier
        moves out of it (no read), and each one not resident is a pin load (`pin_loads`)."""
        new = {(int(li), int(e)) for li, e in pins}
        if capacities is not None:
            if len(capacities) != len(self.capacities) or min(capacities) < 1:
                raise ValueError(f"capacities must be >= 1 for each of {len(self.capacities)} layers")
            self.capacities = [int(c) for c in capacities]
        for key, slot in sorted(self._pin_slot.items(), key=lambda kv: kv[1]):
            if key in new:
                continue
            li, e = key
            del self._pin_slot[key]
            self._pins[li].discard(e)
            if len(self._lru[li]) < self.capacities[li]:
                self._lru[li][e] = None
        for li, lru in enumerate(self._lru):
            while len(lru) > self.capacities[li]:
                lru.popitem(last=False)
        for key in sorted(new - set(self._pin_slot)):
            li, e = key
            taken = set(self._pin_slot.values())
            self._pin_slot[key] = next(i for i in range(len(taken) + 1) if i not in taken)
            self._pins[li].add(e)
            if e in self._lru[li]:
                del self._lru[li][e]
            else:
                self.pin_loads += 1

    def copy(self) -> ReferenceShadowLRU:
        """An independent shadow in the same state (residents in the same order, pins)."""
        other = ReferenceShadowLRU(self.capacities)
        other._lru = [OrderedDict(lru) for lru in self._lru]
        other._pins = [set(p) for p in self._pins]
        other._pin_slot = dict(self._pin_slot)
        other.pin_loads = self.pin_loads
        return other

    def resident(self, layer: int) -> set[int]:
        """The experts `layer` holds now (dynamic residents and pins)."""
        return set(self._lru[layer]) | self._pins[layer]

    def same_state(self, other: ReferenceShadowLRU) -> bool:
        """Whether `other` holds what this one holds, in the same recency order, with the
        same capacities and pins: from here on both miss alike on any routing."""
        return (self.capacities == other.capacities and self._pins == other._pins
                and all(list(a) == list(b) for a, b in zip(self._lru, other._lru)))


@pytest.mark.parametrize("seed", range(4))
def test_same_misses_pins_and_residents_as_the_reference(seed):
    rng = np.random.default_rng(seed)
    layers, experts = int(rng.integers(1, 5)), int(rng.integers(8, 40))
    capacities = [int(c) for c in rng.integers(1, 9, size=layers)]
    shadow, ref = ShadowLRU(capacities), ReferenceShadowLRU(capacities)
    twin, ref_twin = shadow.copy(), ref.copy()
    changes = 0
    for step in range(1500):
        li = int(rng.integers(layers))
        if rng.random() < 0.03:
            pins = {(int(rng.integers(layers)), int(rng.integers(experts))) for _ in range(rng.integers(0, 6))}
            caps = [int(c) for c in rng.integers(1, 9, size=layers)] if rng.random() < 0.5 else None
            shadow.set_pins(pins, caps)
            ref.set_pins(pins, caps)
            changes += 1
        elif rng.random() < 0.02:
            twin, ref_twin = shadow.copy(), ref.copy()
        ids = [int(e) for e in rng.choice(experts, size=int(rng.integers(1, min(13, experts))), replace=False)]
        assert shadow.access(li, ids) == ref.access(li, ids)
        assert twin.access(li, ids[:3]) == ref_twin.access(li, ids[:3])
        assert shadow.pin_loads == ref.pin_loads
        assert shadow.resident(li) == ref.resident(li)
        assert shadow.same_state(twin) == ref.same_state(ref_twin)
    assert changes > 20


def test_a_layer_refuses_what_would_break_it():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        LayerLRU(0)
    layer = LayerLRU(2)
    layer.insert_recent(5)
    with pytest.raises(ValueError, match="cannot insert 5"):
        layer.insert_recent(5)                   # already resident
    layer.insert_recent(7)
    with pytest.raises(ValueError, match="cannot insert 9"):
        layer.insert_recent(9)                   # full
    layer.set_capacity(1)
    assert layer.in_order() == [7]               # the least recent left
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        layer.set_capacity(0)
