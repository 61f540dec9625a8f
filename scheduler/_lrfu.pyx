# Design: the per-expert state and the victim ranking of scheduler.eviction.LRFUPolicy,
# compiled. The cache calls a layer's policy several times per layer step (step, admit,
# hit, victim per miss); in Python the ranking (two pow() per resident, a sort) cost more
# main-thread time per step than the misses lrfu saves on a small-expert model. The rules
# are the Python policy's, to the bit: the same double expressions evaluated in the same
# order (the build passes -ffp-contract=off, so no multiply-add is fused; pow() is the C
# library's, as Python's float ** int uses it), the same key order (value, last use,
# -expert), evictable() asked about the residents in that order, one at a time.
#
# Conventions: experts are ints in [0, num_experts); tokens are non-decreasing ints.
# Memory: six arrays of num_experts entries (48 bytes per expert).
from libc.math cimport log, pow

import numpy as np

cimport numpy as cnp

cnp.import_array()


cdef class LRFUState:
    """Two-scale LRFU state of one layer: CRF values, last uses, residents, prefetch boosts.

    ds, dl: the short and long decay per token (2 ** (-1 / half-life)); ws, wl: CRF ->
    rate factors times their weights ((1 - a) * (1 - ds), a * (1 - dl)). See
    scheduler.eviction.LRFUPolicy for the rules; this class only holds and ranks.
    """

    cdef double ds, dl, ws, wl
    cdef double[::1] crf_short, crf_long, boost_score, key_value
    cdef long long[::1] last, boost_token, key_epoch
    cdef int[::1] residents, position       # residents[0:n_res]; position[e] in it, or -1
    cdef int n_res, num_experts
    cdef long long epoch, epoch_token       # memoized values hold at epoch (one token)
    cdef unsigned char[::1] asked

    def __cinit__(self, int num_experts, double ds, double dl, double ws, double wl):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.ds, self.dl, self.ws, self.wl = ds, dl, ws, wl
        self.crf_short = np.zeros(num_experts)
        self.crf_long = np.zeros(num_experts)
        self.boost_score = np.zeros(num_experts)
        self.key_value = np.zeros(num_experts)
        self.last = np.full(num_experts, -1, dtype=np.int64)
        self.boost_token = np.full(num_experts, -1, dtype=np.int64)   # -1: no boost
        self.key_epoch = np.full(num_experts, -1, dtype=np.int64)
        self.residents = np.zeros(num_experts, dtype=np.int32)
        self.position = np.full(num_experts, -1, dtype=np.int32)
        self.asked = np.zeros(num_experts, dtype=np.uint8)
        self.n_res = 0
        self.epoch = 0
        self.epoch_token = -1

    cdef inline int _check(self, long e) except -1:
        if e < 0 or e >= self.num_experts:
            raise IndexError(f"expert {e} out of range [0, {self.num_experts})")
        return 0

    cdef inline void _forget(self, int e) noexcept:
        self.key_epoch[e] = -1

    cdef inline void _forget_all(self) noexcept:
        self.epoch += 1

    def step(self, long long token, experts):
        """Every expert the layer needs at `token` (a sequence of ints): one use each."""
        cdef long e
        cdef long long last, age
        self._forget_all()
        for x in experts:
            e = x
            self._check(e)
            last = self.last[e]
            if last == token:
                continue
            if last >= 0:
                age = token - last
                self.crf_short[e] = self.crf_short[e] * pow(self.ds, <double>age) + 1.0
                self.crf_long[e] = self.crf_long[e] * pow(self.dl, <double>age) + 1.0
            else:
                self.crf_short[e] = 1.0
                self.crf_long[e] = 1.0
            self.last[e] = token

    def admit(self, long e, long long token, bint demand, double score):
        """e got a dynamic slot; a prefetch (not demand) is boosted to `score` at `token`."""
        self._check(e)
        self._forget(e)
        if self.position[e] < 0:
            self.position[e] = self.n_res
            self.residents[self.n_res] = e
            self.n_res += 1
        if not demand:
            self.boost_score[e] = score
            self.boost_token[e] = token

    def hit(self, long e):
        """A demand use of resident e: its prefetch boost, if any, ends."""
        self._check(e)
        if self.boost_token[e] >= 0:
            self.boost_token[e] = -1
            self._forget(e)

    def drop(self, long e):
        """e left the dynamic tier (its history stays)."""
        cdef int p, moved
        self._check(e)
        self._forget(e)
        self.boost_token[e] = -1
        p = self.position[e]
        if p >= 0:
            self.n_res -= 1
            moved = self.residents[self.n_res]
            self.residents[p] = moved
            self.position[moved] = p
            self.position[e] = -1

    def is_resident(self, long e) -> bool:
        self._check(e)
        return self.position[e] >= 0

    def resident_count(self) -> int:
        return self.n_res

    cdef inline double _rate(self, int e, long long token) noexcept:
        cdef long long last = self.last[e]
        cdef long long age
        if last < 0:
            return 0.0
        age = token - last
        return (self.ws * self.crf_short[e] * pow(self.ds, <double>age)
                + self.wl * self.crf_long[e] * pow(self.dl, <double>age))

    cdef inline double _value(self, int e, long long token, double weight,
                              const double[::1] p_next, bint mixed) noexcept:
        """The key's value at `token` (memoized for the epoch)."""
        cdef double value, floor
        if token != self.epoch_token:
            self.epoch += 1
            self.epoch_token = token
        if self.key_epoch[e] == self.epoch:
            return self.key_value[e]
        value = self._rate(e, token)
        if mixed:
            value = (1.0 - weight) * value + weight * p_next[e]
        floor = self.boost_score[e] if self.boost_token[e] >= 0 and token <= self.boost_token[e] else 0.0
        if floor > value:
            value = floor
        self.key_value[e] = value
        self.key_epoch[e] = self.epoch
        return value

    def rate(self, long e, long long token) -> float:
        """(1 - a) * r_short + a * r_long at `token`: decayed uses per token, 0..1."""
        self._check(e)
        return self._rate(e, token)

    def value(self, long e, long long token, double weight=0.0, p_next=None) -> float:
        """The value victim() ranks e by at `token`: its rate, mixed with p_next[e] at
        `weight` when p_next ([num_experts] float64) is given, at least its prefetch boost
        during the step it was made for."""
        cdef const double[::1] p = self._prediction(p_next)
        self._check(e)
        return self._value(e, token, weight, p, p_next is not None)

    cdef const double[::1] _prediction(self, p_next):
        cdef const double[::1] p
        if p_next is None:
            return None
        p = np.ascontiguousarray(p_next, dtype=np.float64)
        if p.shape[0] != self.num_experts:
            raise ValueError(f"p_next has {p.shape[0]} entries; expected {self.num_experts}")
        return p

    def victim(self, long long token, evictable, double weight=0.0, p_next=None):
        """The resident to evict: the lowest key (value, last use, -expert) that
        `evictable(expert)` accepts, asked in ascending key order; None if none is."""
        cdef const double[::1] p = self._prediction(p_next)
        cdef bint mixed = p_next is not None
        cdef int i, e, best, n = self.n_res
        cdef double v, bv
        cdef long long bl
        cdef int asked_count = 0
        for i in range(n):
            self._value(self.residents[i], token, weight, p, mixed)
        result = None
        try:
            while asked_count < n:
                best = -1
                bv = 0.0
                bl = 0
                for i in range(n):
                    e = self.residents[i]
                    if self.asked[e]:
                        continue
                    v = self.key_value[e]
                    if (best < 0 or v < bv or (v == bv and (self.last[e] < bl
                                                             or (self.last[e] == bl and e > best)))):
                        best, bv, bl = e, v, self.last[e]
                self.asked[best] = 1
                asked_count += 1
                if evictable(best):
                    result = best
                    break
        finally:                            # (evictable has no side effects; it may raise)
            for i in range(n):
                self.asked[self.residents[i]] = 0
        return result


