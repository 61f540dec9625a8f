"""scheduler.eviction: lrfu and predictive decide exactly as their first implementation did.

`ReferenceLRFU` and `ReferencePredictive` below are that implementation, copied verbatim
from scheduler/eviction.py as it was before victim() memoized its ranking (only the class
names changed); they live here as the oracle and nowhere else. Seeded random event
streams — steps (repeated tokens; jumps that underflow the short decay to 0), demand
and prefetch admissions (scores tied with residents' values), hits, evictions, drops —
drive a policy and its reference side by side; every victim() under a random `evictable`
must be the same expert, asked about in ascending key order, and every value(), rate()
and p_next() must be equal with ==, at the current, the next and the previous token.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from scheduler.eviction import (LRFU_LONG_HALF_LIFE, LRFU_LONG_WEIGHT, LRFU_SHORT_HALF_LIFE,
                                PREDICT_WEIGHT, TRANSITION_HALF_LIFE, EvictionPolicy, LRFUPolicy,
                                PredictivePolicy)


# -- the reference: scheduler/eviction.py at 1c9a000, LRFUPolicy and PredictivePolicy ------
class ReferenceLRFU(EvictionPolicy):
    """Two-scale LRFU: short- and long-half-life decayed use rates, history kept per expert."""

    name = "lrfu"

    def __init__(self, num_experts: int, capacity: int, short_half_life: float = LRFU_SHORT_HALF_LIFE,
                 long_half_life: float = LRFU_LONG_HALF_LIFE, long_weight: float = LRFU_LONG_WEIGHT):
        self._ds = 2.0 ** (-1.0 / short_half_life)
        self._dl = 2.0 ** (-1.0 / long_half_life)
        self._ws = (1.0 - long_weight) * (1.0 - self._ds)   # CRF -> rate, times its weight
        self._wl = long_weight * (1.0 - self._dl)
        self._crf_short = [0.0] * num_experts            # CRF at the last use
        self._crf_long = [0.0] * num_experts
        self._last = [-1] * num_experts                  # token of the last use; -1: never
        self._resident: dict[int, None] = {}
        self._boost: dict[int, tuple[float, int]] = {}   # prefetched, unused: (score, token)

    def step(self, token, experts):
        for e in experts:
            last = self._last[e]
            if last == token:
                continue
            if last >= 0:
                age = token - last
                self._crf_short[e] = self._crf_short[e] * self._ds ** age + 1.0
                self._crf_long[e] = self._crf_long[e] * self._dl ** age + 1.0
            else:
                self._crf_short[e] = self._crf_long[e] = 1.0
            self._last[e] = token

    def admit(self, expert, token, demand, score=0.0):
        self._resident[expert] = None
        if not demand:
            self._boost[expert] = (float(score), token)

    def hit(self, expert, token):
        self._boost.pop(expert, None)

    def evict(self, expert, token):
        self.drop(expert)

    def drop(self, expert):
        self._resident.pop(expert, None)
        self._boost.pop(expert, None)

    def victim(self, token, evictable, incoming=None):
        best, best_key = None, None
        for e in self._resident:
            if not evictable(e):
                continue
            key = (self.value(e, token), self._last[e], -e)
            if best_key is None or key < best_key:
                best, best_key = e, key
        return best

    def rate(self, expert: int, token: int) -> float:
        """(1 - a) * r_short + a * r_long at `token`: decayed uses per token, 0..1."""
        last = self._last[expert]
        if last < 0:
            return 0.0
        age = token - last
        return (self._ws * self._crf_short[expert] * self._ds ** age
                + self._wl * self._crf_long[expert] * self._dl ** age)

    def value(self, expert, token):
        return max(self.rate(expert, token), self._boosted(expert, token))

    def _boosted(self, expert: int, token: int) -> float:
        """A prefetch's score counts for the step it was made for, not after."""
        boost = self._boost.get(expert)
        return boost[0] if boost is not None and token <= boost[1] else 0.0


