"""scheduler.cache.ExpertCache: slot states, tiers, demand, prefetch, pins, counters."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.cache import (OUTCOME_HIT, OUTCOME_INFLIGHT, OUTCOME_MISS, Access, CacheBudgetError,
                             CacheFullError, ExpertCache, PinLoad, SlotState, Tier)
from scheduler.eviction import POLICIES


def _step(cache, layer, experts, token, load=True):
    """A demand step as the engine does it: request, read the misses, release."""
    accesses = cache.request(layer, experts, token)
    if load:
        for a in accesses:
            if a.outcome == OUTCOME_MISS:
                cache.loaded(a.slot)
    cache.release(layer, experts)
    return [a.outcome for a in accesses]


def _resident(cache, layer):
    return {cache.held(s)[1] for s in range(cache.total_slots)
            if cache.held(s) is not None and cache.held(s)[0] == layer}


# -- budget ------------------------------------------------------------------------------
def test_a_budget_below_top_k_per_layer_is_refused_with_the_minimum():
    with pytest.raises(CacheBudgetError, match="minimum of 12"):
        ExpertCache([1, 3, 5], 16, 4, total_slots=11)
    assert ExpertCache([1, 3, 5], 16, 4, total_slots=12).dynamic_slots(5) == 4


def test_pinned_slots_must_leave_top_k_dynamic_slots_per_layer():
    with pytest.raises(CacheBudgetError, match=r"pinned_slots \+ staging_slots <= 4"):
        ExpertCache([1, 3], 8, 2, total_slots=8, pinned_slots=5)
    with pytest.raises(CacheBudgetError, match="3 pinned and 2 staging slots"):
        ExpertCache([1, 3], 8, 2, total_slots=8, pinned_slots=3, staging_slots=2)
    assert isinstance(CacheBudgetError("x"), ValueError)


def test_dynamic_slots_are_split_evenly_with_the_remainder_to_the_first_layers():
    cache = ExpertCache([1, 3, 5], 8, 2, total_slots=11)
    assert [cache.dynamic_slots(x) for x in (1, 3, 5)] == [4, 4, 3]
    cache = ExpertCache([1, 3, 5], 8, 2, total_slots=11, pinned_slots=2)
    assert [cache.dynamic_slots(x) for x in (1, 3, 5)] == [3, 3, 3]
    assert sum(cache.tier(s) == Tier.PINNED for s in range(11)) == 2


# -- demand ------------------------------------------------------------------------------
def test_hits_misses_and_lru_eviction():
    cache = ExpertCache([7], 8, 2, total_slots=3, policy="lru")
    first = cache.request(7, [0, 1], token=0)
    assert [a.outcome for a in first] == [OUTCOME_MISS, OUTCOME_MISS]
    assert first[0].slot != first[1].slot and first[0] == Access(0, first[0].slot, "miss")
    for a in first:
        assert cache.state(a.slot) == SlotState.LOADING and cache.users(a.slot) == 1
        cache.loaded(a.slot)
    cache.release(7, [0, 1])
    assert _step(cache, 7, [0, 2], 1) == [OUTCOME_HIT, OUTCOME_MISS]
    slot_of_1 = cache.slot_of(7, 1)
    assert _step(cache, 7, [3, 2], 2) == [OUTCOME_MISS, OUTCOME_HIT]   # evicts 1, the LRU
    assert cache.slot_of(7, 1) is None and cache.slot_of(7, 3) == slot_of_1
    snap = cache.snapshot()
    assert (snap.hits, snap.misses, snap.evictions_dynamic) == ((2,), (4,), (1,))
    assert snap.lookups == 6 and snap.hit_rate == pytest.approx(2 / 6)
    assert snap.resident_dynamic == (3,) and snap.resident_pinned == (0,)


def test_loading_and_in_use_slots_are_never_evicted_or_handed_out():
    cache = ExpertCache([7], 8, 2, total_slots=4, policy="lru")
    a = cache.request(7, [0, 1], 0)                       # LOADING, in use
    b = cache.request(7, [2, 3], 1)
    before = cache.snapshot()
    with pytest.raises(CacheFullError, match="0 of 4 dynamic slots"):
        cache.request(7, [4], 2)
    assert cache.snapshot() == before and cache.slot_of(7, 4) is None   # nothing changed
    cache.loaded(a[0].slot)                               # 0 READY but still in use
    with pytest.raises(CacheFullError):
        cache.request(7, [4], 2)
    cache.release(7, [0, 1])                              # 0 evictable; 1 still LOADING
    with pytest.raises(CacheFullError):
        cache.request(7, [4, 5], 2)
    (c,) = cache.request(7, [4], 2)
    assert c.slot == a[0].slot and cache.slot_of(7, 0) is None
    assert [cache.held(x.slot) for x in b] == [(7, 2), (7, 3)]
    assert cache.held(a[1].slot) == (7, 1) and cache.state(a[1].slot) == SlotState.LOADING


def test_request_validates_its_arguments():
    cache = ExpertCache([7], 8, 2, total_slots=4)
    with pytest.raises(KeyError):
        cache.request(6, [0], 0)
    with pytest.raises(ValueError):
        cache.request(7, [0, 0], 0)
    with pytest.raises(ValueError):
        cache.request(7, [8], 0)
    _step(cache, 7, [0], 0)
    with pytest.raises(ValueError, match="not in use"):
        cache.release(7, [0])
    with pytest.raises(ValueError, match="no read in flight"):
        cache.loaded(cache.slot_of(7, 0))


def test_failed_frees_only_that_slot():
    cache = ExpertCache([7, 9], 8, 2, total_slots=8, policy="lru")
    _step(cache, 9, [4, 5], 0)
    accesses = cache.request(7, [0, 1], 1)
    states = [cache.state(s) for s in range(8)]
    cache.failed(accesses[0].slot)
    assert cache.state(accesses[0].slot) == SlotState.FREE and cache.slot_of(7, 0) is None
    changed = [s for s in range(8) if cache.state(s) != states[s]]
    assert changed == [accesses[0].slot]
    assert cache.held(accesses[1].slot) == (7, 1) and cache.users(accesses[1].slot) == 1
    assert _resident(cache, 9) == {4, 5}
    cache.release(7, [0, 1])                              # the failed one is skipped
    cache.loaded(accesses[1].slot)
    assert _step(cache, 7, [0, 1], 2) == [OUTCOME_MISS, OUTCOME_HIT]
    with pytest.raises(ValueError):
        cache.failed(accesses[1].slot)


# -- prefetch ----------------------------------------------------------------------------
def test_a_prefetched_expert_is_found_in_flight_then_counted_used():
    cache = ExpertCache([7], 8, 2, total_slots=4)
    slot = cache.prefetch(7, 5, token=0, score=0.9)
    assert cache.state(slot) == SlotState.LOADING and cache.users(slot) == 0
    accesses = cache.request(7, [5, 6], 0)
    assert accesses[0] == Access(5, slot, OUTCOME_INFLIGHT) and accesses[1].outcome == OUTCOME_MISS
    snap = cache.snapshot()
    assert (snap.prefetch_hits, snap.prefetches_issued, snap.prefetches_used) == ((1,), (1,), (1,))
    assert snap.prefetches_unused == (0,)


def test_prefetch_skips_resident_and_in_flight_experts_and_keeps_top_k_for_demand():
    cache = ExpertCache([7], 8, 2, total_slots=4)      # 4 dynamic: at most 2 prefetches in flight
    _step(cache, 7, [0], 0)
    assert cache.prefetch(7, 0, 1, 1.0) is None        # resident
    assert cache.prefetch(7, 1, 1, 1.0) is not None
    assert cache.prefetch(7, 1, 1, 1.0) is None        # in flight
    assert cache.prefetch(7, 2, 1, 1.0) is not None
    assert cache.prefetch(7, 3, 1, 1.0) is None        # a FREE slot is left, but for demand
    assert [a.outcome for a in cache.request(7, [3, 4], 1)] == [OUTCOME_MISS, OUTCOME_MISS]


def test_prefetch_never_evicts_an_expert_hotter_than_its_score():
    cache = ExpertCache([7], 8, 2, total_slots=3, policy="lru")
    _step(cache, 7, [0, 1], 0)
    _step(cache, 7, [2, 0], 1)
    assert cache.value(7, 1, 2) == pytest.approx(1 / 3)   # the LRU victim: last used 2 tokens ago
    assert cache.prefetch(7, 5, 2, score=0.2) is None
    assert _resident(cache, 7) == {0, 1, 2}
    slot = cache.prefetch(7, 5, 2, score=0.4)
    assert cache.held(slot) == (7, 5) and _resident(cache, 7) == {0, 2, 5}
    cache.loaded(slot)
    _step(cache, 7, [3, 4], 3)                            # evicts 0 and 2; 5 is younger
    assert cache.snapshot().prefetches_unused == (1,)
    _step(cache, 7, [6, 3], 4)                            # 5 evicted unused: wasted
    snap = cache.snapshot()
    assert snap.prefetches_wasted == (1,) and snap.prefetches_used == (0,)


def test_prefetch_never_evicts_pinned_in_use_or_loading():
    cache = ExpertCache([7], 8, 1, total_slots=4, pinned_slots=1, policy="lru")
    for load in cache.set_pins({(7, 7)}):
        cache.loaded(load.slot)
    cache.request(7, [0], 0)                              # miss, in use, not yet loaded
    s1 = cache.prefetch(7, 1, 0, 1.0)
    s2 = cache.prefetch(7, 2, 0, 1.0)
    assert None not in (s1, s2)
    assert cache.prefetch(7, 3, 0, 1.0) is None           # everything is pinned, in use or LOADING
    cache.loaded(s1)
    cache.loaded(s2)
    cache.loaded(cache.slot_of(7, 0))
    s3 = cache.prefetch(7, 3, 0, 1.0)
    assert cache.held(s3) == (7, 3) and s3 in (s1, s2)
    assert cache.slot_of(7, 7) is not None and cache.slot_of(7, 0) is not None


# -- staging tier -------------------------------------------------------------------------
def test_a_staged_guess_evicts_no_resident_and_a_used_one_takes_the_victims_place():
    cache = ExpertCache([7], 8, 2, total_slots=5, staging_slots=2, policy="lru")  # 3 dynamic
    _step(cache, 7, [0, 1], 0)
    _step(cache, 7, [2, 0], 1)                            # dynamic: 0, 1, 2 (1 is the LRU victim)
    slot = cache.prefetch(7, 5, 2, score=0.01)            # no victim needed, whatever the score
    assert cache.tier(slot) == Tier.STAGING and cache.state(slot) == SlotState.LOADING
    assert _resident(cache, 7) == {0, 1, 2, 5}
    cache.loaded(slot)
    assert [a.outcome for a in cache.request(7, [5, 0], 2)] == [OUTCOME_HIT, OUTCOME_HIT]
    assert cache.tier(slot) == Tier.DYNAMIC               # same slot, no read: tiers swapped
    assert _resident(cache, 7) == {0, 2, 5}               # 1 evicted as a miss of 5 would have
    cache.release(7, [5, 0])
    assert sum(cache.tier(s) == Tier.STAGING for s in range(5)) == 2 and cache.dynamic_slots(7) == 3
    snap = cache.snapshot()
    assert (snap.hits, snap.prefetches_used, snap.evictions_dynamic) == ((3,), (1,), (1,))
    assert snap.resident_dynamic == (3,) and snap.resident_staging == (0,) and snap.staging_slots == 2


def test_a_staged_guess_in_flight_is_waited_for_and_then_joins_the_layer():
    cache = ExpertCache([7], 8, 2, total_slots=4, staging_slots=2)      # 2 dynamic
    slot = cache.prefetch(7, 5, 0, score=0.9)
    accesses = cache.request(7, [5, 6], 0)
    assert accesses[0] == Access(5, slot, OUTCOME_INFLIGHT) and accesses[1].outcome == OUTCOME_MISS
    assert cache.tier(slot) == Tier.DYNAMIC and cache.state(slot) == SlotState.LOADING
    cache.loaded(slot)
    cache.loaded(accesses[1].slot)
    cache.release(7, [5, 6])
    assert _step(cache, 7, [5, 6], 1) == [OUTCOME_HIT, OUTCOME_HIT]


def test_unused_guesses_go_stale_and_are_recycled_first_then_only_for_likelier_ones():
    cache = ExpertCache([7, 9], 8, 2, total_slots=10, staging_slots=2, policy="lru")
    a = cache.prefetch(7, 3, 0, score=0.5)
    b = cache.prefetch(9, 4, 0, score=0.6)
    assert cache.prefetch(9, 5, 0, score=0.9) is None     # both LOADING: never recycled
    cache.loaded(a)
    cache.loaded(b)
    assert cache.prefetch(9, 5, 0, score=0.55) == a       # 0.5 < 0.55; 0.6 is not
    assert cache.prefetch(9, 6, 0, score=0.2) is None     # nothing less likely, nothing stale
    cache.loaded(a)
    _step(cache, 9, [0, 1], 0)                            # layer 9 ran without 4 or 5: stale
    assert cache.prefetch(7, 2, 1, score=0.1) in (a, b)
    snap = cache.snapshot()
    assert snap.prefetches_wasted == (1, 1) and snap.prefetches_used == (0, 0)
    assert snap.resident_staging == (1, 1)


def test_a_failed_guess_frees_its_staging_slot_and_counts_as_wasted():
    cache = ExpertCache([7], 8, 2, total_slots=4, staging_slots=1)
    slot = cache.prefetch(7, 5, 0, score=0.9)
    cache.failed(slot)
    assert cache.held(slot) is None and cache.tier(slot) == Tier.STAGING
    assert cache.snapshot().prefetches_wasted == (1,)
    assert cache.prefetch(7, 5, 0, score=0.9) == slot


def test_set_pins_takes_a_staged_guess_without_a_read():
    cache = ExpertCache([7], 8, 2, total_slots=6, pinned_slots=1, staging_slots=1)
    slot = cache.prefetch(7, 5, 0, score=0.9)
    cache.loaded(slot)
    assert cache.set_pins({(7, 5)}) == []
    assert cache.tier(slot) == Tier.PINNED and cache.pins == {(7, 5)}
    assert sum(cache.tier(s) == Tier.STAGING for s in range(6)) == 1
    assert _step(cache, 7, [5, 0], 1) == [OUTCOME_HIT, OUTCOME_MISS]


# -- pins --------------------------------------------------------------------------------
def test_set_pins_moves_a_resident_expert_without_a_read():
    cache = ExpertCache([7, 9], 8, 2, total_slots=8, pinned_slots=2)
    _step(cache, 7, [0, 1], 0)
    slot = cache.slot_of(7, 0)
    loads = cache.set_pins({(7, 0), (9, 5)})
    assert loads == [PinLoad(loads[0].slot, 9, 5)]
    assert cache.slot_of(7, 0) == slot and cache.tier(slot) == Tier.PINNED
    assert cache.state(loads[0].slot) == SlotState.LOADING and cache.tier(loads[0].slot) == Tier.PINNED
    cache.loaded(loads[0].slot)
    assert cache.pins == {(7, 0), (9, 5)}
    assert [cache.dynamic_slots(x) for x in (7, 9)] == [3, 3]
    assert _step(cache, 7, [2, 3], 1) == [OUTCOME_MISS, OUTCOME_MISS]
    assert _step(cache, 9, [5, 6], 1) == [OUTCOME_HIT, OUTCOME_MISS]
    snap = cache.snapshot()
    assert snap.evictions_dynamic == (0, 0)               # the move freed a dynamic slot
    assert snap.resident_pinned == (1, 1) and snap.resident_dynamic == (3, 1)


def test_unpinned_experts_are_demoted_when_there_is_room_else_freed():
    cache = ExpertCache([7, 9], 8, 2, total_slots=8, pinned_slots=2)
    for load in cache.set_pins({(7, 0), (9, 5)}):
        cache.loaded(load.slot)
    slot = cache.slot_of(7, 0)
    assert cache.set_pins({(9, 5)}) == []                 # layer 7 has free dynamic slots
    assert cache.slot_of(7, 0) == slot and cache.tier(slot) == Tier.DYNAMIC
    _step(cache, 9, [1, 2], 1)
    _step(cache, 9, [3, 4], 2)                            # layer 9's dynamic slots all full
    assert cache.set_pins(set()) == []
    assert cache.slot_of(9, 5) is None
    snap = cache.snapshot()
    assert snap.evictions_pinned == (0, 1) and cache.pins == frozenset()
    assert [cache.dynamic_slots(x) for x in (7, 9)] == [3, 3]


def test_set_pins_refuses_more_pins_than_slots():
    cache = ExpertCache([7], 8, 2, total_slots=4, pinned_slots=1)
    with pytest.raises(ValueError, match="exceed"):
        cache.set_pins({(7, 0), (7, 1)})
    with pytest.raises(KeyError):
        cache.set_pins({(8, 0)})


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pinned_experts_are_never_evicted_by_traffic(policy):
    rng = np.random.default_rng(1)
    cache = ExpertCache([0, 1], 32, 4, total_slots=14, pinned_slots=4, policy=policy)
    pins = {(0, 30), (0, 31), (1, 0), (1, 1)}
    for load in cache.set_pins(pins):
        cache.loaded(load.slot)
    slots = {p: cache.slot_of(*p) for p in pins}
    for t in range(300):
        for layer in (0, 1):
            _step(cache, layer, rng.choice(32, size=4, replace=False).tolist(), t)
            cache.prefetch(layer, int(rng.integers(32)), t, score=1.0)
            for s in range(cache.total_slots):
                if cache.state(s) == SlotState.LOADING:
                    cache.loaded(s)
    assert {p: cache.slot_of(*p) for p in pins} == slots
    assert cache.snapshot().evictions_pinned == (0, 0)


# -- invariants under random operations ----------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("staging", [0, 3])
def test_invariants_under_random_traffic(policy, seed, staging):
    """Random demand, prefetch, failures and pin changes, checked after every operation.

    - a LOADING or in-use slot keeps its expert until loaded/failed/released by us;
    - demand never fails (one step per layer in use at a time, prefetches bounded);
    - without staging, a prefetch evicts only a victim whose value was <= its score, never
      a pinned one; with staging it evicts no dynamic or pinned expert at all, only a
      staged guess that is stale or less likely than it;
    - pinned experts stay resident until set_pins or a failed read changes them;
    - tier sizes never change; slot_of and held agree.
    """
    rng = np.random.default_rng(seed)
    layers, n_exp, top_k = [3, 7, 11], 12, 3
    cache = ExpertCache(layers, n_exp, top_k, total_slots=22, pinned_slots=4, policy=policy,
                        staging_slots=staging)
    per_layer = (22 - 4 - staging) // 3
    held: dict[int, tuple[int, int]] = {}      # slots that must not change owner
    pinned_ready: set[tuple[int, int]] = set()

    def check():
        for s, key in held.items():
            assert cache.held(s) == key
        for s in range(cache.total_slots):
            key = cache.held(s)
            assert (key is None) == (cache.state(s) == SlotState.FREE)
            if key is not None:
                assert cache.slot_of(*key) == s
        assert sum(cache.tier(s) == Tier.PINNED for s in range(cache.total_slots)) == 4
        assert sum(cache.tier(s) == Tier.STAGING for s in range(cache.total_slots)) == staging
        assert [cache.dynamic_slots(x) for x in layers] == [per_layer] * 3
        for x in layers:
            assert sum(cache.tier(s) == Tier.DYNAMIC and cache._owner[s] == layers.index(x)
                       for s in range(cache.total_slots)) == per_layer
        for key in pinned_ready:
            assert cache.tier(cache.slot_of(*key)) == Tier.PINNED

    def finish(slot):
        key = held.pop(slot)
        if rng.random() < 0.1:
            cache.failed(slot)
            pinned_ready.discard(key)
        else:
            cache.loaded(slot)
            if key in cache.pins and cache.tier(slot) == Tier.PINNED:
                pinned_ready.add(key)

    for t in range(150):
        if t % 25 == 0:
            wanted = {(layers[int(rng.integers(3))], int(rng.integers(n_exp))) for _ in range(4)}
            for load in cache.set_pins(wanted):
                held[load.slot] = (load.layer, load.expert)
            pinned_ready = {k for k in pinned_ready if k in cache.pins}
            check()
        for layer in layers:
            for _ in range(int(rng.integers(0, 4))):          # prefetches for this layer
                expert, score = int(rng.integers(n_exp)), float(rng.random())
                before = {cache.held(s)[1]: cache.value(layer, cache.held(s)[1], t)
                          for s in range(cache.total_slots)
                          if cache.held(s) is not None and cache.held(s)[0] == layer
                          and cache.tier(s) == Tier.DYNAMIC and cache.state(s) == SlotState.READY
                          and cache.users(s) == 0}
                guesses = {s: cache._guess[s] for s in cache._guess}
                everyone = {cache.held(s): s for s in range(cache.total_slots) if cache.held(s)}
                resident = _resident(cache, layer)
                slot = cache.prefetch(layer, expert, t, score)
                if slot is not None:
                    held[slot] = (layer, expert)
                    assert cache.tier(slot) == (Tier.STAGING if staging else Tier.DYNAMIC)
                    if staging:
                        now = {cache.held(s) for s in range(cache.total_slots) if cache.held(s)}
                        for key in set(everyone) - now:            # at most one guess recycled
                            _, guess_score, stale = guesses[everyone[key]]
                            assert stale or guess_score < score
                    else:
                        for gone in resident - _resident(cache, layer):
                            assert before[gone] <= score
                check()
            experts = rng.choice(n_exp, size=top_k, replace=False).tolist()
            accesses = cache.request(layer, experts, t)       # must never raise
            for a in accesses:
                assert cache.users(a.slot) >= 1 and cache.held(a.slot) == (layer, a.expert)
                if a.outcome == OUTCOME_MISS:
                    held[a.slot] = (layer, a.expert)
            check()
            for a in accesses:                                # compute waits for its reads
                if a.slot in held and cache.state(a.slot) == SlotState.LOADING:
                    finish(a.slot)
            cache.release(layer, experts)
            check()
        for slot in [s for s in held if rng.random() < 0.5]:  # some prefetches land late
            finish(slot)
            check()
    snap = cache.snapshot()
    assert snap.lookups == 150 * 3 * top_k
    assert sum(snap.prefetches_used) + sum(snap.prefetches_wasted) + sum(snap.prefetches_unused) \
        == sum(snap.prefetches_issued)


# -- re-dividing the tiers ---------------------------------------------------------------
def _invariants(cache):
    for s in range(cache.total_slots):
        key = cache.held(s)
        assert (key is None) == (cache.state(s) == SlotState.FREE)
        if key is not None:
            assert cache.slot_of(*key) == s
    tiers = [cache.tier(s) for s in range(cache.total_slots)]
    assert tiers.count(Tier.PINNED) == cache.pinned_slots
    assert tiers.count(Tier.STAGING) == cache.staging_slots
    for i, layer in enumerate(cache.moe_layers):
        assert sum(t == Tier.DYNAMIC and cache._owner[s] == i for s, t in enumerate(tiers)) \
            == cache.dynamic_slots(layer)


def test_set_tiers_grows_the_pinned_tier_from_the_dynamic_one_keeping_residents():
    cache = ExpertCache([0, 1], 16, 2, total_slots=12, pinned_slots=0, policy="lru")
    for t, experts in enumerate([[0, 1], [2, 3], [4, 5]]):
        _step(cache, 0, experts, t)
        _step(cache, 1, experts, t)
    slot_of_5 = cache.slot_of(0, 5)
    cache.set_tiers(4, 0)
    assert [cache.dynamic_slots(x) for x in (0, 1)] == [4, 4]
    _invariants(cache)
    assert _resident(cache, 0) == {2, 3, 4, 5}                   # 0 and 1 were the LRU victims
    assert cache.slot_of(0, 5) == slot_of_5                      # no read, no copy
    assert cache.snapshot().evictions_dynamic == (2, 2)
    loads = cache.set_pins({(0, 5), (1, 9)})
    assert [(l.layer, l.expert) for l in loads] == [(1, 9)]      # 5 moves without a read
    _invariants(cache)


def test_set_tiers_shrinks_pinned_and_staging_back_into_the_layers():
    cache = ExpertCache([0, 1], 16, 2, total_slots=12, pinned_slots=2, staging_slots=2, policy="lru")
    for load in cache.set_pins({(0, 7), (1, 8)}):
        cache.loaded(load.slot)
    guess = cache.prefetch(1, 3, 0, 0.9)
    cache.loaded(guess)
    cache.set_pins({(0, 7)})                          # (1, 8) goes to its layer's dynamic tier
    cache.set_tiers(1, 1)
    _invariants(cache)
    assert cache.pins == {(0, 7)} and cache.tier(cache.slot_of(0, 7)) == Tier.PINNED
    assert cache.tier(cache.slot_of(1, 8)) == Tier.DYNAMIC
    assert cache.tier(cache.slot_of(1, 3)) == Tier.STAGING     # the fresh guess is kept
    cache.set_pins([])
    cache.set_tiers(0, 0, dynamic_slots=[7, 5])
    _invariants(cache)
    assert [cache.dynamic_slots(x) for x in (0, 1)] == [7, 5]
    assert cache.tier(cache.slot_of(0, 7)) == Tier.DYNAMIC      # the old pin stays resident


def test_set_tiers_refuses_a_busy_cache_and_bad_sizes():
    cache = ExpertCache([0, 1], 16, 2, total_slots=8, pinned_slots=2, policy="lru")
    cache.request(0, [1, 2], 0)
    with pytest.raises(ValueError, match="released"):
        cache.set_tiers(0, 0)
    with pytest.raises(CacheBudgetError, match="top_k"):
        ExpertCache([0, 1], 16, 2, total_slots=8).set_tiers(5, 0)
    for load in (c := ExpertCache([0, 1], 16, 2, total_slots=8, pinned_slots=2)).set_pins({(0, 1), (1, 1)}):
        c.loaded(load.slot)
    with pytest.raises(ValueError, match="shrink the pin set"):
        c.set_tiers(1, 0)
    with pytest.raises(ValueError, match="dynamic_slots"):
        c.set_tiers(2, 0, dynamic_slots=[3, 2])


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_set_tiers_under_random_traffic_keeps_the_invariants(policy, seed):
    rng = np.random.default_rng(seed)
    layers, n_exp, top_k = [2, 5, 9], 12, 3
    cache = ExpertCache(layers, n_exp, top_k, total_slots=24, pinned_slots=3, policy=policy,
                        staging_slots=2)
    for t in range(120):
        for layer in layers:
            if rng.random() < 0.3:
                slot = cache.prefetch(layer, int(rng.integers(n_exp)), t, float(rng.random()))
                if slot is not None:
                    cache.loaded(slot)
            _step(cache, layer, rng.choice(n_exp, size=top_k, replace=False).tolist(), t)
        if t % 10 == 9:
            pinned = int(rng.integers(0, 7))
            staging = int(rng.integers(0, 24 - pinned - 9 * 1 - 6))
            keep = sorted(cache.pins)[:pinned]
            cache.set_pins(keep)
            cache.set_tiers(pinned, staging)
            wanted = {(layers[int(rng.integers(3))], int(rng.integers(n_exp))) for _ in range(pinned)}
            for load in cache.set_pins(list(wanted)[:pinned]):
                cache.loaded(load.slot)
            _invariants(cache)
    snap = cache.snapshot()
    assert snap.lookups == 120 * 3 * top_k
    assert sum(snap.prefetches_used) + sum(snap.prefetches_wasted) + sum(snap.prefetches_unused) \
        == sum(snap.prefetches_issued)


# -- warm start and a live policy switch -------------------------------------------------
def test_a_warm_start_read_takes_only_free_slots_and_evicts_nothing():
    cache = ExpertCache([0], 8, 2, total_slots=3, policy="lru")
    s = cache.warm(0, 5, token=0)
    assert s is not None and cache.state(s) == SlotState.LOADING
    assert cache.warm(0, 5, token=0) is None              # in flight already
    cache.loaded(s)
    assert cache.warm(0, 5, token=0) is None              # resident
    assert cache.warm(0, 6, token=0) is not None and cache.warm(0, 7, token=0) is not None
    for e in (6, 7):
        cache.loaded(cache.slot_of(0, e))
    assert cache.warm(0, 1, token=0) is None              # no FREE slot: nothing is evicted
    assert _resident(cache, 0) == {5, 6, 7}
    assert _step(cache, 0, [5, 6], 1) == [OUTCOME_HIT, OUTCOME_HIT]
    snap = cache.snapshot()                               # warm reads are not lookups
    assert snap.lookups == 2 and snap.misses == (0,)


@pytest.mark.parametrize("old", ["default", "lfu", "slru"])
def test_set_policy_keeps_the_residents_and_lru_starts_from_the_old_policys_ranking(old):
    cache = ExpertCache([0], 8, 2, total_slots=4, policy=old)
    for t, experts in enumerate([[0, 1], [0, 1], [0, 1], [2, 3], [0, 2]]):
        _step(cache, 0, experts, t)
    assert _resident(cache, 0) == {0, 1, 2, 3}
    policy = cache._policies[0]
    values = {e: policy.value(e, 4) for e in (1, 3)}      # 0 and 2 are asked for below
    cache.set_policy("lru")
    assert cache.policy_name == "lru" and _resident(cache, 0) == {0, 1, 2, 3}
    # the first victim is the old policy's least valuable resident, whatever LRU's
    # own recency would say; from there on it is plain LRU
    assert _step(cache, 0, [0, 2], 5) == [OUTCOME_HIT, OUTCOME_HIT]
    _step(cache, 0, [5, 0], 6)
    (gone,) = {1, 3} - _resident(cache, 0)
    assert gone == min(values, key=lambda e: (values[e], e))
    (kept,) = {1, 3} - {gone}
    _step(cache, 0, [6, 0], 7)
    assert kept not in _resident(cache, 0) and {0, 5, 6} <= _resident(cache, 0)
    with pytest.raises(ValueError):
        cache.set_policy("no-such-policy")
    assert cache.policy_name == "lru"
