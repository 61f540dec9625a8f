"""daemon.store.adaptive.bookkeeping_costs: the referee's prior split into a fixed part per
layer step and a part per miss, from LRU measured with every expert resident and with
top_k slots."""
from __future__ import annotations

import time

import pytest

from daemon.store import adaptive
from daemon.store.adaptive import bookkeeping_costs, cpu_clock_for


def test_the_per_miss_part_comes_from_lru_at_two_sizes(monkeypatch):
    measured = {("lru", 32): (20e-6, 0.5), ("lru", 4): (80e-6, 3.5),    # 60 us for 3 misses
                ("lru", 9): (60e-6, 2.0), ("predictive", 9): (70e-6, 1.5)}
    monkeypatch.setattr(adaptive, "_measure", lambda policy, n, e, k, slots, clock, *prior: measured[(policy, slots)])
    fixed, per_miss = bookkeeping_costs(["lru", "predictive"], 8, 32, 4, 9)
    assert per_miss == pytest.approx(20e-6)
    assert fixed == pytest.approx({"lru": 20e-6, "predictive": 40e-6})


def test_no_per_miss_part_when_the_two_sizes_cannot_tell_it(monkeypatch):
    measured = {("lru", 4): (50e-6, 3.0)}
    monkeypatch.setattr(adaptive, "_measure", lambda policy, n, e, k, slots, clock, *prior: measured[(policy, slots)])
    assert bookkeeping_costs(["lru"], 8, 4, 4, 4) == ({"lru": 50e-6}, 0.0)    # every expert fits
    measured.update({("lru", 32): (90e-6, 0.5), ("lru", 9): (80e-6, 2.0)})  # noise: more misses, less time
    assert bookkeeping_costs(["lru"], 8, 32, 4, 9) == ({"lru": 80e-6}, 0.0)


def test_a_test_clock_times_the_bookkeeping_and_is_not_memoized():
    ticks = iter(range(1000))
    fixed, per_miss = bookkeeping_costs(["lru"], 2, 8, 2, 4, clock=lambda: float(next(ticks)))
    assert fixed["lru"] >= 0.0 and per_miss >= 0.0
    assert not any(key[0] == "lru" and key[1:] == (2, 8, 2, 4) for key in adaptive._calibrated)
    assert cpu_clock_for(time.perf_counter) is time.thread_time
    fake = lambda: 0.0                                             # noqa: E731
    assert cpu_clock_for(fake) is fake


def test_a_session_with_learned_transitions_calibrates_the_policies_with_a_prior(monkeypatch):
    seen = []

    def measure(policy, n, e, k, slots, clock, with_prior=False):
        seen.append((policy, slots, with_prior))
        return (50e-6, 1.0)

    monkeypatch.setattr(adaptive, "_measure", measure)
    bookkeeping_costs(["lru", "predictive"], 8, 32, 4, 9, with_prior=True)
    assert ("predictive", 9, True) in seen and ("lru", 9, True) in seen
    assert ("lru", 32, False) in seen and ("lru", 4, False) in seen    # the per-miss part: no prior needed