class ReferencePredictive(ReferenceLRFU):
    """lrfu plus a next-step predictor learned online from the layer's own steps.

    Transition statistics: T[a, e] = decayed count of steps at which expert a was used and
    e was used at the following step; N[a] = decayed count of steps at which a was used and
    a following step was seen (half-life TRANSITION_HALF_LIFE tokens). After step t with
    experts X, the probability that e is needed at step t+1 is estimated as
        p_next(e) = mean over a in X of T[a, e] / N[a]      (0 for an a never seen)
    and value(e) = (1 - PREDICT_WEIGHT) * lrfu rate(e) + PREDICT_WEIGHT * p_next(e).
    Memory: num_experts ** 2 float64 per layer (0.5 MiB at 256 experts).
    """

    name = "predictive"

    def __init__(self, num_experts: int, capacity: int, transition_half_life: float = TRANSITION_HALF_LIFE,
                 predict_weight: float = PREDICT_WEIGHT, **lrfu_args):
        super().__init__(num_experts, capacity, **lrfu_args)
        self._half_life = float(transition_half_life)
        self._predict_weight = float(predict_weight)
        self._t = np.zeros((num_experts, num_experts))  # stored / scale        [E, E]
        self._n = np.zeros(num_experts)                  # stored / scale        [E]
        self._base = 0                                   # token where the weight is 1
        self._prev: np.ndarray | None = None             # experts of the last step
        self._prev_token = -1
        self._p_next: np.ndarray | None = None           # [E], cached per step

    def step(self, token, experts):
        super().step(token, experts)
        ids = np.asarray(sorted(set(experts)), dtype=np.int64)
        if self._prev is None:
            self._base = token
        elif token > self._prev_token and ids.size:
            # Newer steps weigh 2 ** (age / half-life) more (lazy decay); the ratios
            # T / N do not depend on the common scale, which is folded back before it grows.
            exponent = (token - self._base) / self._half_life
            if exponent > 60.0:
                scale = 2.0 ** -min(exponent, 1000.0)
                self._t *= scale
                self._n *= scale
                self._base, exponent = token, 0.0
            weight = 2.0 ** exponent
            self._t[np.ix_(self._prev, ids)] += weight
            self._n[self._prev] += weight
        if token != self._prev_token or self._prev is None:
            self._prev, self._prev_token = ids, token
        self._p_next = None

    def p_next(self) -> np.ndarray:
        """[E] float64: estimated probability of each expert at the step after the last one."""
        if self._p_next is None:
            if self._prev is None or self._prev.size == 0:
                self._p_next = np.zeros(self._n.shape)
            else:
                n = self._n[self._prev]                               # [X]
                rows = self._t[self._prev] / np.where(n > 0, n, 1.0)[:, None]   # [X, E]
                self._p_next = rows.mean(axis=0)
        return self._p_next

    def value(self, expert, token):
        mixed = ((1.0 - self._predict_weight) * self.rate(expert, token)
                 + self._predict_weight * float(self.p_next()[expert]))
        return max(mixed, self._boosted(expert, token))


# -- the comparison -------------------------------------------------------------------------

# Weights outside [0, 1] make rates negative, where value's max(rate, 0.0) matters.
PARAMS = {
    "defaults": {},
    "other half-lives": {"short_half_life": 1.0, "long_half_life": 7.0, "long_weight": 0.3},
    "negative rates": {"long_weight": 1.5},
}
PREDICTIVE_PARAMS = {
    **PARAMS,
    "other predictor": {"transition_half_life": 3.0, "predict_weight": 0.9},
    "negative mix": {"predict_weight": 1.25},
}
EVENTS = 2500


def _ranking(ref, token):
    """The reference's residents in ascending victim key (value, last use, -expert)."""
    return [e for *_, e in sorted((ref.value(e, token), ref._last[e], -e, e) for e in ref._resident)]


