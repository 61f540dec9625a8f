"""The self-tuner's decisions (scheduler.tuner) against fake cost surfaces.

A fake "machine" maps settings to seconds per decode step; the tests drive the tuner as
the daemon does (settings -> window -> observe) and check where it ends: the optimum of
a known surface, no move for gains below 3 %, no move on a flat noisy surface, rejected
candidates skipped, windows at another batch size dropped.
"""
from __future__ import annotations

import random

import pytest

from scheduler.tuner import ARM_A, Knob, OnlineTuner, choose_cache_split, wins

KNOBS = [Knob("threads", (1, 2, 3, 4)), Knob("io_workers", (1, 2, 4, 8, 16)),
         Knob("prefetch_width", (0, 4, 6, 8))]
START = {"threads": 1, "io_workers": 1, "prefetch_width": 4}


def drive(tuner: OnlineTuner, cost, batch_size=lambda: 1, limit=10_000) -> int:
    """Run windows until the tuner is done; returns the number of windows."""
    n = 0
    while not tuner.done:
        tuner.observe(cost(tuner.settings()), batch_size())
        n += 1
        assert n < limit, "the tuner never finished"
    return n


def bowl(optimum: dict, step_gain: float = 0.1):
    """Cost grows by `step_gain` per candidate step away from the optimum on each knob."""
    def cost(s):
        c = 1.0
        for knob in KNOBS:
            distance = abs(knob.values.index(s[knob.name]) - knob.values.index(optimum[knob.name]))
            c *= (1 + step_gain) ** distance
        return c
    return cost


def test_it_finds_the_optimum_of_a_known_surface_with_noise():
    optimum = {"threads": 3, "io_workers": 8, "prefetch_width": 0}
    rng = random.Random(0)
    surface = bowl(optimum)
    tuner = OnlineTuner(KNOBS, START)
    drive(tuner, lambda s: surface(s) * (1 + rng.gauss(0, 0.01)))
    assert tuner.incumbent == optimum
    kept = [t for t in tuner.trials if t.outcome == "win"]
    assert all(any(u.confirming is False and u.outcome == "win, confirming" and
                   (u.knob, u.b) == (t.knob, t.b) for u in tuner.trials) for t in kept)


def test_it_steps_down_when_up_loses():
    tuner = OnlineTuner(KNOBS, {"threads": 4, "io_workers": 16, "prefetch_width": 8})
    drive(tuner, bowl({"threads": 2, "io_workers": 2, "prefetch_width": 4}))
    assert tuner.incumbent == {"threads": 2, "io_workers": 2, "prefetch_width": 4}


def test_gains_below_three_percent_are_ignored():
    start = {"threads": 2, "io_workers": 4, "prefetch_width": 4}
    tuner = OnlineTuner(KNOBS, start)
    drive(tuner, bowl({"threads": 4, "io_workers": 16, "prefetch_width": 8}, step_gain=0.02))
    assert tuner.incumbent == start
    assert all(t.outcome == "loss" for t in tuner.trials)
    ups = [t for t in tuner.trials if t.b > t.a]
    assert len(ups) == 3 and all(min(t.gains) > 0 for t in ups)   # better, by too little


@pytest.mark.parametrize("seed", range(20))
def test_a_flat_noisy_surface_leads_to_no_change(seed):
    rng = random.Random(seed)
    tuner = OnlineTuner(KNOBS, START)
    drive(tuner, lambda s: 1.0 * (1 + rng.gauss(0, 0.05)))
    assert tuner.incumbent == START
    assert not [t for t in tuner.trials if t.outcome == "win"]


def test_windows_alternate_a_b_and_compare_only_at_the_trial_batch_size():
    tuner = OnlineTuner([Knob("threads", (1, 2))], {"threads": 1}, pairs=4)
    arms, values = [], []
    batch_sizes = iter([2, 2, 3, 2, 2, 1, 2, 2, 2, 2] + [2] * 100)
    while not tuner.done:
        arms.append(tuner.arm)
        values.append(tuner.settings()["threads"])
        tuner.observe(1.0 if tuner.settings()["threads"] == 1 else 0.8, next(batch_sizes))
    first = tuner.trials[0]
    assert first.batch_size == 2 and first.dropped_windows == 2
    assert first.costs_a == [1.0] * 4 and first.costs_b == [0.8] * 4
    # pairs alternate their order (A B, B A, ...); the arm of a dropped window (batch 3,
    # batch 1) runs again
    assert "".join(arms) == "AB" + "BBA" + "AAB" + "BA" + "ABBAABBA"
    assert all((a == ARM_A) == (v == 1) for a, v in zip(arms, values))
    assert tuner.incumbent == {"threads": 2}
    assert [t.outcome for t in tuner.trials] == ["win, confirming", "win"]


