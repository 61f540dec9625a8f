"""Shadow caches: what a plain LRU cache would have done with the same routing, for free.

Conventions (the whole module): layers are layer *indices* 0..L-1 (positions in the
model's MoE layer list), experts are ints. Nothing is read and nothing is timed: a shadow
only keeps ids, so replaying a step costs a few dictionary operations per expert.

`ShadowLRU` replays demand accesses exactly as `scheduler.cache.ExpertCache` with
policy "lru" and no staging tier would serve them — per layer, the step's resident
experts are refreshed first, then each missing one takes a free slot or evicts the least
recently used resident — with an optional pin set that always hits and takes no dynamic
slot. Its miss counts are the reads that cache would have issued (tests/scheduler check
the two agree on random routing). The streaming provider runs two: the naive mode's
cache (every slot dynamic, no pins, no prefetch) and LRU over moed's own pinned and
dynamic tiers (which separates what the pins bring from what the policy and prefetch
bring); the do-no-harm referee (scheduler/referee.py) weighs them.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class ShadowLRU:
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

    def resident(self, layer: int) -> set[int]:
        """The experts `layer` holds now (dynamic residents and pins)."""
        return set(self._lru[layer]) | self._pins[layer]


def even_split(slots: int, layers: int) -> list[int]:
    """`slots` dynamic slots over `layers` layers as ExpertCache splits them (the first
    layers take the remainder)."""
    per_layer, extra = divmod(slots, layers)
    return [per_layer + (1 if i < extra else 0) for i in range(layers)]