def _drive(policy, ref, rng, num_experts, capacity):
    """Random events to both; asserts they agree throughout. Returns counts of what was seen."""
    seen = Counter()
    resident: set[int] = set()
    token = 0

    def check_victim(t, evictable):
        asked = []

        def recording(e):
            asked.append(e)
            return evictable(e)

        ranking = _ranking(ref, t)
        expected = ref.victim(t, evictable)
        got = policy.victim(t, recording)
        assert got == expected
        first = ranking.index(got) + 1 if got is not None else len(ranking)
        assert asked == ranking[:first]                  # in key order, up to the victim
        if got is not None:
            values = [ref.value(e, t) for e in resident if evictable(e)]
            seen["victims"] += 1
            seen["tied victims"] += values.count(ref.value(got, t)) > 1
        return got

    def make_room(t):
        while len(resident) >= capacity:
            victim = check_victim(t, lambda e: True)
            policy.evict(victim, t)
            ref.evict(victim, t)
            resident.discard(victim)

    for _ in range(EVENTS):
        kind = rng.choice(["step", "admit", "hit", "evict", "drop", "victim", "value"],
                          p=[0.2, 0.22, 0.1, 0.04, 0.04, 0.2, 0.2])
        someone = sorted(resident)[rng.integers(len(resident))] if resident else None
        if kind == "step":
            token += int(rng.choice([0, 1, 2, 3, 60, 2500], p=[0.04, 0.8, 0.06, 0.04, 0.04, 0.02]))
            experts = rng.choice(num_experts, size=int(rng.integers(1, 5)), replace=bool(rng.random() < 0.1))
            experts = [int(e) for e in experts]
            policy.step(token, experts)
            ref.step(token, experts)
            seen["steps"] += 1
        elif kind == "admit":
            outside = [e for e in range(num_experts) if e not in resident]
            if not outside or (someone is not None and rng.random() < 0.05):
                outside = [someone]                      # admitted again while resident
            e = outside[rng.integers(len(outside))]
            t = token + int(rng.integers(0, 2))          # a prefetch may be for the next step
            if e not in resident:
                make_room(t)
            demand = bool(rng.random() < 0.5)
            choices = [0.0, 1.0, float(rng.random())]
            choices += [ref.value(r, t) for r in resident]    # ties with residents' values
            score = choices[rng.integers(len(choices))]
            policy.admit(e, t, demand, score)
            ref.admit(e, t, demand, score)
            resident.add(e)
            seen["prefetches" if not demand else "demand admissions"] += 1
        elif kind in ("hit", "evict", "drop") and someone is not None:
            if kind == "drop":
                policy.drop(someone)
                ref.drop(someone)
            else:
                getattr(policy, kind)(someone, token)
                getattr(ref, kind)(someone, token)
            if kind != "hit":
                resident.discard(someone)
        elif kind == "victim":
            t = max(0, token + int(rng.choice([-1, 0, 0, 0, 1])))
            share = rng.choice([0.0, 0.3, 0.7, 1.0])
            accepted = {e for e in resident if rng.random() < share}
            check_victim(t, accepted.__contains__)
        elif kind == "value":
            e = int(rng.integers(num_experts))
            t = max(0, token + int(rng.choice([-1, 0, 0, 1])))
            got, expected = policy.value(e, t), ref.value(e, t)
            assert got == expected and type(got) is type(expected)
            assert policy.rate(e, t) == ref.rate(e, t)
            if isinstance(ref, ReferencePredictive):
                assert np.array_equal(policy.p_next(), ref.p_next())
            seen["values"] += 1
    return seen


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cls, ref_cls, params", [
    *[(LRFUPolicy, ReferenceLRFU, p) for p in PARAMS.values()],
    *[(PredictivePolicy, ReferencePredictive, p) for p in PREDICTIVE_PARAMS.values()],
], ids=[*(f"lrfu-{k}" for k in PARAMS), *(f"predictive-{k}" for k in PREDICTIVE_PARAMS)])
def test_same_victims_and_values_as_the_reference(cls, ref_cls, params, seed):
    rng = np.random.default_rng(seed)
    num_experts = int(rng.integers(6, 40))
    capacity = int(rng.integers(2, num_experts))
    seen = _drive(cls(num_experts, capacity, **params), ref_cls(num_experts, capacity, **params),
                  rng, num_experts, capacity)
    assert seen["victims"] > 300 and seen["values"] > 300 and seen["prefetches"] > 100
    assert seen["tied victims"] > 0              # ties in value, broken by last use and id