def test_an_unconfirmed_win_is_reverted():
    tuner = OnlineTuner([Knob("threads", (1, 2))], {"threads": 1})
    confirming = []

    def cost(s):    # B wins the first trial clearly, then loses its confirmation
        confirming.append(tuner.trial.confirming)
        if not confirming[-1]:
            return 1.0 if s["threads"] == 1 else 0.8
        return 1.0 if s["threads"] == 1 else 1.01
    drive(tuner, cost)
    assert tuner.incumbent == {"threads": 1}
    assert [t.outcome for t in tuner.trials] == ["win, confirming", "unconfirmed"]


def test_a_drift_that_favours_whichever_runs_later_is_not_a_win():
    # the cost ignores the settings and falls 5 % per window (a cache warming up): with
    # B always second, every pair would show B 5 % faster
    tuner = OnlineTuner(KNOBS, START)
    windows = []
    drive(tuner, lambda s: windows.append(1) or 0.95 ** len(windows))
    assert tuner.incumbent == START


def test_a_trial_moves_to_the_batch_size_the_traffic_settled_on():
    tuner = OnlineTuner([Knob("threads", (1, 2))], {"threads": 1}, pairs=4)
    tuner.observe(1.0, 1)                               # a lone request: A at batch 1
    for _ in range(8):                                  # then steady 4-way traffic
        tuner.observe(1.0, 4)
    assert tuner.trial.batch_size == 1 and tuner.trial.dropped_windows == 8
    tuner.observe(1.0, 4)                               # one more: the trial restarts at 4
    assert tuner.trial.batch_size == 4 and tuner.trial.costs_a == [1.0]
    drive(tuner, lambda s: 1.0 if s["threads"] == 1 else 0.5, batch_size=lambda: 4)
    assert tuner.incumbent == {"threads": 2}


def test_a_rejected_candidate_is_skipped():
    tuner = OnlineTuner([Knob("threads", (1, 2, 3))], {"threads": 1})
    assert tuner.candidate() == ("threads", 2)
    tuner.reject("changed the tokens of the check prompt")
    assert tuner.candidate() == ("threads", 3)                 # 2 is skipped
    drive(tuner, lambda s: {1: 1.0, 2: 0.5, 3: 0.8}[s["threads"]])
    assert tuner.incumbent == {"threads": 3}
    assert tuner.trials[0].outcome == "rejected: changed the tokens of the check prompt"
    assert all(t.b != 2 for t in tuner.trials[1:])


def test_a_proposal_is_tried_first_and_kept_only_when_it_wins():
    start = {"threads": 2, "io_workers": 2, "prefetch_width": 4}
    good = OnlineTuner(KNOBS, start, proposals=[("io_workers", 8)])
    assert good.candidate() == ("io_workers", 8) and good.trial.proposal
    drive(good, bowl({"threads": 2, "io_workers": 8, "prefetch_width": 4}))
    assert good.incumbent["io_workers"] == 8
    assert [t.outcome for t in good.trials[:2]] == ["win, confirming", "win"]
    bad = OnlineTuner(KNOBS, start, proposals=[("io_workers", 16)])
    drive(bad, bowl(start))
    assert bad.incumbent == start and bad.trials[0].outcome == "loss"
    # proposals off the knob's values, or equal to the start, are ignored
    assert OnlineTuner(KNOBS, start, proposals=[("io_workers", 3), ("io_workers", 2)]).candidate() \
        == ("threads", 3)


def test_the_rule_for_a_win():
    assert wins([0.04, 0.05, 0.03, 0.06])
    assert not wins([0.04, 0.05, 0.03, -0.001])                # one pair lost
    assert not wins([0.02, 0.05, 0.01, 0.029])                 # median below 3 %
    assert not wins([])


