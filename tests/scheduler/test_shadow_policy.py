"""ShadowPolicyCache — the cache's own policy replayed on ids — and the pin learner's
check through it: pins are judged against the policy that really runs (issue 17)."""
from __future__ import annotations

import numpy as np

from scheduler.pinlearn import PinLearner
from scheduler.shadow import ShadowLRU, ShadowPolicyCache

L, E, K = 2, 16, 2


def random_steps(seed: int, n: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1)
    p /= p.sum()
    return [[sorted(rng.choice(E, K, replace=False, p=p).tolist()) for _ in range(L)] for _ in range(n)]


def test_with_lru_it_misses_exactly_as_shadow_lru():
    a, b = ShadowPolicyCache([0, 1], [5, 5], E, K, "lru"), ShadowLRU([5, 5])
    for step in random_steps(0, 200):
        for li, ids in enumerate(step):
            assert a.resident(li) == b.resident(li)
            assert a.access(li, ids) == b.access(li, ids)


def test_pins_always_hit_and_take_no_dynamic_slot():
    shadow = ShadowPolicyCache([0, 1], [2, 2], E, K, "predictive", pins=[(0, 7), (1, 3)])
    assert 7 in shadow.resident(0) and 3 in shadow.resident(1)
    misses = 0
    for step in random_steps(1, 50):
        misses += shadow.access(0, sorted(set(step[0]) | {7}))
        assert 7 in shadow.resident(0)
    assert misses > 0


def hot_and_scan(n: int) -> list[list[list[int]]]:
    """Each layer: one of 5 hot experts in turn (each back every 5 steps) plus a scan of
    the cold ones: 4 LRU slots lose every hot expert, a frequency-aware policy keeps them."""
    return [[[t % 5, 5 + (t % (E - 5))] for _ in range(L)] for t in range(n)]


def test_the_check_through_the_real_policy_declines_pins_lru_would_want():
    def learner(check_shadow=None):
        return PinLearner(L, E, K, total_slots=2 * 7, max_share=0.5, check_shadow=check_shadow)

    lru_judged = learner()
    policy_judged = learner(lambda layers, caps, pins: ShadowPolicyCache(layers, caps, E, K, "lrfu", pins))
    steps = hot_and_scan(256)
    for t, step in enumerate(steps):
        for lrn in (lru_judged, policy_judged):
            lrn.observe(step)
            if lrn.due():
                counts = np.zeros((L, E))
                for s in steps[: t + 1]:
                    for li, ids in enumerate(s):
                        counts[li, ids] += 1
                lrn.decide(counts)
    assert lru_judged.share > 0                 # against LRU, pinning the hot five pays
    assert policy_judged.share == 0             # lrfu keeps them anyway: pins would only cost slots
