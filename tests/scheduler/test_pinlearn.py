"""scheduler.pinlearn.PinLearner: pins chosen on older routing, kept only when they win on
the newest window; stale ones dropped."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.pinlearn import PinLearner


def _periodic(rng, n_steps, layers, hot, n_exp, top_k, offset=0):
    """Each step: one expert of `hot` (cycling, so each returns every len(hot) steps) plus
    top_k - 1 one-off experts drawn from the rest: LRU of a few slots keeps losing the hot
    ones, pins keep them."""
    steps = []
    for t in range(n_steps):
        step = []
        for _ in range(layers):
            ids = [hot[(t + offset) % len(hot)]]
            others = [e for e in range(n_exp) if e not in hot]
            ids += rng.choice(others, size=top_k - 1, replace=False).tolist()
            step.append(ids)
        steps.append(step)
    return steps


def _feed(learner, steps, usage):
    decisions = []
    for step in steps:
        for li, ids in enumerate(step):
            usage[li, ids] += 1.0
        learner.observe(step)
        if learner.due():
            decisions.append(learner.decide(usage))
    return decisions


def test_a_first_session_pins_its_recurring_experts_within_a_few_hundred_steps():
    rng = np.random.default_rng(0)
    learner = PinLearner(2, 64, 3, total_slots=16, window_tokens=32)   # 8 slots per layer
    usage = np.zeros((2, 64))
    decisions = _feed(learner, _periodic(rng, 256, 2, hot=[0, 1, 2, 3], n_exp=64, top_k=3), usage)
    adopted = next(i for i, d in enumerate(decisions) if d.changed)
    assert learner.windows_seen == 8 and adopted <= 2
    assert learner.share > 0 and learner.pinned_slots_for(learner.share) >= 4
    assert set(learner.pins) <= {(li, e) for li in range(2) for e in range(4)}   # only hot ones
    d = decisions[adopted]
    assert d.validation["challenger"]["hit_rate"] >= d.validation["incumbent"]["hit_rate"] + 0.01


def test_uniform_routing_keeps_no_pins():
    rng = np.random.default_rng(1)
    learner = PinLearner(2, 64, 3, total_slots=16, window_tokens=32)
    usage = np.zeros((2, 64))
    steps = [[rng.choice(64, size=3, replace=False).tolist() for _ in range(2)] for _ in range(320)]
    decisions = _feed(learner, steps, usage)
    assert decisions and not any(d.changed for d in decisions)
    assert learner.share == 0.0 and learner.pins == frozenset()


def test_stale_pins_from_an_earlier_session_are_dropped_when_the_workload_moves():
    """An earlier session pinned experts 0-3 (start share 0.5, long-term counts full of
    them); this session's hot experts are 10-13: the learner leaves the stale set within a
    few windows — for the recent counts' set or for none."""
    rng = np.random.default_rng(2)
    learner = PinLearner(2, 64, 3, total_slots=16, window_tokens=32, start_share=0.5)
    usage = np.zeros((2, 64))
    usage[:, :4] = 1000.0
    learner.pins = frozenset((li, e) for li in range(2) for e in range(4))
    hot = [10, 11, 12, 13]
    decisions = _feed(learner, _periodic(rng, 160, 2, hot=hot, n_exp=64, top_k=3), usage)
    assert any(d.changed for d in decisions[:3])
    assert not {(li, e) for li in range(2) for e in range(4)} & set(learner.pins)
    if learner.share:
        assert learner.source == "recent"
        assert {(0, e) for e in hot} <= set(learner.pins)


def test_evaluations_back_off_while_nothing_changes():
    rng = np.random.default_rng(3)
    learner = PinLearner(1, 32, 2, total_slots=6, window_tokens=8, max_interval_windows=4)
    usage = np.zeros((1, 32))
    steps = [[rng.choice(32, size=2, replace=False).tolist()] for _ in range(8 * 40)]
    at = []
    for step in steps:
        usage[0, step[0]] += 1
        learner.observe(step)
        if learner.due():
            learner.decide(usage)
            at.append(learner.windows_seen)
    assert at[:4] == [2, 4, 8, 12]
    assert all(b - a == 4 for a, b in zip(at[4:], at[5:]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="shares"):
        PinLearner(2, 8, 2, 8, shares=(0.0,))
    with pytest.raises(ValueError, match="start_source"):
        PinLearner(2, 8, 2, 8, start_source="x")
    learner = PinLearner(2, 8, 2, 8, window_tokens=1)
    learner.observe([[0, 1], [2, 3]])
    learner.observe([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="shape"):
        learner.decide(np.zeros((3, 8)))
