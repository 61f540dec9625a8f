"""Eviction policies for the dynamic tier of one MoE layer of the expert cache.

Conventions (the whole module):
  One policy object per MoE layer, ordering the experts that hold a dynamic slot of that
  layer ("residents", READY or LOADING). Experts are ints in [0, num_experts).
  `token` is the decode step (time in tokens, passed in; non-decreasing).
  The cache (scheduler/cache.py) owns slots and states; a policy never decides whether a
  slot may be evicted — `victim` receives an `evictable(expert)` predicate (false for
  LOADING and in-use slots) and only ranks. lrfu and predictive ask it about residents
  in rank order and stop at the first it accepts; it must have no side effects.

Events from the cache:
  step(token, experts)            every expert the layer needs at this step (once per layer
                                  per step, before the others; pinned ones included).
  admit(e, token, demand, score)  e got a dynamic slot: demand miss (demand=True, counts as a
                                  use), prefetch (demand=False, `score` = the prefetcher's
                                  estimate, not a use) or demotion from the pinned tier.
  hit(e, token)                   demand use of a resident e (READY or in flight).
  evict(e, token)                 e lost its slot to eviction (policies may keep history).
  drop(e)                         e left without eviction (failed read, moved to pins).
  victim(token, evictable, incoming) -> the resident to evict next, or None.
  value(e, token) -> float        the policy's estimate of how hot e is, on the scale of a
                                  probability of use per token (0..1). A prefetch may only
                                  evict a victim whose value <= the prefetch's score.

Policies (`POLICIES`, by name):
  lru     plain per-layer LRU: victim = least recently used. value = 1 / (1 + age), age =
          tokens since last use.
  slru    segmented LRU (Karedla et al. 1994): new experts enter a probation segment, a
          second use promotes to a protected segment (PROTECTED_FRACTION of the slots);
          victims come from probation's LRU end first. value as lru.
  lfu     in-cache LFU: victim = fewest uses since admission, ties to the least recent.
          value as lru.
  arc     ARC (Megiddo & Modha, FAST 2003): recency list T1 and frequency list T2 with
          ghost lists B1/B2 adapting the T1 target p. value as lru.
  s3fifo  S3-FIFO (Yang et al., SOSP 2023): small, main and ghost FIFO queues
          (`S3FIFOPolicy`). value as lru.
  lrfu    two-scale LRFU (after Lee et al., IEEE TC 2001, "LRFU: a spectrum of policies
          that subsumes LRU and LFU"): each expert keeps two combined recency-frequency
          values, CRF_h(t) = sum over past uses u of 2 ** (-(t - u) / h), for a short and a
          long half-life, kept for non-resident experts too (history of what the cache
          observed). value = (1 - a) * r_short + a * r_long with r_h = CRF_h * (1 - 2**(-1/h))
          the decayed use rate (in [0, 1], uses per token); victim = lowest value, ties to
          the least recent then the higher id (values memoized per token, `LRFUPolicy`).
          A prefetched expert not yet used counts at least its prefetch score during the
          step it was prefetched for.
  predictive
          lrfu plus a next-step predictor learned online from the layer's own steps: the
          decayed frequency with which each expert followed each other expert at the next
          step (`PredictivePolicy`). value = mean of the lrfu rate and the predicted
          probability of use at the next step.
  belady  Belady's MIN, offline (needs the future; for evaluation only, see
          `BeladyPolicy`): victim = the resident used again furthest in the future.
  default the measured winner, DEFAULT_POLICY = "predictive". On the Kimi-Linear decode
          trace (scheduler/replay.py protocol, 2 x top_k slots per layer, a quarter of them
          pinned) it scores 47.97 % hits against lru 43.84 %, lrfu 47.11 %, slru 46.19 %,
          arc 46.13 %, Belady 57.50 %; it is at or above lrfu at 1.5x and 3x top_k and for
          every warm-up length tried.
"""
from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from scheduler._lrfu import LRFUState, add_transitions, distinct_sorted, log_score, mix, predict

Evictable = Callable[[int], bool]