# ---------------------------------------------------------------- predictive's statistics
# scheduler.eviction.PredictivePolicy's per-step arithmetic on its transition counts
# T [E, E] and N [E] (float64, C-contiguous, owned by the policy): the numpy expressions
# it replaces are named in each docstring, and the results are theirs to the bit (one
# add per element; the mean's sum in row order, as numpy reduces a non-contiguous axis).

def distinct_sorted(experts) -> np.ndarray:
    """np.asarray(sorted(set(experts)), dtype=np.int64): [X] int64 (an insertion sort:
    a step's experts are a handful)."""
    cdef list values = list(experts)
    cdef Py_ssize_t n = len(values), i, j, i2, m = 0
    out_array = np.empty(n, dtype=np.int64)
    cdef long long[::1] out = out_array
    cdef long long v
    for i in range(n):
        v = values[i]
        j = m
        while j > 0 and out[j - 1] > v:
            j -= 1
        if j > 0 and out[j - 1] == v:
            continue                        # a repeat
        i2 = m
        while i2 > j:                       # shift the larger ones up by one
            out[i2] = out[i2 - 1]
            i2 -= 1
        out[j] = v
        m += 1
    return out_array[:m]


def mix(double w, const double[::1] a, const double[::1] b):
    """w * a + (1.0 - w) * b: [E] float64 (a and b of one length)."""
    cdef Py_ssize_t e, n = a.shape[0]
    if b.shape[0] != n:
        raise ValueError(f"mix of lengths {n} and {b.shape[0]}")
    out_array = np.empty(n)
    cdef double[::1] out = out_array
    cdef double v = 1.0 - w
    for e in range(n):
        out[e] = w * a[e] + v * b[e]
    return out_array


def add_transitions(double[:, ::1] t, double[::1] n, const long long[::1] prev,
                    const long long[::1] ids, double weight):
    """t[np.ix_(prev, ids)] += weight; n[prev] += weight (prev and ids distinct, in
    range: the caller's own arrays)."""
    cdef Py_ssize_t i, j
    cdef long long a
    for i in range(prev.shape[0]):
        a = prev[i]
        for j in range(ids.shape[0]):
            t[a, ids[j]] += weight
        n[a] += weight


def predict(const double[:, ::1] t, const double[::1] n, const long long[::1] prev):
    """(t[prev] / np.where(n[prev] > 0, n[prev], 1.0)[:, None]).mean(axis=0): [E] float64,
    the mean over the rows of prev (at least one) of each row's counts over its total."""
    cdef Py_ssize_t x = prev.shape[0], e_count = t.shape[1], i, e
    cdef double total
    out_array = np.zeros(e_count)
    cdef double[::1] out = out_array
    cdef long long a
    if x == 0:
        raise ValueError("predict needs at least one expert of the last step")
    for i in range(x):
        a = prev[i]
        total = n[a] if n[a] > 0 else 1.0
        for e in range(e_count):
            out[e] = out[e] + t[a, e] / total if i else t[a, e] / total
    for e in range(e_count):
        out[e] = out[e] / <double>x
    return out_array


def log_score(const double[::1] p, ids, double floor) -> float:
    """sum over e in ids of log(max(p[e], floor)), in the order given (libm's log)."""
    cdef double s = 0.0, v
    cdef long e
    for x in ids:
        e = x
        if e < 0 or e >= p.shape[0]:
            raise IndexError(f"expert {e} out of range [0, {p.shape[0]})")
        v = p[e]
        s += log(v if v > floor else floor)
    return s
