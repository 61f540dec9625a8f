"""scheduler.eviction: each policy's ranking, driven through its events directly."""
from __future__ import annotations

import pytest

from scheduler.eviction import (DEFAULT_POLICY, POLICIES, ARCPolicy, BeladyPolicy, LFUPolicy,
                                LRFUPolicy, LRUPolicy, PredictivePolicy, S3FIFOPolicy, SLRUPolicy,
                                policy_factory)
from scheduler.policy_names import POLICY_NAMES

ANY = lambda e: True  # noqa: E731


def _use(policy, token, experts, resident):
    """One demand step: step, then hit for residents and admit for the others."""
    policy.step(token, experts)
    for e in experts:
        if e in resident:
            policy.hit(e, token)
        else:
            policy.admit(e, token, demand=True)
            resident.add(e)


def test_lru_evicts_the_least_recently_used_evictable():
    p, res = LRUPolicy(8, 3), set()
    for t, e in enumerate([0, 1, 2, 0]):
        _use(p, t, [e], res)
    assert p.victim(4, ANY) == 1
    assert p.victim(4, lambda e: e != 1) == 2
    assert p.victim(4, lambda e: False) is None
    assert p.value(0, 4) == pytest.approx(0.5) and p.value(1, 4) == pytest.approx(0.25)


def test_slru_protects_experts_seen_twice():
    p, res = SLRUPolicy(8, capacity=4), set()
    for t, e in enumerate([0, 0, 1, 2, 3]):       # 0 promoted; 1..3 on probation
        _use(p, t, [e], res)
    assert p.victim(5, ANY) == 1                   # LRU would pick 0
    assert p.victim(5, lambda e: e in (0,)) == 0   # protected only when probation is exhausted


def test_arc_moves_experts_seen_twice_to_t2_and_learns_from_ghosts():
    p, res = ARCPolicy(16, capacity=2), set()
    _use(p, 0, [0], res)
    _use(p, 1, [0], res)                           # 0 -> T2
    _use(p, 2, [1], res)                           # 1 -> T1
    assert p.victim(3, ANY) == 1                   # |T1| = 1 > p = 0: evict from T1
    p.evict(1, 3)
    res.discard(1)
    _use(p, 4, [1], res)                           # ghost hit in B1: p grows, 1 enters T2
    assert p._p == 1.0
    assert p.victim(5, ANY) == 0                   # T1 empty: LRU of T2


def test_lfu_evicts_the_least_used_then_the_least_recent():
    p, res = LFUPolicy(8, 3), set()
    for t, e in enumerate([0, 0, 1, 2, 1]):
        _use(p, t, [e], res)
    assert p.victim(5, ANY) == 2                   # used once; 0 and 1 twice
    assert p.victim(5, lambda e: e != 2) == 0      # tie 0/1 at two uses: 0 is older
    p.admit(5, 6, demand=False)                    # an unused prefetch counts 0
    assert p.victim(6, ANY) == 5


def test_s3fifo_sends_one_hit_wonders_to_the_ghost_and_keeps_reused_experts():
    p, res = S3FIFOPolicy(32, capacity=10), set()   # small FIFO: 1 slot
    _use(p, 0, [0], res)
    _use(p, 1, [0], res)                            # 0 used again while in S
    _use(p, 2, [1], res)
    # S holds 0 (used) and 1: 0 moves to M, 1 is the victim; victim() changes nothing
    assert p.victim(3, ANY) == 1 and p.victim(3, ANY) == 1
    assert list(p._small) == [0, 1]
    p.evict(1, 3)
    assert list(p._small) == [] and list(p._main) == [0] and 1 in p._ghost
    res.discard(1)
    _use(p, 4, [1], res)                            # back from the ghost: straight to M
    assert list(p._main) == [0, 1]
    assert p.victim(5, ANY) == 0                    # M's oldest, its use count spent
    assert p.victim(5, lambda e: e != 0) == 1
    assert p.victim(5, lambda e: False) is None