PROTECTED_FRACTION = 0.5       # slru: share of the layer's dynamic slots that is protected
LRFU_SHORT_HALF_LIFE = 2.0     # tokens
LRFU_LONG_HALF_LIFE = 50.0     # tokens
LRFU_LONG_WEIGHT = 0.8         # a in value = (1 - a) * r_short + a * r_long
TRANSITION_HALF_LIFE = 500.0   # predictive: tokens
PREDICT_WEIGHT = 0.5           # predictive: weight of p_next against the lrfu rate
PRIOR_SCORE_HALF_LIFE = 32.0   # predictive: steps; memory of the prior-vs-live scores
PRIOR_SCORE_FLOOR = 0.02       # predictive: least probability a score counts (log 0 guard)
S3FIFO_SMALL_FRACTION = 0.1    # s3fifo: share of the slots in the small FIFO (the paper's 10 %)


class EvictionPolicy(ABC):
    """Ranks the dynamic residents of one layer; see the module docstring for the events."""

    name = "abstract"

    def step(self, token: int, experts: Sequence[int]) -> None:
        """All experts the layer needs at this step (resident or not, pinned included)."""

    def resize(self, capacity: int) -> None:
        """The layer's dynamic tier now has `capacity` slots (ExpertCache.set_tiers)."""

    @abstractmethod
    def admit(self, expert: int, token: int, demand: bool, score: float = 0.0) -> None: ...

    @abstractmethod
    def hit(self, expert: int, token: int) -> None: ...

    @abstractmethod
    def evict(self, expert: int, token: int) -> None: ...

    @abstractmethod
    def drop(self, expert: int) -> None: ...

    @abstractmethod
    def victim(self, token: int, evictable: Evictable, incoming: int | None = None) -> int | None: ...

    @abstractmethod
    def value(self, expert: int, token: int) -> float: ...


def _recency_value(last: int, token: int) -> float:
    return 1.0 / (1.0 + max(0, token - last))


def _first(order: Mapping[int, int], evictable: Evictable) -> int | None:
    return next((e for e in order if evictable(e)), None)


