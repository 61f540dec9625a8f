# Design: one layer of scheduler.shadow.ShadowLRU, compiled. The referee replays every
# layer step of routing through two or three such shadows; as OrderedDicts that cost a
# few microseconds per layer step each, on the main thread, on every step. Here a layer
# is two small arrays (residents and their last-use stamps, at most `capacity`) and the
# pins (a few ids): membership is a linear scan, which at tens of slots is faster than
# hashing, and the least recently used resident is the one with the smallest stamp.
# The rules are ShadowLRU's (see its docstrings); tests/scheduler check the two agree.
#
# Conventions: experts are any ints that fit in 64 bits; capacity >= 1.
import numpy as np


cdef class LayerLRU:
    """The dynamic residents of one layer in recency order, plus its pins."""

    cdef long long[::1] ids, stamps        # residents [0:n] and their last-use stamps
    cdef long long[::1] pins               # pinned ids [0:n_pins]
    cdef long long[::1] fresh              # scratch: a batch's new ids
    cdef int n, n_pins, capacity
    cdef long long clock

    def __cinit__(self, int capacity):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.stamps = np.zeros(capacity, dtype=np.int64)
        self.fresh = np.zeros(capacity, dtype=np.int64)
        self.pins = np.zeros(1, dtype=np.int64)
        self.n = self.n_pins = 0
        self.clock = 0

    cdef inline int _find(self, long long e) noexcept:
        cdef int i
        for i in range(self.n):
            if self.ids[i] == e:
                return i
        return -1

    cdef inline bint _pinned(self, long long e) noexcept:
        cdef int i
        for i in range(self.n_pins):
            if self.pins[i] == e:
                return True
        return False

    cdef inline void _evict_oldest(self) noexcept:
        cdef int i, oldest = 0
        for i in range(1, self.n):
            if self.stamps[i] < self.stamps[oldest]:
                oldest = i
        self.n -= 1
        self.ids[oldest] = self.ids[self.n]
        self.stamps[oldest] = self.stamps[self.n]

    def access(self, experts) -> int:
        """One step needs `experts` (distinct ids): the misses (ShadowLRU.access)."""
        cdef list batch_ids = [int(e) for e in experts]
        cdef Py_ssize_t total = len(batch_ids), start, j, end
        cdef int i, n_new, misses = 0
        cdef long long e
        start = 0
        while start < total:
            end = min(total, start + self.capacity)
            n_new = 0
            for j in range(start, end):            # residents first: they cannot be evicted now
                e = batch_ids[j]
                if self._pinned(e):
                    continue
                i = self._find(e)
                if i >= 0:
                    self.clock += 1
                    self.stamps[i] = self.clock
                else:
                    self.fresh[n_new] = e
                    n_new += 1
            for i in range(n_new):
                if self.n >= self.capacity:
                    self._evict_oldest()
                self.clock += 1
                self.ids[self.n] = self.fresh[i]
                self.stamps[self.n] = self.clock
                self.n += 1
            misses += n_new
            start = end
        return misses

    def count(self) -> int:
        return self.n

    def slots(self) -> int:
        return self.capacity

    def contains(self, long long e) -> bool:
        return self._find(e) >= 0

    def insert_recent(self, long long e) -> None:
        """e joins as the most recent (the caller checked there is room and e is absent)."""
        if self.n >= self.capacity or self._find(e) >= 0:
            raise ValueError(f"cannot insert {e}: {self.n} of {self.capacity} slots, or resident")
        self.clock += 1
        self.ids[self.n] = e
        self.stamps[self.n] = self.clock
        self.n += 1

    def remove(self, long long e) -> bool:
        """Drop e if resident; whether it was."""
        cdef int i = self._find(e)
        if i < 0:
            return False
        self.n -= 1
        self.ids[i] = self.ids[self.n]
        self.stamps[i] = self.stamps[self.n]
        return True

    def set_capacity(self, int capacity) -> None:
        """New capacity (>= 1); the least recent residents beyond it are dropped."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        order = self.in_order()
        keep = order[max(0, len(order) - capacity):]
        self.capacity = capacity
        self.ids = np.zeros(capacity, dtype=np.int64)
        self.stamps = np.zeros(capacity, dtype=np.int64)
        self.fresh = np.zeros(capacity, dtype=np.int64)
        self.n = 0
        for e in keep:
            self.insert_recent(e)

    def set_pins(self, pins) -> None:
        """The layer's pinned ids (they always hit and take no slot)."""
        values = [int(e) for e in pins]
        self.pins = np.asarray(values if values else [0], dtype=np.int64)
        self.n_pins = len(values)

    def in_order(self) -> list:
        """The residents, least recently used first."""
        order = sorted(range(self.n), key=lambda i: self.stamps[i])
        return [int(self.ids[i]) for i in order]

    def copy(self) -> LayerLRU:
        """An independent layer in the same state."""
        cdef LayerLRU other = LayerLRU(self.capacity)
        other.ids[:] = self.ids
        other.stamps[:] = self.stamps
        other.n, other.clock = self.n, self.clock
        other.pins = self.pins.copy()
        other.n_pins = self.n_pins
        return other
