"""scheduler.shadow.ShadowLRU: the reads an LRU ExpertCache would make, without the cache."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.cache import OUTCOME_MISS, ExpertCache
from scheduler.shadow import ShadowLRU, even_split


def _cache_misses(cache, layer, experts, token):
    limit = cache.dynamic_slots(layer)
    misses = 0
    for start in range(0, len(experts), limit):
        batch = experts[start:start + limit]
        for a in cache.request(layer, batch, token):
            if a.outcome == OUTCOME_MISS:
                cache.loaded(a.slot)
                misses += 1
        cache.release(layer, batch)
    return misses


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("total, pinned", [(9, 0), (14, 0), (14, 4), (20, 6)])
def test_shadow_lru_misses_equal_an_lru_expert_cache(seed, total, pinned):
    """Same routing (decode steps and prefill unions larger than a layer), same pins set and
    changed midway: the shadow's misses equal the cache's, step by step."""
    rng = np.random.default_rng(seed)
    layers, n_exp, top_k = 3, 16, 3
    cache = ExpertCache(list(range(layers)), n_exp, top_k, total, pinned, policy="lru")
    shadow = ShadowLRU([cache.dynamic_slots(l) for l in range(layers)])
    popularity = 1.0 / np.arange(1, n_exp + 1)
    popularity /= popularity.sum()
    for t in range(200):
        if pinned and t in (50, 120):
            pins = {(int(rng.integers(layers)), int(rng.integers(n_exp))) for _ in range(pinned)}
            pins = set(sorted(pins)[:pinned])
            for load in cache.set_pins(pins):
                cache.loaded(load.slot)
            shadow.set_pins(pins)
        for layer in range(layers):
            size = top_k if t % 17 else 9          # now and then a prefill chunk's union
            experts = rng.choice(n_exp, size=size, replace=False, p=popularity).tolist()
            assert shadow.access(layer, experts) == _cache_misses(cache, layer, experts, t)
            assert shadow.resident(layer) == {cache.held(s)[1] for s in range(total)
                                              if cache.held(s) and cache.held(s)[0] == layer}


def test_pin_loads_count_only_pins_that_were_not_resident():
    shadow = ShadowLRU([2, 2])
    shadow.access(0, [1, 2])
    shadow.set_pins({(0, 1), (1, 5)})
    assert shadow.pin_loads == 1 and shadow.resident(0) == {1, 2}
    assert shadow.access(0, [1, 3]) == 1          # 1 pinned, 3 fills the freed slot
    shadow.set_pins(set(), capacities=[1, 2])
    assert shadow.resident(0) == {3}              # the dropped pin found no room


def test_even_split_matches_the_cache_and_bad_capacities_are_refused():
    assert even_split(11, 3) == [4, 4, 3]
    with pytest.raises(ValueError, match="capacities"):
        ShadowLRU([2, 0])


def test_a_copy_replays_as_the_original_would_and_independently():
    """Adaptation replays a second shadow only once it differs from the first: it starts
    as a copy, which must then miss exactly as the original would have."""
    rng = np.random.default_rng(4)
    steps = [[rng.choice(12, 3, replace=False).tolist() for _ in range(2)] for _ in range(60)]
    a = ShadowLRU([5, 5], pins=[(0, 1)])
    for step in steps[:30]:
        for li, ids in enumerate(step):
            a.access(li, ids)
    b = a.copy()
    reference = ShadowLRU([5, 5], pins=[(0, 1)])
    for step in steps[:30]:
        for li, ids in enumerate(step):
            reference.access(li, ids)
    b.set_pins([(1, 2)], [4, 4])
    reference.set_pins([(1, 2)], [4, 4])
    for step in steps[30:]:
        for li, ids in enumerate(step):
            assert b.access(li, ids) == reference.access(li, ids)
    assert b.resident(0) == reference.resident(0) and b.resident(1) == reference.resident(1)
    assert a.capacities == [5, 5] and 1 in a.resident(0)          # the original is untouched


def test_same_state_means_same_residents_in_the_same_order_and_pins():
    a = ShadowLRU([2, 2])
    a.access(0, [1, 2])
    b = a.copy()
    assert a.same_state(b) and b.same_state(a)
    b.access(0, [1])                     # same residents, another recency order
    assert not a.same_state(b)
    a.access(0, [1])
    assert a.same_state(b)
    b.set_pins([(1, 3)])
    assert not a.same_state(b)
    assert not ShadowLRU([2, 3]).same_state(ShadowLRU([2, 2]))