class LRUPolicy(EvictionPolicy):
    """Plain LRU over the layer's dynamic residents (the baseline)."""

    name = "lru"

    def __init__(self, num_experts: int, capacity: int):
        self._last: OrderedDict[int, int] = OrderedDict()   # expert -> last use, LRU first

    def admit(self, expert, token, demand, score=0.0):
        self._last[expert] = token
        self._last.move_to_end(expert)

    def hit(self, expert, token):
        self.admit(expert, token, True)

    def evict(self, expert, token):
        self._last.pop(expert, None)

    def drop(self, expert):
        self._last.pop(expert, None)

    def victim(self, token, evictable, incoming=None):
        return _first(self._last, evictable)

    def value(self, expert, token):
        return _recency_value(self._last[expert], token)


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: probation (seen once) and protected (seen again) segments."""

    name = "slru"

    def __init__(self, num_experts: int, capacity: int, protected_fraction: float = PROTECTED_FRACTION):
        self._protected_fraction = protected_fraction
        self._protected_max = max(1, int(round(capacity * protected_fraction)))
        self._probation: OrderedDict[int, int] = OrderedDict()
        self._protected: OrderedDict[int, int] = OrderedDict()
        self._fresh: set[int] = set()   # prefetched, not yet used

    def admit(self, expert, token, demand, score=0.0):
        self._probation[expert] = token
        if not demand:
            self._fresh.add(expert)

    def resize(self, capacity):
        self._protected_max = max(1, int(round(capacity * self._protected_fraction)))

    def hit(self, expert, token):
        if expert in self._fresh:                       # first real use of a prefetch
            self._fresh.discard(expert)
            self._probation[expert] = token
            self._probation.move_to_end(expert)
        elif expert in self._probation:
            del self._probation[expert]
            self._protected[expert] = token
            while len(self._protected) > self._protected_max:
                old, last = self._protected.popitem(last=False)
                self._probation[old] = last             # demote to probation's MRU end
        else:
            self._protected[expert] = token
            self._protected.move_to_end(expert)

    def evict(self, expert, token):
        self.drop(expert)

    def drop(self, expert):
        self._probation.pop(expert, None)
        self._protected.pop(expert, None)
        self._fresh.discard(expert)

    def victim(self, token, evictable, incoming=None):
        found = _first(self._probation, evictable)
        return found if found is not None else _first(self._protected, evictable)

    def value(self, expert, token):
        last = self._probation.get(expert, self._protected.get(expert))
        return _recency_value(last, token)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over the layer's dynamic slots (capacity c)."""

    name = "arc"

    def __init__(self, num_experts: int, capacity: int):
        self._c = capacity
        self._p = 0.0
        self._t1: OrderedDict[int, int] = OrderedDict()
        self._t2: OrderedDict[int, int] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._fresh: set[int] = set()

    def admit(self, expert, token, demand, score=0.0):
        if demand and expert in self._b1:
            self._p = min(self._c, self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[expert]
            self._t2[expert] = token
        elif demand and expert in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[expert]
            self._t2[expert] = token
        else:
            self._b1.pop(expert, None)
            self._b2.pop(expert, None)
            self._t1[expert] = token
            if not demand:
                self._fresh.add(expert)
        self._trim_ghosts()

    def hit(self, expert, token):
        if expert in self._fresh:
            self._fresh.discard(expert)
            self._t1[expert] = token
            self._t1.move_to_end(expert)
        elif expert in self._t1:
            del self._t1[expert]
            self._t2[expert] = token
        else:
            self._t2[expert] = token
            self._t2.move_to_end(expert)

    def evict(self, expert, token):
        if expert in self._t1:
            del self._t1[expert]
            self._b1[expert] = None
        elif expert in self._t2:
            del self._t2[expert]
            self._b2[expert] = None
        self._fresh.discard(expert)
        self._trim_ghosts()

    def drop(self, expert):
        self._t1.pop(expert, None)
        self._t2.pop(expert, None)
        self._fresh.discard(expert)

    def victim(self, token, evictable, incoming=None):
        t1 = len(self._t1)
        from_t1 = t1 >= 1 and (t1 > self._p or (incoming in self._b2 and t1 == int(self._p)))
        first, second = (self._t1, self._t2) if from_t1 else (self._t2, self._t1)
        found = _first(first, evictable)
        return found if found is not None else _first(second, evictable)

    def value(self, expert, token):
        last = self._t1.get(expert, self._t2.get(expert))
        return _recency_value(last, token)

    def resize(self, capacity):
        self._c = capacity
        self._p = min(self._p, float(capacity))
        self._trim_ghosts()

    def _trim_ghosts(self):
        while self._b1 and len(self._t1) + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * self._c:
            self._b2.popitem(last=False)


class LRFUPolicy(EvictionPolicy):
    """Two-scale LRFU: short- and long-half-life decayed use rates, history kept per expert.

    victim() ranks the residents by the key (value, last use, -expert) — lowest value
    first, ties to the least recent use, then to the higher id: a total order, so the
    order of admission never matters — and asks `evictable` about them in that order
    until one is. The state and the ranking are compiled (`scheduler._lrfu.LRFUState`:
    the same expressions in the same order, so values are the Python ones to the bit);
    values are memoized for the token they were computed at, and every event that can
    change an expert's value forgets it (a step forgets all): the several victim() and
    value() calls of one step compute each resident's value once, and victim() and
    value() agree to the bit.
    """

    name = "lrfu"

    def __init__(self, num_experts: int, capacity: int, short_half_life: float = LRFU_SHORT_HALF_LIFE,
                 long_half_life: float = LRFU_LONG_HALF_LIFE, long_weight: float = LRFU_LONG_WEIGHT):
        ds = 2.0 ** (-1.0 / short_half_life)
        dl = 2.0 ** (-1.0 / long_half_life)
        # CRF -> rate, times its weight
        self._state = LRFUState(num_experts, ds, dl, (1.0 - long_weight) * (1.0 - ds),
                                long_weight * (1.0 - dl))

    def step(self, token, experts):
        self._state.step(token, experts)

    def admit(self, expert, token, demand, score=0.0):
        self._state.admit(expert, token, demand, score)

    def hit(self, expert, token):
        self._state.hit(expert)

    def evict(self, expert, token):
        self._state.drop(expert)

    def drop(self, expert):
        self._state.drop(expert)

    def victim(self, token, evictable, incoming=None):
        prediction = self._prediction()
        if prediction is None:
            return self._state.victim(token, evictable)
        return self._state.victim(token, evictable, *prediction)

    def rate(self, expert: int, token: int) -> float:
        """(1 - a) * r_short + a * r_long at `token`: decayed uses per token, 0..1."""
        return self._state.rate(expert, token)

    def value(self, expert, token):
        prediction = self._prediction()
        if prediction is None:
            return self._state.value(expert, token)
        return self._state.value(expert, token, *prediction)

    def _prediction(self) -> tuple[float, np.ndarray] | None:
        """(weight, [E] float64 p_next) to mix into the rate, or None (plain lrfu)."""
        return None


class PredictivePolicy(LRFUPolicy):
    """lrfu plus a next-step predictor learned online from the layer's own steps.

    Transition statistics: T[a, e] = decayed count of steps at which expert a was used and
    e was used at the following step; N[a] = decayed count of steps at which a was used and
    a following step was seen (half-life TRANSITION_HALF_LIFE tokens). After step t with
    experts X, the probability that e is needed at step t+1 is estimated as
        p_next(e) = mean over a in X of T[a, e] / N[a]      (0 for an a never seen)
    and value(e) = (1 - PREDICT_WEIGHT) * lrfu rate(e) + PREDICT_WEIGHT * p_next(e).
    Memory: num_experts ** 2 float64 per layer (0.5 MiB at 256 experts).

    A prior from an earlier session (`seed_prior`: its exported T and N, `transitions`)
    is kept apart from what this session sees, and the two predictors are mixed by how
    well each has predicted this session's steps (Bayesian model averaging with
    forgetting): after each step with experts X, each predictor's score is decayed by
    2 ** (-1 / PRIOR_SCORE_HALF_LIFE) and adds sum over e in X of log(max(p(e),
    PRIOR_SCORE_FLOOR)) for the p it gave before the step; the prior's weight is
    w = 1 / (1 + exp(score_live - score_prior)), and
        p_next(e) = w * p_prior(e) + (1 - w) * p_live(e).
    A prior that predicts this traffic well keeps its weight; one learned on other traffic
    loses it within a few dozen steps. `transitions` exports the prior (decayed with
    the transition half-life over the tokens since it was seeded) plus this session's
    counts, so what sessions learn accumulates. Measured on recorded routing of the
    default model and a second trained model (256-token sessions, the next session on the
    same text and on another kind): adding the prior's counts to the live ones instead
    gained about 0.3 points less on the same text and lost up to 0.6 points on other text.
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
        self._parts: tuple[np.ndarray, np.ndarray] | None = None   # (p_prior, p_live), cached per step
        self._prior: tuple[np.ndarray, np.ndarray] | None = None   # (T, N) seeded
        self._prior_token: int | None = None             # token of the first step after seeding
        self._score_prior = self._score_live = 0.0
        self._prior_weight = 1.0

    def seed_prior(self, transitions: np.ndarray, totals: np.ndarray) -> None:
        """Start from an earlier session's transition counts: T [E, E] and N [E], float,
        finite and >= 0 (as `transitions` exports them). Raises ValueError otherwise."""
        t = np.array(transitions, dtype=np.float64)
        n = np.array(totals, dtype=np.float64)
        e = self._n.shape[0]
        if t.shape != (e, e) or n.shape != (e,):
            raise ValueError(f"prior shapes {t.shape}, {n.shape}; expected {(e, e)}, {(e,)}")
        if not (np.all(np.isfinite(t)) and np.all(np.isfinite(n)) and t.min(initial=0) >= 0
                and n.min(initial=0) >= 0):
            raise ValueError("prior counts must be finite and >= 0")
        self._prior = (t, n) if n.any() else None
        self._prior_token = None
        self._score_prior = self._score_live = 0.0
        self._prior_weight = 1.0
        self._p_next = self._parts = None

    def seed_counts(self, transitions: np.ndarray, totals: np.ndarray) -> None:
        """As `seed_prior`, but taken as this policy's own counts (no weighing): a replay
        that continues another policy's state. Raises ValueError as seed_prior."""
        self.seed_prior(transitions, totals)
        if self._prior is not None:
            (self._t, self._n), self._prior = self._prior, None
            self._base = self._prev_token if self._prev is not None else 0

    def transitions(self) -> tuple[np.ndarray, np.ndarray]:
        """(T [E, E], N [E]) float64 as of the last step: this session's counts plus the
        prior decayed over the tokens since it was seeded (see the class docstring)."""
        if self._prev is None:
            t, n = np.zeros_like(self._t), np.zeros_like(self._n)
        else:
            scale = 2.0 ** (-(self._prev_token - self._base) / self._half_life)
            t, n = self._t * scale, self._n * scale
        if self._prior is not None:
            age = 0 if self._prior_token is None or self._prev is None else self._prev_token - self._prior_token
            decay = 2.0 ** (-age / self._half_life)
            t, n = t + self._prior[0] * decay, n + self._prior[1] * decay
        return t, n

    def prior_weight(self) -> float | None:
        """The weight of the seeded prior in p_next now (0..1), None without one."""
        return None if self._prior is None else self._prior_weight

    def forget_transitions(self) -> None:
        """Drop the prior and this session's transition counts."""
        self._prior = None
        self._t[:] = 0.0
        self._n[:] = 0.0
        self._p_next = self._parts = None

    def step(self, token, experts):
        ids = distinct_sorted(experts)                   # [X] int64
        if self._prior is not None and self._prev is not None and token > self._prev_token and ids.size:
            self._score_predictors(ids)
        super().step(token, experts)
        if self._prior is not None and self._prior_token is None:
            self._prior_token = token
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
            add_transitions(self._t, self._n, self._prev, ids, weight)   # T[prev x ids], N[prev] += weight
        if token != self._prev_token or self._prev is None:
            self._prev, self._prev_token = ids, token
        self._p_next = self._parts = None

    def p_next(self) -> np.ndarray:
        """[E] float64: estimated probability of each expert at the step after the last one."""
        if self._p_next is None:
            if self._prev is None or self._prev.size == 0:
                self._p_next = np.zeros(self._n.shape)
            elif self._prior is None:
                self._p_next = self._predict(self._t, self._n)
            else:
                w = self._prior_weight
                p_prior, p_live = self._prior_and_live()
                self._p_next = mix(w, p_prior, p_live)    # w * p_prior + (1 - w) * p_live
        return self._p_next

    def _prior_and_live(self) -> tuple[np.ndarray, np.ndarray]:
        """(the prior's prediction, this session's) for the step after the last one, computed
        once per step: p_next mixes them and the next step scores them."""
        if self._parts is None:
            self._parts = (self._predict(*self._prior), self._predict(self._t, self._n))
        return self._parts

    def _predict(self, t: np.ndarray, n: np.ndarray) -> np.ndarray:
        """mean over a in the last step's experts of t[a] / n[a] (0 where n[a] is 0)."""
        return predict(t, n, self._prev)     # compiled; the numpy expression is its docstring

    def _score_predictors(self, ids: np.ndarray) -> None:
        """Score the prior's and the live prediction made before this step on `ids`."""
        decay = 2.0 ** (-1.0 / PRIOR_SCORE_HALF_LIFE)
        p_prior, p_live = self._prior_and_live()
        prior = log_score(p_prior, ids, PRIOR_SCORE_FLOOR)
        live = log_score(p_live, ids, PRIOR_SCORE_FLOOR)
        self._score_prior = self._score_prior * decay + float(prior)
        self._score_live = self._score_live * decay + float(live)
        x = min(50.0, max(-50.0, self._score_live - self._score_prior))
        self._prior_weight = 1.0 / (1.0 + math.exp(x))

    def _prediction(self):
        return self._predict_weight, self.p_next()


class LFUPolicy(EvictionPolicy):
    """In-cache LFU: victim = the resident used least since it was admitted, ties to the
    least recently used, then to the higher id. A prefetched expert not yet used counts 0."""

    name = "lfu"

    def __init__(self, num_experts: int, capacity: int):
        self._uses: dict[int, int] = {}
        self._last: dict[int, int] = {}

    def admit(self, expert, token, demand, score=0.0):
        self._uses[expert] = 1 if demand else 0
        self._last[expert] = token

    def hit(self, expert, token):
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._last[expert] = token

    def evict(self, expert, token):
        self.drop(expert)

    def drop(self, expert):
        self._uses.pop(expert, None)
        self._last.pop(expert, None)

    def victim(self, token, evictable, incoming=None):
        order = sorted(self._uses, key=lambda e: (self._uses[e], self._last[e], -e))
        return next((e for e in order if evictable(e)), None)

    def value(self, expert, token):
        return _recency_value(self._last[expert], token)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023, "FIFO queues are all you need for cache eviction").

    A small FIFO S (S3FIFO_SMALL_FRACTION of the slots) takes new experts; a main FIFO M
    holds those used again while in S; a ghost FIFO G remembers (ids only, as many as
    the slots) what left S unused, and an expert found in G is admitted straight to M.
    Each resident has a use count capped at 3. Evicting: while S holds at least its
    share, S's oldest moves to M if it was used since admission, else it is the victim
    (and enters G); otherwise M's oldest is reinserted with its count minus one while the
    count is positive, else it is the victim. victim() walks copies of the queues (no
    side effects); evict() of the expert it named commits that walk.
    value as lru.
    """

    name = "s3fifo"

    def __init__(self, num_experts: int, capacity: int):
        self._capacity = capacity
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._pending: tuple | None = None   # (victim, small, main, freq) of the last walk

    def resize(self, capacity):
        self._capacity = capacity
        self._pending = None

    def admit(self, expert, token, demand, score=0.0):
        self._pending = None
        if expert in self._ghost:
            del self._ghost[expert]
            self._main[expert] = None
        else:
            self._small[expert] = None
        self._freq[expert] = 0
        self._last[expert] = token

    def hit(self, expert, token):
        self._pending = None
        self._freq[expert] = min(3, self._freq.get(expert, 0) + 1)
        self._last[expert] = token

    def evict(self, expert, token):
        pending = self._pending
        if pending is not None and pending[0] == expert:
            _, self._small, self._main, self._freq = pending
        from_small = expert in self._small
        self.drop(expert)
        if from_small:
            self._ghost[expert] = None
            while len(self._ghost) > self._capacity:
                self._ghost.popitem(last=False)

    def drop(self, expert):
        self._pending = None
        self._small.pop(expert, None)
        self._main.pop(expert, None)
        self._freq.pop(expert, None)
        self._last.pop(expert, None)

    def victim(self, token, evictable, incoming=None):
        small, main, freq = OrderedDict(self._small), OrderedDict(self._main), dict(self._freq)
        small_share = max(1, round(S3FIFO_SMALL_FRACTION * self._capacity))
        skipped: set[int] = set()          # not evictable now: passed over, kept in place
        for _ in range(4 * (len(small) + len(main)) + 4):
            queue = small if len(small) >= small_share or not main else main
            candidates = [e for e in queue if e not in skipped]
            if not candidates:
                queue = main if queue is small else small
                candidates = [e for e in queue if e not in skipped]
                if not candidates:
                    return None
            e = candidates[0]
            if queue is small:
                if freq.get(e, 0) > 0:
                    del small[e]
                    main[e] = None
                    freq[e] = 0
                elif evictable(e):
                    self._pending = (e, small, main, freq)
                    return e
                else:
                    skipped.add(e)
            else:
                if freq.get(e, 0) > 0:
                    freq[e] -= 1
                    main.move_to_end(e)
                elif evictable(e):
                    self._pending = (e, small, main, freq)
                    return e
                else:
                    skipped.add(e)
        return None

    def value(self, expert, token):
        return _recency_value(self._last[expert], token)


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN for one layer: evict the resident whose next use is furthest away.

    uses: expert -> sorted tokens at which the layer needs it (the whole future). Offline
    only: for replaying traces as the optimal reference. value = 1 / (tokens to next use),
    0 when never used again.
    """

    name = "belady"

    def __init__(self, uses: Mapping[int, Sequence[int]]):
        self._uses = {e: list(ts) for e, ts in uses.items()}
        self._resident: set[int] = set()

    def _next_use(self, expert: int, token: int) -> float:
        ts = self._uses.get(expert, [])
        i = bisect.bisect_right(ts, token)
        return ts[i] if i < len(ts) else math.inf

    def admit(self, expert, token, demand, score=0.0):
        self._resident.add(expert)

    def hit(self, expert, token):
        pass

    def evict(self, expert, token):
        self._resident.discard(expert)

    def drop(self, expert):
        self._resident.discard(expert)

    def victim(self, token, evictable, incoming=None):
        candidates = [e for e in self._resident if evictable(e)]
        if not candidates:
            return None
        return max(candidates, key=lambda e: (self._next_use(e, token), e))

    def value(self, expert, token):
        return 1.0 / (self._next_use(expert, token) - token)


PolicyFactory = Callable[[int, int], EvictionPolicy]   # (layer_index, capacity) -> policy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy, "lfu": LFUPolicy, "slru": SLRUPolicy, "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy, "lrfu": LRFUPolicy, "predictive": PredictivePolicy,
}
DEFAULT_POLICY = "predictive"


def policy_factory(name: str, num_experts: int) -> PolicyFactory:
    """Factory of per-layer policies for `name` ("default" resolves to DEFAULT_POLICY).

    Raises ValueError naming the known policies for an unknown name.
    """
    cls = POLICIES.get(DEFAULT_POLICY if name == "default" else name)
    if cls is None:
        raise ValueError(f"unknown cache policy {name!r}; known: default, {', '.join(POLICIES)}")
    return lambda layer_index, capacity: cls(num_experts, capacity)
