"""Shadow caches: what a plain LRU cache would have done with the same routing, for free.

Conventions (the whole module): layers are layer *indices* 0..L-1 (positions in the
model's MoE layer list), experts are ints. Nothing is read and nothing is timed: a shadow
only keeps ids, each layer in a compiled `scheduler._shadow.LayerLRU` (residents and
their last-use stamps in two small arrays): replaying a layer step of 8 experts over 9
slots costs about 0.8 us (timeit, Zen 4).

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

from collections.abc import Iterable, Sequence

from scheduler._shadow import LayerLRU


class ShadowLRU:
    """Per-layer LRU of `capacities[li]` dynamic slots (each >= 1), plus pins.

    pins: (layer index, expert) pairs that always hit and hold no dynamic slot.
    Raises ValueError for an empty capacity list or a capacity < 1.
    """

    def __init__(self, capacities: Sequence[int], pins: Iterable[tuple[int, int]] = ()):
        if not capacities or min(capacities) < 1:
            raise ValueError(f"capacities must be >= 1 per layer, got {list(capacities)}")
        self.capacities = [int(c) for c in capacities]
        self._lru: list[LayerLRU] = [LayerLRU(c) for c in self.capacities]   # compiled
        self._pins: list[set[int]] = [set() for _ in self.capacities]
        self._pin_slot: dict[tuple[int, int], int] = {}   # the pinned slot index each pin holds
        self.pin_loads = 0                  # pins that were not resident when set: reads
        self.set_pins(pins)

    def access(self, layer: int, experts: Sequence[int]) -> int:
        """One step of `layer` needs `experts` (distinct ids): the number of misses.

        More misses than the layer's capacity (a prefill chunk's union) are served as the
        cache serves them: in batches of at most its capacity, in the order given.
        """
        # Per batch: the residents are refreshed first (they cannot be evicted now), then
        # each new one takes a free slot or evicts the least recently used.
        return self._lru[layer].access(experts)

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
        for li, lru in enumerate(self._lru):
            if lru.slots() < self.capacities[li]:
                lru.set_capacity(self.capacities[li])    # grown: room for dropped pins
        for key, slot in sorted(self._pin_slot.items(), key=lambda kv: kv[1]):
            if key in new:
                continue
            li, e = key
            del self._pin_slot[key]
            self._pins[li].discard(e)
            if self._lru[li].count() < self.capacities[li] and not self._lru[li].contains(e):
                self._lru[li].insert_recent(e)
        for li, lru in enumerate(self._lru):
            lru.set_capacity(self.capacities[li])        # shrunk: the least recent leave
        for key in sorted(new - set(self._pin_slot)):
            li, e = key
            taken = set(self._pin_slot.values())
            self._pin_slot[key] = next(i for i in range(len(taken) + 1) if i not in taken)
            self._pins[li].add(e)
            if not self._lru[li].remove(e):
                self.pin_loads += 1
        for li, lru in enumerate(self._lru):
            lru.set_pins(sorted(self._pins[li]))

    def copy(self) -> ShadowLRU:
        """An independent shadow in the same state (residents in the same order, pins)."""
        other = ShadowLRU(self.capacities)
        other._lru = [lru.copy() for lru in self._lru]
        other._pins = [set(p) for p in self._pins]
        other._pin_slot = dict(self._pin_slot)
        other.pin_loads = self.pin_loads
        return other

    def resident(self, layer: int) -> set[int]:
        """The experts `layer` holds now (dynamic residents and pins)."""
        return set(self._lru[layer].in_order()) | self._pins[layer]

    def same_state(self, other: ShadowLRU) -> bool:
        """Whether `other` holds what this one holds, in the same recency order, with the
        same capacities and pins: from here on both miss alike on any routing."""
        return (self.capacities == other.capacities and self._pins == other._pins
                and all(a.in_order() == b.in_order() for a, b in zip(self._lru, other._lru)))


def even_split(slots: int, layers: int) -> list[int]:
    """`slots` dynamic slots over `layers` layers as ExpertCache splits them (the first
    layers take the remainder)."""
    per_layer, extra = divmod(slots, layers)
    return [per_layer + (1 if i < extra else 0) for i in range(layers)]


class ShadowPolicyCache:
    """The cache's own policy replayed on ids: an `ExpertCache` over the layer indices
    `layers` with `capacities[i]` dynamic slots for layers[i], plus a pinned tier holding
    `pins` ((layer index, expert), of those layers), served as the engine serves it
    (request, loaded for every miss, release), nothing read. Same `access` / `resident`
    interface as ShadowLRU, at the cost of the real policy's bookkeeping (tens of
    microseconds per layer step for predictive, against a few for ShadowLRU).

    transitions: per layer of `layers`, next-step statistics (T, N) the policy starts
    from as its own counts (ExpertCache.transitions of the running cache), so a short
    replay is not judged by a policy that has learned nothing yet. Raises ValueError for
    a capacity < 1 or lists of different lengths.
    """

    def __init__(self, layers: Sequence[int], capacities: Sequence[int], num_experts: int, top_k: int,
                 policy: str, pins: Iterable[tuple[int, int]] = (), transitions=None):
        from scheduler.cache import OUTCOME_MISS, ExpertCache

        if not capacities or min(capacities) < 1 or len(capacities) != len(layers):
            raise ValueError(f"capacities must be >= 1 for each of {list(layers)}, got {list(capacities)}")
        pins = list(pins)
        total = sum(max(int(c), top_k) for c in capacities) + len(pins)
        self._miss = OUTCOME_MISS
        self._cache = ExpertCache(list(layers), num_experts, top_k, total,
                                  pinned_slots=len(pins), policy=policy)
        for load in self._cache.set_pins(pins):
            self._cache.loaded(load.slot)
        if transitions is not None:
            self._cache.seed_transitions(transitions, as_counts=True)
        self._token = 0
        self._last_layer = -1

    def access(self, layer: int, experts: Sequence[int]) -> int:
        """Serve one layer's experts; returns the misses. A layer index not above the
        previous one starts a new step."""
        return len(experts) - sum(self.access_hits(layer, experts))

    def access_hits(self, layer: int, experts: Sequence[int]) -> list[int]:
        """As `access` (distinct `experts`); 1 (hit) or 0 per expert, in their order."""
        if layer <= self._last_layer:
            self._token += 1
        self._last_layer = layer
        ids = [int(e) for e in experts]
        out = []
        for a in self._cache.request(layer, ids, self._token):
            if a.outcome == self._miss:
                self._cache.loaded(a.slot)
                out.append(0)
            else:
                out.append(1)
        self._cache.release(layer, ids)
        return out

    def resident(self, layer: int) -> set[int]:
        """Experts of `layer` that would hit now (pinned or dynamic)."""
        return {e for e in range(self._cache.num_experts) if self._cache.slot_of(layer, e) is not None}
