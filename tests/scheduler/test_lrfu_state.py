"""scheduler._lrfu.LRFUState, the compiled core of lrfu: its own error paths (its rules are
checked against the reference implementation in test_eviction_reference.py)."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler._lrfu import LRFUState, add_transitions, distinct_sorted, log_score, predict
from scheduler.eviction import LRFUPolicy


def make(num_experts: int = 4) -> LRFUState:
    return LRFUState(num_experts, 0.5, 0.9, 0.1, 0.08)


def test_experts_out_of_range_are_refused_and_change_nothing():
    s = make()
    s.step(0, [1])
    with pytest.raises(IndexError, match=r"expert 4 out of range \[0, 4\)"):
        s.step(1, [2, 4])
    for call in (lambda: s.admit(-1, 1, True, 0.0), lambda: s.hit(7), lambda: s.drop(4),
                 lambda: s.rate(-3, 1), lambda: s.value(9, 1)):
        with pytest.raises(IndexError):
            call()
    assert s.resident_count() == 0
    assert s.rate(1, 0) == pytest.approx(0.1 + 0.08)


def test_a_prediction_of_the_wrong_length_is_refused():
    s = make()
    s.admit(0, 0, True, 0.0)
    with pytest.raises(ValueError, match="p_next has 3 entries; expected 4"):
        s.victim(0, lambda e: True, 0.5, np.zeros(3))
    assert s.victim(0, lambda e: True, 0.5, np.zeros(4)) == 0


def test_an_evictable_that_raises_leaves_the_ranking_intact():
    p = LRFUPolicy(5, 3)
    for e in (0, 1, 2):
        p.step(e, [e])
        p.admit(e, e, True)

    def broken(e):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        p.victim(3, broken)
    asked = []
    assert p.victim(3, lambda e: asked.append(e) or e != 0) == 1
    assert asked == [0, 1]                       # every resident asked again, coldest first


def test_resident_bookkeeping_survives_admits_again_and_drops():
    s = make(6)
    for e in (3, 1, 5):
        s.admit(e, 0, True, 0.0)
    s.admit(1, 0, True, 0.0)                     # again while resident: still one slot
    assert s.resident_count() == 3
    s.drop(3)
    s.drop(3)                                    # dropping a non-resident is a no-op
    assert s.resident_count() == 2 and not s.is_resident(3) and s.is_resident(5)
    assert s.victim(0, lambda e: True) in (1, 5)


def test_zero_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        LRFUState(0, 0.5, 0.9, 0.1, 0.08)


def test_predictive_helpers_refuse_what_they_cannot_compute():
    t, n = np.ones((3, 3)), np.array([2.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="at least one expert"):
        predict(t, n, np.zeros(0, dtype=np.int64))
    with pytest.raises(IndexError, match=r"expert 3 out of range \[0, 3\)"):
        log_score(np.full(3, 0.5), [0, 3], 0.02)


def test_predictive_helpers_match_their_numpy_expressions():
    rng = np.random.default_rng(1)
    t, n = rng.random((6, 6)), rng.random(6)
    n[2] = 0.0                                   # a row never followed: divided by 1
    prev, ids = np.array([1, 2, 5]), np.array([0, 2, 3])
    expected = (t[prev] / np.where(n[prev] > 0, n[prev], 1.0)[:, None]).mean(axis=0)
    assert np.array_equal(predict(t, n, prev), expected)
    t2, n2 = t.copy(), n.copy()
    add_transitions(t, n, prev, ids, 0.75)
    t2[np.ix_(prev, ids)] += 0.75
    n2[prev] += 0.75
    assert np.array_equal(t, t2) and np.array_equal(n, n2)
    p = np.array([0.5, 0.0, 0.25, 1e-9])
    assert log_score(p, [0, 1, 3], 0.02) == pytest.approx(np.log([0.5, 0.02, 0.02]).sum(), rel=1e-15)
    assert list(distinct_sorted([4, 1, 4, 0])) == [0, 1, 4]
