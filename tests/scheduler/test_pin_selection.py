"""scheduler.pins: greedy pin selection and hysteresis while serving."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.pins import PinPolicy, pins_to_layer_ids, select_pins
from scheduler.usage import UsageStats


def test_select_pins_takes_the_densest_within_the_budget():
    hits = np.array([[5.0, 0.0, 9.0, 1.0],
                     [7.0, 3.0, 0.0, 2.0]])
    assert select_pins(hits, 1, 3) == {(0, 2), (1, 0), (0, 0)}
    assert select_pins(hits, 10, 35) == {(0, 2), (1, 0), (0, 0)}   # bytes scale the budget
    assert select_pins(hits, 1, 0) == frozenset()


def test_ties_go_to_the_lower_layer_then_expert():
    hits = np.array([[1.0, 2.0, 2.0], [2.0, 0.0, 0.0]])
    assert select_pins(hits, 1, 1) == {(0, 1)}
    assert select_pins(hits, 1, 2) == {(0, 1), (0, 2)}
    assert select_pins(hits, 1, 3) == {(0, 1), (0, 2), (1, 0)}


def test_zero_hit_experts_are_never_pinned():
    hits = np.array([[0.0, 3.0, 0.0], [0.0, 0.0, 1e-9]])
    assert select_pins(hits, 1, 100) == {(0, 1), (1, 2)}


def test_greedy_by_hits_per_byte_skips_what_does_not_fit():
    hits = np.array([[10.0, 8.0, 1.0]])
    sizes = np.array([[10, 2, 1]])          # densities 1, 4, 1
    assert select_pins(hits, sizes, 3) == {(0, 1), (0, 2)}          # (0,0) does not fit
    assert select_pins(hits, sizes, 12) == {(0, 1), (0, 0)}        # (0,2) no longer fits
    assert select_pins(hits, sizes, 13) == {(0, 0), (0, 1), (0, 2)}


@pytest.mark.parametrize("hits, size, budget", [
    (np.ones(3), 1, 1), (np.full((1, 2), np.nan), 1, 1), (-np.ones((1, 2)), 1, 1),
    (np.ones((1, 2)), 0, 1), (np.ones((1, 2)), 1, -1),
])
def test_select_pins_validates(hits, size, budget):
    with pytest.raises(ValueError):
        select_pins(hits, size, budget)


def test_pins_to_layer_ids():
    assert pins_to_layer_ids({(0, 3), (2, 1)}, [1, 5, 9]) == {(1, 3), (9, 1)}


def _apply(pins, change):
    add, remove = change
    assert not (add & remove) and remove <= pins and not (add & pins)
    return (pins - remove) | add


def test_hysteresis_swaps_only_a_clearly_better_newcomer():
    policy = PinPolicy(hysteresis=1.5, max_swaps_per_eval=4)
    hits = np.array([[10.0, 9.0, 13.0]])
    # The newcomer is compared with the weakest incumbent: 13 < 1.5 * 9.
    assert policy.reevaluate({(0, 0), (0, 1)}, hits, 2) == (frozenset(), frozenset())
    hits[0, 2] = 13.6
    assert policy.reevaluate({(0, 0), (0, 1)}, hits, 2) == ({(0, 2)}, {(0, 1)})


def test_free_budget_is_filled_and_a_shrunk_budget_obeyed_at_once():
    policy = PinPolicy(hysteresis=1.5, max_swaps_per_eval=1)
    hits = np.array([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert policy.reevaluate(set(), hits, 3) == ({(0, 0)}, frozenset())   # rate-bounded fill
    current = {(0, 0), (0, 1), (0, 2), (0, 3)}
    add, remove = policy.reevaluate(current, hits, 1)                      # not rate-bounded
    assert add == frozenset() and remove == {(0, 1), (0, 2), (0, 3)}


def _simulate(popularity_by_phase, tokens_per_phase, hysteresis, seed=0):
    """Serve a workload, re-evaluating pins every 50 tokens; returns (pins, swaps per phase)."""
    rng = np.random.default_rng(seed)
    layers, n_exp, top_k, budget = [0, 1], 32, 4, 12
    stats = UsageStats(layers, n_exp, half_life_tokens=500)
    policy = PinPolicy(hysteresis=hysteresis, max_swaps_per_eval=2)
    pins: frozenset = frozenset()
    swaps = []
    for popularity in popularity_by_phase:
        n = 0
        for t in range(tokens_per_phase):
            for layer in layers:
                stats.observe(layer, rng.choice(n_exp, size=top_k, replace=False, p=popularity))
            stats.advance(1)
            if t % 50 == 49:
                change = policy.reevaluate(pins, stats.counts(), budget)
                n += len(change[0] & frozenset(pins)) + len(change[1])   # removals = swaps once full
                pins = _apply(frozenset(pins), change)
        swaps.append(n)
    return pins, swaps


def _zipf(n, s, shift=0):
    p = 1.0 / np.arange(1, n + 1) ** s
    return np.roll(p / p.sum(), shift)


def test_a_stable_workload_does_not_churn_but_without_hysteresis_it_would():
    stable = [_zipf(32, 0.6)] * 2
    _, swaps = _simulate(stable, 3000, hysteresis=1.5)
    assert swaps[1] == 0
    _, swaps_no_hysteresis = _simulate(stable, 3000, hysteresis=1.0)
    assert swaps_no_hysteresis[1] > 5


def test_a_changed_workload_is_followed():
    pins, swaps = _simulate([_zipf(32, 1.2), _zipf(32, 1.2, shift=16)], 4000, hysteresis=1.5)
    hottest_now = {(layer, int(e)) for layer in (0, 1) for e in np.argsort(-_zipf(32, 1.2, shift=16))[:6]}
    assert pins == hottest_now
    assert swaps[1] >= 6


def test_reevaluate_validates_pins():
    with pytest.raises(ValueError):
        PinPolicy().reevaluate({(3, 0)}, np.ones((2, 2)), 4)
    with pytest.raises(ValueError):
        PinPolicy(hysteresis=0.5)
    with pytest.raises(ValueError):
        PinPolicy(max_swaps_per_eval=0)