def test_lrfu_keeps_a_frequent_expert_over_a_recent_one_off():
    p, res = LRFUPolicy(8, 4), set()
    for t in range(10):
        _use(p, t, [0], res)                       # 0 used every step
    _use(p, 10, [1], res)                          # 1 once, more recently
    assert p.victim(11, ANY) == 1
    assert LRUPolicy(8, 4).name == "lru"
    assert 0.0 <= p.value(1, 11) < p.value(0, 11) <= 1.0


def test_lrfu_counts_a_prefetch_at_its_score_until_used():
    p, res = LRFUPolicy(8, 4), set()
    _use(p, 0, [0], res)
    p.admit(1, 1, demand=False, score=0.9)         # prefetched, never used
    assert p.value(1, 1) == pytest.approx(0.9)
    assert p.victim(1, ANY) == 0
    p.step(2, [1])
    p.hit(1, 2)                                    # first use: its own history from now on
    assert p.value(1, 2) < 0.9


@pytest.mark.parametrize("policy", [LRFUPolicy, PredictivePolicy])
def test_an_unused_prefetch_loses_its_score_after_its_step(policy):
    """A wrong prediction must not stay 'hot' forever: the score covers one step."""
    p, res = policy(8, 4), set()
    _use(p, 0, [0], res)
    _use(p, 1, [0], res)
    p.admit(1, 1, demand=False, score=0.9)         # predicted for step 1, never used
    assert p.value(1, 1) == pytest.approx(0.9)
    _use(p, 2, [0], res)
    assert p.value(1, 2) == 0.0
    assert p.victim(2, ANY) == 1


def test_predictive_learns_which_expert_follows_which():
    """A 4-step cycle in which 0 is followed by 1 and never by 3."""
    cycle = [[0, 4], [1, 5], [2, 4], [3, 5]]
    p, res = PredictivePolicy(8, 4), set()
    lrfu, lrfu_res = LRFUPolicy(8, 4), set()
    for t in range(20):
        _use(p, t, cycle[t % 4], res)
        _use(lrfu, t, cycle[t % 4], lrfu_res)
    _use(p, 20, [0, 6], res)                        # 6 is new: no prediction from it
    _use(lrfu, 20, [0, 6], lrfu_res)
    assert p.p_next()[1] == pytest.approx(0.5) and p.p_next()[5] == pytest.approx(0.5)
    assert p.p_next()[3] == 0.0
    assert p.victim(20, lambda e: e in (1, 3)) == 3
    assert lrfu.victim(20, lambda e: e in (1, 3)) == 1   # 3 is more recent: recency gets it wrong


def test_predictive_survives_a_huge_token_jump():
    p, res = PredictivePolicy(4, 2), set()
    _use(p, 10**9, [0], res)
    _use(p, 10**9 + 1, [1], res)
    _use(p, 10**9 + 10**6, [0], res)
    _use(p, 10**9 + 10**6 + 1, [1], res)
    assert p.p_next()[0] == pytest.approx(1.0)    # after 1 came 0, last time
    assert p.p_next()[1] == 0.0


def test_belady_evicts_the_furthest_next_use():
    p = BeladyPolicy({0: [0, 5], 1: [1, 2], 2: [3, 9]})
    for e in (0, 1, 2):
        p.admit(e, 0, demand=True)
    assert p.victim(1, ANY) == 0                    # next uses: 0 at 5, 1 at 2, 2 at 3
    assert p.victim(5, ANY) == 1                    # 0 and 1 never used again: ties to higher id
    assert p.victim(6, lambda e: e != 1) == 0
    assert p.value(2, 6) == pytest.approx(1 / 3) and p.value(1, 6) == 0.0


def test_factory_resolves_names():
    assert DEFAULT_POLICY in POLICIES
    assert type(policy_factory("default", 8)(0, 4)) is POLICIES[DEFAULT_POLICY]
    assert isinstance(policy_factory("slru", 8)(0, 4), SLRUPolicy)
    with pytest.raises(ValueError, match="known: default, lru"):
        policy_factory("fifo", 8)


def test_the_light_list_of_names_is_the_policies():
    """`moed replay-trace --policy` offers POLICY_NAMES (no numpy to import for --help)."""
    assert POLICY_NAMES == tuple(POLICIES)