def test_bad_start_and_costs_are_refused():
    with pytest.raises(ValueError, match="lack knob 'io_workers'"):
        OnlineTuner(KNOBS, {"threads": 1, "prefetch_width": 4})
    with pytest.raises(ValueError, match="start value 5 of knob 'threads'"):
        OnlineTuner(KNOBS, {**START, "threads": 5})
    tuner = OnlineTuner(KNOBS, START)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            tuner.observe(bad, 1)


def test_no_knobs_means_nothing_to_do():
    tuner = OnlineTuner([], {})
    assert tuner.done and tuner.settings() == {} and tuner.arm is None


# ------------------------------------------------------------------- cache split
def zipf_trace(n_tokens: int, layers: int, experts: int, top_k: int, seed: int = 0):
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(experts)]
    trace = []
    for _ in range(n_tokens):
        token = []
        for _ in range(layers):
            chosen: set[int] = set()
            while len(chosen) < top_k:
                chosen.add(rng.choices(range(experts), weights)[0])
            token.append(sorted(chosen))
        trace.append(token)
    return trace


def test_the_cache_split_keeps_the_budget_that_buys_hits_and_moves_only_for_a_clear_gain():
    trace = zipf_trace(400, layers=2, experts=16, top_k=2)
    choice = choose_cache_split(trace, 16, 2, 8, (0.25, 0.5), slot_bytes=1 << 20,
                                current_fraction=0.0)
    assert choice.slots_per_layer == 8                         # every slot still buys hits
    at_max = {f: h for s, f, h in choice.table if s == 8}
    assert set(at_max) == {0.0, 0.25, 0.5}
    if choice.pin_fraction != 0.0:
        assert choice.hit_rate >= at_max[0.0] + 0.01
    assert choice.hit_rate == max(h for f, h in at_max.items()
                                  if f == 0.0 or h >= at_max[0.0] + 0.01)
    stay = choose_cache_split(trace, 16, 2, 8, (0.25, 0.5), slot_bytes=1 << 20,
                              current_fraction=0.0, min_gain=1.0)
    assert stay.pin_fraction == 0.0                            # no gain can be that clear


def test_the_cache_split_leaves_room_for_prefetch():
    trace = zipf_trace(200, layers=2, experts=16, top_k=2)
    # 8 slots per layer, floor 1.5 x top_k = 3 dynamic: at most 5 of 8 pinned (62.5 %)
    choice = choose_cache_split(trace, 16, 2, 8, (0.5, 0.75), slot_bytes=1,
                                current_fraction=0.0)
    assert {f for s, f, h in choice.table} == {0.0, 0.5}      # 0.75 was never replayed
    assert choice.pin_fraction in (0.0, 0.5)


def test_the_cache_split_gives_back_slots_that_buy_nothing():
    # every token uses the same two experts: more than two slots per layer buys nothing
    trace = [[[0, 1], [2, 3]] for _ in range(100)]
    choice = choose_cache_split(trace, 16, 2, 8, (), slot_bytes=1 << 20, current_fraction=0.0)
    assert choice.slots_per_layer == 2


def test_the_cache_split_refuses_bad_input():
    with pytest.raises(ValueError, match="below top_k"):
        choose_cache_split([[[0, 1]]] * 4, 4, 2, 1, (0.0,), 1, current_fraction=0.0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        choose_cache_split([], 4, 2, 2, (0.0,), 1, current_fraction=0.0)


def test_the_window_grows_until_a_three_percent_effect_is_resolvable():
    from scheduler.tuner import window_multiplier
    assert window_multiplier(0.0) == window_multiplier(0.015) == 1
    assert window_multiplier(0.03) == 4             # noise halves with 4 x the steps
    assert window_multiplier(0.045) == 9
    assert window_multiplier(1.0) == 16             # capped


def test_a_vs_a_pairs_come_first_and_set_the_window_multiplier():
    knob = Knob("threads", (1, 2))
    tuner = OnlineTuner([knob], {"threads": 1}, noise_pairs=2)
    assert tuner.calibrating and tuner.candidate() is None
    for cost in (1.0, 1.06, 1.0, 0.94):           # +-6 % between identical windows
        assert tuner.settings() == {"threads": 1}
        tuner.observe(cost, 1)
    assert not tuner.calibrating and tuner.noise == pytest.approx(0.06, rel=1e-6)
    assert tuner.window_multiplier == 16           # (0.06 / 0.015) ** 2
    assert tuner.candidate() == ("threads", 2)     # the search starts
    assert tuner.report()["window_multiplier"] == 16
